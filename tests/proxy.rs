//! The gateway's request path end to end: the real binary on loopback in front of
//! two recording stubs.

mod common;

use common::*;
use futures_util::StreamExt;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_rewrite_and_a_1mib_prompt_arrive_byte_for_byte_over_a_reused_connection() {
    let stub = Stub::start("a").await.unwrap();
    let gw = Gateway::start(&routes_toml(&[stub.url()], "round_robin", "")).await;

    // Warm the pool with a small request, then send a 1 MiB prompt.
    let (status, _, _) = post_chat(&gw, chat_body("alias", "warm up", false)).await;
    assert_eq!(status, 200);
    let big = "x".repeat(1024 * 1024);
    let body = chat_body("alias", &big, false);
    let (status, stub_id, answer) = post_chat(&gw, body.clone()).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(stub_id.as_deref(), Some("a"));

    let rec = stub.recorded();
    assert_eq!(rec.len(), 2);
    let expected = body.replacen("\"model\":\"alias\"", "\"model\":\"upstream-model-0\"", 1);
    assert!(rec[1].body.len() > 1024 * 1024);
    assert!(
        rec[1].body == expected.as_bytes(),
        "upstream body differs from the rewritten client body"
    );
    assert_eq!(
        rec[1].headers["content-length"].to_str().unwrap(),
        expected.len().to_string()
    );
    assert_eq!(rec[1].uri, "/v1/chat/completions");
    assert_eq!(
        rec[0].peer, rec[1].peer,
        "second request should reuse the pooled upstream connection"
    );
}

/// A body that arrives in bursts of mixed sizes (full 64 KiB reads the gateway takes over
/// without a copy, reads that leave room and are copied, a last read shorter than 64 KiB)
/// reaches the upstream byte for byte, and so does the next body on the same connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_arriving_in_bursts_of_mixed_sizes_arrive_byte_for_byte() {
    let stub = Stub::start("a").await.unwrap();
    let gw = Gateway::start(&routes_toml(&[stub.url()], "round_robin", "")).await;
    let client = reqwest::Client::new();
    let content: String = (0..400_000u32)
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect();
    let body = chat_body("alias", &content, false);
    let expected = body.replacen("\"model\":\"alias\"", "\"model\":\"upstream-model-0\"", 1);
    for (round, bursts) in [
        vec![150_000, 10, 70_000, 1, 65_536, 3_000],
        vec![1, 200_000, 7, 131_072],
    ]
    .into_iter()
    .enumerate()
    {
        let mut chunks = Vec::new();
        let mut at = 0;
        for n in bursts {
            chunks.push(body.as_bytes()[at..at + n].to_vec());
            at += n;
        }
        chunks.push(body.as_bytes()[at..].to_vec());
        let resp = post_chat_in_pieces(&client, &gw, chunks, Duration::from_millis(20)).await;
        assert_eq!(resp.status().as_u16(), 200, "round {round}");
        let got = stub.recorded().pop().expect("recorded").body;
        assert!(
            got == expected.as_bytes(),
            "round {round}: the body changed on the way"
        );
    }
    assert_eq!(stub.recorded().len(), 2);
}

/// A gateway whose `limits.max_body_bytes` is 64 KiB, in front of one stub.
async fn gateway_with_64k_body_limit() -> (Stub, Gateway) {
    let stub = Stub::start("a").await.unwrap();
    let gw = Gateway::start(&routes_toml(
        &[stub.url()],
        "round_robin",
        "[limits]\nmax_body_bytes = 65536\n",
    ))
    .await;
    (stub, gw)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_over_the_limit_gets_413_and_never_reaches_upstream() {
    let (stub, gw) = gateway_with_64k_body_limit().await;
    let (status, _, body) =
        post_chat(&gw, chat_body("alias", &"y".repeat(1024 * 1024), false)).await;
    assert_eq!(status, 413);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["code"], "body_too_large");
    assert!(stub.recorded().is_empty());
    // The gateway is still fine.
    let (status, _, _) = post_chat(&gw, chat_body("alias", "small", false)).await;
    assert_eq!(status, 200);
    assert_eq!(
        gw.metric("rolter_request_errors_total{kind=\"body_too_large\"}")
            .await,
        Some(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_chunks_reach_the_client_before_the_upstream_finishes() {
    let stub = Stub::start("a").await.unwrap();
    stub.set_behaviour(Behaviour {
        stream_chunks: 5,
        chunk_interval: Duration::from_millis(300),
        ..Default::default()
    });
    let gw = Gateway::start(&routes_toml(&[stub.url()], "round_robin", "")).await;
    let started = Instant::now();
    let resp = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .body(chat_body("alias", "stream please", true))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut stream = resp.bytes_stream();
    let mut arrivals = Vec::new();
    let mut text = String::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.unwrap();
        arrivals.push(started.elapsed());
        text.push_str(std::str::from_utf8(&chunk).unwrap());
    }
    let first_data = arrivals[0];
    let last = *arrivals.last().unwrap();
    // The upstream takes 5 × 300 ms; the first chunk must not wait for the end.
    assert!(
        last >= Duration::from_millis(1400),
        "stream ended too early: {last:?}"
    );
    assert!(
        last - first_data >= Duration::from_millis(1000),
        "first chunk at {first_data:?}, last at {last:?}"
    );
    assert!(arrivals.len() >= 4, "chunks were coalesced: {arrivals:?}");
    assert!(
        text.contains("a-0") && text.ends_with("data: [DONE]\n\n"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_alternates() {
    let (a, b) = (
        Stub::start("a").await.unwrap(),
        Stub::start("b").await.unwrap(),
    );
    let gw = Gateway::start(&routes_toml(&[a.url(), b.url()], "round_robin", "")).await;
    let mut ids = Vec::new();
    for i in 0..6 {
        let (status, id, _) = post_chat(&gw, chat_body("alias", &format!("q{i}"), false)).await;
        assert_eq!(status, 200);
        ids.push(id.unwrap());
    }
    for pair in ids.windows(2) {
        assert_ne!(pair[0], pair[1], "{ids:?}");
    }
    // Each stub saw its own upstream model name.
    assert!(a.recorded().iter().all(|r| std::str::from_utf8(&r.body)
        .unwrap()
        .contains("\"upstream-model-0\"")));
    assert!(b.recorded().iter().all(|r| std::str::from_utf8(&r.body)
        .unwrap()
        .contains("\"upstream-model-1\"")));
}

/// Two least_load targets and one request held in flight for `delay` on one of them: the
/// stubs (answering at once from now on), the gateway, the busy target's id and the slow
/// request's task (the `x-stub-id` that answered it).
async fn one_slow_request_in_flight(
    delay: Duration,
) -> (
    Stub,
    Stub,
    Gateway,
    &'static str,
    tokio::task::JoinHandle<String>,
) {
    let (a, b) = (
        Stub::start("a").await.unwrap(),
        Stub::start("b").await.unwrap(),
    );
    let slow = Behaviour {
        delay,
        ..Default::default()
    };
    a.set_behaviour(slow.clone());
    b.set_behaviour(slow);
    let gw = Gateway::start(&routes_toml(&[a.url(), b.url()], "least_load", "")).await;
    let url = gw.url("/v1/chat/completions");
    let slow_req = tokio::spawn(async move {
        reqwest::Client::new()
            .post(url)
            .body(chat_body("alias", "slow one", false))
            .send()
            .await
            .unwrap()
            .headers()["x-stub-id"]
            .to_str()
            .unwrap()
            .to_string()
    });
    assert!(
        eventually(Duration::from_secs(5), || async {
            a.active() + b.active() == 1
        })
        .await
    );
    let busy = if a.active() == 1 { "a" } else { "b" };
    a.set_behaviour(Behaviour::default());
    b.set_behaviour(Behaviour::default());
    (a, b, gw, busy, slow_req)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_load_avoids_a_target_with_a_slow_request_in_flight() {
    // Long enough that the five fast requests below finish while it is still in flight,
    // even on a loaded CI machine (at 1.5 s it once ended first while a build ran).
    let (_a, _b, gw, busy, slow_req) = one_slow_request_in_flight(Duration::from_secs(4)).await;
    for i in 0..5 {
        let (status, id, _) = post_chat(&gw, chat_body("alias", &format!("fast {i}"), false)).await;
        assert_eq!(status, 200);
        assert_ne!(
            id.as_deref(),
            Some(busy),
            "request {i} went to the busy target"
        );
    }
    assert_eq!(slow_req.await.unwrap(), busy);
}

/// A target's in-flight slot is given back before its client can see the answer end: a
/// client that sends its next request (on a new connection) as soon as it has an answer
/// must find that target idle again. The slot used to be freed only after the last write
/// to the client, so now and then (about 1 in 3,000 requests on an idle machine, 1 in 100
/// under CPU load) the next request found both targets busy and least_load sent it to
/// the one with a slow request in flight: the flake of the test above. Many requests
/// make that window likely to show if it comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answered_request_has_freed_its_slot_when_the_client_sends_the_next() {
    // In flight for the whole test, however slow the machine.
    let (_a, _b, gw, busy, _slow) = one_slow_request_in_flight(Duration::from_secs(60)).await;
    let n = 500;
    let mut to_busy = 0;
    for i in 0..n {
        let (status, id, _) = post_chat(&gw, chat_body("alias", &format!("fast {i}"), false)).await;
        assert_eq!(status, 200);
        to_busy += usize::from(id.as_deref() == Some(busy));
    }
    assert_eq!(
        to_busy, 0,
        "{to_busy} of {n} requests went to the busy target"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inflight_returns_to_zero_after_a_client_disconnects_mid_stream() {
    let stub = Stub::start("a").await.unwrap();
    stub.set_behaviour(Behaviour {
        stream_chunks: 40,
        chunk_interval: Duration::from_millis(100),
        ..Default::default()
    });
    let gw = Gateway::start(&routes_toml(&[stub.url()], "least_load", "")).await;
    let series = "rolter_inflight_requests{target=\"p0/upstream-model-0\"}";
    let resp = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .body(chat_body("alias", "long stream", true))
        .send()
        .await
        .unwrap();
    let mut stream = resp.bytes_stream();
    stream.next().await.unwrap().unwrap();
    assert_eq!(gw.metric(series).await, Some(1.0));
    // Once the answer has started, the request body is let go: a long stream holds none
    // of the body budget.
    assert_eq!(gw.metric("rolter_buffered_body_bytes").await, Some(0.0));
    drop(stream); // client goes away mid-stream
    assert!(
        eventually(Duration::from_secs(5), || async {
            gw.metric(series).await == Some(0.0)
        })
        .await,
        "in-flight did not return to 0"
    );
    assert!(
        eventually(Duration::from_secs(5), || async {
            gw.metric("rolter_request_errors_total{kind=\"client_disconnect\"}")
                .await
                == Some(1.0)
        })
        .await
    );
}

/// A raw client connection that has sent a chat request's head (declaring all of `body`)
/// and the first `sent` bytes of `body`.
async fn raw_client(gw: &Gateway, body: &str, sent: usize) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let mut client = tokio::net::TcpStream::connect(("127.0.0.1", gw.port))
        .await
        .unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    client
        .write_all(
            [head.as_bytes(), &body.as_bytes()[..sent]]
                .concat()
                .as_slice(),
        )
        .await
        .unwrap();
    client
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_before_the_answer_frees_its_slot_and_the_replica_at_once() {
    // A long generation (non-streaming, or a stream still in prefill): nothing is written
    // to the client for a long while, so only watching its connection tells it has gone.
    let stub = Stub::start("a").await.unwrap();
    stub.set_behaviour(Behaviour {
        delay: Duration::from_secs(60),
        ..Default::default()
    });
    let gw = Gateway::start(&routes_toml(&[stub.url()], "least_load", "")).await;
    let series = "rolter_inflight_requests{target=\"p0/upstream-model-0\"}";
    let body = chat_body("alias", "a long generation", false);
    let client = raw_client(&gw, &body, body.len()).await;
    assert!(
        eventually(Duration::from_secs(5), || async { stub.active() == 1 }).await,
        "the request never reached the replica"
    );
    assert_eq!(gw.metric(series).await, Some(1.0));
    drop(client);
    assert!(
        eventually(Duration::from_secs(5), || async {
            gw.metric(series).await == Some(0.0)
                && gw.metric("rolter_admitted_requests").await == Some(0.0)
        })
        .await,
        "the departed client still holds its in-flight slot"
    );
    // The upstream connection is closed, which is how vLLM learns to abort the request.
    assert!(
        eventually(Duration::from_secs(5), || async { stub.active() == 0 }).await,
        "the replica is still working for a client that left"
    );
    assert_eq!(
        gw.metric("rolter_request_errors_total{kind=\"client_disconnect\"}")
            .await,
        Some(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_in_the_middle_of_its_body_is_counted_as_gone() {
    let stub = Stub::start("a").await.unwrap();
    let gw = Gateway::start(&routes_toml(&[stub.url()], "round_robin", "")).await;
    let body = chat_body("alias", "cut short", false);
    let client = raw_client(&gw, &body, body.len() / 2).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(client);
    let gone = "rolter_request_errors_total{kind=\"client_disconnect\"}";
    assert!(
        eventually(Duration::from_secs(5), || async {
            gw.metric(gone).await == Some(1.0)
        })
        .await,
        "not counted as a client disconnect"
    );
    assert_eq!(
        gw.metric("rolter_request_errors_total{kind=\"bad_request\"}")
            .await,
        None
    );
    assert!(stub.recorded().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_errors_move() {
    let stub = Stub::start("a").await.unwrap();
    let gw = Gateway::start(&routes_toml(&[stub.url()], "round_robin", "")).await;
    let ok = "rolter_requests_total{route=\"alias\",status=\"200\",target=\"p0/upstream-model-0\"}";
    assert_eq!(gw.metric(ok).await, None);
    for _ in 0..3 {
        post_chat(&gw, chat_body("alias", "count me", false)).await;
    }
    assert_eq!(gw.metric(ok).await, Some(3.0));
    assert_eq!(
        gw.metric(
            "rolter_routing_decisions_total{reason=\"round_robin\",strategy=\"round_robin\"}"
        )
        .await,
        Some(3.0)
    );

    let (status, _, body) = post_chat(&gw, "{\"model\": ".into()).await;
    assert_eq!(status, 400, "{body}");
    let (status, _, body) = post_chat(&gw, chat_body("no-such-model", "x", false)).await;
    assert_eq!(status, 404);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("no-such-model"));
    assert_eq!(
        gw.metric("rolter_request_errors_total{kind=\"bad_request\"}")
            .await,
        Some(1.0)
    );
    assert_eq!(
        gw.metric("rolter_request_errors_total{kind=\"not_found\"}")
            .await,
        Some(1.0)
    );

    let models: serde_json::Value = reqwest::get(gw.url("/v1/models"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "alias");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_upstream_gives_502_and_slow_upstream_gives_504() {
    let dead = format!("http://127.0.0.1:{}", free_port());
    let gw = Gateway::start(&routes_toml(&[dead], "round_robin", "")).await;
    let (status, _, body) = post_chat(&gw, chat_body("alias", "anyone?", false)).await;
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("upstream_connect"), "{body}");
    drop(gw);

    let stub = Stub::start("slow").await.unwrap();
    stub.set_behaviour(Behaviour {
        delay: Duration::from_secs(10),
        ..Default::default()
    });
    let gw = Gateway::start(&routes_toml(
        &[stub.url()],
        "round_robin",
        "[limits]\nread_timeout_ms = 300\n",
    ))
    .await;
    let started = Instant::now();
    let (status, _, body) = post_chat(&gw, chat_body("alias", "hello?", false)).await;
    assert_eq!(status, 504, "{body}");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(
        gw.metric("rolter_inflight_requests{target=\"p0/upstream-model-0\"}")
            .await,
        Some(0.0)
    );
}

/// Read one HTTP/1.1 request (head, then a `content-length` body) from `sock`; `None` at EOF.
/// A round_robin route to the one upstream at `addr`, with health probes off (so every
/// connection the upstream sees carries a proxied request).
fn one_target_without_probes(addr: std::net::SocketAddr) -> String {
    format!(
        "[[providers]]\nname = \"p0\"\nkind = \"openai_compatible\"\napi_base = \"http://{addr}\"\n\
         [providers.health]\nenabled = false\n\n\
         [[routes]]\nmodel = \"alias\"\nstrategy = \"round_robin\"\n\
         [[routes.targets]]\nprovider = \"p0\"\nmodel = \"m\"\n"
    )
}

async fn read_one_request(sock: &mut tokio::net::TcpStream, buf: &mut Vec<u8>) -> Option<()> {
    use tokio::io::AsyncReadExt;
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(0, |v| v.trim().parse::<usize>().unwrap());
            if buf.len() >= end + 4 + len {
                buf.drain(..end + 4 + len);
                return Some(());
            }
        }
        let mut chunk = [0u8; 8192];
        match sock.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

/// An upstream whose idle timeout expired closes a kept-alive connection without answering
/// the request that arrives on it; the gateway must retry that request on another
/// connection instead of answering 502 (pingora-proxy does the same).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_connection_closed_unanswered_is_retried_on_a_fresh_one() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (answered, dropped) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (a, d) = (answered.clone(), dropped.clone());
    let server = tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            let (a, d) = (a.clone(), d.clone());
            tokio::spawn(async move {
                let mut buf = Vec::new();
                if read_one_request(&mut sock, &mut buf).await.is_none() {
                    return;
                }
                let body = r#"{"id":"x","object":"chat.completion","choices":[]}"#;
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                // Counted before the answer is written, so the count is in place before
                // the client can see the 200 (counting after the write raced the test's read).
                a.fetch_add(1, Ordering::SeqCst);
                sock.write_all(answer.as_bytes()).await.unwrap();
                // The next request on this connection is read, then the connection closed.
                if read_one_request(&mut sock, &mut buf).await.is_some() {
                    d.fetch_add(1, Ordering::SeqCst);
                }
            });
        }
    });
    let gw = Gateway::start(&one_target_without_probes(addr)).await;
    for i in 0..4 {
        let (status, _, body) =
            post_chat(&gw, chat_body("alias", &format!("question {i}"), false)).await;
        assert_eq!(status, 200, "request {i}: {body}");
    }
    assert_eq!(answered.load(Ordering::SeqCst), 4);
    assert!(
        dropped.load(Ordering::SeqCst) >= 1,
        "no request reached a pooled connection, so the retry path was not exercised"
    );
    server.abort();
}

/// An upstream that answers every request on a connection with `status_line` and `extra`
/// header lines, keeping the connection open afterwards; returns its address and the
/// number of connections it accepted and requests it answered (each counted just before
/// its answer is written, so the count is final by the time the client has the answer).
async fn counting_upstream(
    status_line: &'static str,
    extra: &'static str,
) -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (conns, answered) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (c, a) = (conns.clone(), answered.clone());
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            c.fetch_add(1, Ordering::SeqCst);
            let a = a.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                while read_one_request(&mut sock, &mut buf).await.is_some() {
                    let body = r#"{"id":"x","object":"chat.completion","choices":[]}"#;
                    // `extra` naming chunked framing gets a chunked body, else a length.
                    let answer = if extra.contains("transfer-encoding: chunked") {
                        format!(
                            "{status_line}\r\ncontent-type: application/json\r\n{extra}\r\n{:x}\r\n{body}\r\n0\r\n\r\n",
                            body.len()
                        )
                    } else {
                        format!(
                            "{status_line}\r\ncontent-type: application/json\r\n{extra}content-length: {}\r\n\r\n{body}",
                            body.len()
                        )
                    };
                    // Counted before the answer is written: the client's 200 can only follow
                    // the write, so the test never reads a count that lags its answers.
                    a.fetch_add(1, Ordering::SeqCst);
                    if sock.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, conns, answered)
}

/// A connection whose response said it ends (`connection: close`, HTTP/1.0 without
/// keep-alive, HTTP/1.0 with `Transfer-Encoding`) never goes back to the pool, even if the
/// upstream leaves it open; an ordinary keep-alive response (length or chunks), or an
/// HTTP/1.0 one asking for keep-alive, does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_responses_that_keep_the_connection_alive_return_it_to_the_pool() {
    use std::sync::atomic::Ordering;
    for (status_line, extra, reusable) in [
        ("HTTP/1.1 200 OK", "", true),
        ("HTTP/1.1 200 OK", "connection: close\r\n", false),
        ("HTTP/1.0 200 OK", "", false),
        // The gateway forwards the upstream's header without copying it; what stays with
        // the upstream session must still carry the keep-alive headers.
        (
            "HTTP/1.0 200 OK",
            "connection: keep-alive\r\nkeep-alive: timeout=30\r\n",
            true,
        ),
        ("HTTP/1.1 200 OK", "transfer-encoding: chunked\r\n", true),
        // HTTP/1.0 with `Transfer-Encoding` must end the connection whatever else it says
        // (RFC 9112 §6.1): what stays with the upstream session keeps that header too.
        (
            "HTTP/1.0 200 OK",
            "connection: keep-alive\r\ntransfer-encoding: chunked\r\n",
            false,
        ),
    ] {
        let (addr, conns, answered) = counting_upstream(status_line, extra).await;
        let gw = Gateway::start(&one_target_without_probes(addr)).await;
        for i in 0..3 {
            let (status, _, body) =
                post_chat(&gw, chat_body("alias", &format!("question {i}"), false)).await;
            assert_eq!(status, 200, "{status_line} {extra:?} request {i}: {body}");
            assert!(
                body.contains(r#""object":"chat.completion""#),
                "{status_line} {extra:?} request {i}: {body}"
            );
        }
        assert_eq!(answered.load(Ordering::SeqCst), 3);
        let expected = if reusable { 1 } else { 3 };
        assert_eq!(
            conns.load(Ordering::SeqCst),
            expected,
            "{status_line} {extra:?}: upstream connections for 3 requests"
        );
    }
}

/// A client that sends its whole body before reading (as hyper, Python's http.client and
/// curl do) gets the 413, not a reset: the gateway answers on the declared length, then
/// keeps reading and discarding for a bounded while before it closes. Closing a socket
/// with unread bytes makes the kernel reset the connection, so such a client's next write
/// failed and it never read the answer (seen as a flaky "broken pipe" in the test above).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_sends_a_refused_body_in_full_reads_the_413() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (_stub, gw) = gateway_with_64k_body_limit().await;
    // Far more than loopback socket buffers hold, so the gateway must read for it to fit.
    let body = chat_body("alias", &"y".repeat(16 * 1024 * 1024), false);
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", gw.port))
        .await
        .unwrap();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let sent = tokio::time::timeout(Duration::from_secs(10), s.write_all(request.as_bytes())).await;
    assert!(matches!(sent, Ok(Ok(()))), "sending the body: {sent:?}");
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut answer)).await;
    let text = String::from_utf8_lossy(&answer);
    assert!(
        text.starts_with("HTTP/1.1 413"),
        "answer {text:?} (read: {read:?})"
    );
    assert!(text.contains("body_too_large"), "{text}");
}
