#!/usr/bin/env python3
"""Write byte fixtures of vLLM KV-event messages for the gateway's decoder tests.

Usage: python3 tools/vllm_kv_events/gen_fixtures.py [OUT_DIR]
       (default OUT_DIR: tests/fixtures/kv_events; needs `pip install msgspec`)

Every fixture is one ZMQ multipart message stored as `<name>.bin`: its frames in
order, each as a 4-byte big-endian length followed by the frame's bytes.
`manifest.json` lists the fixtures: `kind` ("pub" = a SUB-side message, "replay" =
what a DEALER receives from vLLM's replay ROUTER), a description, and either the
expected decoded value (`expect`, hashes already normalised to u64 by
`structs.normalise_hash`, i.e. by vLLM's own int conversion) or the expected error
kind (`error`). The payloads come from msgspec encoding the Structs in structs.py,
the same encoder and struct options vLLM's publisher uses: an oracle independent of
the Rust decoder. The output is deterministic; rerunning must not change any file.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))

import structs as S  # noqa: E402

TOPIC = "kv@pod-a@meta-llama/Llama-3.1-8B-Instruct"
BLOCK = 4  # small block size keeps fixtures readable; vLLM's default is 16 (64 from 0.34)

# A u64 hash above i64::MAX (vLLM >= 0.10.2 default), a small one, and negative
# i64 hashes (Python hash() in older vLLM).
H_BIG = 0xF00D_CAFE_DEAD_BEEF
H_SMALL = 0x0123_4567_89AB_CDEF
H_NEG1 = -0x1234_5678_9ABC_DEF0
H_NEG2 = -1
# 32-byte binary hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0): sha256 digests.
B1 = hashlib.sha256(b"block-1").digest()
B2 = hashlib.sha256(b"block-2").digest()
B_PARENT = hashlib.sha256(b"parent").digest()

TS = 1_767_225_600.25

fixtures: list[dict] = []


def frame_file(frames: list[bytes]) -> bytes:
    return b"".join(struct.pack(">I", len(f)) + f for f in frames)


def exp_stored(
    hashes,
    parent,
    tokens,
    block_size,
    lora_id=None,
    medium=None,
    lora_name=None,
    extra_keys=None,
    group_idx=None,
):
    return {
        "type": "BlockStored",
        "block_hashes": [S.normalise_hash(h) for h in hashes],
        "parent_block_hash": None if parent is None else S.normalise_hash(parent),
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": lora_id,
        "medium": medium,
        "lora_name": lora_name,
        "extra_keys": extra_keys,
        "group_idx": group_idx,
    }


def exp_removed(hashes, medium=None, group_idx=None):
    return {
        "type": "BlockRemoved",
        "block_hashes": [S.normalise_hash(h) for h in hashes],
        "medium": medium,
        "group_idx": group_idx,
    }


EXP_CLEARED = {"type": "AllBlocksCleared"}


def add(name, kind, description, frames, expect=None, error=None):
    assert (expect is None) != (error is None)
    entry = {"name": name, "file": f"{name}.bin", "kind": kind, "description": description}
    if expect is not None:
        entry["expect"] = expect
    else:
        entry["error"] = error
    fixtures.append((entry, frame_file(frames)))


def exp_batch(topic, seq, events, dp_rank=None, ts=TS):
    return {
        "end": False,
        "topic": topic,
        "seq": seq,
        "ts": ts,
        "data_parallel_rank": dp_rank,
        "events": events,
    }


def pub(name, description, batch, expect_events, seq=7, topic=TOPIC, dp_rank=None):
    add(
        name,
        "pub",
        description,
        S.pub_frames(topic, seq, batch),
        expect=exp_batch(topic, seq, expect_events, dp_rank),
    )


TOK2 = [11, 12, 13, 14, 21, 22, 23, 24]

# ---------------------------------------------------------------- map layout (>= 0.24)
pub(
    "pub_map_stored_u64",
    "map layout, BlockStored, two u64 hashes (one above i64::MAX), no parent, dp rank 0",
    S.KVEventBatch(
        ts=TS,
        events=[S.BlockStored([H_BIG, H_SMALL], None, TOK2, BLOCK, None, S.MEDIUM_GPU, None)],
        data_parallel_rank=0,
    ),
    [exp_stored([H_BIG, H_SMALL], None, TOK2, BLOCK, medium="GPU")],
    dp_rank=0,
)
pub(
    "pub_map_stored_bytes",
    "map layout, BlockStored, 32-byte hashes and parent, LoRA, extra_keys, group_idx, spec kind",
    S.KVEventBatch(
        ts=TS,
        events=[
            S.BlockStored(
                [B1, B2],
                B_PARENT,
                TOK2,
                BLOCK,
                3,
                S.MEDIUM_GPU,
                "sql-lora",
                extra_keys=[("sql-lora", "salt-1"), ("sql-lora",)],
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            )
        ],
        data_parallel_rank=1,
    ),
    [
        exp_stored(
            [B1, B2],
            B_PARENT,
            TOK2,
            BLOCK,
            lora_id=3,
            medium="GPU",
            lora_name="sql-lora",
            extra_keys=[["sql-lora", "salt-1"], ["sql-lora"]],
            group_idx=0,
        )
    ],
    dp_rank=1,
)
pub(
    "pub_map_removed_cpu",
    "map layout, BlockRemoved on the CPU tier with group_idx",
    S.KVEventBatch(ts=TS, events=[S.BlockRemoved([H_BIG], S.MEDIUM_CPU, group_idx=0)]),
    [exp_removed([H_BIG], medium="CPU", group_idx=0)],
)
pub(
    "pub_map_all_cleared",
    "map layout, AllBlocksCleared alone, dp rank 3",
    S.KVEventBatch(ts=TS, events=[S.AllBlocksCleared()], data_parallel_rank=3),
    [EXP_CLEARED],
    dp_rank=3,
)
pub(
    "pub_map_mixed",
    "map layout, stored + removed + cleared + stored in one batch, u64 and 32-byte hashes mixed",
    S.KVEventBatch(
        ts=TS,
        events=[
            S.BlockStored([H_SMALL], H_BIG, [1, 2, 3, 4], BLOCK, None, None, None),
            S.BlockRemoved([H_SMALL, B1], S.MEDIUM_GPU),
            S.AllBlocksCleared(),
            S.BlockStored([B2], None, [5, 6, 7, 8], BLOCK, None, S.MEDIUM_GPU, None),
        ],
        data_parallel_rank=0,
    ),
    [
        exp_stored([H_SMALL], H_BIG, [1, 2, 3, 4], BLOCK),
        exp_removed([H_SMALL, B1], medium="GPU"),
        EXP_CLEARED,
        exp_stored([B2], None, [5, 6, 7, 8], BLOCK, medium="GPU"),
    ],
    dp_rank=0,
)
pub(
    "pub_map_future_fields",
    "map layout with fields newer releases/forks add (locality, ownership, session_id, lookahead_token_ids): ignored",
    S.KVEventBatch(
        ts=TS,
        events=[
            S.FutureBlockStored(
                [H_SMALL],
                None,
                [1, 2, 3, 4],
                BLOCK,
                None,
                S.MEDIUM_GPU,
                None,
                group_idx=2,
                kv_cache_spec_kind="sliding_window",
                kv_cache_spec_sliding_window=1024,
                locality="LOCAL",
                ownership="tier-2",
                session_id="sess-9",
                lookahead_token_ids=[9, 9],
            )
        ],
    ),
    [exp_stored([H_SMALL], None, [1, 2, 3, 4], BLOCK, medium="GPU", group_idx=2)],
)
pub(
    "pub_map_offload_store",
    "offloading connector announcement: CPU tier, parent None, token_ids [], block_size 0",
    S.KVEventBatch(
        ts=TS,
        events=[S.BlockStored([H_BIG, H_SMALL], None, [], 0, None, S.MEDIUM_CPU, None)],
        data_parallel_rank=0,
    ),
    [exp_stored([H_BIG, H_SMALL], None, [], 0, medium="CPU")],
    dp_rank=0,
)
pub(
    "pub_map_empty_topic",
    "default empty topic, large sequence number, empty event list",
    S.KVEventBatch(ts=TS, events=[]),
    [],
    seq=(1 << 40) + 5,
    topic="",
)
pub(
    "pub_batch_as_map",
    "the batch itself as a map (upstream snapshot 0181ea31 without array_like on EventBatch)",
    S.MapKVEventBatch(
        ts=TS,
        events=[S.BlockStored([H_BIG], None, [1, 2, 3, 4], BLOCK, None, S.MEDIUM_GPU, None)],
        data_parallel_rank=0,
    ),
    [exp_stored([H_BIG], None, [1, 2, 3, 4], BLOCK, medium="GPU")],
    dp_rank=0,
)

# ---------------------------------------------------------------- positional layout (<= 0.23)
pub(
    "pub_array_stored_full",
    "positional layout, BlockStored with every field through kv_cache_spec_sliding_window",
    S.KVEventBatch(
        ts=TS,
        events=[
            S.ArrayBlockStored(
                [H_BIG, H_SMALL],
                H_NEG1,
                TOK2,
                BLOCK,
                7,
                S.MEDIUM_CPU,
                "code-lora",
                extra_keys=[None, ("code-lora",)],
                group_idx=1,
                kv_cache_spec_kind="full_attention",
                kv_cache_spec_sliding_window=4096,
            )
        ],
        data_parallel_rank=0,
    ),
    [
        exp_stored(
            [H_BIG, H_SMALL],
            H_NEG1,
            TOK2,
            BLOCK,
            lora_id=7,
            medium="CPU",
            lora_name="code-lora",
            extra_keys=[None, ["code-lora"]],
            group_idx=1,
        )
    ],
    dp_rank=0,
)
pub(
    "pub_array_stored_nil_defaults",
    "positional layout, BlockStored with defaults encoded as nil (msgspec never omits them in arrays)",
    S.KVEventBatch(
        ts=TS,
        events=[S.ArrayBlockStored([H_SMALL], None, [1, 2, 3, 4], BLOCK, None, S.MEDIUM_GPU, None)],
    ),
    [exp_stored([H_SMALL], None, [1, 2, 3, 4], BLOCK, medium="GPU")],
)
pub(
    "pub_array_mid_era",
    "positional layout of the releases with medium/lora_name but no extra_keys: tag + 7 / tag + 2 fields",
    S.KVEventBatch(
        ts=TS,
        events=[
            S.MidBlockStored([H_SMALL], H_BIG, [1, 2, 3, 4], BLOCK, 2, S.MEDIUM_GPU, "my-lora"),
            S.MidBlockRemoved([H_BIG], S.MEDIUM_CPU),
        ],
        data_parallel_rank=0,
    ),
    [
        exp_stored([H_SMALL], H_BIG, [1, 2, 3, 4], BLOCK, lora_id=2, medium="GPU", lora_name="my-lora"),
        exp_removed([H_BIG], medium="CPU"),
    ],
    dp_rank=0,
)
pub(
    "pub_array_removed",
    "positional layout, BlockRemoved with medium and group_idx",
    S.KVEventBatch(ts=TS, events=[S.ArrayBlockRemoved([H_BIG, H_SMALL], S.MEDIUM_GPU, group_idx=0)]),
    [exp_removed([H_BIG, H_SMALL], medium="GPU", group_idx=0)],
)
pub(
    "pub_array_cleared",
    "positional layout, AllBlocksCleared (a one-element array: just the tag)",
    S.KVEventBatch(ts=TS, events=[S.ArrayAllBlocksCleared()], data_parallel_rank=0),
    [EXP_CLEARED],
    dp_rank=0,
)
pub(
    "pub_legacy_stored_negative",
    "vLLM 0.8.5 layout: BlockStored with 5 fields, negative i64 hashes, batch without dp rank",
    S.LegacyEventBatch(
        ts=TS,
        events=[S.LegacyBlockStored([H_NEG1, H_NEG2], H_SMALL, TOK2, BLOCK, None)],
    ),
    [exp_stored([H_NEG1, H_NEG2], H_SMALL, TOK2, BLOCK)],
    seq=0,
)
pub(
    "pub_legacy_removed_negative",
    "vLLM 0.8.5 layout: BlockRemoved with only block_hashes (negative i64)",
    S.LegacyEventBatch(ts=TS, events=[S.LegacyBlockRemoved([H_NEG1])]),
    [exp_removed([H_NEG1])],
    seq=1,
)

# ---------------------------------------------------------------- replay replies
REPLAY_PAYLOAD = S.encode_payload(
    S.KVEventBatch(
        ts=TS,
        events=[S.BlockStored([H_SMALL], None, [1, 2, 3, 4], BLOCK, None, S.MEDIUM_GPU, None)],
        data_parallel_rank=0,
    )
)
REPLAY_EVENTS = [exp_stored([H_SMALL], None, [1, 2, 3, 4], BLOCK, medium="GPU")]
add(
    "replay_old_layout",
    "replay",
    "replay reply before the topic frame was added: [b'', seq, payload]",
    S.replay_reply_frames(None, 42, REPLAY_PAYLOAD),
    expect=exp_batch(None, 42, REPLAY_EVENTS, 0),
)
add(
    "replay_new_layout",
    "replay",
    "replay reply with the topic frame (vLLM >= 0.26): [b'', topic, seq, payload]",
    S.replay_reply_frames(TOPIC, 42, REPLAY_PAYLOAD),
    expect=exp_batch(TOPIC, 42, REPLAY_EVENTS, 0),
)
add(
    "replay_new_layout_no_delimiter",
    "replay",
    "replay reply as a REQ-style client sees it, delimiter stripped: [topic, seq, payload]",
    S.replay_reply_frames(TOPIC, 43, REPLAY_PAYLOAD)[1:],
    expect=exp_batch(TOPIC, 43, REPLAY_EVENTS, 0),
)
add(
    "replay_old_layout_no_delimiter",
    "replay",
    "old replay reply, delimiter stripped: [seq, payload]",
    S.replay_reply_frames(None, 44, REPLAY_PAYLOAD)[1:],
    expect=exp_batch(None, 44, REPLAY_EVENTS, 0),
)
add(
    "replay_end_old_layout",
    "replay",
    "end marker without topic frame: [b'', -1, b'']",
    S.replay_end_frames(False),
    expect={"end": True, "topic": None},
)
add(
    "replay_end_new_layout",
    "replay",
    "end marker with the (empty) topic frame: [b'', b'', -1, b'']",
    S.replay_end_frames(True),
    expect={"end": True, "topic": ""},
)

# ---------------------------------------------------------------- malformed
GOOD = S.encode_payload(
    S.KVEventBatch(
        ts=TS,
        events=[S.BlockStored([H_BIG, H_SMALL], None, TOK2, BLOCK, None, S.MEDIUM_GPU, None)],
    )
)
SEQ = S.seq_frame(9)
T = TOPIC.encode()
add("bad_truncated_payload", "pub", "payload cut in half", [T, SEQ, GOOD[: len(GOOD) // 2]], error="Msgpack")
add("bad_empty_payload", "pub", "empty payload frame on the live stream", [T, SEQ, b""], error="Msgpack")
add("bad_not_msgpack", "pub", "0xc1 is a byte msgpack never uses", [T, SEQ, b"\xc1\x00\x01"], error="Msgpack")
add("bad_trailing_bytes", "pub", "a valid batch followed by junk", [T, SEQ, GOOD + b"\x00"], error="TrailingBytes")
add("bad_two_frames", "pub", "topic and sequence but no payload frame", [T, SEQ], error="FrameCount")
add("bad_four_frames", "pub", "one frame too many on the live stream", [T, SEQ, GOOD, b""], error="FrameCount")
add("bad_short_seq", "pub", "sequence frame of 4 bytes", [T, SEQ[4:], GOOD], error="Sequence")
add(
    "bad_batch_not_array",
    "pub",
    "payload is a msgpack int, not a batch",
    [T, SEQ, msgspec.msgpack.encode(5)],
    error="Schema",
)
add(
    "bad_unknown_tag_map",
    "pub",
    "map event with an unknown tag",
    [T, SEQ, msgspec.msgpack.encode([TS, [{"type": "BlockMoved", "block_hashes": [1]}]])],
    error="UnknownTag",
)
add(
    "bad_unknown_tag_array",
    "pub",
    "positional event with an unknown tag",
    [T, SEQ, msgspec.msgpack.encode([TS, [["BlockMoved", [1]]]])],
    error="UnknownTag",
)
add(
    "bad_hash_is_string",
    "pub",
    "block_hashes holds a string",
    [T, SEQ, msgspec.msgpack.encode([TS, [{"type": "BlockRemoved", "block_hashes": ["x"], "medium": None}]])],
    error="Schema",
)
add(
    "bad_missing_block_hashes",
    "pub",
    "map BlockStored without block_hashes",
    [
        T,
        SEQ,
        msgspec.msgpack.encode(
            [TS, [{"type": "BlockStored", "parent_block_hash": None, "token_ids": [1], "block_size": 1}]]
        ),
    ],
    error="Schema",
)
add(
    "bad_array_stored_too_short",
    "pub",
    "positional BlockStored with only two fields",
    [T, SEQ, msgspec.msgpack.encode([TS, [["BlockStored", [1], None]]])],
    error="Schema",
)
add(
    "bad_replay_seq_short",
    "replay",
    "replay reply whose sequence frame is 3 bytes",
    [b"", b"abc", GOOD],
    error="Sequence",
)
add("bad_replay_one_frame", "replay", "replay reply with a single frame", [GOOD], error="FrameCount")


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "tests/fixtures/kv_events"
    out.mkdir(parents=True, exist_ok=True)
    manifest = {
        "format": "each <file> holds one multipart message: per frame a u32 big-endian length, then the bytes",
        "generator": "tools/vllm_kv_events/gen_fixtures.py",
        "fixtures": [entry for entry, _ in fixtures],
    }
    for entry, data in fixtures:
        (out / entry["file"]).write_bytes(data)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(fixtures)} fixtures to {out}")


if __name__ == "__main__":
    main()
