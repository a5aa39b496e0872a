//! A minimal OpenAI-compatible upstream for tests: it records every request it gets
//! (path, headers, body bytes, connection) and answers chat/completions with a small JSON
//! body, or with an SSE stream whose pacing the test controls. The Responses API is served
//! as vLLM does it, in memory: `POST /v1/responses` stores a response (JSON, or an SSE
//! stream whose first event is `response.created`) and a later request naming it
//! (`previous_response_id`, `GET`/`DELETE /v1/responses/{id}`, `.../cancel`) finds it only
//! on the stub that stored it (else 404). `GET /metrics` answers a vLLM-style Prometheus body
//! without a cache size (not recorded: a gateway reads it in the background). Any other
//! path is echoed back as JSON.
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
    /// Requests whose body contains this marker wait this long before answering (a test
    /// holds requests in flight on one stub without slowing the others).
    pub hold: Option<(String, Duration)>,
    /// The body of `GET /v1/models` (a vLLM-style model list); `None` answers 404.
    pub models: Option<String>,
}

impl Default for Behaviour {
    fn default() -> Self {
        Behaviour {
            delay: Duration::ZERO,
            stream_chunks: 3,
            chunk_interval: Duration::from_millis(1),
            status: 200,
            health_status: 200,
            hold: None,
            models: None,
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
    /// Responses this stub stored (Responses API), by id.
    responses: Mutex<std::collections::HashSet<String>>,
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
            responses: Mutex::new(std::collections::HashSet::new()),
        });
        let app = Router::new()
            .route("/v1/chat/completions", post(complete))
            .route("/v1/completions", post(complete))
            .route("/health", get(health))
            .route("/metrics", get(metrics))
            .route("/v1/models", get(models))
            .route("/v1/responses", post(create_response))
            .route(
                "/v1/responses/{id}",
                get(stored_response).delete(stored_response),
            )
            .route("/v1/responses/{id}/cancel", post(stored_response))
            .fallback(echo)
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

/// `GET /metrics`: a replica's load gauges, no `vllm:cache_config_info` (neither counted nor
/// recorded).
async fn metrics() -> Response {
    (
        [("content-type", "text/plain; version=0.0.4")],
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n",
    )
        .into_response()
}

/// `GET /v1/models` (counted in [`Stub::served`], not recorded).
async fn models(State(shared): State<Arc<Shared>>) -> Response {
    shared.served.fetch_add(1, Ordering::Relaxed);
    match shared.behaviour.lock().models.clone() {
        Some(body) => ([("content-type", "application/json")], body).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
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
    let (guard, b) = admit(&shared, peer, &uri, headers, &body).await;
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
    json_answer(id, StatusCode::OK, &answer)
}

/// Count, record and (per the behaviour) delay a request; its active guard and the
/// behaviour it is answered under.
async fn admit(
    shared: &Arc<Shared>,
    peer: SocketAddr,
    uri: &Uri,
    headers: HeaderMap,
    body: &Bytes,
) -> (ActiveGuard, Behaviour) {
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
    if let Some((marker, hold)) = &b.hold {
        if memchr::memmem::find(body, marker.as_bytes()).is_some() {
            tokio::time::sleep(*hold).await;
        }
    }
    (guard, b)
}

/// A JSON answer from stub `id`.
fn json_answer(id: String, status: StatusCode, body: &serde_json::Value) -> Response {
    (
        status,
        [
            ("x-stub-id", id),
            ("content-type", "application/json".into()),
        ],
        body.to_string(),
    )
        .into_response()
}

/// A non-2xx answer in OpenAI's error shape.
fn error_answer(id: &str, status: StatusCode, message: String) -> Response {
    let err = serde_json::json!({"error": {"message": message, "type": "invalid_request_error", "code": status.as_u16()}});
    json_answer(id.to_string(), status, &err)
}

/// `POST /v1/responses`: store a response (its id names this stub) and answer it as JSON
/// or, for `"stream": true`, as vLLM's SSE events. A `previous_response_id` this stub
/// did not store is a 404, as in vLLM.
async fn create_response(
    State(shared): State<Arc<Shared>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let (guard, b) = admit(&shared, peer, &uri, headers, &body).await;
    let id = shared.id.clone();
    let status = StatusCode::from_u16(b.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    if !status.is_success() {
        return error_answer(&id, status, format!("stub {id} failing"));
    }
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    if let Some(prev) = json["previous_response_id"].as_str() {
        if !shared.responses.lock().contains(prev) {
            return error_answer(
                &id,
                StatusCode::NOT_FOUND,
                format!("Response with id '{prev}' not found."),
            );
        }
    }
    let n = shared.served.load(Ordering::Relaxed);
    let rid = format!("resp_{id}_{n}_{}", shared.responses.lock().len());
    shared.responses.lock().insert(rid.clone());
    let response = serde_json::json!({
        "object": "response", "status": "completed", "model": json["model"],
        "output": [{"id": "msg_1", "type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": format!("hello from {id}"), "annotations": []}]}],
        "id": rid,
    });
    // A background response is answered at once as JSON (queued), stream or not.
    if json["stream"].as_bool() != Some(true) || json["background"].as_bool() == Some(true) {
        drop(guard);
        return json_answer(id, StatusCode::OK, &response);
    }
    let mut events = vec![(
        "response.created",
        serde_json::json!({"type": "response.created", "sequence_number": 0, "response": response}),
    )];
    for i in 0..b.stream_chunks {
        events.push(("response.output_text.delta", serde_json::json!({"type": "response.output_text.delta", "delta": format!("{id}-{i} ")})));
    }
    events.push((
        "response.completed",
        serde_json::json!({"type": "response.completed", "response": response}),
    ));
    let interval = b.chunk_interval;
    let stream = futures_util::stream::unfold((0usize, guard), move |(i, guard)| {
        let next = events.get(i).cloned();
        async move {
            let (name, data) = next?;
            if i > 0 {
                tokio::time::sleep(interval).await;
            }
            let text = format!("event: {name}\ndata: {data}\n\n");
            Some((Ok::<_, std::io::Error>(Bytes::from(text)), (i + 1, guard)))
        }
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .header("x-stub-id", id)
        .body(Body::from_stream(stream))
        .expect("static response")
}

/// `GET`/`DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`: found only on
/// the stub that stored it.
async fn stored_response(
    State(shared): State<Arc<Shared>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    axum::extract::Path(rid): axum::extract::Path<String>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let (_guard, _) = admit(&shared, peer, &uri, headers, &body).await;
    let id = shared.id.clone();
    if !shared.responses.lock().contains(&rid) {
        return error_answer(
            &id,
            StatusCode::NOT_FOUND,
            format!("Response with id '{rid}' not found."),
        );
    }
    let answer =
        serde_json::json!({"id": rid, "object": "response", "status": "completed", "stub": id});
    json_answer(id, StatusCode::OK, &answer)
}

/// Any other path: recorded and answered with a JSON echo of what arrived.
async fn echo(
    State(shared): State<Arc<Shared>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    method: axum::http::Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let (_guard, b) = admit(&shared, peer, &uri, headers, &body).await;
    let id = shared.id.clone();
    let status = StatusCode::from_u16(b.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    if !status.is_success() {
        return error_answer(&id, status, format!("stub {id} failing"));
    }
    let answer = serde_json::json!({"object": "stub.echo", "method": method.as_str(), "path": uri.path(), "stub": id, "body_bytes": body.len()});
    json_answer(id, StatusCode::OK, &answer)
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
