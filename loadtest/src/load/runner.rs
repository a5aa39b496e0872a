//! Sending a workload: closed-loop clients or open-loop Poisson arrivals, streaming requests,
//! per-request timings.
//!
//! Owns the client side of one run: which URL each request goes to ([`Dispatch`]), when it is
//! sent ([`Mode`]), the request shape (streaming chat completions with `x-session-id` and
//! `x-rolter-vllm-token-ids`), and measuring TTFT (first content chunk) and end-to-end latency
//! (through `data: [DONE]`). A session's turns are always sequential: turn t+1 is sent after
//! turn t's reply arrived, with that reply in its history (falling back to the reply every
//! replica would generate if the request failed), after an optional think time. A turn that
//! fans out (agentic) sends its calls at once and goes on when all answered. Every run is
//! bounded by a deadline.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tokio::time::Instant;

use crate::load::workload::Session;
use crate::tokenizer;

/// When requests are sent.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Mode {
    /// `clients` concurrent clients, each running whole sessions back to back.
    Closed { clients: usize },
    /// Sessions start at Poisson arrivals so that requests arrive at about `rate` per second
    /// (session rate = rate / mean requests per session).
    Open { rate: f64 },
}

/// Where requests go.
#[derive(Debug, Clone)]
pub enum Dispatch {
    /// Everything to one base URL (the gateway).
    Single(String),
    /// Client-side round robin over replica base URLs (a baseline without the gateway).
    RoundRobin(Vec<String>),
    /// Client-side session stickiness: session i always goes to replica hash(i) mod N.
    SessionHash(Vec<String>),
    /// Each request to one of the URLs at random (an L4 balancer in front of several
    /// gateways); the sequence of picks is fixed (a hash of the request's number).
    Spread(Vec<String>),
}

/// Mixed into [`Dispatch::Spread`]'s hash so its picks are not those of `SessionHash`.
const SPREAD_SALT: u64 = 0x6c34_6261_6c61_6e63;

impl Dispatch {
    fn url(&self, session: usize, counter: &AtomicUsize) -> &str {
        match self {
            Dispatch::Single(u) => u,
            Dispatch::RoundRobin(us) => &us[counter.fetch_add(1, Ordering::Relaxed) % us.len()],
            Dispatch::SessionHash(us) => {
                &us[(tokenizer::splitmix64(session as u64) % us.len() as u64) as usize]
            }
            Dispatch::Spread(us) => {
                let n = counter.fetch_add(1, Ordering::Relaxed) as u64;
                &us[(tokenizer::splitmix64(n ^ SPREAD_SALT) % us.len() as u64) as usize]
            }
        }
    }
}

/// How a run behaves.
#[derive(Debug, Clone)]
pub struct RunOptions {
    pub mode: Mode,
    /// `model` sent in each request (the gateway's route alias).
    pub model: String,
    pub send_session_id: bool,
    pub send_token_ids: bool,
    pub request_timeout: Duration,
    /// No new request starts after this much time.
    pub max_duration: Duration,
    /// Mean pause between a reply and the session's next turn (exponentially distributed,
    /// seeded per session); zero sends the next turn at once.
    pub think_time: Duration,
    /// Seed of the open-loop arrival process and of think times.
    pub seed: u64,
    /// How the `x-rolter-vllm-token-ids` header's ids are computed (the simulator's own).
    pub tokenizer: tokenizer::PromptTokenizer,
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            mode: Mode::Closed { clients: 16 },
            model: "sim".into(),
            send_session_id: true,
            send_token_ids: true,
            request_timeout: Duration::from_secs(60),
            max_duration: Duration::from_secs(240),
            think_time: Duration::ZERO,
            seed: 1,
            tokenizer: tokenizer::PromptTokenizer::Builtin,
        }
    }
}

/// One request's result.
#[derive(Debug, Clone)]
pub struct RequestOutcome {
    pub session: usize,
    pub turn: usize,
    /// Which of the turn's parallel calls (0 unless the turn fans out).
    pub call: usize,
    pub ok: bool,
    pub error: Option<String>,
    /// Time to the first content chunk.
    pub ttft: Option<Duration>,
    /// Time to the end of the response.
    pub e2e: Duration,
    pub prompt_tokens: usize,
    /// Replica that served it, from the completion id (`…-sim{i}-…`, the simulator's ids).
    pub replica: Option<usize>,
    /// `usage.prompt_tokens_details.cached_tokens` of the final chunk, if reported.
    pub cached_tokens: Option<usize>,
    /// When it was sent, from the start of the run.
    pub sent_at: Duration,
}

/// All results of a run.
#[derive(Debug, Clone, Default)]
pub struct RunOutcome {
    pub requests: Vec<RequestOutcome>,
    pub wall: Duration,
}

struct Shared {
    client: reqwest::Client,
    sessions: Arc<Vec<Session>>,
    dispatch: Dispatch,
    opts: RunOptions,
    rr: AtomicUsize,
    start: Instant,
    deadline: Instant,
    out: Mutex<Vec<RequestOutcome>>,
}

/// Run `sessions` against `dispatch`.
pub async fn run(sessions: Arc<Vec<Session>>, dispatch: Dispatch, opts: RunOptions) -> RunOutcome {
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(opts.request_timeout)
        .pool_max_idle_per_host(256)
        .build()
        .expect("building the HTTP client");
    let start = Instant::now();
    let shared = Arc::new(Shared {
        client,
        sessions,
        dispatch,
        start,
        deadline: start + opts.max_duration,
        opts,
        rr: AtomicUsize::new(0),
        out: Mutex::new(Vec::new()),
    });
    let n = shared.sessions.len();
    let mut tasks = Vec::new();
    match shared.opts.mode {
        Mode::Closed { clients } => {
            let next = Arc::new(AtomicUsize::new(0));
            for _ in 0..clients.max(1).min(n.max(1)) {
                let (shared, next) = (shared.clone(), next.clone());
                tasks.push(tokio::spawn(async move {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= n || Instant::now() >= shared.deadline {
                            break;
                        }
                        run_session(&shared, i).await;
                    }
                }));
            }
        }
        Mode::Open { rate } => {
            let requests: usize = shared.sessions.iter().map(|s| s.requests()).sum();
            let mean_requests = requests as f64 / n.max(1) as f64;
            let session_rate = (rate / mean_requests.max(1.0)).max(1e-6);
            let mut rng = StdRng::seed_from_u64(shared.opts.seed);
            let mut at = start;
            for i in 0..n {
                let u: f64 = rng.gen_range(f64::EPSILON..1.0);
                at += Duration::from_secs_f64(-u.ln() / session_rate);
                if at >= shared.deadline {
                    break;
                }
                let shared = shared.clone();
                tasks.push(tokio::spawn(async move {
                    tokio::time::sleep_until(at).await;
                    run_session(&shared, i).await;
                }));
            }
        }
    }
    for t in tasks {
        let _ = t.await;
    }
    let wall = start.elapsed();
    let requests = std::mem::take(&mut *shared.out.lock());
    RunOutcome { requests, wall }
}

async fn run_session(shared: &Shared, i: usize) {
    let session = &shared.sessions[i];
    let mut replies = Vec::with_capacity(session.user_turns.len());
    let mut rng = StdRng::seed_from_u64(tokenizer::splitmix64(shared.opts.seed ^ i as u64));
    for t in 0..session.user_turns.len() {
        if t > 0 && !shared.opts.think_time.is_zero() {
            let u: f64 = rng.gen_range(f64::EPSILON..1.0);
            let pause = shared.opts.think_time.mul_f64(-u.ln());
            tokio::time::sleep_until((Instant::now() + pause).min(shared.deadline)).await;
        }
        if Instant::now() >= shared.deadline {
            return;
        }
        // A fanned-out turn sends its calls at once; the history goes on with call 0's reply.
        let calls = (0..session.calls_at(t)).map(|c| send_call(shared, i, t, c, &replies));
        let done = futures_util::future::join_all(calls).await;
        let mut out = shared.out.lock();
        for (call, (outcome, text)) in done.into_iter().enumerate() {
            if call == 0 {
                replies.push(text);
            }
            out.push(outcome);
        }
    }
}

/// Send call `call` of turn `t` of session `i`; its outcome and the reply text (the reply
/// every replica would generate if the request failed).
async fn send_call(
    shared: &Shared,
    i: usize,
    t: usize,
    call: usize,
    replies: &[String],
) -> (RequestOutcome, String) {
    let session = &shared.sessions[i];
    let messages = session.call_messages(t, call, replies);
    let tokens = shared.opts.tokenizer.chat_tokens(&messages);
    let url = format!(
        "{}/v1/chat/completions",
        shared.dispatch.url(i, &shared.rr).trim_end_matches('/')
    );
    let body = json!({
        "model": shared.opts.model,
        "messages": messages.iter()
            .map(|m| json!({"role": m.role, "content": m.content}))
            .collect::<Vec<_>>(),
        "max_tokens": session.max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let mut req = shared.client.post(&url).json(&body);
    if shared.opts.send_session_id {
        req = req.header("x-session-id", &session.id);
    }
    if shared.opts.send_token_ids {
        req = req.header(
            "x-rolter-vllm-token-ids",
            tokenizer::token_header_value(&tokens),
        );
    }
    let started = Instant::now();
    let result = send_streaming(req, started).await;
    let e2e = started.elapsed();
    let (ok, error, ttft, text, meta) = match result {
        Ok(s) => (true, None, s.ttft, Some(s.text), s.meta),
        Err(e) => (false, Some(e), None, None, StreamMeta::default()),
    };
    let text = text.unwrap_or_else(|| tokenizer::reply(&tokens, session.max_tokens).0);
    let outcome = RequestOutcome {
        session: i,
        turn: t,
        call,
        ok,
        error,
        ttft,
        e2e,
        prompt_tokens: tokens.len(),
        replica: meta.replica,
        cached_tokens: meta.cached_tokens,
        sent_at: started.duration_since(shared.start),
    };
    (outcome, text)
}

/// What the stream told about where and how a request was served.
#[derive(Debug, Clone, Copy, Default)]
struct StreamMeta {
    replica: Option<usize>,
    cached_tokens: Option<usize>,
}

impl StreamMeta {
    fn observe(&mut self, chunk: &Value) {
        if self.replica.is_none() {
            self.replica = chunk
                .get("id")
                .and_then(Value::as_str)
                .and_then(replica_from_id);
        }
        if let Some(c) = chunk
            .pointer("/usage/prompt_tokens_details/cached_tokens")
            .and_then(Value::as_u64)
        {
            self.cached_tokens = Some(c as usize);
        }
    }
}

/// The replica index in a simulator completion id (`chatcmpl-sim3-17` → 3).
fn replica_from_id(id: &str) -> Option<usize> {
    let rest = &id[id.find("-sim")? + 4..];
    rest.split('-').next()?.parse().ok()
}

/// A finished stream: TTFT, reply text, where it was served.
struct Streamed {
    ttft: Option<Duration>,
    text: String,
    meta: StreamMeta,
}

/// Send a streaming request; returns the TTFT, the reply text and what the chunks said.
async fn send_streaming(
    req: reqwest::RequestBuilder,
    started: Instant,
) -> Result<Streamed, String> {
    let resp = req.send().await.map_err(|e| format!("send: {e}"))?;
    let status = resp.status();
    if !status.is_success() {
        return Err(format!("HTTP {}", status.as_u16()));
    }
    let mut stream = resp.bytes_stream();
    let mut buf: Vec<u8> = Vec::new();
    let mut text = String::new();
    let mut ttft = None;
    let mut meta = StreamMeta::default();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| format!("body: {e}"))?;
        buf.extend_from_slice(&chunk);
        while let Some(pos) = find(&buf, b"\n\n") {
            let event: Vec<u8> = buf.drain(..pos + 2).collect();
            for line in String::from_utf8_lossy(&event).lines() {
                let Some(data) = line.strip_prefix("data:") else {
                    continue;
                };
                let data = data.trim();
                if data == "[DONE]" {
                    return Ok(Streamed { ttft, text, meta });
                }
                let v: Value =
                    serde_json::from_str(data).map_err(|e| format!("bad SSE chunk: {e}"))?;
                meta.observe(&v);
                let piece = v
                    .pointer("/choices/0/delta/content")
                    .or_else(|| v.pointer("/choices/0/text"))
                    .and_then(Value::as_str)
                    .unwrap_or("");
                if !piece.is_empty() {
                    ttft.get_or_insert_with(|| started.elapsed());
                    text.push_str(piece);
                }
            }
        }
    }
    Err("stream ended before [DONE]".into())
}

/// Write one JSON line per request (session, a hash of its system message, turn, replica,
/// prompt and cached tokens, send time and latency in ms), in send order: the per-request view
/// behind a report's hit rate.
pub fn write_trace(
    path: &std::path::Path,
    run: &RunOutcome,
    sessions: &[Session],
) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut reqs: Vec<&RequestOutcome> = run.requests.iter().collect();
    reqs.sort_by_key(|r| r.sent_at);
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    for r in reqs {
        let system = sessions
            .get(r.session)
            .and_then(|s| s.system.as_deref())
            .map(|s| format!("{:08x}", tokenizer::fnv1a32(s.as_bytes())));
        let line = json!({
            "session": r.session,
            "system": system,
            "turn": r.turn,
            "call": r.call,
            "replica": r.replica,
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens,
            "sent_ms": r.sent_at.as_secs_f64() * 1e3,
            "e2e_ms": r.e2e.as_secs_f64() * 1e3,
            "ok": r.ok,
        });
        writeln!(f, "{line}")?;
    }
    f.flush()
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_uses_every_url_about_evenly_and_not_in_turn() {
        let urls: Vec<String> = (0..2).map(|i| format!("http://g{i}")).collect();
        let d = Dispatch::Spread(urls);
        let counter = AtomicUsize::new(0);
        let picks: Vec<&str> = (0..1000).map(|_| d.url(0, &counter)).collect();
        let first = picks.iter().filter(|&&u| u == "http://g0").count();
        assert!((430..=570).contains(&first), "{first} of 1000 to g0");
        // Random, not alternating: some consecutive requests go to the same gateway.
        assert!(picks.windows(2).filter(|w| w[0] == w[1]).count() > 300);
    }

    #[test]
    fn replica_index_from_simulator_ids() {
        assert_eq!(replica_from_id("chatcmpl-sim3-17"), Some(3));
        assert_eq!(replica_from_id("cmpl-sim12-0"), Some(12));
        assert_eq!(replica_from_id("chatcmpl-abc"), None);
        assert_eq!(replica_from_id("chatcmpl-simx-1"), None);
    }

    #[test]
    fn stream_meta_reads_replica_and_cached_tokens() {
        let mut m = StreamMeta::default();
        m.observe(&json!({"id": "chatcmpl-sim2-5", "choices": []}));
        assert_eq!((m.replica, m.cached_tokens), (Some(2), None));
        m.observe(&json!({"id": "chatcmpl-sim2-5",
            "usage": {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 64}}}));
        assert_eq!((m.replica, m.cached_tokens), (Some(2), Some(64)));
    }
}
