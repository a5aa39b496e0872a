//! A minimal OpenAI-compatible upstream for tests: it records every request it gets
//! (path, headers, body bytes, connection) and answers chat/completions with a small JSON
//! body, or with an SSE stream whose pacing the test controls.
//!
//! Owns: nothing shared; every stub is its own server on a loopback port. Must not: model
//! caches or costs (that is the simulator's job).

use axum::body::Body;
use axum::extract::{ConnectInfo, State};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use parking_lot::Mutex;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Most requests a stub remembers (tests are bounded; this keeps memory bounded too).
const MAX_RECORDED: usize = 10_000;

/// One request as the stub received it.
#[derive(Debug, Clone)]
pub struct Recorded {
    /// Request path and query.
    pub uri: String,
    /// Headers as received.
    pub headers: HeaderMap,
    /// Body bytes as received.
    pub body: Bytes,
    /// Client address of the connection it came on (same address = reused connection).
    pub peer: SocketAddr,
}

/// How a stub behaves; change it while it runs through [`Stub::behaviour`].
#[derive(Debug, Clone)]
pub struct Behaviour {
    /// Wait this long before answering at all.
    pub delay: Duration,
    /// SSE chunks to send when the request asks for `"stream": true`.
    pub stream_chunks: usize,
    /// Pause between SSE chunks.
    pub chunk_interval: Duration,
    /// Status code to answer with (non-2xx answers carry an OpenAI error body).
    pub status: u16,
    /// Status code of `GET /health`.
    pub health_status: u16,
}

impl Default for Behaviour {
    fn default() -> Self {
        Behaviour {
            delay: Duration::ZERO,
            stream_chunks: 3,
            chunk_interval: Duration::from_millis(1),
            status: 200,
            health_status: 200,
        }
    }
}

struct Shared {
    id: String,
    recorded: Mutex<Vec<Recorded>>,
    behaviour: Mutex<Behaviour>,
    active: AtomicUsize,
    served: AtomicU64,
    recording: std::sync::atomic::AtomicBool,
}

/// A running stub server.
pub struct Stub {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Mutex<
        Option<(
            tokio::sync::oneshot::Sender<()>,
            std::thread::JoinHandle<()>,
        )>,
    >,
}

impl Stub {
    /// Start a stub on `127.0.0.1:0`, answering as `id` (echoed in `x-stub-id`).
    pub async fn start(id: &str) -> std::io::Result<Stub> {
        Self::start_on(id, "127.0.0.1:0".parse().expect("literal address")).await
    }

    /// Start a stub on a given address. The stub runs on its own thread and runtime, so
    /// [`Stub::stop`] really kills it: the listener *and* every open connection close,
    /// like a replica process dying.
    pub async fn start_on(id: &str, addr: SocketAddr) -> std::io::Result<Stub> {
        Self::start_with(id, addr, 1)
    }

    /// [`Stub::start_on`] with `threads` runtime worker threads (benchmarks want more
    /// than one so the stub is not the bottleneck).
    pub fn start_with(id: &str, addr: SocketAddr, threads: usize) -> std::io::Result<Stub> {
        let shared = Arc::new(Shared {
            id: id.to_string(),
            recorded: Mutex::new(Vec::new()),
            behaviour: Mutex::new(Behaviour::default()),
            active: AtomicUsize::new(0),
            served: AtomicU64::new(0),
            recording: std::sync::atomic::AtomicBool::new(true),
        });
        let app = Router::new()
            .route("/v1/chat/completions", post(complete))
            .route("/v1/completions", post(complete))
            .route("/health", get(health))
            .with_state(shared.clone());
        let listener = std::net::TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(format!("stub-{id}"))
            .spawn(move || {
                let rt = if threads <= 1 {
                    tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                } else {
                    tokio::runtime::Builder::new_multi_thread()
                        .worker_threads(threads)
                        .enable_all()
                        .build()
                }
                .expect("stub runtime");
                rt.block_on(async move {
                    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                        return;
                    };
                    let svc = app.into_make_service_with_connect_info::<SocketAddr>();
                    tokio::select! {
                        _ = axum::serve(listener, svc) => {}
                        _ = stop_rx => {}
                    }
                });
                // Dropping the runtime drops every connection task with it.
            })?;
        Ok(Stub {
            addr,
            shared,
            stop: Mutex::new(Some((stop_tx, thread))),
        })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT`
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Everything received so far.
    pub fn recorded(&self) -> Vec<Recorded> {
        self.shared.recorded.lock().clone()
    }

    /// Requests being answered right now.
    pub fn active(&self) -> usize {
        self.shared.active.load(Ordering::Relaxed)
    }

    /// Requests answered (or started) in total.
    pub fn served(&self) -> u64 {
        self.shared.served.load(Ordering::Relaxed)
    }

    /// Stop (or resume) recording requests; benchmarks turn it off.
    pub fn set_recording(&self, on: bool) {
        self.shared.recording.store(on, Ordering::Relaxed);
    }

    /// Change how the stub answers from now on.
    pub fn set_behaviour(&self, b: Behaviour) {
        *self.shared.behaviour.lock() = b;
    }

    /// Stop serving: the port and all open connections close; later connections are
    /// refused. Idempotent.
    pub fn stop(&self) {
        if let Some((tx, thread)) = self.stop.lock().take() {
            let _ = tx.send(());
            let _ = thread.join();
        }
    }
}

impl Drop for Stub {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn health(State(shared): State<Arc<Shared>>) -> StatusCode {
    let status = shared.behaviour.lock().health_status;
    StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

struct ActiveGuard(Arc<Shared>);
impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn complete(
    State(shared): State<Arc<Shared>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    shared.served.fetch_add(1, Ordering::Relaxed);
    shared.active.fetch_add(1, Ordering::Relaxed);
    let guard = ActiveGuard(shared.clone());
    if shared.recording.load(Ordering::Relaxed) {
        let mut rec = shared.recorded.lock();
        if rec.len() < MAX_RECORDED {
            rec.push(Recorded {
                uri: uri.to_string(),
                headers,
                body: body.clone(),
                peer,
            });
        }
    }
    let b = shared.behaviour.lock().clone();
    // Not `sleep(ZERO)`: tokio rounds a timer up to its next 1 ms tick, so an idle stub
    // would answer ~1 ms late and every latency measured through it would carry that.
    if !b.delay.is_zero() {
        tokio::time::sleep(b.delay).await;
    }
    let id = shared.id.clone();
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let model = json["model"].as_str().unwrap_or("").to_string();
    let status = StatusCode::from_u16(b.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    if !status.is_success() {
        let err = serde_json::json!({"error": {"message": format!("stub {id} failing"), "type": "server_error"}});
        return (status, [("x-stub-id", id)], err.to_string()).into_response();
    }
    if json["stream"].as_bool() == Some(true) {
        let chunks = b.stream_chunks;
        let interval = b.chunk_interval;
        let stream = async_stream(id.clone(), model, chunks, interval, guard);
        return Response::builder()
            .header("content-type", "text/event-stream")
            .header("x-stub-id", id)
            .body(Body::from_stream(stream))
            .expect("static response");
    }
    drop(guard);
    let answer = serde_json::json!({
        "id": "cmpl-stub", "object": "chat.completion", "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": format!("hello from {id}")}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    });
    (
        [
            ("x-stub-id", id),
            ("content-type", "application/json".into()),
        ],
        answer.to_string(),
    )
        .into_response()
}

fn async_stream(
    id: String,
    model: String,
    chunks: usize,
    interval: Duration,
    guard: ActiveGuard,
) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> {
    futures_util::stream::unfold((0usize, guard), move |(i, guard)| {
        let (id, model) = (id.clone(), model.clone());
        async move {
            if i > chunks {
                return None;
            }
            if i > 0 {
                tokio::time::sleep(interval).await;
            }
            let data = if i == chunks {
                "data: [DONE]\n\n".to_string()
            } else {
                let chunk = serde_json::json!({"id": "cmpl-stub", "object": "chat.completion.chunk", "model": model,
                    "choices": [{"index": 0, "delta": {"content": format!("{id}-{i} ")}}]});
                format!("data: {chunk}\n\n")
            };
            Some((Ok(Bytes::from(data)), (i + 1, guard)))
        }
    })
}
