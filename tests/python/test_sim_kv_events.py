"""Interop test: the simulator's KV-event frames decoded by an independent decoder.

Starts `rolter-sim` (path in the ROLTER_SIM_BIN environment variable; the test is skipped
when it is unset or msgspec is missing), drives a few requests through one replica with a
tiny cache (stores and evictions), resets its prefix cache (AllBlocksCleared), and checks
every message the replica published:

* framing: three frames, the configured topic, 8-byte big-endian sequence numbers from 0;
* payloads decode with msgspec structs written from vLLM's published field order
  (tools/vllm_kv_events/structs.py) for the wire profile under test, and re-encoding the
  decoded batch with msgspec gives back the exact payload bytes;
* field by field, each decoded event equals the logical event the simulator logged beside the
  stream (its --events-dump .jsonl), with hashes normalised like vLLM's int conversion;
* applying the events in order reproduces the replica's cache (GET /sim/cache).

Frames come from the --events-dump file (the exact frames the PUB socket sent). When pyzmq is
installed the test also subscribes over ZMQ, checks the live frames are byte-identical to the
dump, and exercises the replay ROUTER socket (DEALER request from seq 0, end marker -1).

Run: ROLTER_SIM_BIN=target/debug/rolter-sim python3 -m unittest discover -s tests/python
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.request
from pathlib import Path
from typing import Any, Union

try:
    import msgspec
except ImportError:  # pragma: no cover - depends on the machine
    msgspec = None

try:
    import zmq
except ImportError:  # pragma: no cover - depends on the machine
    zmq = None

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "vllm_kv_events"))
SIM_BIN = os.environ.get("ROLTER_SIM_BIN")
TIMEOUT = 15.0
BLOCK_SIZE = 16

if msgspec is not None:
    import structs as vs  # noqa: E402  (needs msgspec)


def _batch_types():
    """Wire profile name -> (rolter-sim flags, msgspec batch type)."""

    class MidBatch(vs.EventBatch):
        events: list[Union[vs.MidBlockStored, vs.MidBlockRemoved, vs.ArrayAllBlocksCleared]]

    class ArrayBatch(vs.EventBatch):
        events: list[Union[vs.ArrayBlockStored, vs.ArrayBlockRemoved, vs.ArrayAllBlocksCleared]]

    class LegacyBatch(vs.LegacyEventBatch):
        events: list[
            Union[vs.LegacyBlockStored, vs.LegacyBlockRemoved, vs.ArrayAllBlocksCleared]
        ]

    class MapBatchAsMap(vs.MapKVEventBatch):
        events: list[Union[vs.BlockStored, vs.BlockRemoved, vs.AllBlocksCleared]]

    return {
        "array-lora-name-u64": (["--kv-layout", "array", "--kv-fields", "lora-name"], MidBatch),
        "array-extended-u64": (["--kv-layout", "array", "--kv-fields", "extended"], ArrayBatch),
        "array-base-i64": (
            ["--kv-layout", "array", "--kv-fields", "base", "--kv-hash", "i64"],
            LegacyBatch,
        ),
        "map-extended-bytes32": (
            ["--kv-layout", "map", "--kv-fields", "extended", "--kv-hash", "bytes32",
             "--replay-topic-frame"],
            vs.KVEventBatch,
        ),
        "map-batch-as-map": (
            ["--kv-layout", "map", "--kv-fields", "extended", "--kv-batch-layout", "map"],
            MapBatchAsMap,
        ),
    }


def _http(method: str, url: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("content-type", "application/json")
    with urllib.request.urlopen(req, timeout=TIMEOUT) as resp:
        raw = resp.read()
    return json.loads(raw) if raw else None


def _read_dump(path: Path) -> list[list[bytes]]:
    data = path.read_bytes()
    msgs, i = [], 0
    while i < len(data):
        (n,) = struct.unpack_from(">I", data, i)
        i += 4
        frames = []
        for _ in range(n):
            (ln,) = struct.unpack_from(">I", data, i)
            i += 4
            frames.append(data[i : i + ln])
            i += ln
        msgs.append(frames)
    return msgs


def _event_fields(ev: Any) -> dict:
    """A decoded msgspec event as {type, block_hashes, ...} with normalised hashes."""
    name = type(ev).__struct_config__.tag
    out = {"type": name}
    if name == "BlockStored":
        out["block_hashes"] = [vs.normalise_hash(h) for h in ev.block_hashes]
        p = ev.parent_block_hash
        out["parent_block_hash"] = None if p is None else vs.normalise_hash(p)
        out["token_ids"] = list(ev.token_ids)
        out["block_size"] = ev.block_size
    elif name == "BlockRemoved":
        out["block_hashes"] = [vs.normalise_hash(h) for h in ev.block_hashes]
    return out


class SimProcess:
    """A rolter-sim child process with one replica on ephemeral ports."""

    def __init__(self, extra: list[str], topic: str, dump_dir: Path):
        args = [
            SIM_BIN, "--replicas", "1", "--base-port", "0", "--kv-base-port", "0",
            "--cache-blocks", "6", "--topic", topic, "--events-dump", str(dump_dir),
            "--run-for-secs", "60", *extra,
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        line: list[bytes] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()))
        reader.start()
        reader.join(TIMEOUT)
        if not line or not line[0]:
            self.stop()
            raise RuntimeError("rolter-sim printed no announcement line")
        self.info = json.loads(line[0])["replicas"][0]
        self.base = self.info["api_base"]

    def stats(self) -> dict:
        return _http("GET", self.base + "/sim/stats")

    def wait_flushed(self) -> dict:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            s = self.stats()
            if s["kv_batches"] > 0 and s["kv_sent"] == s["kv_batches"]:
                return s
            time.sleep(0.02)
        raise AssertionError(f"KV events not flushed: {self.stats()}")

    def stop(self) -> None:
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(TIMEOUT)


@unittest.skipUnless(SIM_BIN, "ROLTER_SIM_BIN is not set")
@unittest.skipIf(msgspec is None, "msgspec is not installed")
class SimKvEventsInterop(unittest.TestCase):
    maxDiff = None

    def _drive(self, sim: SimProcess) -> tuple[dict, int]:
        """Requests that store, share, evict; returns (cache snapshot, batches before reset)."""
        url = sim.base + "/v1/completions"
        # 40-token prompt + 8 output tokens: 2 blocks at admission, a 3rd at completion.
        _http("POST", url, {"prompt": list(range(1, 41)), "max_tokens": 8})
        # Shares block 0, stores one more under it.
        _http("POST", url, {"prompt": list(range(1, 17)) + list(range(500, 520)),
                            "max_tokens": 1})
        # Unrelated 70 tokens: 4 new blocks into a 6-block cache -> evictions.
        _http("POST", url, {"prompt": list(range(1000, 1070)), "max_tokens": 1})
        # A chat request too (tokens from the simulator's tokenizer).
        _http("POST", sim.base + "/v1/chat/completions",
              {"messages": [{"role": "user", "content": " ".join(f"w{i}" for i in range(40))}],
               "max_tokens": 2})
        stats = sim.wait_flushed()
        snapshot = _http("GET", sim.base + "/sim/cache")
        _http("POST", sim.base + "/reset_prefix_cache")
        deadline = time.monotonic() + TIMEOUT
        while sim.stats()["kv_sent"] < stats["kv_batches"] + 1:
            self.assertLess(time.monotonic(), deadline, "AllBlocksCleared not published")
            time.sleep(0.02)
        return snapshot, stats["kv_batches"]

    def _check_profile(self, name: str, flags: list[str], batch_type: type) -> None:
        topic = f"kv@sim@{name}"
        with tempfile.TemporaryDirectory() as tmp:
            dump_dir = Path(tmp)
            sim = SimProcess(flags, topic, dump_dir)
            live: list[list[bytes]] = []
            replayed: list[list[bytes]] = []
            try:
                sub = None
                if zmq is not None:
                    ctx = zmq.Context.instance()
                    sub = ctx.socket(zmq.SUB)
                    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
                    sub.connect(sim.info["kv_events"])
                    deadline = time.monotonic() + TIMEOUT
                    while sim.stats()["kv_subscribers"] < 1:
                        self.assertLess(time.monotonic(), deadline, "SUB never connected")
                        time.sleep(0.02)
                snapshot, n_before_reset = self._drive(sim)
                if sub is not None:
                    while sub.poll(500):
                        live.append(sub.recv_multipart())
                    sub.close(linger=0)
                    replayed = self._replay(sim.info["kv_replay"],
                                            "--replay-topic-frame" in flags, topic)
            finally:
                sim.stop()
            msgs = _read_dump(dump_dir / "replica-0.bin")
            logical = [json.loads(l) for l in
                       (dump_dir / "replica-0.bin.jsonl").read_text().splitlines()]

        self.assertGreaterEqual(len(msgs), 5)
        self.assertEqual(len(msgs), len(logical))
        decoder = msgspec.msgpack.Decoder(batch_type)
        state: dict[int, list[int]] = {}
        saw = set()
        for i, (frames, log) in enumerate(zip(msgs, logical)):
            self.assertEqual(len(frames), 3)
            self.assertEqual(frames[0], topic.encode())
            self.assertEqual(frames[1], i.to_bytes(8, "big"), "sequence numbers from 0")
            self.assertEqual(log["seq"], i)
            batch = decoder.decode(frames[2])
            # Byte-for-byte: msgspec re-encodes the decoded batch to the same payload.
            self.assertEqual(msgspec.msgpack.encode(batch), frames[2], f"{name} seq {i}")
            if hasattr(batch, "data_parallel_rank"):
                self.assertEqual(batch.data_parallel_rank, 0)
            self.assertGreater(batch.ts, 1e9)
            got = [_event_fields(e) for e in batch.events]
            self.assertEqual(got, log["events"], f"{name} seq {i}")
            for ev, raw in zip(got, batch.events):
                saw.add(ev["type"])
                if ev["type"] == "BlockStored":
                    self.assertEqual(ev["block_size"], BLOCK_SIZE)
                    self.assertEqual(len(ev["token_ids"]), BLOCK_SIZE * len(ev["block_hashes"]))
                    if hasattr(raw, "medium"):
                        self.assertEqual(raw.medium, vs.MEDIUM_GPU)
                    if getattr(raw, "group_idx", None) is not None:
                        self.assertEqual(raw.group_idx, 0)
                        self.assertEqual(raw.extra_keys, [None] * len(ev["block_hashes"]))
                        self.assertEqual(raw.kv_cache_spec_kind, "full_attention")
                    if ev["parent_block_hash"] is not None:
                        self.assertIn(ev["parent_block_hash"], state, "parent is cached")
                    for j, h in enumerate(ev["block_hashes"]):
                        state[h] = ev["token_ids"][j * BLOCK_SIZE : (j + 1) * BLOCK_SIZE]
                elif ev["type"] == "BlockRemoved":
                    for h in ev["block_hashes"]:
                        self.assertIn(h, state)
                        del state[h]
                else:
                    state.clear()
            if i + 1 == n_before_reset:
                want = {b["hash"]: b["tokens"] for b in snapshot["blocks"]}
                self.assertEqual(state, want, "events reproduce the replica's cache")
        self.assertEqual(saw, {"BlockStored", "BlockRemoved", "AllBlocksCleared"})
        self.assertEqual(state, {})

        if zmq is not None:
            self.assertEqual(live, msgs, "live ZMQ frames equal the dump")
            self.assertEqual([r[-1] for r in replayed], [m[2] for m in msgs])
            self.assertEqual([r[-2] for r in replayed], [m[1] for m in msgs])

    def _replay(self, endpoint: str, with_topic: bool, topic: str) -> list[list[bytes]]:
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        out = []
        while True:
            self.assertTrue(dealer.poll(int(TIMEOUT * 1000)), "replay reply in time")
            frames = dealer.recv_multipart()
            self.assertEqual(frames[0], b"")
            self.assertEqual(len(frames), 4 if with_topic else 3)
            if with_topic:
                self.assertEqual(frames[1], topic.encode())
            if frames[-2] == vs.END_SEQ:
                self.assertEqual(frames[-1], b"")
                break
            out.append(frames)
        dealer.close(linger=0)
        return out

    def test_profiles(self):
        for name, (flags, batch_type) in _batch_types().items():
            with self.subTest(profile=name):
                self._check_profile(name, flags, batch_type)


if __name__ == "__main__":
    unittest.main()
