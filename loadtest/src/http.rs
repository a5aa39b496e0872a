//! The HTTP surface of a simulated replica (axum).
//!
//! Owns request parsing and response shapes; the engine work is `replica::Replica::start`.
//! Routes:
//! - `POST /v1/chat/completions`, `POST /v1/completions`: OpenAI shapes as vLLM returns them;
//!   `stream: true` gives SSE `data: {chunk}\n\n` lines then `data: [DONE]\n\n`, with a usage
//!   chunk when `stream_options.include_usage` is set. Output length is `max_completion_tokens`
//!   or `max_tokens` (default `default_max_tokens`).
//! - `POST /v1/chat/completions/render`, `POST /v1/completions/render`: vLLM's render API (the
//!   prompt's token ids as a `GenerateRequest`, no generation; not counted as a request), which
//!   vllm-router's cache_aware calls before every request.
//! - `GET /health`, `GET /metrics` (vLLM metric names), `GET /v1/models` (vLLM's model card,
//!   `owned_by: "vllm"`), `GET /version` (vLLM's `{"version": ...}`).
//! - `GET /cache/status`: the LMCache-style `{"occupancy": f, "cache_available": b}`.
//! - `POST /reset_prefix_cache` (vLLM's dev endpoint): clear the cache, publish AllBlocksCleared.
//! - Test hooks: `GET /sim/stats`, `GET /sim/cache`, `GET /sim/requests`, and
//!   `POST /sim/fault/{target}/{kind}` with target `kv` (drop, corrupt, stall, resume, restart),
//!   `lmcache` (none, error, garbage, hang) or `http` (none, error, hang, unhealthy).

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use crate::kv_events::KvFault;
use crate::replica::{GenEvent, HttpFault, LmcacheFault, Replica, RequestRecord, Usage};

/// Longest a fault-injected hang lasts (it ends earlier at shutdown).
pub const HANG_LIMIT: Duration = Duration::from_secs(600);
/// Largest request body accepted (vLLM has no small limit; prompts of several MiB are normal).
pub const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;

/// What `GET /version` reports: the simulator, not a vLLM release.
pub const SIM_VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), "+rolter-sim");

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// The router of one replica.
pub fn router(replica: Arc<Replica>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions/render", post(render_chat))
        .route("/v1/completions/render", post(render_completions))
        .route("/v1/models", get(models))
        .route("/version", get(version))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/cache/status", get(lmcache_status))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/sim/stats", get(sim_stats))
        .route("/sim/cache", get(sim_cache))
        .route("/sim/requests", get(sim_requests))
        .route("/sim/fault/{target}/{kind}", post(sim_fault))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(replica)
}

fn openai_error(status: StatusCode, message: &str) -> Response {
    let body = json!({"error": {
        "message": message,
        "type": status.canonical_reason().unwrap_or("Error").replace(' ', "") + "Error",
        "param": null,
        "code": status.as_u16(),
    }});
    (status, Json(body)).into_response()
}

/// vLLM's `GenerateRequest` for a rendered prompt: the token ids and the sampling parameters
/// the request would run with (the fields a router reads; vLLM's full `SamplingParams` has more).
fn generate_request(r: &Replica, req: &Value, token_ids: Vec<u32>) -> Value {
    let max_tokens = req
        .get("max_completion_tokens")
        .or_else(|| req.get("max_tokens"))
        .and_then(Value::as_u64)
        .unwrap_or(r.config().default_max_tokens as u64);
    let model = req
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or(&r.config().model);
    json!({
        "request_id": format!("render-sim{}-{}", r.index, NEXT_ID.fetch_add(1, Ordering::Relaxed)),
        "token_ids": token_ids,
        "features": null,
        "sampling_params": {
            "n": 1,
            "temperature": req.get("temperature").and_then(Value::as_f64).unwrap_or(1.0),
            "top_p": req.get("top_p").and_then(Value::as_f64).unwrap_or(1.0),
            "max_tokens": max_tokens,
            "min_tokens": 0,
            "stop": [],
            "stop_token_ids": [],
            "ignore_eos": false,
            "skip_special_tokens": true,
        },
        "model": model,
        "stream": req.get("stream").and_then(Value::as_bool).unwrap_or(false),
        "stream_options": req.get("stream_options").cloned().unwrap_or(Value::Null),
        "cache_salt": null,
        "priority": 0,
        "kv_transfer_params": null,
    })
}

/// vLLM's `POST /v1/chat/completions/render`: the chat rendered with the template, tokenized.
async fn render_chat(State(r): State<Arc<Replica>>, body: Bytes) -> Response {
    let Ok(req) = serde_json::from_slice::<Value>(&body) else {
        return openai_error(StatusCode::BAD_REQUEST, "request body is not valid JSON");
    };
    match r
        .config()
        .tokenizer
        .request_prompt_tokens("/v1/chat/completions", &body, &req)
    {
        Some(ids) => Json(generate_request(&r, &req, ids)).into_response(),
        None => openai_error(StatusCode::BAD_REQUEST, "missing or invalid `messages`"),
    }
}

/// vLLM's `POST /v1/completions/render`: one `GenerateRequest` per prompt (the simulator serves
/// one prompt per request, so a list of one).
async fn render_completions(State(r): State<Arc<Replica>>, body: Bytes) -> Response {
    let Ok(req) = serde_json::from_slice::<Value>(&body) else {
        return openai_error(StatusCode::BAD_REQUEST, "request body is not valid JSON");
    };
    match r
        .config()
        .tokenizer
        .request_prompt_tokens("/v1/completions", &body, &req)
    {
        Some(ids) => Json(json!([generate_request(&r, &req, ids)])).into_response(),
        None => openai_error(StatusCode::BAD_REQUEST, "missing or invalid `prompt`"),
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

async fn chat(State(r): State<Arc<Replica>>, headers: HeaderMap, body: Bytes) -> Response {
    generate(r, Kind::Chat, headers, body).await
}

async fn completions(State(r): State<Arc<Replica>>, headers: HeaderMap, body: Bytes) -> Response {
    generate(r, Kind::Completion, headers, body).await
}

async fn generate(r: Arc<Replica>, kind: Kind, headers: HeaderMap, body: Bytes) -> Response {
    let path = match kind {
        Kind::Chat => "/v1/chat/completions",
        Kind::Completion => "/v1/completions",
    };
    let parsed: Result<Value, _> = serde_json::from_slice(&body);
    let req = parsed.as_ref().ok();
    let model = req
        .and_then(|v| v.get("model"))
        .and_then(Value::as_str)
        .map(str::to_string);
    let prompt = req.and_then(|v| r.config().tokenizer.request_prompt_tokens(path, &body, v));
    let header_str = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    r.record_request(RequestRecord {
        path: path.to_string(),
        model: model.clone(),
        prompt_tokens: prompt.as_ref().map_or(0, Vec::len),
        cached_tokens: 0,
        session_id: header_str("x-session-id"),
        token_ids_header: header_str("x-rolter-vllm-token-ids"),
        body_bytes: body.len(),
    });
    match r.http_fault() {
        HttpFault::Error => {
            return openai_error(StatusCode::INTERNAL_SERVER_ERROR, "injected fault")
        }
        HttpFault::Hang => {
            r.hang(HANG_LIMIT).await;
            return openai_error(StatusCode::SERVICE_UNAVAILABLE, "shutting down");
        }
        HttpFault::None | HttpFault::Unhealthy => {}
    }
    let Ok(req) = parsed else {
        return openai_error(StatusCode::BAD_REQUEST, "request body is not valid JSON");
    };
    let model = model.unwrap_or_else(|| r.config().model.clone());
    if r.config().strict_model && model != r.config().model {
        return openai_error(
            StatusCode::NOT_FOUND,
            &format!("The model `{model}` does not exist."),
        );
    }
    let Some(prompt) = prompt else {
        let what = match kind {
            Kind::Chat => "messages",
            Kind::Completion => "prompt",
        };
        return openai_error(
            StatusCode::BAD_REQUEST,
            &format!("missing or invalid `{what}`"),
        );
    };
    let max_tokens = req
        .get("max_completion_tokens")
        .or_else(|| req.get("max_tokens"))
        .and_then(Value::as_u64);
    let n = max_tokens.map_or(r.config().default_max_tokens, |m| m as usize);
    let finish = if max_tokens.is_some() {
        "length"
    } else {
        "stop"
    };
    let stream = req.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = req
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let rx = r.start(prompt, n);
    let meta = Meta {
        id: format!(
            "{}-sim{}-{}",
            if kind == Kind::Chat {
                "chatcmpl"
            } else {
                "cmpl"
            },
            r.index,
            NEXT_ID.fetch_add(1, Ordering::Relaxed)
        ),
        created: unix_secs(),
        model,
        kind,
        finish,
    };
    if stream {
        sse_response(meta, rx, include_usage)
    } else {
        json_response(meta, rx).await
    }
}

struct Meta {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
    finish: &'static str,
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

async fn json_response(meta: Meta, mut rx: tokio::sync::mpsc::Receiver<GenEvent>) -> Response {
    let mut text = String::new();
    let mut usage = None;
    while let Some(ev) = rx.recv().await {
        match ev {
            GenEvent::Token { index, word } => {
                if index > 0 {
                    text.push(' ');
                }
                text.push_str(word);
            }
            GenEvent::Done(u) => usage = Some(u),
        }
    }
    let Some(usage) = usage else {
        return openai_error(StatusCode::SERVICE_UNAVAILABLE, "replica shutting down");
    };
    let body = match meta.kind {
        Kind::Chat => json!({
            "id": meta.id, "object": "chat.completion", "created": meta.created,
            "model": meta.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": null, "finish_reason": meta.finish}],
            "usage": usage_json(&usage),
        }),
        Kind::Completion => json!({
            "id": meta.id, "object": "text_completion", "created": meta.created,
            "model": meta.model,
            "choices": [{"index": 0, "text": text, "logprobs": null,
                         "finish_reason": meta.finish}],
            "usage": usage_json(&usage),
        }),
    };
    Json(body).into_response()
}

fn sse_line(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

fn sse_response(
    meta: Meta,
    rx: tokio::sync::mpsc::Receiver<GenEvent>,
    include_usage: bool,
) -> Response {
    let chunk = move |meta: &Meta, choice: Value| -> Value {
        let object = match meta.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        };
        json!({"id": meta.id, "object": object, "created": meta.created,
               "model": meta.model, "choices": [choice]})
    };
    // State: (receiver, meta, finished flag).
    let stream =
        futures_util::stream::unfold((rx, meta, false), move |(mut rx, meta, done)| async move {
            if done {
                return None;
            }
            let out = match rx.recv().await {
                Some(GenEvent::Token { index, word }) => {
                    let piece = if index == 0 {
                        word.to_string()
                    } else {
                        format!(" {word}")
                    };
                    let choice = match meta.kind {
                        Kind::Chat if index == 0 => json!({"index": 0,
                            "delta": {"role": "assistant", "content": piece},
                            "logprobs": null, "finish_reason": null}),
                        Kind::Chat => json!({"index": 0, "delta": {"content": piece},
                            "logprobs": null, "finish_reason": null}),
                        Kind::Completion => json!({"index": 0, "text": piece,
                            "logprobs": null, "finish_reason": null}),
                    };
                    (sse_line(&chunk(&meta, choice)), false)
                }
                Some(GenEvent::Done(u)) => {
                    let last = match meta.kind {
                        Kind::Chat => json!({"index": 0, "delta": {},
                            "logprobs": null, "finish_reason": meta.finish}),
                        Kind::Completion => json!({"index": 0, "text": "",
                            "logprobs": null, "finish_reason": meta.finish}),
                    };
                    let mut buf = sse_line(&chunk(&meta, last)).to_vec();
                    if include_usage {
                        let mut c = chunk(&meta, Value::Null);
                        c["choices"] = json!([]);
                        c["usage"] = usage_json(&u);
                        buf.extend_from_slice(&sse_line(&c));
                    }
                    buf.extend_from_slice(b"data: [DONE]\n\n");
                    (Bytes::from(buf), true)
                }
                // Engine stopped without finishing (shutdown): end the stream.
                None => return None,
            };
            Some((Ok::<_, Infallible>(out.0), (rx, meta, out.1)))
        });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .expect("static response parts are valid")
}

/// vLLM's model card: `owned_by: "vllm"` is how gateways (smg, vllm-router) recognise a vLLM
/// worker and pick its load source (`/metrics`).
async fn models(State(r): State<Arc<Replica>>) -> Response {
    let model = &r.config().model;
    Json(json!({"object": "list", "data": [
        {"id": model, "object": "model", "created": unix_secs(), "owned_by": "vllm",
         "root": model, "parent": null}
    ]}))
    .into_response()
}

/// vLLM's `GET /version` (`{"version": "..."}`), the other probe gateways use to tell vLLM apart.
async fn version() -> Response {
    Json(json!({"version": SIM_VERSION})).into_response()
}

async fn health(State(r): State<Arc<Replica>>) -> Response {
    if r.http_fault() == HttpFault::Unhealthy {
        StatusCode::SERVICE_UNAVAILABLE.into_response()
    } else {
        StatusCode::OK.into_response()
    }
}

async fn metrics(State(r): State<Arc<Replica>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        r.metrics_text(),
    )
        .into_response()
}

async fn lmcache_status(State(r): State<Arc<Replica>>) -> Response {
    if !r.config().lmcache_status {
        return StatusCode::NOT_FOUND.into_response();
    }
    match r.lmcache_fault() {
        LmcacheFault::None => Json(r.lmcache_status()).into_response(),
        LmcacheFault::Error => openai_error(StatusCode::INTERNAL_SERVER_ERROR, "injected fault"),
        LmcacheFault::Garbage => (
            [(header::CONTENT_TYPE, "application/json")],
            "{\"occupancy\": \"lots\", <garbage>",
        )
            .into_response(),
        LmcacheFault::Hang => {
            r.hang(HANG_LIMIT).await;
            StatusCode::SERVICE_UNAVAILABLE.into_response()
        }
    }
}

async fn reset_prefix_cache(State(r): State<Arc<Replica>>) -> Response {
    r.reset_prefix_cache();
    StatusCode::OK.into_response()
}

async fn sim_stats(State(r): State<Arc<Replica>>) -> Response {
    Json(r.stats()).into_response()
}

async fn sim_cache(State(r): State<Arc<Replica>>) -> Response {
    let mut blocks = r.cache_snapshot();
    blocks.sort_by_key(|b| b.hash);
    Json(json!({
        "block_size": r.config().block_size,
        "capacity": r.config().cache_blocks,
        "blocks": blocks,
    }))
    .into_response()
}

async fn sim_requests(State(r): State<Arc<Replica>>) -> Response {
    Json(r.recent_requests()).into_response()
}

/// Parse a fault name for `target`, or `None` if unknown.
pub fn apply_fault(r: &Replica, target: &str, kind: &str) -> Result<(), String> {
    match target {
        "kv" => {
            let f = match kind {
                "drop" => KvFault::DropNext,
                "corrupt" => KvFault::CorruptNext,
                "stall" => KvFault::Stall,
                "resume" => KvFault::Resume,
                "restart" => KvFault::Restart,
                _ => return Err(format!("unknown kv fault `{kind}`")),
            };
            r.kv_fault(f);
        }
        "lmcache" => r.set_lmcache_fault(match kind {
            "none" => LmcacheFault::None,
            "error" => LmcacheFault::Error,
            "garbage" => LmcacheFault::Garbage,
            "hang" => LmcacheFault::Hang,
            _ => return Err(format!("unknown lmcache fault `{kind}`")),
        }),
        "http" => r.set_http_fault(match kind {
            "none" => HttpFault::None,
            "error" => HttpFault::Error,
            "hang" => HttpFault::Hang,
            "unhealthy" => HttpFault::Unhealthy,
            _ => return Err(format!("unknown http fault `{kind}`")),
        }),
        _ => return Err(format!("unknown fault target `{target}`")),
    }
    Ok(())
}

async fn sim_fault(
    State(r): State<Arc<Replica>>,
    Path((target, kind)): Path<(String, String)>,
) -> Response {
    match apply_fault(&r, &target, &kind) {
        Ok(()) => StatusCode::OK.into_response(),
        Err(e) => openai_error(StatusCode::BAD_REQUEST, &e),
    }
}

fn unix_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
