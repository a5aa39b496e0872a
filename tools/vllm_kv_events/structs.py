"""msgspec definitions of vLLM's V1 KV-event wire format, for fixtures and interop tests.

Transcribed (field names, field order, struct options) from vLLM's
`vllm/distributed/kv_events.py`; nothing here is vLLM's code. Encoding one of these
with `msgspec.msgpack.encode` yields exactly the bytes a vLLM publisher of that
version puts in the third ZMQ frame.

Layouts (see SPEC.md section 4.1; field order checked against the vLLM sources in
the comments below):

* Positional ("array") layout, vLLM 0.8.5 .. 0.23: `KVCacheEvent` has
  `array_like=True, omit_defaults=True, tag=True`, so an event is an array whose
  first element is the tag (the class name) followed by the fields in declaration
  order. Note: msgspec ignores `omit_defaults` for array_like structs (msgspec
  issue #720; checked with msgspec 0.23), so a positional event always carries
  every field its release declares, defaults as nil; arrays are shorter only
  because older releases declare fewer fields.
  - 0.8.5-era: BlockStored(block_hashes, parent_block_hash, token_ids,
    block_size, lora_id), BlockRemoved(block_hashes). -> `Legacy*` below.
  - later: BlockStored gains medium, lora_name, extra_keys, group_idx,
    kv_cache_spec_kind, kv_cache_spec_sliding_window; BlockRemoved gains
    medium, group_idx. -> `Array*` below.
* Map layout, vLLM >= 0.24: `KVCacheEvent` drops `array_like`, so an event is a
  map keyed by field name with the tag under "type"; default-valued fields are
  omitted. -> `BlockStored`, `BlockRemoved`, `AllBlocksCleared` below (the
  names vLLM uses, so `from structs import BlockStored` reads like vLLM).
* The batch `EventBatch(ts, events, data_parallel_rank=None)` is `array_like`
  in every release the spec covers. One upstream snapshot (commit 0181ea31 of
  vllm-project/vllm) declares it without `array_like`, i.e. as a map;
  `MapKVEventBatch` reproduces that so decoders can be tested against it.

Block hashes (`ExternalBlockHash`): an int (u64 by default since 0.10.2; a
signed, possibly negative, 64-bit int from Python's `hash()` before that) or
32 bytes (sha256 digest) when `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`.
`normalise_hash` is the gateway's one key type: vLLM's own int conversion
(`int.from_bytes(b, "big") & (2**64 - 1)`), applied to ints as two's complement.

Keep this module's names stable: the simulator (branch `sim`) imports it.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

ExternalBlockHash = Union[int, bytes]

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"

U64_MASK = (1 << 64) - 1
# Sequence number of the replay end marker: (-1).to_bytes(8, "big", signed=True).
END_SEQ = (-1).to_bytes(8, "big", signed=True)


# --------------------------------------------------------------------------------------
# Map layout (vLLM >= 0.24): tag under "type", fields by name.
# --------------------------------------------------------------------------------------


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the map-layout events (tag field "type" = class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


class FutureBlockStored(KVCacheEvent, tag="BlockStored"):
    """A BlockStored with fields newer/fork releases add (must be ignored by decoders)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[int] | None = None


class MapKVEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    """The batch as a map (upstream snapshot 0181ea31 declares EventBatch without array_like)."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


# --------------------------------------------------------------------------------------
# Positional layout (vLLM <= 0.23): [tag, field0, field1, ...], trailing defaults omitted.
# --------------------------------------------------------------------------------------


class ArrayKVCacheEvent(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True
):
    """Base class of the positional events."""


class ArrayBlockStored(ArrayKVCacheEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class ArrayBlockRemoved(ArrayKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class ArrayAllBlocksCleared(ArrayKVCacheEvent, tag="AllBlocksCleared"):
    pass


class MidBlockStored(ArrayKVCacheEvent, tag="BlockStored"):
    """BlockStored of the releases that had medium and lora_name but no extra_keys yet."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class MidBlockRemoved(ArrayKVCacheEvent, tag="BlockRemoved"):
    """BlockRemoved of the releases that had medium but no group_idx yet."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None


class LegacyBlockStored(ArrayKVCacheEvent, tag="BlockStored"):
    """vLLM 0.8.5-era BlockStored (commit b4e69e0a of vllm-project/vllm)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class LegacyBlockRemoved(ArrayKVCacheEvent, tag="BlockRemoved"):
    """vLLM 0.8.5-era BlockRemoved."""

    block_hashes: list[int]


class LegacyEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM 0.8.5-era batch: no data_parallel_rank field."""

    ts: float
    events: list[Any]


# --------------------------------------------------------------------------------------
# Framing helpers.
# --------------------------------------------------------------------------------------

_ENCODER = msgspec.msgpack.Encoder()


def encode_payload(batch: msgspec.Struct) -> bytes:
    """The third frame of a published message (what vLLM's publisher thread sends)."""
    return _ENCODER.encode(batch)


def seq_frame(seq: int) -> bytes:
    """The second frame: the batch sequence number, 8 bytes big-endian (vLLM `seq.to_bytes(8, "big")`)."""
    return seq.to_bytes(8, "big")


def pub_frames(topic: str, seq: int, batch: msgspec.Struct) -> list[bytes]:
    """The three frames of one PUB message: topic, sequence, msgpack payload."""
    return [topic.encode("utf-8"), seq_frame(seq), encode_payload(batch)]


def replay_reply_frames(topic: str | None, seq: int, payload: bytes) -> list[bytes]:
    """Frames a DEALER receives for one replayed batch.

    The ROUTER sends `(client_id, b"", [topic,] seq, payload)`; the DEALER drops
    nothing but the identity, so the empty delimiter comes first. Older vLLM
    sends no topic frame (`topic=None`); newer vLLM does.
    """
    frames = [b""]
    if topic is not None:
        frames.append(topic.encode("utf-8"))
    frames += [seq_frame(seq), payload]
    return frames


def replay_end_frames(with_topic: bool) -> list[bytes]:
    """The end-of-replay marker as a DEALER receives it: seq -1, empty payload."""
    return [b"", b"", END_SEQ, b""] if with_topic else [b"", END_SEQ, b""]


def normalise_hash(h: ExternalBlockHash) -> int:
    """The gateway's key for a block hash: an unsigned 64-bit int (see module doc)."""
    if isinstance(h, (bytes, bytearray)):
        return int.from_bytes(h, "big") & U64_MASK
    return h & U64_MASK
