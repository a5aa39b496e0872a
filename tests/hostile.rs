//! Hostile and broken requests through the real gateway, table-driven.
//!
//! Every case is written byte for byte to a raw TCP connection (so malformed HTTP reaches
//! the gateway as sent), and asserts: the status; the body (rolter's OpenAI error JSON with
//! its `code`, or pingora's own empty 400 for requests rejected while parsing the header,
//! before rolter sees them); what the recording upstream received (nothing, or exactly the
//! expected bytes); the `rolter_request_errors_total{kind}` increment; what happens to a
//! second request on the same connection (answered correctly, or the connection closed —
//! never a smuggled request); and that the gateway is healthy afterwards (a normal request
//! succeeds, the process is alive).
//!
//! A second stub, `evil`, stands for "another host": absolute-form targets and Host headers
//! name it, and it must never be contacted.

mod common;

use common::*;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Body limit of the gateway under test (small so oversize cases are cheap).
const BODY_LIMIT: usize = 1024 * 1024;
/// Client body timeout of the gateway under test.
const BODY_TIMEOUT_MS: u64 = 600;
/// Longest any single response may take to arrive.
const RESPONSE_LIMIT: Duration = Duration::from_secs(5);

/// A parsed HTTP/1.1 response.
#[derive(Debug)]
struct Resp {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Resp {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// What reading a response from a raw connection gave.
#[derive(Debug)]
enum Read {
    Response(Resp),
    /// The gateway closed (or reset) the connection without a response.
    Closed,
    /// Nothing within the limit: the connection hangs.
    Hung,
}

/// A raw client connection with a read buffer.
struct Raw {
    stream: TcpStream,
    buf: Vec<u8>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_body_senders_hold_no_proxy_slot_and_bodies_are_held_within_a_byte_budget() {
    let stub = Stub::start("a").await.unwrap();
    let gw = Gateway::start(&routes_toml(
        &[stub.url()],
        "round_robin",
        "[limits]\nmax_inflight = 2\nmax_body_bytes = 70000\nmax_buffered_body_bytes = 100000\n",
    ))
    .await;
    // A body is charged for the memory it holds: its bytes, and 64 bytes for each piece
    // they arrived in (nothing ahead of them, whatever length it declares).
    let charge = |bytes: usize, pieces: usize| (bytes + 64 * pieces) as f64;
    let stalled_charge = 3.0 * charge(10, 1);
    // Three clients (more than max_inflight) start bodies and stall: a slowloris.
    let mut stalled = Vec::new();
    for i in 0..3 {
        let mut conn = Raw::connect(gw.port).await;
        conn.send(&http(
            &format!("POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Length: 1000\r\nx-n: {i}"),
            &[b' '; 10],
        ))
        .await;
        stalled.push(conn);
    }
    assert!(
        eventually(Duration::from_secs(3), || async {
            gw.metric("rolter_buffered_body_bytes").await == Some(stalled_charge)
        })
        .await,
        "the stalled bodies' buffers are not charged"
    );
    // They hold no proxying slot: a complete request is proxied at once.
    let (status, _, _) = post_chat(&gw, chat_body("alias", "not locked out", false)).await;
    assert_eq!(status, 200);
    assert_eq!(gw.metric("rolter_admitted_requests").await, Some(0.0));

    // A client that sends 60,000 bytes of a 65,000-byte body and stalls holds (and is
    // charged for) them; a body that would take the held bytes over the budget is refused
    // with 503.
    let mut big = Raw::connect(gw.port).await;
    big.send(&http(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Length: 65000",
        &[b' '; 60_000],
    ))
    .await;
    assert!(
        eventually(Duration::from_secs(3), || async {
            let held = gw.metric("rolter_buffered_body_bytes").await.unwrap_or(0.0);
            // However many reads the 60,000 bytes took (a few on loopback; past eight,
            // short ones are gathered into 32 KiB buffers, charged whole).
            (stalled_charge + charge(60_000, 1)..=stalled_charge + charge(2 * 60_000, 16))
                .contains(&held)
        })
        .await
    );
    let second = serde_json::json!({"model": "alias", "pad": "x".repeat(50_000), "messages": [{"role": "user", "content": "hi"}]}).to_string();
    let mut conn = Raw::connect(gw.port).await;
    conn.send(&post(second.as_bytes(), "")).await;
    let Read::Response(r) = conn.response(RESPONSE_LIMIT).await else {
        panic!("no answer to the request over the budget");
    };
    assert_eq!(r.status, 503, "{:?}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.header("retry-after"), Some("1"));
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["error"]["code"], "overloaded");
    // Its bytes went back; once the big one leaves, the same request fits.
    drop(big);
    assert!(
        eventually(Duration::from_secs(3), || async {
            gw.metric("rolter_buffered_body_bytes").await == Some(stalled_charge)
        })
        .await,
        "bytes of refused or departed bodies are not given back"
    );
    let mut conn = Raw::connect(gw.port).await;
    conn.send(&post(second.as_bytes(), "")).await;
    assert!(matches!(conn.response(RESPONSE_LIMIT).await, Read::Response(r) if r.status == 200));
    drop(stalled);
    assert!(
        eventually(Duration::from_secs(3), || async {
            gw.metric("rolter_buffered_body_bytes").await == Some(0.0)
        })
        .await
    );
}

impl Raw {
    async fn connect(port: u16) -> Raw {
        let stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        stream.set_nodelay(true).unwrap();
        Raw {
            stream,
            buf: Vec::new(),
        }
    }

    /// Write bytes; a write error (the gateway already closed) is not a test failure.
    async fn send(&mut self, bytes: &[u8]) -> bool {
        self.stream.write_all(bytes).await.is_ok()
    }

    /// Read more bytes into the buffer: Some(n > 0), Some(0) at EOF/reset, None on timeout.
    async fn fill(&mut self, deadline: Instant) -> Option<usize> {
        let mut chunk = [0u8; 64 * 1024];
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, self.stream.read(&mut chunk)).await {
            Err(_) => None,
            Ok(Err(_)) => Some(0),
            Ok(Ok(n)) => {
                self.buf.extend_from_slice(&chunk[..n]);
                Some(n)
            }
        }
    }

    /// Read one final (non-1xx) response.
    async fn response(&mut self, limit: Duration) -> Read {
        let deadline = Instant::now() + limit;
        loop {
            let Some(end) = find(&self.buf, b"\r\n\r\n") else {
                match self.fill(deadline).await {
                    None => return Read::Hung,
                    Some(0) if self.buf.is_empty() => return Read::Closed,
                    Some(0) => panic!(
                        "connection closed inside a response header: {:?}",
                        self.text()
                    ),
                    Some(_) => continue,
                }
            };
            let head = String::from_utf8_lossy(&self.buf[..end]).to_string();
            self.buf.drain(..end + 4);
            let mut lines = head.split("\r\n");
            let status: u16 = lines
                .next()
                .and_then(|l| l.split(' ').nth(1))
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| panic!("bad status line in {head:?}"));
            let headers: Vec<(String, String)> = lines
                .filter_map(|l| l.split_once(':'))
                .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
                .collect();
            if (100..200).contains(&status) {
                continue;
            }
            let mut resp = Resp {
                status,
                headers,
                body: Vec::new(),
            };
            if let Some(n) = resp.header("content-length") {
                let n: usize = n.parse().unwrap();
                while self.buf.len() < n {
                    match self.fill(deadline).await {
                        Some(k) if k > 0 => {}
                        _ => panic!("short response body"),
                    }
                }
                resp.body = self.buf.drain(..n).collect();
            } else if resp
                .header("transfer-encoding")
                .is_some_and(|v| v.eq_ignore_ascii_case("chunked"))
            {
                resp.body = self.chunked(deadline).await;
            } else {
                while let Some(k) = self.fill(deadline).await {
                    if k == 0 {
                        break;
                    }
                }
                resp.body = std::mem::take(&mut self.buf);
            }
            return Read::Response(resp);
        }
    }

    async fn chunked(&mut self, deadline: Instant) -> Vec<u8> {
        let mut body = Vec::new();
        loop {
            let line_end = loop {
                if let Some(i) = find(&self.buf, b"\r\n") {
                    break i;
                }
                assert!(matches!(self.fill(deadline).await, Some(k) if k > 0));
            };
            let size_text = String::from_utf8_lossy(&self.buf[..line_end]).to_string();
            let size = usize::from_str_radix(size_text.split(';').next().unwrap().trim(), 16)
                .unwrap_or_else(|_| panic!("bad chunk size {size_text:?}"));
            while self.buf.len() < line_end + 2 + size + 2 {
                assert!(matches!(self.fill(deadline).await, Some(k) if k > 0));
            }
            body.extend_from_slice(&self.buf[line_end + 2..line_end + 2 + size]);
            self.buf.drain(..line_end + 2 + size + 2);
            if size == 0 {
                return body;
            }
        }
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.buf).to_string()
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// `head` (request line and header lines, CRLF-separated, no trailing blank line) + body.
fn http(head: &str, body: &[u8]) -> Vec<u8> {
    let mut out = format!("{head}\r\n\r\n").into_bytes();
    out.extend_from_slice(body);
    out
}

/// A well-formed chat POST with an exact Content-Length and `extra` header lines.
fn post(body: &[u8], extra: &str) -> Vec<u8> {
    let mut head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\nContent-Length: {}",
        body.len()
    );
    if !extra.is_empty() {
        head += "\r\n";
        head += extra;
    }
    http(&head, body)
}

/// A chunked chat POST whose body is `chunks`, each framed correctly.
fn post_chunked(chunks: &[&[u8]], extra: &str) -> Vec<u8> {
    let mut head =
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nTransfer-Encoding: chunked"
            .to_string();
    if !extra.is_empty() {
        head += "\r\n";
        head += extra;
    }
    http(&head, &chunked(chunks))
}

fn chunked(chunks: &[&[u8]]) -> Vec<u8> {
    let mut body = Vec::new();
    for c in chunks {
        body.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
        body.extend_from_slice(c);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(b"0\r\n\r\n");
    body
}

/// A small valid chat body for the `alias` route.
fn chat(content: &str) -> Vec<u8> {
    serde_json::json!({"model": "alias", "messages": [{"role": "user", "content": content}]})
        .to_string()
        .into_bytes()
}

/// `body` as the upstream must receive it (model rewritten, every other byte kept).
fn upstream_view(body: &[u8]) -> Vec<u8> {
    String::from_utf8_lossy(body)
        .replacen("\"model\":\"alias\"", "\"model\":\"upstream-model-0\"", 1)
        .into_bytes()
}

/// How a case is sent.
enum Send {
    /// All bytes in one write.
    Once(Vec<u8>),
    /// `head` then `piece` every `every`, until `pieces` were sent or a response arrived.
    Dribble {
        head: Vec<u8>,
        piece: Vec<u8>,
        every: Duration,
        pieces: usize,
    },
}

/// What the response body must be.
enum Body {
    /// Any body (a success relayed from the upstream).
    Relayed,
    /// rolter's OpenAI error JSON with this `error.code`.
    OpenAi(&'static str),
    /// Pingora's own reply to an unparseable request header: no body.
    Pingora,
}

/// What the upstream must have received because of this case.
enum Upstream {
    Nothing,
    /// Exactly one request with exactly this body.
    Body(Vec<u8>),
}

/// What a follow-up request on the same connection gets.
enum Then {
    /// Not tried.
    Skip,
    /// This request is written after the response; it must be answered 200 by the stub,
    /// or the connection must already be closed — never anything else.
    AnsweredOrClosed(Vec<u8>),
    /// The connection must be closed after the response (bytes already sent after the
    /// request, if any, were not served).
    Closed,
    /// This request must be answered 200 (a normal keep-alive reuse).
    Answered(Vec<u8>),
}

struct Case {
    name: &'static str,
    send: Send,
    status: u16,
    body: Body,
    upstream: Upstream,
    /// `rolter_request_errors_total{kind}` that must go up by one.
    kind: Option<&'static str>,
    then: Then,
}

fn case(name: &'static str, bytes: Vec<u8>, status: u16, body: Body) -> Case {
    Case {
        name,
        send: Send::Once(bytes),
        status,
        kind: match &body {
            Body::OpenAi(code) => Some(code),
            _ => None,
        },
        body,
        upstream: Upstream::Nothing,
        then: Then::Skip,
    }
}

impl Case {
    fn upstream(mut self, u: Upstream) -> Self {
        self.upstream = u;
        self
    }
    fn then(mut self, t: Then) -> Self {
        self.then = t;
        self
    }
}

fn cases(evil_port: u16) -> Vec<Case> {
    use Body::*;
    let ok = chat("hello there");
    let smuggled = serde_json::json!({"model": "alias", "messages": [{"role": "user", "content": "SMUGGLED"}]}).to_string();
    let smuggled_req = post(smuggled.as_bytes(), "");
    let ten_thousand = serde_json::json!({
        "model": "alias",
        "messages": (0..10_000).map(|i| serde_json::json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": format!("message {i}")})).collect::<Vec<_>>()
    })
    .to_string()
    .into_bytes();
    let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
    let deep_unknown = format!(r#"{{"model":"alias","x":{},"messages":[]}}"#, deep(10_000));
    let ids_huge = (0..100_000)
        .map(|i| (i % 50_000).to_string())
        .collect::<Vec<_>>()
        .join(",");
    let mut invalid_utf8 =
        br#"{"model":"alias","messages":[{"role":"user","content":"bad "#.to_vec();
    invalid_utf8.extend_from_slice(b"\xff\xfe\x80");
    invalid_utf8.extend_from_slice(br#""}]}"#);
    let ok_len = ok.len();
    let (ok_a, ok_b) = ok.split_at(ok_len / 2);
    // Over the body buffer's first reservation (64 KiB) and under BODY_LIMIT.
    let long = chat(&"a long prompt, ".repeat(50_000));
    let tiny = chat(&"t".repeat(3000));
    let evil = format!("127.0.0.1:{evil_port}");

    vec![
        // --- broken JSON and wrong shapes: 400 (or 404), never forwarded ---
        case("truncated JSON", post(br#"{"model":"alias","messages":[{"role":"user","content":"hi"#, ""), 400, OpenAi("bad_request")),
        case("empty body", post(b"", ""), 400, OpenAi("bad_request")),
        case("messages is a string", post(br#"{"model":"alias","messages":"hi"}"#, ""), 400, OpenAi("bad_request")),
        case("content is a number", post(br#"{"model":"alias","messages":[{"role":"user","content":5}]}"#, ""), 400, OpenAi("bad_request")),
        case("missing model", post(br#"{"messages":[{"role":"user","content":"hi"}]}"#, ""), 400, OpenAi("bad_request")),
        case("model is a number", post(br#"{"model":7,"messages":[]}"#, ""), 400, OpenAi("bad_request")),
        case("duplicate model key", post(br#"{"model":"alias","model":"other","messages":[]}"#, ""), 400, OpenAi("bad_request")),
        case("unknown model", post(br#"{"model":"nope","messages":[]}"#, ""), 404, OpenAi("not_found")),
        case("JSON array, not object", post(b"[1,2,3]", ""), 400, OpenAi("bad_request")),
        case("invalid UTF-8 in content", post(&invalid_utf8, ""), 400, OpenAi("bad_request")),
        // serde_json stops at 128 levels: no stack overflow, a 400.
        case("messages nested 100,000 deep", post(format!(r#"{{"model":"alias","messages":{}}}"#, deep(100_000)).as_bytes(), ""), 400, OpenAi("bad_request")),
        case("content part nested 10,000 deep", post(format!(r#"{{"model":"alias","messages":[{{"role":"user","content":[{{"type":"image_url","image_url":{}}}]}}]}}"#, deep(10_000)).as_bytes(), ""), 400, OpenAi("bad_request")),
        // Deliberately forwarded: rolter reads only what routing needs, and serde_json skips
        // an unknown field without recursing; what the upstream makes of it is its own call.
        case("unknown field nested 10,000 deep", post(deep_unknown.as_bytes(), ""), 200, Relayed)
            .upstream(Upstream::Body(upstream_view(deep_unknown.as_bytes()))),
        // Deliberately accepted: bounded by max_body_bytes, forwarded byte for byte.
        case("10,000 messages", post(&ten_thousand, ""), 200, Relayed).upstream(Upstream::Body(upstream_view(&ten_thousand))),
        // --- methods and paths ---
        case("GET on a POST endpoint", http("GET /v1/chat/completions HTTP/1.1\r\nHost: gateway", b""), 405, OpenAi("method_not_allowed")),
        case("unknown path", http("POST /v1/nonexistent HTTP/1.1\r\nHost: gateway\r\nContent-Length: 2", b"{}"), 404, OpenAi("not_found")),
        case("pass-through body without a model", http("POST /v1/embeddings HTTP/1.1\r\nHost: gateway\r\nContent-Length: 2", b"{}"), 400, OpenAi("bad_request")),
        case("audio form without a boundary", http("POST /v1/audio/transcriptions HTTP/1.1\r\nHost: gateway\r\nContent-Type: multipart/form-data\r\nContent-Length: 2", b"{}"), 400, OpenAi("bad_request")),
        case("audio form cut before its end", http("POST /v1/audio/transcriptions HTTP/1.1\r\nHost: gateway\r\nContent-Type: multipart/form-data; boundary=b\r\nContent-Length: 53", b"--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n"), 400, OpenAi("bad_request")),
        case("CONNECT", http("CONNECT 127.0.0.1:1 HTTP/1.1\r\nHost: 127.0.0.1:1", b""), 405, Pingora),
        case("garbage request line", http("FOO BAR BAZ QUX", b""), 400, Pingora),
        case("NUL in a header value", http("POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nX-A: a\0b\r\nContent-Length: 2", b"{}"), 400, Pingora),
        // --- body size and time limits ---
        case("declared body over the limit", http(&format!("POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Length: {}", BODY_LIMIT + 1), b"{"), 413, OpenAi("body_too_large")),
        Case {
            name: "slowloris body over the limit (chunked, 64 KiB every 10 ms)",
            send: Send::Dribble {
                head: b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec(),
                piece: [format!("{:x}\r\n", 64 * 1024).into_bytes(), vec![b' '; 64 * 1024], b"\r\n".to_vec()].concat(),
                every: Duration::from_millis(10),
                pieces: 64,
            },
            status: 413,
            body: OpenAi("body_too_large"),
            upstream: Upstream::Nothing,
            kind: Some("body_too_large"),
            then: Then::Closed,
        },
        Case {
            name: "slowloris body under the limit (10 bytes every 100 ms)",
            send: Send::Dribble {
                head: b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Length: 5000\r\n\r\n".to_vec(),
                piece: vec![b' '; 10],
                every: Duration::from_millis(100),
                pieces: 50,
            },
            status: 408,
            body: OpenAi("client_body_timeout"),
            upstream: Upstream::Nothing,
            kind: Some("client_body_timeout"),
            then: Then::Closed,
        },
        // --- Content-Length mismatches ---
        case("body shorter than Content-Length", http(&format!("POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Length: {}", ok_len + 10), &ok), 408, OpenAi("client_body_timeout")).then(Then::Closed),
        case("body longer than Content-Length (a request hidden after it)", [post(&ok, ""), smuggled_req.clone()].concat(), 200, Relayed)
            .upstream(Upstream::Body(upstream_view(&ok))).then(Then::Closed),
        case("two different Content-Length headers", http(&format!("POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Length: {ok_len}\r\nContent-Length: 5"), &ok), 400, Pingora),
        case("two equal Content-Length headers", http(&format!("POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Length: {ok_len}\r\nContent-Length: {ok_len}"), &ok), 200, Relayed)
            .upstream(Upstream::Body(upstream_view(&ok))),
        case("signed Content-Length", http(&format!("POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Length: +{ok_len}"), &ok), 400, Pingora),
        case("non-numeric Content-Length", http("POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Length: 1e3", &ok), 400, Pingora),
        // --- chunked bodies ---
        case("valid chunked body, then a second request on the connection", post_chunked(&[ok_a, ok_b], ""), 200, Relayed)
            .upstream(Upstream::Body(upstream_view(&ok)))
            .then(Then::Answered(post(&chat("second"), ""))),
        // Buffered in many pieces: held, then copied into the buffer as it grows.
        case("chunked body in 1-byte chunks", post_chunked(&tiny.chunks(1).collect::<Vec<_>>(), ""), 200, Relayed)
            .upstream(Upstream::Body(upstream_view(&tiny))),
        case("chunked 750 KB body in 190-byte chunks", post_chunked(&long.chunks(190).collect::<Vec<_>>(), ""), 200, Relayed)
            .upstream(Upstream::Body(upstream_view(&long))),
        case("750 KB body with its Content-Length", post(&long, ""), 200, Relayed)
            .upstream(Upstream::Body(upstream_view(&long))),
        case("chunk size not hex", http("POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nTransfer-Encoding: chunked", b"zz\r\n{}\r\n0\r\n\r\n"), 400, OpenAi("bad_request")).then(Then::Closed),
        case("chunk size overflows", http("POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nTransfer-Encoding: chunked", b"fffffffffffffffffffff\r\n{}\r\n0\r\n\r\n"), 400, OpenAi("bad_request")).then(Then::Closed),
        case("chunk data longer than its size", http("POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nTransfer-Encoding: chunked", b"2\r\n{}XX\r\n0\r\n\r\n"), 400, OpenAi("bad_request")).then(Then::Closed),
        // --- token-id header: malformed or huge falls back, never 5xx ---
        case("non-numeric token ids", post(&ok, "x-rolter-vllm-token-ids: 1,2,banana,-4"), 200, Relayed).upstream(Upstream::Body(upstream_view(&ok))),
        case("token ids past u32", post(&ok, "x-rolter-vllm-token-ids: 99999999999999999999"), 200, Relayed).upstream(Upstream::Body(upstream_view(&ok))),
        // Accepted because this gateway raises limits.max_header_bytes to its maximum, as
        // precise_cache_aware routes given long prompts' token ids must (README).
        case("100,000 token ids (~590 KB header)", post(&ok, &format!("x-rolter-vllm-token-ids: {ids_huge}")), 200, Relayed).upstream(Upstream::Body(upstream_view(&ok))),
        // Refused by rolter before pingora's own 1 MiB limit (a bare 400) is reached.
        case("header section over limits.max_header_bytes (and pingora's 1 MiB)", post(&ok, &format!("x-rolter-vllm-token-ids: {}", "1,".repeat(600_000))), 431, OpenAi("header_too_large")).then(Then::Closed),
        case("300 header fields (pingora allows 256)", post(&ok, &(0..300).map(|i| format!("x-h{i}: v")).collect::<Vec<_>>().join("\r\n")), 400, Pingora),
        case("invalid UTF-8 in a header value", post(&ok, "x-session-id: \u{00ff}\u{00fe}"), 200, Relayed).upstream(Upstream::Body(upstream_view(&ok))),
        // --- other hosts: never change the upstream ---
        case("Host names another host", http(&format!("POST /v1/chat/completions HTTP/1.1\r\nHost: {evil}\r\nContent-Length: {ok_len}"), &ok), 200, Relayed)
            .upstream(Upstream::Body(upstream_view(&ok))),
        case("absolute-form target naming another host", http(&format!("POST http://{evil}/v1/chat/completions HTTP/1.1\r\nHost: {evil}\r\nContent-Length: {ok_len}"), &ok), 200, Relayed)
            .upstream(Upstream::Body(upstream_view(&ok))),
        case("absolute-form target without Host", http(&format!("POST http://{evil}/v1/chat/completions HTTP/1.1\r\nContent-Length: {ok_len}"), &ok), 200, Relayed)
            .upstream(Upstream::Body(upstream_view(&ok))),
        case("absolute-form target and a different Host", http(&format!("POST http://{evil}/v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Length: {ok_len}"), &ok), 400, Pingora),
        case("two Host headers", http(&format!("POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nHost: {evil}\r\nContent-Length: {ok_len}"), &ok), 400, Pingora),
        case("userinfo in Host", http(&format!("POST /v1/chat/completions HTTP/1.1\r\nHost: user@{evil}\r\nContent-Length: {ok_len}"), &ok), 400, Pingora),
        // --- smuggling probes: CL+TE, TE obfuscation ---
        // CL.TE: a front end trusting Content-Length would see the hidden request as a
        // second one. Pingora frames by Transfer-Encoding, drops Content-Length and closes
        // the connection after the response (RFC 9112 §6.1).
        case("CL+TE: chunked body, a request hidden after the last chunk", [http("POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Length: 4\r\nTransfer-Encoding: chunked", &chunked(&[&ok])), smuggled_req.clone()].concat(), 200, Relayed)
            .upstream(Upstream::Body(upstream_view(&ok))).then(Then::Closed),
        // TE.CL: a back end trusting Content-Length would read the hidden request as body.
        case("TE+CL: empty chunked body, Content-Length covering a hidden request", {
            let tail = [b"0\r\n\r\n".to_vec(), smuggled_req.clone()].concat();
            http(&format!("POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nTransfer-Encoding: chunked\r\nContent-Length: {}", tail.len()), &tail)
        }, 400, OpenAi("bad_request")).then(Then::Closed),
        case("TE: xchunked (+CL)", http(&format!("POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nTransfer-Encoding: xchunked\r\nContent-Length: {ok_len}"), &ok), 400, Pingora),
        case("TE: chunked, identity", http("POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nTransfer-Encoding: chunked, identity", &chunked(&[&ok])), 400, Pingora),
        case("TE: two headers, last not chunked", http("POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: identity", &chunked(&[&ok])), 400, Pingora),
        case("TE: space before the colon", http(&format!("POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nTransfer-Encoding : chunked\r\nContent-Length: {ok_len}"), &ok), 400, Pingora),
        case("TE: on HTTP/1.0", http("POST /v1/chat/completions HTTP/1.0\r\nHost: gateway\r\nTransfer-Encoding: chunked", &chunked(&[&ok])), 400, Pingora),
        case("TE: line folding (obs-fold)", http(&format!("POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nTransfer-Encoding:\r\n chunked\r\nContent-Length: {ok_len}"), &ok), 400, Pingora),
        // Case-insensitive "CHUNKED" is the real thing: framed as chunked, answered.
        case("TE: CHUNKED (upper case is valid)", http("POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nTransfer-Encoding: CHUNKED", &chunked(&[&ok])), 200, Relayed)
            .upstream(Upstream::Body(upstream_view(&ok)))
            .then(Then::AnsweredOrClosed(post(&chat("after upper-case TE"), ""))),
        // Pipelining (two requests in one write) is not supported: the first is served,
        // the connection closes, and the client retries the second (RFC 9112 §9.3.2).
        // (That is when the second arrives with the first's header read; one behind a body
        // long enough to be read later stays on the socket, as pingora reads a body only to
        // its end, and is served next on the kept-alive connection.)
        case("two pipelined requests in one write", [post(&ok, ""), post(&chat("pipelined"), "")].concat(), 200, Relayed)
            .upstream(Upstream::Body(upstream_view(&ok))).then(Then::Closed),
        case("Expect: 100-continue", post(&ok, "Expect: 100-continue"), 200, Relayed).upstream(Upstream::Body(upstream_view(&ok))),
        // After the interim 100 Continue, an error is still the OpenAI-shaped answer (the
        // interim response does not count as "a response already written").
        case("Expect: 100-continue, unknown model", post(br#"{"model":"nope","messages":[]}"#, "Expect: 100-continue"), 404, OpenAi("not_found")),
        case("Expect: 100-continue, broken JSON", post(b"{\"model\":", "Expect: 100-continue"), 400, OpenAi("bad_request")),
    ]
}

async fn errors_of(gw: &Gateway, kind: &str) -> f64 {
    gw.metric(&format!("rolter_request_errors_total{{kind=\"{kind}\"}}"))
        .await
        .unwrap_or(0.0)
}

async fn send_case(port: u16, send: &Send) -> (Raw, Read) {
    let mut conn = Raw::connect(port).await;
    match send {
        Send::Once(bytes) => {
            conn.send(bytes).await;
            let r = conn.response(RESPONSE_LIMIT).await;
            (conn, r)
        }
        Send::Dribble {
            head,
            piece,
            every,
            pieces,
        } => {
            conn.send(head).await;
            for _ in 0..*pieces {
                // Stop dribbling as soon as the gateway answers or closes.
                match tokio::time::timeout(*every, conn.stream.peek(&mut [0u8; 1])).await {
                    Ok(_) => break,
                    Err(_) => {
                        if !conn.send(piece).await {
                            break;
                        }
                    }
                }
            }
            let r = conn.response(RESPONSE_LIMIT).await;
            (conn, r)
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_requests_get_the_expected_answer_and_leave_the_gateway_healthy() {
    let stub = Stub::start("a").await.unwrap();
    let evil = Stub::start("evil").await.unwrap();
    let mut gw = Gateway::start(&routes_toml(
        &[stub.url()],
        "round_robin",
        &format!(
            "[limits]\nmax_body_bytes = {BODY_LIMIT}\nclient_body_timeout_ms = {BODY_TIMEOUT_MS}\nmax_header_bytes = 1048575\n"
        ),
    ))
    .await;
    let started = Instant::now();
    let mut failures = Vec::new();
    for c in cases(evil.addr().port()) {
        let before_rec = stub.recorded().len();
        let before_kind = match c.kind {
            Some(k) => errors_of(&gw, k).await,
            None => 0.0,
        };
        let case_started = Instant::now();
        let (mut conn, read) = send_case(gw.port, &c.send).await;
        let mut problems = Vec::new();
        match &read {
            Read::Response(r) => {
                if r.status != c.status {
                    problems.push(format!(
                        "status {} (expected {}), body {:?}",
                        r.status,
                        c.status,
                        String::from_utf8_lossy(&r.body)
                    ));
                }
                match &c.body {
                    Body::Relayed => {}
                    Body::OpenAi(code) => {
                        match serde_json::from_slice::<serde_json::Value>(&r.body) {
                            Ok(v) => {
                                let e = &v["error"];
                                if e["code"] != *code
                                    || !e["message"].is_string()
                                    || !e["type"].is_string()
                                    || !e["param"].is_null()
                                {
                                    problems.push(format!("error body {v} (expected code {code})"));
                                }
                            }
                            Err(_) => problems.push(format!(
                                "body is not JSON: {:?}",
                                String::from_utf8_lossy(&r.body)
                            )),
                        }
                        if r.header("content-type") != Some("application/json") {
                            problems.push(format!("content-type {:?}", r.header("content-type")));
                        }
                        if c.status == 503 && r.header("retry-after").is_none() {
                            problems.push("503 without Retry-After".into());
                        }
                    }
                    Body::Pingora => {
                        if !r.body.is_empty() {
                            problems.push(format!(
                                "expected pingora's empty error body, got {:?}",
                                String::from_utf8_lossy(&r.body)
                            ));
                        }
                    }
                }
            }
            other => problems.push(format!("no response: {other:?}")),
        }
        let status = match &read {
            Read::Response(r) => r.status.to_string(),
            other => format!("{other:?}"),
        };
        // The follow-up on the same connection.
        let next = match &c.then {
            Then::Skip => "-",
            Then::Closed => match conn.response(Duration::from_secs(2)).await {
                Read::Closed => "closed",
                other => {
                    problems.push(format!("connection should be closed, got {other:?}"));
                    "?"
                }
            },
            Then::Answered(req) | Then::AnsweredOrClosed(req) => {
                conn.send(req).await;
                match conn.response(RESPONSE_LIMIT).await {
                    Read::Response(r) if r.status == 200 => "answered 200",
                    Read::Closed if matches!(c.then, Then::AnsweredOrClosed(_)) => "closed",
                    other => {
                        problems.push(format!("second request: {other:?}"));
                        "?"
                    }
                }
            }
        };
        println!(
            "{:<66} {:>4} next: {:<13} {:>5} ms",
            c.name,
            status,
            next,
            case_started.elapsed().as_millis()
        );
        drop(conn);
        // What the upstream saw.
        let rec = stub.recorded();
        let new = &rec[before_rec..];
        let followup = usize::from(matches!(
            c.then,
            Then::Answered(_) | Then::AnsweredOrClosed(_)
        ));
        match &c.upstream {
            Upstream::Nothing if !new.is_empty() => {
                problems.push(format!("upstream got {} request(s)", new.len()))
            }
            Upstream::Body(expected) => {
                if new.is_empty() || new.len() > 1 + followup {
                    problems.push(format!("upstream got {} request(s)", new.len()));
                } else {
                    let got = &new[0];
                    if got.body != expected.as_slice() {
                        problems.push(format!(
                            "upstream body differs ({} bytes, expected {})",
                            got.body.len(),
                            expected.len()
                        ));
                    }
                    if got.uri != "/v1/chat/completions" {
                        problems.push(format!("upstream path {}", got.uri));
                    }
                    let host = got.headers.get("host").and_then(|h| h.to_str().ok());
                    if host != Some(stub.addr().to_string().as_str()) {
                        problems.push(format!("upstream Host {host:?}"));
                    }
                }
            }
            _ => {}
        }
        if new
            .iter()
            .any(|r| find(&r.body, b"SMUGGLED").is_some() || find(&r.body, b"pipelined").is_some())
        {
            problems.push("a hidden request reached the upstream".into());
        }
        if new
            .iter()
            .any(|r| r.headers.contains_key("x-rolter-vllm-token-ids"))
        {
            problems.push("the gateway's token-id header was forwarded upstream".into());
        }
        if !evil.recorded().is_empty() {
            problems.push("the other host was contacted".into());
        }
        if let Some(k) = c.kind {
            let after = errors_of(&gw, k).await;
            if after != before_kind + 1.0 {
                problems.push(format!("errors{{kind={k}}} went {before_kind} -> {after}"));
            }
        }
        // Healthy afterwards: the process lives and a normal request succeeds.
        if let Ok(Some(status)) = gw.child.try_wait() {
            panic!("{}: the gateway exited ({status})", c.name);
        }
        let (status, _, _) = post_chat(&gw, chat_body("alias", "still ok?", false)).await;
        if status != 200 {
            problems.push(format!("a normal request afterwards got {status}"));
        }
        if !problems.is_empty() {
            failures.push(format!("{}: {}", c.name, problems.join("; ")));
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
    assert!(
        started.elapsed() < Duration::from_secs(40),
        "the table took {:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn global_inflight_cap_refuses_with_503_and_idle_clients_are_closed() {
    let stub = Stub::start("a").await.unwrap();
    stub.set_behaviour(Behaviour {
        delay: Duration::from_millis(800),
        ..Default::default()
    });
    let gw = Gateway::start(&routes_toml(
        &[stub.url()],
        "round_robin",
        "[limits]\nmax_inflight = 2\nclient_keepalive_timeout_s = 1\n",
    ))
    .await;

    // Two slow requests take both slots; a third is refused at once with 503 overloaded.
    let slow: Vec<_> = (0..2)
        .map(|i| {
            let body = post(&chat(&format!("slow {i}")), "");
            let port = gw.port;
            tokio::spawn(async move {
                let mut conn = Raw::connect(port).await;
                conn.send(&body).await;
                match conn.response(RESPONSE_LIMIT).await {
                    Read::Response(r) => r.status,
                    other => panic!("slow request: {other:?}"),
                }
            })
        })
        .collect();
    assert!(eventually(Duration::from_secs(3), || async { stub.active() == 2 }).await);
    let refused_at = Instant::now();
    let mut conn = Raw::connect(gw.port).await;
    conn.send(&post(&chat("third"), "")).await;
    let Read::Response(r) = conn.response(RESPONSE_LIMIT).await else {
        panic!("no answer to the third request");
    };
    assert_eq!(r.status, 503, "{:?}", String::from_utf8_lossy(&r.body));
    assert!(
        refused_at.elapsed() < Duration::from_millis(500),
        "refusal must not wait"
    );
    assert_eq!(r.header("retry-after"), Some("1"));
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["error"]["code"], "overloaded");
    assert_eq!(v["error"]["type"], "service_unavailable");
    // Health and metrics are never refused.
    assert_eq!(reqwest::get(gw.url("/health")).await.unwrap().status(), 200);
    assert_eq!(gw.metric("rolter_admitted_requests").await, Some(2.0));
    for t in slow {
        assert_eq!(t.await.unwrap(), 200);
    }
    assert_eq!(
        stub.recorded().len(),
        2,
        "the refused request never reached upstream"
    );
    assert_eq!(
        gw.metric("rolter_request_errors_total{kind=\"overloaded\"}")
            .await,
        Some(1.0)
    );
    // The slots came back.
    assert_eq!(gw.metric("rolter_admitted_requests").await, Some(0.0));
    let (status, _, _) = post_chat(&gw, chat_body("alias", "after", false)).await;
    assert_eq!(status, 200);

    // An idle kept-alive client connection is closed after client_keepalive_timeout_s,
    // not kept forever (pingora's default for a reused HTTP/1.1 connection).
    let mut conn = Raw::connect(gw.port).await;
    conn.send(&http("GET /health HTTP/1.1\r\nHost: gateway", b""))
        .await;
    assert!(matches!(conn.response(RESPONSE_LIMIT).await, Read::Response(r) if r.status == 200));
    conn.send(&http("GET /health HTTP/1.1\r\nHost: gateway", b""))
        .await;
    assert!(matches!(conn.response(RESPONSE_LIMIT).await, Read::Response(r) if r.status == 200));
    let idle_from = Instant::now();
    assert!(matches!(
        conn.response(Duration::from_secs(4)).await,
        Read::Closed
    ));
    let idle = idle_from.elapsed();
    assert!(
        idle >= Duration::from_millis(900) && idle < Duration::from_secs(3),
        "closed after {idle:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_the_client_marks_hop_by_hop_stay_here_and_x_forwarded_for_is_appended() {
    let stub = Stub::start("a").await.unwrap();
    let gw = Gateway::start(&routes_toml(&[stub.url()], "round_robin", "")).await;
    let body = chat("hop by hop");
    let mut conn = Raw::connect(gw.port).await;
    conn.send(&post(
        &body,
        "Connection: keep-alive, X-Internal-Token\r\nX-Internal-Token: secret\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\nX-Forwarded-For: 203.0.113.9\r\nX-Kept: yes",
    ))
    .await;
    assert!(matches!(conn.response(RESPONSE_LIMIT).await, Read::Response(r) if r.status == 200));
    let rec = stub.recorded();
    assert_eq!(rec.len(), 1);
    let h = &rec[0].headers;
    for gone in ["x-internal-token", "http2-settings", "connection"] {
        assert!(h.get(gone).is_none(), "{gone} forwarded: {h:?}");
    }
    assert_eq!(h["x-kept"], "yes");
    let xff: Vec<_> = h.get_all("x-forwarded-for").iter().collect();
    assert_eq!(xff, ["203.0.113.9, 127.0.0.1"], "{h:?}");

    // `[forwarding] x_forwarded_for = "replace"`: only the client's own address.
    let gw = Gateway::start(&routes_toml(
        &[stub.url()],
        "round_robin",
        "[forwarding]\nx_forwarded_for = \"replace\"\n",
    ))
    .await;
    let mut conn = Raw::connect(gw.port).await;
    conn.send(&post(&body, "X-Forwarded-For: 203.0.113.9"))
        .await;
    assert!(matches!(conn.response(RESPONSE_LIMIT).await, Read::Response(r) if r.status == 200));
    let rec = stub.recorded();
    let xff: Vec<_> = rec[1].headers.get_all("x-forwarded-for").iter().collect();
    assert_eq!(xff, ["127.0.0.1"]);
}

/// The first line and the start of a header whose last field is then dribbled.
const SLOW_HEAD: &[u8] = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nX-Slow: ";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dribbled_header_is_cut_at_the_header_deadline_on_first_and_later_requests() {
    let stub = Stub::start("a").await.unwrap();
    let gw = Gateway::start(&routes_toml(
        &[stub.url()],
        "round_robin",
        "[limits]\nclient_header_timeout_ms = 1500\n",
    ))
    .await;
    let dribble = Send::Dribble {
        head: SLOW_HEAD.to_vec(),
        piece: b"a".to_vec(),
        every: Duration::from_millis(250),
        pieces: 40,
    };
    // A first request: due 1.5 s after the accept.
    let started = Instant::now();
    let (mut conn, read) = send_case(gw.port, &dribble).await;
    let took = started.elapsed();
    let Read::Response(r) = read else {
        panic!("a dribbled first header was not cut: {read:?} after {took:?}");
    };
    assert_eq!(r.status, 408, "{:?}", String::from_utf8_lossy(&r.body));
    let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["error"]["code"], "client_header_timeout");
    assert!(
        took >= Duration::from_millis(1400) && took < Duration::from_secs(3),
        "cut after {took:?}"
    );
    assert!(matches!(
        conn.response(Duration::from_secs(2)).await,
        Read::Closed
    ));

    // A later request on a kept-alive connection: idle first (within the keep-alive time),
    // then due 1.5 s after its first byte.
    let mut conn = Raw::connect(gw.port).await;
    conn.send(&http("GET /health HTTP/1.1\r\nHost: gateway", b""))
        .await;
    assert!(matches!(conn.response(RESPONSE_LIMIT).await, Read::Response(r) if r.status == 200));
    tokio::time::sleep(Duration::from_millis(1800)).await;
    conn.send(SLOW_HEAD).await;
    let first_byte = Instant::now();
    let mut answered = None;
    for _ in 0..40 {
        match tokio::time::timeout(Duration::from_millis(250), conn.stream.peek(&mut [0u8; 1]))
            .await
        {
            Ok(_) => break,
            Err(_) => {
                if !conn.send(b"a").await {
                    break;
                }
            }
        }
    }
    if let Read::Response(r) = conn.response(RESPONSE_LIMIT).await {
        answered = Some((r.status, first_byte.elapsed()));
    }
    let (status, took) = answered.expect("a dribbled keep-alive header was not cut");
    assert_eq!(status, 408);
    assert!(
        took >= Duration::from_millis(1400) && took < Duration::from_secs(3),
        "cut {took:?} after its first byte"
    );
    assert_eq!(
        errors_of(&gw, "client_header_timeout").await,
        2.0,
        "not counted"
    );
    assert!(stub.recorded().is_empty());
    // A connection that sends nothing is closed quietly at the deadline, not answered.
    let mut idle = Raw::connect(gw.port).await;
    assert!(matches!(
        idle.response(Duration::from_secs(4)).await,
        Read::Closed
    ));
    let (status, _, _) = post_chat(&gw, chat_body("alias", "still fine", false)).await;
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_over_max_header_bytes_gets_431_whether_sent_at_once_or_dribbled() {
    let stub = Stub::start("a").await.unwrap();
    // The default limit: 64 KiB.
    let gw = Gateway::start(&routes_toml(&[stub.url()], "round_robin", "")).await;
    let ok = chat("fits");
    let field = |n: usize| format!("X-Big: {}", "a".repeat(n));
    let cases = [
        ("at once", Send::Once(post(&ok, &field(70_000)))),
        (
            "dribbled 4 KiB every 20 ms",
            Send::Dribble {
                head: SLOW_HEAD.to_vec(),
                piece: vec![b'a'; 4096],
                every: Duration::from_millis(20),
                pieces: 64,
            },
        ),
        ("only empty lines", Send::Once(b"\r\n".repeat(40_000))),
    ];
    for (i, (name, send)) in cases.iter().enumerate() {
        let (mut conn, read) = send_case(gw.port, send).await;
        let Read::Response(r) = read else {
            panic!("{name}: no answer: {read:?}");
        };
        assert_eq!(
            r.status,
            431,
            "{name}: {:?}",
            String::from_utf8_lossy(&r.body)
        );
        let v: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(v["error"]["code"], "header_too_large", "{name}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains("65536"),
            "{name}: {v}"
        );
        assert!(
            matches!(conn.response(Duration::from_secs(3)).await, Read::Closed),
            "{name}: not closed"
        );
        assert_eq!(errors_of(&gw, "header_too_large").await, (i + 1) as f64);
    }
    assert!(stub.recorded().is_empty());
    // Just under the limit is accepted.
    let mut conn = Raw::connect(gw.port).await;
    conn.send(&post(&ok, &field(60_000))).await;
    assert!(matches!(conn.response(RESPONSE_LIMIT).await, Read::Response(r) if r.status == 200));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_max_connections_are_closed_at_accept_and_open_ones_are_counted() {
    let stub = Stub::start("a").await.unwrap();
    let gw = Gateway::start(&routes_toml(
        &[stub.url()],
        "round_robin",
        "[limits]\nmax_connections = 3\n",
    ))
    .await;
    // A connection that got an answer is surely open (counted) and now idle.
    async fn open_idle(port: u16) -> Option<Raw> {
        let mut conn = Raw::connect(port).await;
        conn.send(&http("GET /health HTTP/1.1\r\nHost: gateway", b""))
            .await;
        match conn.response(RESPONSE_LIMIT).await {
            Read::Response(r) if r.status == 200 => Some(conn),
            Read::Closed => None,
            other => panic!("{other:?}"),
        }
    }
    // Two idle connections, plus the scrape's own.
    let mut idle = vec![
        open_idle(gw.port).await.unwrap(),
        open_idle(gw.port).await.unwrap(),
    ];
    assert!(
        eventually(Duration::from_secs(3), || async {
            gw.metric("rolter_client_connections").await == Some(3.0)
        })
        .await,
        "open connections not counted"
    );
    // A third idle one takes the last place (once the scrape's connection is gone), and a
    // fourth is closed unanswered at once.
    let mut refusals = 0.0;
    loop {
        if let Some(conn) = open_idle(gw.port).await {
            idle.push(conn);
            break;
        }
        refusals += 1.0;
        assert!(refusals < 40.0, "the scrape's connection never closed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut refused = Raw::connect(gw.port).await;
    refused.send(&post(&chat("refused"), "")).await;
    assert!(matches!(
        refused.response(Duration::from_secs(2)).await,
        Read::Closed
    ));
    refusals += 1.0;
    assert!(stub.recorded().is_empty());
    // Places come back when connections close. (A scrape that races the closes can be
    // refused itself, and counted.)
    drop(idle);
    assert!(
        eventually(Duration::from_secs(3), || async {
            gw.metric("rolter_client_connections_refused_total")
                .await
                .is_some_and(|n| n >= refusals)
                && gw.metric("rolter_client_connections").await == Some(1.0)
        })
        .await,
        "refused: {:?} (expected {refusals}), open: {:?}",
        gw.metric("rolter_client_connections_refused_total").await,
        gw.metric("rolter_client_connections").await
    );
    let (status, _, _) = post_chat(&gw, chat_body("alias", "room again", false)).await;
    assert_eq!(status, 200);
}
