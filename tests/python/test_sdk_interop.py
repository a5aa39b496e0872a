"""Interop test: the official `openai` and `anthropic` Python SDKs, unchanged, through rolter.

Starts two small fake vLLM replicas in this process (ThreadingHTTPServer on 127.0.0.1,
ephemeral ports) that serve enough of vLLM's OpenAI-compatible API for the SDKs:

* POST /v1/responses, JSON or SSE (`response.created`, `response.in_progress`, the output
  item and content part events, `response.output_text.delta`, `response.completed`, each
  with its `type` and `sequence_number`); every response is stored under a fresh id
  `resp_<replica>_<n>`, and a `previous_response_id` the replica does not hold gets vLLM's
  404 in OpenAI's error shape, as a real replica would answer a request sent to the wrong
  place;
* GET /v1/responses/{id} (404 likewise), POST /v1/embeddings (float or base64),
  POST /v1/messages (Anthropic Messages, JSON or SSE), GET /v1/models, GET /health.

Each replica records what it received (method, path, headers, JSON body). rolter (path in
ROLTER_BIN, default target/debug/rolter) runs with a routing file of two providers and one
cache_aware route whose alias "alias" maps to the upstream model "served-model". The
tests then drive the real SDK clients at rolter and check, on the replicas' side, where
each request went and what it carried:

* responses.create (JSON): text back, the replica saw model "served-model";
* a 5-turn conversation by previous_response_id, JSON and streamed (`stream=True`, the
  next turn's id taken from the `response.completed` event), plus a turn through the SDK's
  `responses.stream()` helper: every turn reaches the replica holding the previous
  response, although the follow-up input is a long prompt the *other* replica has cached
  (a control request shows cache_aware would send it there otherwise);
* responses.retrieve(id) and responses.delete(id) reach the holding replica, for ids of
  both replicas; an unknown id is a 404 (openai.NotFoundError);
* embeddings.create (the SDK asks for base64 and decodes it; and floats): vectors back, the
  replica saw the rewritten model;
* anthropic's messages.create, JSON and streamed: text back, the replica saw the rewritten
  model and the SDK's anthropic-version header.

Skipped (saying why) when openai, anthropic or the rolter binary is missing. Loopback only;
every client has a timeout and no retries; rolter is killed and the servers shut down in
tearDownClass.

Run: ROLTER_BIN=target/debug/rolter python3 -m unittest tests/python/test_sdk_interop.py -v
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import os
import socket
import struct
import subprocess
import tempfile
import threading
import time
import unittest
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Optional

try:
    import openai
except ImportError:  # pragma: no cover - depends on the machine
    openai = None

try:
    import anthropic
except ImportError:  # pragma: no cover - depends on the machine
    anthropic = None

ROOT = Path(__file__).resolve().parents[2]
ROLTER_BIN = os.environ.get("ROLTER_BIN") or str(ROOT / "target" / "debug" / "rolter")
TIMEOUT = 10.0
ALIAS = "alias"
SERVED = "served-model"
EMBED_DIM = 8
# A follow-up turn's input: long enough (~1000 tokens at 4 bytes a token) that the replica
# holding it in its prefix cache wins any cache_aware placement by far.
LONG_INPUT = " ".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog."
                      for i in range(70))


def _noise(seed: str) -> str:
    """A short text unrelated to every other seed's (no common prefix to speak of)."""
    return hashlib.sha256(seed.encode()).hexdigest()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeReplica:
    """A fake vLLM replica: enough of the OpenAI (and Anthropic) API for the SDKs."""

    def __init__(self, name: str):
        self.name = name
        self.lock = threading.Lock()
        self.received: list[dict] = []
        self.responses: dict[str, dict] = {}
        self.unknown_previous: list[str] = []
        self.counter = itertools.count(1)
        replica = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                replica._handle(self, "GET")

            def do_POST(self) -> None:
                replica._handle(self, "POST")

            def do_DELETE(self) -> None:
                replica._handle(self, "DELETE")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(TIMEOUT)

    # -- recording --------------------------------------------------------------------

    def requests(self, path_prefix: str = "") -> list[dict]:
        with self.lock:
            return [r for r in self.received if r["path"].startswith(path_prefix)]

    def holds(self, response_id: str) -> bool:
        with self.lock:
            return response_id in self.responses

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}_{self.name}_{next(self.counter)}"

    # -- HTTP plumbing ----------------------------------------------------------------

    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        length = int(h.headers.get("content-length") or 0)
        raw = h.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        path = h.path.split("?", 1)[0]
        if path != "/health":
            with self.lock:
                self.received.append({
                    "method": method,
                    "path": path,
                    "headers": {k.lower(): v for k, v in h.headers.items()},
                    "body": body,
                })
        if method == "GET" and path == "/health":
            return self._json(h, 200, {})
        if method == "GET" and path == "/v1/models":
            return self._json(h, 200, {"object": "list", "data": [{
                "id": SERVED, "object": "model", "created": 0, "owned_by": "vllm",
                "root": SERVED, "max_model_len": 4096}]})
        if method == "POST" and path == "/v1/responses":
            return self._create_response(h, body or {})
        if path.startswith("/v1/responses/") and method in ("GET", "DELETE"):
            rid = path[len("/v1/responses/"):]
            with self.lock:
                stored = self.responses.get(rid)
                if stored is not None and method == "DELETE":
                    del self.responses[rid]
            if stored is None:
                return self._not_found(h, rid)
            if method == "DELETE":
                return self._json(h, 200, {"id": rid, "object": "response", "deleted": True})
            return self._json(h, 200, stored)
        if method == "POST" and path == "/v1/embeddings":
            return self._embeddings(h, body or {})
        if method == "POST" and path == "/v1/messages":
            return self._messages(h, body or {})
        return self._json(h, 404, {"error": {"message": f"no route {method} {path}",
                                             "type": "NotFoundError", "param": None,
                                             "code": 404}})

    @staticmethod
    def _json(h: BaseHTTPRequestHandler, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        h.send_response(status)
        h.send_header("content-type", "application/json")
        h.send_header("content-length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    @staticmethod
    def _start_sse(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("content-type", "text/event-stream; charset=utf-8")
        h.send_header("cache-control", "no-cache")
        h.send_header("transfer-encoding", "chunked")
        h.end_headers()

    @staticmethod
    def _chunk(h: BaseHTTPRequestHandler, data: bytes) -> None:
        h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        h.wfile.flush()

    def _sse(self, h: BaseHTTPRequestHandler, event: Optional[str], obj: Any) -> None:
        head = f"event: {event}\n" if event else ""
        self._chunk(h, f"{head}data: {json.dumps(obj)}\n\n".encode())

    @staticmethod
    def _end_sse(h: BaseHTTPRequestHandler) -> None:
        h.wfile.write(b"0\r\n\r\n")
        h.wfile.flush()

    def _not_found(self, h: BaseHTTPRequestHandler, rid: str) -> None:
        # vLLM's answer for a response id this replica does not hold.
        self._json(h, 404, {"error": {
            "message": f"Response with id '{rid}' not found.",
            "type": "invalid_request_error", "param": None, "code": None}})

    # -- Responses API ----------------------------------------------------------------

    def _response_obj(self, rid: str, body: dict, text: str, status: str) -> dict:
        done = status == "completed"
        msg_id = "msg_" + rid
        return {
            "id": rid,
            "object": "response",
            "created_at": int(time.time()),
            "status": status,
            "model": body.get("model"),
            "instructions": body.get("instructions"),
            "previous_response_id": body.get("previous_response_id"),
            "output": [{
                "id": msg_id, "type": "message", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": [],
                             "logprobs": []}],
            }] if done else [],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "temperature": 1.0,
            "top_p": 1.0,
            "max_output_tokens": body.get("max_output_tokens"),
            "truncation": "disabled",
            "text": {"format": {"type": "text"}},
            "reasoning": None,
            "metadata": {},
            "error": None,
            "incomplete_details": None,
            "store": True,
            "usage": {
                "input_tokens": 7, "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": 10,
            } if done else None,
        }

    def _create_response(self, h: BaseHTTPRequestHandler, body: dict) -> None:
        prev = body.get("previous_response_id")
        if prev is not None and not self.holds(prev):
            with self.lock:
                self.unknown_previous.append(prev)
            return self._not_found(h, prev)
        rid = self._new_id("resp")
        text = f"answer {rid} from {self.name}"
        final = self._response_obj(rid, body, text, "completed")
        with self.lock:
            self.responses[rid] = final
        if not body.get("stream"):
            return self._json(h, 200, final)
        seq = itertools.count(0)
        msg_id = "msg_" + rid
        created = self._response_obj(rid, body, text, "in_progress")
        self._start_sse(h)
        events = [
            {"type": "response.created", "response": created},
            {"type": "response.in_progress", "response": created},
            {"type": "response.output_item.added", "output_index": 0,
             "item": {"id": msg_id, "type": "message", "role": "assistant",
                      "status": "in_progress", "content": []}},
            {"type": "response.content_part.added", "item_id": msg_id, "output_index": 0,
             "content_index": 0,
             "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}},
        ]
        half = len(text) // 2
        for piece in (text[:half], text[half:]):
            events.append({"type": "response.output_text.delta", "item_id": msg_id,
                           "output_index": 0, "content_index": 0, "delta": piece,
                           "logprobs": []})
        events += [
            {"type": "response.output_text.done", "item_id": msg_id, "output_index": 0,
             "content_index": 0, "text": text, "logprobs": []},
            {"type": "response.content_part.done", "item_id": msg_id, "output_index": 0,
             "content_index": 0, "part": final["output"][0]["content"][0]},
            {"type": "response.output_item.done", "output_index": 0,
             "item": final["output"][0]},
            {"type": "response.completed", "response": final},
        ]
        for ev in events:
            ev["sequence_number"] = next(seq)
            self._sse(h, ev["type"], ev)
        self._end_sse(h)

    # -- embeddings -------------------------------------------------------------------

    def _embeddings(self, h: BaseHTTPRequestHandler, body: dict) -> None:
        inputs = body.get("input")
        if isinstance(inputs, str) or (isinstance(inputs, list) and inputs
                                       and isinstance(inputs[0], int)):
            inputs = [inputs]
        data = []
        for i, item in enumerate(inputs or []):
            vec = [float(i + 1)] + [0.5 * k for k in range(1, EMBED_DIM)]
            if body.get("encoding_format") == "base64":
                emb: Any = base64.b64encode(struct.pack(f"<{EMBED_DIM}f", *vec)).decode()
            else:
                emb = vec
            data.append({"object": "embedding", "index": i, "embedding": emb})
        self._json(h, 200, {"object": "list", "model": body.get("model"), "data": data,
                            "usage": {"prompt_tokens": 4, "total_tokens": 4}})

    # -- Anthropic Messages -----------------------------------------------------------

    def _messages(self, h: BaseHTTPRequestHandler, body: dict) -> None:
        mid = self._new_id("msg")
        text = f"anthropic answer {mid} from {self.name}"
        usage = {"input_tokens": 5, "output_tokens": 4}
        if not body.get("stream"):
            return self._json(h, 200, {
                "id": mid, "type": "message", "role": "assistant", "model": body.get("model"),
                "content": [{"type": "text", "text": text}], "stop_reason": "end_turn",
                "stop_sequence": None, "usage": usage})
        self._start_sse(h)
        half = len(text) // 2
        events = [
            {"type": "message_start", "message": {
                "id": mid, "type": "message", "role": "assistant", "model": body.get("model"),
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": 5, "output_tokens": 0}}},
            {"type": "content_block_start", "index": 0,
             "content_block": {"type": "text", "text": ""}},
            {"type": "content_block_delta", "index": 0,
             "delta": {"type": "text_delta", "text": text[:half]}},
            {"type": "content_block_delta", "index": 0,
             "delta": {"type": "text_delta", "text": text[half:]}},
            {"type": "content_block_stop", "index": 0},
            {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
             "usage": {"output_tokens": 4}},
            {"type": "message_stop"},
        ]
        for ev in events:
            self._sse(h, ev["type"], ev)
        self._end_sse(h)


ROUTES = """\
[[providers]]
name = "{a}"
kind = "openai_compatible"
api_base = "http://127.0.0.1:{pa}"
[providers.health]
interval_ms = 500

[[providers]]
name = "{b}"
kind = "openai_compatible"
api_base = "http://127.0.0.1:{pb}"
[providers.health]
interval_ms = 500

[[routes]]
model = "{alias}"
strategy = "cache_aware"

[[routes.targets]]
provider = "{a}"
model = "{served}"

[[routes.targets]]
provider = "{b}"
model = "{served}"
"""


def _skip_reason() -> Optional[str]:
    if openai is None:
        return "the openai SDK is not installed (scripts/setup.sh installs it)"
    if not os.access(ROLTER_BIN, os.X_OK):
        return f"no rolter binary at {ROLTER_BIN} (set ROLTER_BIN or cargo build)"
    return None


@unittest.skipIf(_skip_reason() is not None, _skip_reason() or "")
class SdkInteropTest(unittest.TestCase):
    replicas: dict[str, FakeReplica]
    proc: subprocess.Popen
    base: str

    @classmethod
    def setUpClass(cls) -> None:
        cls.replicas = {}
        cls.proc = None  # type: ignore[assignment]
        cls.tmp = tempfile.TemporaryDirectory()
        try:
            for name in ("ra", "rb"):
                cls.replicas[name] = FakeReplica(name)
            ra, rb = cls.replicas["ra"], cls.replicas["rb"]
            routes = Path(cls.tmp.name) / "routes.toml"
            routes.write_text(ROUTES.format(a="ra", pa=ra.port, b="rb", pb=rb.port,
                                            alias=ALIAS, served=SERVED))
            port = _free_port()
            cls.base = f"http://127.0.0.1:{port}"
            cls.log = open(Path(cls.tmp.name) / "rolter.log", "wb")
            cls.proc = subprocess.Popen(
                [ROLTER_BIN, "--routes", str(routes), "--listen", f"127.0.0.1:{port}"],
                stdout=cls.log, stderr=subprocess.STDOUT, cwd=cls.tmp.name)
            deadline = time.monotonic() + 20
            while True:
                if cls.proc.poll() is not None:
                    raise RuntimeError(f"rolter exited with {cls.proc.returncode}: "
                                       + cls._log_tail())
                try:
                    with urllib.request.urlopen(cls.base + "/health", timeout=1) as r:
                        if r.status == 200:
                            break
                except (urllib.error.URLError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("rolter not healthy within 20 s: " + cls._log_tail())
                time.sleep(0.1)
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def _log_tail(cls) -> str:
        try:
            cls.log.flush()
            return (Path(cls.tmp.name) / "rolter.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    @classmethod
    def tearDownClass(cls) -> None:
        if cls.proc is not None and cls.proc.poll() is None:
            cls.proc.kill()
            cls.proc.wait(TIMEOUT)
        for r in cls.replicas.values():
            r.stop()
        if getattr(cls, "log", None) is not None:
            cls.log.close()
        cls.tmp.cleanup()

    # -- helpers ----------------------------------------------------------------------

    def client(self) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.base + "/v1", api_key="x", timeout=TIMEOUT,
                             max_retries=0)

    def holder(self, response_id: str) -> str:
        """The replica that produced a response (its name is in the id)."""
        for name, r in self.replicas.items():
            if r.holds(response_id):
                return name
        self.fail(f"no replica holds {response_id}")

    def misrouted(self) -> list[str]:
        """previous_response_ids a replica answered 404 to (it did not hold them)."""
        return [rid for r in self.replicas.values() for rid in r.unknown_previous]

    def other(self, name: str) -> str:
        return "rb" if name == "ra" else "ra"

    def last_request(self, replica: str, path: str) -> dict:
        reqs = self.replicas[replica].requests(path)
        self.assertTrue(reqs, f"{replica} received no {path}")
        return reqs[-1]

    def where(self, path: str, pred) -> list[str]:
        """Names of the replicas that received a request on path whose body matches."""
        return [n for n, r in self.replicas.items()
                for q in r.requests(path) if q["path"] == path and pred(q["body"] or {})]

    def tempting_input(self, client, home: str, seed: str) -> str:
        """A long prompt that the replica other than `home` has in its prefix cache.

        A follow-up turn sending it is pulled towards that replica by cache_aware (see
        test_control_long_input_follows_cache); its previous_response_id must win. Cold
        long prompts (different from the first byte on) spread over both replicas by the
        cold tie-break, so a few tries find one that lands away from home."""
        for i in range(32):
            text = _noise(f"{seed} {i}") + " " + LONG_INPUT
            warm = client.responses.create(model=ALIAS, input=text)
            if self.holder(warm.id) != home:
                return text
        self.fail(f"no cold long prompt landed away from {home} in 32 tries")

    # -- tests ------------------------------------------------------------------------

    def test_responses_create(self) -> None:
        client = self.client()
        resp = client.responses.create(model=ALIAS, input="Say hi.")
        self.assertEqual(resp.status, "completed")
        name = self.holder(resp.id)
        self.assertEqual(resp.output_text, f"answer {resp.id} from {name}")
        seen = self.last_request(name, "/v1/responses")
        self.assertEqual(seen["body"]["model"], SERVED, "alias not rewritten upstream")
        self.assertEqual(seen["body"]["input"], "Say hi.")
        self.assertEqual(seen["headers"].get("authorization"), "Bearer x")

    def test_control_long_input_follows_cache(self) -> None:
        """Without previous_response_id, a long prompt goes where it is cached, whichever
        replica that is: the pull the conversations below must resist is real."""
        client = self.client()
        for i in range(6):
            text = _noise(f"control {i}") + " " + LONG_INPUT
            warm = client.responses.create(model=ALIAS, input=text)
            for _ in range(2):
                again = client.responses.create(model=ALIAS, input=text)
                self.assertEqual(self.holder(again.id), self.holder(warm.id))

    def test_conversation_previous_response_id(self) -> None:
        client = self.client()
        prev = client.responses.create(model=ALIAS, instructions="Be brief.",
                                       input=_noise("json turn 1")).id
        home = self.holder(prev)
        for turn in range(2, 6):
            text = self.tempting_input(client, home, f"json turn {turn}")
            before = len(self.replicas[home].requests("/v1/responses"))
            resp = client.responses.create(model=ALIAS, input=text,
                                           previous_response_id=prev)
            self.assertEqual(resp.status, "completed")
            self.assertEqual(self.holder(resp.id), home, f"turn {turn} left {home}")
            self.assertEqual(resp.output_text, f"answer {resp.id} from {home}")
            self.assertEqual(len(self.replicas[home].requests("/v1/responses")), before + 1)
            seen = self.last_request(home, "/v1/responses")["body"]
            self.assertEqual(seen["previous_response_id"], prev)
            self.assertEqual(seen["model"], SERVED)
            prev = resp.id
        self.assertEqual(self.misrouted(), [], "a follow-up reached a replica not holding "
                                               "its previous response (404)")

    def test_conversation_previous_response_id_streamed(self) -> None:
        client = self.client()
        stream = client.responses.create(model=ALIAS, instructions="Be brief.",
                                         input=_noise("sse turn 1"), stream=True)
        with stream:
            prev = [ev.response.id for ev in stream if ev.type == "response.completed"][0]
        home = self.holder(prev)
        for turn in range(2, 6):
            text = self.tempting_input(client, home, f"sse turn {turn}")
            stream = client.responses.create(model=ALIAS, input=text,
                                             previous_response_id=prev, stream=True)
            types, seqs, deltas, completed = [], [], [], None
            with stream:
                for ev in stream:
                    types.append(ev.type)
                    seqs.append(ev.sequence_number)
                    if ev.type == "response.output_text.delta":
                        deltas.append(ev.delta)
                    elif ev.type == "response.completed":
                        completed = ev.response
            self.assertIsNotNone(completed, f"turn {turn}: no response.completed in {types}")
            self.assertEqual(types[0], "response.created")
            self.assertEqual(seqs, list(range(len(seqs))))
            self.assertEqual(completed.status, "completed")
            self.assertEqual(self.holder(completed.id), home, f"turn {turn} left {home}")
            self.assertEqual("".join(deltas), completed.output_text)
            seen = self.last_request(home, "/v1/responses")["body"]
            self.assertEqual(seen["previous_response_id"], prev)
            self.assertIs(seen["stream"], True)
            self.assertEqual(seen["model"], SERVED)
            prev = completed.id
        self.assertEqual(self.misrouted(), [])
        # rolter learnt the streamed ids too (from response.created): the SDK's stream helper
        # continues from the last one, and a retrieve finds it.
        text = self.tempting_input(client, home, "sse helper")
        with client.responses.stream(model=ALIAS, input=text,
                                     previous_response_id=prev) as s:
            final = s.get_final_response()
        self.assertEqual(self.holder(final.id), home)
        self.assertEqual(final.output_text, f"answer {final.id} from {home}")
        self.assertEqual(client.responses.retrieve(prev).id, prev)

    def test_responses_retrieve(self) -> None:
        client = self.client()
        seen_homes = {}
        for i in range(32):
            r = client.responses.create(model=ALIAS, instructions=_noise(f"retrieve {i}"),
                                        input=_noise(f"retrieve me {i}"))
            seen_homes.setdefault(self.holder(r.id), r.id)
            if len(seen_homes) == 2:
                break
        self.assertEqual(len(seen_homes), 2, "cold prompts never reached both replicas")
        for home, rid in seen_homes.items():
            before = {n: len(r.requests("/v1/responses/")) for n, r in self.replicas.items()}
            got = client.responses.retrieve(rid)
            self.assertEqual(got.id, rid)
            self.assertEqual(got.output_text, f"answer {rid} from {home}")
            after = {n: len(r.requests("/v1/responses/")) for n, r in self.replicas.items()}
            self.assertEqual(after[home], before[home] + 1, f"GET {rid} missed {home}")
            self.assertEqual(after[self.other(home)], before[self.other(home)])
            self.assertEqual(self.last_request(home, "/v1/responses/")["method"], "GET")
        # DELETE reaches the holding replica too; the id then 404s there.
        home, rid = next(iter(seen_homes.items()))
        client.responses.delete(rid)
        self.assertEqual(self.last_request(home, "/v1/responses/")["method"], "DELETE")
        self.assertFalse(self.replicas[home].holds(rid))
        with self.assertRaises(openai.NotFoundError):
            client.responses.retrieve(rid)
        # An id rolter never saw: its own 404, which the SDK raises as NotFoundError.
        with self.assertRaises(openai.NotFoundError):
            client.responses.retrieve("resp_nowhere_1")

    def test_embeddings(self) -> None:
        client = self.client()
        # The SDK asks for base64 by default and decodes it to floats.
        out = client.embeddings.create(model=ALIAS, input=["one", "two"])
        self.assertEqual(len(out.data), 2)
        for i, d in enumerate(out.data):
            self.assertEqual(len(d.embedding), EMBED_DIM)
            self.assertEqual(d.embedding[0], float(i + 1))
        self.assertEqual(out.model, SERVED)
        homes = self.where("/v1/embeddings", lambda b: b.get("input") == ["one", "two"])
        self.assertEqual(len(homes), 1, homes)
        seen = self.last_request(homes[0], "/v1/embeddings")["body"]
        self.assertEqual(seen["model"], SERVED, "alias not rewritten upstream")
        self.assertEqual(seen["encoding_format"], "base64")
        floats = client.embeddings.create(model=ALIAS, input="three", encoding_format="float")
        self.assertEqual(floats.data[0].embedding, [1.0] + [0.5 * k for k in range(1, EMBED_DIM)])

    @unittest.skipIf(anthropic is None, "the anthropic SDK is not installed "
                                        "(scripts/setup.sh installs it)")
    def test_anthropic_messages(self) -> None:
        client = anthropic.Anthropic(base_url=self.base, api_key="x", timeout=TIMEOUT,
                                     max_retries=0)
        msg = client.messages.create(model=ALIAS, max_tokens=16, system="Be brief.",
                                     messages=[{"role": "user", "content": "Hello"}])
        self.assertEqual(msg.type, "message")
        self.assertEqual(msg.role, "assistant")
        self.assertEqual(msg.stop_reason, "end_turn")
        home = msg.id.split("_")[1]
        self.assertEqual(msg.content[0].text, f"anthropic answer {msg.id} from {home}")
        seen = self.last_request(home, "/v1/messages")
        self.assertEqual(seen["body"]["model"], SERVED, "alias not rewritten upstream")
        self.assertEqual(seen["body"]["messages"], [{"role": "user", "content": "Hello"}])
        # The client's key, as this SDK version sends it (x-api-key, or Authorization:
        # Bearer in recent versions), reaches the replica unchanged.
        key_headers = (seen["headers"].get("x-api-key"), seen["headers"].get("authorization"))
        self.assertIn(key_headers, [("x", None), (None, "Bearer x"), ("x", "Bearer x")])
        self.assertTrue(seen["headers"].get("anthropic-version"))
        # Streamed, through the SDK's stream helper.
        with client.messages.stream(model=ALIAS, max_tokens=16,
                                    messages=[{"role": "user", "content": "Stream it"}]) as s:
            text = "".join(s.text_stream)
            final = s.get_final_message()
        home = final.id.split("_")[1]
        self.assertEqual(text, f"anthropic answer {final.id} from {home}")
        self.assertEqual(final.stop_reason, "end_turn")
        self.assertIs(self.last_request(home, "/v1/messages")["body"]["stream"], True)


if __name__ == "__main__":
    unittest.main()
