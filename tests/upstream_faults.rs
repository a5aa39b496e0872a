//! Misbehaving upstreams and clients that stop reading, through the real gateway: an
//! upstream that answers only `100 Continue` (fast, or just often enough to beat a
//! per-read timeout), one that answers `101 Switching Protocols` and then raw bytes, and a
//! client that stops reading a long answer. Each is answered in OpenAI's error shape (or
//! cut) and counted under its own kind.

mod common;

use common::*;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A scripted upstream on loopback. Each connection's requests are read (head and
/// `Content-Length` body); `GET /health` is answered 200 (rolter's health probes), any
/// other request is handed with its connection to the script, which ends the connection.
struct ScriptedUpstream {
    addr: SocketAddr,
    /// Requests handed to the script so far.
    scripted: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ScriptedUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ScriptedUpstream {
    async fn start<F, Fut>(script: F) -> ScriptedUpstream
    where
        F: Fn(TcpStream) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let scripted = Arc::new(AtomicUsize::new(0));
        let script = Arc::new(script);
        let count = scripted.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let script = script.clone();
                let count = count.clone();
                tokio::spawn(async move {
                    while let Some(path) = read_request(&mut conn).await {
                        if path != "/health" {
                            count.fetch_add(1, Ordering::SeqCst);
                            script(conn).await;
                            return;
                        }
                        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
                        if conn.write_all(ok).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        ScriptedUpstream {
            addr,
            scripted,
            task,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// Read one request (head, then a `Content-Length` body); its path, or None at EOF.
async fn read_request(conn: &mut TcpStream) -> Option<String> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = conn.read(&mut chunk).await.ok().filter(|n| *n > 0)?;
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .map_or(0, |v| v.trim().parse().unwrap());
    while buf.len() < head_end + length {
        let n = conn.read(&mut chunk).await.ok().filter(|n| *n > 0)?;
        buf.extend_from_slice(&chunk[..n]);
    }
    head.split(' ').nth(1).map(str::to_string)
}

/// POST a chat request; (status, parsed JSON body or Null, raw body).
async fn chat(gw: &Gateway) -> (u16, serde_json::Value, String) {
    chat_on(&reqwest::Client::new(), gw).await
}

/// [`chat`] through `client` (which may reuse its connection to the gateway).
async fn chat_on(client: &reqwest::Client, gw: &Gateway) -> (u16, serde_json::Value, String) {
    let resp = client
        .post(gw.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .timeout(Duration::from_secs(20))
        .body(chat_body("alias", "hello", false))
        .send()
        .await
        .expect("an answer from the gateway");
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap_or_default();
    let json = serde_json::from_str(&text).unwrap_or(serde_json::Value::Null);
    (status, json, text)
}

async fn errors_of(gw: &Gateway, kind: &str) -> Option<f64> {
    gw.metric(&format!("rolter_request_errors_total{{kind=\"{kind}\"}}"))
        .await
}

/// An upstream that answers every request with `100 Continue`, every `every`, forever.
async fn continue_forever(every: Duration) -> ScriptedUpstream {
    ScriptedUpstream::start(move |mut conn| async move {
        while conn
            .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
            .await
            .is_ok()
        {
            tokio::time::sleep(every).await;
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_flooding_100_continue_is_a_502_after_a_few() {
    let up = continue_forever(Duration::from_millis(5)).await;
    let gw = Gateway::start(&routes_toml(
        &[up.url()],
        "round_robin",
        "[limits]\nread_timeout_ms = 5000\n",
    ))
    .await;
    let started = Instant::now();
    let (status, json, text) = chat(&gw).await;
    assert_eq!(status, 502, "{text}");
    assert_eq!(json["error"]["code"], "upstream_broken", "{text}");
    assert!(
        json["error"]["message"]
            .as_str()
            .unwrap()
            .contains("informational"),
        "{text}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "answered after {:?}: the 1xx were not bounded",
        started.elapsed()
    );
    assert_eq!(errors_of(&gw, "upstream_broken").await, Some(1.0));
    assert_eq!(up.scripted.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_sending_100_continue_within_each_read_timeout_is_a_504_at_the_head_deadline() {
    // Every 300 ms: each read is well within the 1 s read timeout, and 1 s holds fewer
    // 1xx than the count bound, so only a deadline on the whole head ends it. The first
    // request is answered at once, the later ones never: the deadline holds for a request
    // on a client connection an earlier request used (the second; a 504 ends the
    // connection, so the third comes on a new one).
    let served = Arc::new(AtomicUsize::new(0));
    let up = ScriptedUpstream::start(move |mut conn| {
        let first = served.fetch_add(1, Ordering::SeqCst) == 0;
        async move {
            if first {
                let ok = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
                let _ = conn.write_all(ok).await;
                return;
            }
            while conn
                .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
                .await
                .is_ok()
            {
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }
    })
    .await;
    let gw = Gateway::start(&routes_toml(
        &[up.url()],
        "round_robin",
        "[limits]\nread_timeout_ms = 1000\n",
    ))
    .await;
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1)
        .build()
        .unwrap();
    for i in 0..3 {
        let started = Instant::now();
        let (status, json, text) = chat_on(&client, &gw).await;
        let took = started.elapsed();
        if i == 0 {
            assert_eq!(status, 200, "{text}");
            continue;
        }
        assert_eq!(status, 504, "request {i}: {text}");
        assert_eq!(json["error"]["code"], "upstream_timeout", "{text}");
        assert_eq!(json["error"]["type"], "upstream_error", "{text}");
        assert!(
            took >= Duration::from_millis(900) && took < Duration::from_secs(3),
            "request {i} answered after {took:?}"
        );
    }
    assert_eq!(errors_of(&gw, "upstream_timeout").await, Some(2.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_101_from_an_upstream_is_a_502_and_what_follows_is_never_relayed() {
    let up = ScriptedUpstream::start(|mut conn| async move {
        let _ = conn
            .write_all(
                b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n\
                  HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\nINJECTED",
            )
            .await;
        // Hold the connection open: a relayed upgrade would wait for more.
        tokio::time::sleep(Duration::from_secs(10)).await;
    })
    .await;
    let gw = Gateway::start(&routes_toml(&[up.url()], "round_robin", "")).await;
    let (status, json, text) = chat(&gw).await;
    assert_eq!(status, 502, "{text}");
    assert_eq!(json["error"]["code"], "upstream_broken", "{text}");
    assert!(!text.contains("INJECTED"), "{text}");
    assert_eq!(errors_of(&gw, "upstream_broken").await, Some(1.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_cut_at_the_write_timeout_and_counted_as_such() {
    // An answer far larger than the socket buffers between the gateway and the client.
    let up = ScriptedUpstream::start(|mut conn| async move {
        let head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
        if conn.write_all(head).await.is_err() {
            return;
        }
        let mut chunk = format!("{:x}\r\n", 64 * 1024).into_bytes();
        chunk.extend(std::iter::repeat_n(b'x', 64 * 1024));
        chunk.extend_from_slice(b"\r\n");
        for _ in 0..4096 {
            if conn.write_all(&chunk).await.is_err() {
                return;
            }
        }
    })
    .await;
    let gw = Gateway::start(&routes_toml(
        &[up.url()],
        "round_robin",
        "[limits]\nclient_write_timeout_ms = 300\n",
    ))
    .await;
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut client = socket
        .connect(([127, 0, 0, 1], gw.port).into())
        .await
        .unwrap();
    let body = chat_body("alias", "a long answer", true);
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    client.write_all(request.as_bytes()).await.unwrap();
    // The client never reads.
    assert!(
        eventually(Duration::from_secs(10), || async {
            errors_of(&gw, "client_write_timeout").await == Some(1.0)
        })
        .await,
        "not counted as a write timeout (client_disconnect: {:?})",
        errors_of(&gw, "client_disconnect").await
    );
    assert_eq!(errors_of(&gw, "client_disconnect").await, None);
    assert!(
        eventually(Duration::from_secs(3), || async {
            gw.metric("rolter_admitted_requests").await == Some(0.0)
        })
        .await,
        "the cut exchange still holds its slot"
    );
    drop(client);
}
