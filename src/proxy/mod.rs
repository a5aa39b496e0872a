//! The HTTP front: a pingora `ProxyHttp` whose `request_filter` answers every request.
//!
//! Owns: endpoint dispatch, request body buffering, error responses (via [`error`]), the
//! model rewrite, and forwarding over pooled upstream connections (via [`upstream`] and
//! [`pool`]).
//! Must not: contain routing policy (that is `routing`, called through the route's
//! `Strategy`) or parse config.
//!
//! ## Why forwarding happens inside `request_filter` (SPEC §3.1)
//! Routing needs the whole body (the prompt) before the peer is chosen, so the body is
//! read in `request_filter`. Pingora 0.9.1 re-sends a body consumed there only through
//! its 64 KiB retry buffer; a larger body is silently dropped and the upstream waits
//! forever. LLM prompts routinely exceed 64 KiB. Of the two options inside pingora's
//! public API we chose to forward ourselves (connections from pingora-core's
//! `TransportConnector`, kept idle by [`pool`]) rather than the subrequest
//! API: one code path for every body size up to `limits.max_body_bytes`, exact control
//! of *when* a failure happened (which decides whether a retry is safe), the in-flight
//! slot held by an RAII guard for exactly the life of the exchange, and TTFB measured
//! where it happens. The cost is that pingora's upstream-side filters
//! (`upstream_peer`, `upstream_request_filter`, ...) are unused; rolter needs none of
//! them. `tests/proxy.rs` proves a 1 MiB prompt arrives byte-for-byte (after the model
//! rewrite) over a reused pooled connection.

pub mod admission;
pub mod attempt;
pub mod body;
pub mod connection;
pub mod error;
pub mod framing;
pub mod models;
pub mod pool;
mod responses;
pub mod retry;
pub mod upstream;

use crate::fleet::ms_at;
use crate::metrics::METRICS;
use crate::prompt::responses::ResponseIdSniffer;
use crate::prompt::{self, Endpoint, TOKEN_IDS_HEADER};
use crate::routing::responses::Pinned;
use crate::routing::{FleetView, LeastLoad, PromptFacts, RouteInput, Strategy};
use crate::runtime::{Route, RouteTable, RouteTarget, Runtime};
use admission::Admission;
use async_trait::async_trait;
use attempt::Attempt;
use bytes::Bytes;
use error::GatewayError;
use pingora::http::ResponseHeader;
use pingora::proxy::{ProxyHttp, Session};
use pingora::server::configuration::ServerConf;
use pingora::upstreams::peer::HttpPeer;
use std::sync::Arc;
use std::time::{Duration, Instant};
use upstream::{ExchangeError, Upstream};

/// Header carrying a client's session id (pipeline affinity).
pub const SESSION_ID_HEADER: &str = "x-session-id";
/// Seconds a client is told to wait when no target is eligible.
const RETRY_AFTER_SECS: &str = "1";
/// Bodies from this long on have their prompt summarised as it is encoded rather than
/// kept (`prompt::PromptSummary`); below it, copying the prompt costs less than hashing
/// its first messages piece by piece (docs/performance.md, "long prompts summarised").
const SUMMARISE_FROM_BYTES: usize = 32 << 10;

/// Per-request facts for the access log.
#[derive(Debug, Default)]
pub struct RequestCtx {
    started: Option<Instant>,
    /// The API endpoint (`rolter_endpoint_requests_total{endpoint}`); "" if none matched.
    endpoint: &'static str,
    route: Option<String>,
    target: Option<String>,
    strategy: &'static str,
    reason: &'static str,
    score: Option<f64>,
    status: u16,
    error: Option<&'static str>,
    attempts: usize,
    /// Why each retried attempt failed (`retry::RetryReason`), in order.
    retried: Vec<&'static str>,
    stream: bool,
    body_bytes: usize,
    /// `rolter_requests_total` already bumped (through the route's resolved series).
    counted: bool,
}

/// A request ready to forward: its routing input, its buffered body (and the body
/// budget's charge for it), where its `model` value sits, who sent it, and when routing
/// started.
struct Prepared<'a, 'c> {
    input: RouteInput<'a>,
    body: &'a mut framing::BodyBuf,
    charged: &'a mut admission::BodyBytes<'c>,
    /// Where the `model` value sits and how the target's replaces it.
    model: ModelRewrite,
    /// Learn the answer's response id (Responses API).
    learn: bool,
    /// What the upstream is told about the client.
    client: upstream::ClientInfo,
    at: Instant,
}

/// The body's `model` value and what replaces it.
#[derive(Debug, Clone)]
enum ModelRewrite {
    /// A JSON string literal at this span: the target's model as a JSON string.
    Json(std::ops::Range<usize>),
    /// A form field's raw value at this span: the target's model as is.
    Raw(std::ops::Range<usize>),
    /// No model in the body (a request naming a stored response): nothing replaced.
    None,
}

impl ModelRewrite {
    /// The span to replace and its replacement for `target`.
    fn replacement<'t>(&self, target: &'t RouteTarget) -> (std::ops::Range<usize>, &'t [u8]) {
        match self {
            ModelRewrite::Json(span) => (span.clone(), target.upstream_model_json.as_bytes()),
            ModelRewrite::Raw(span) => (span.clone(), target.upstream_model.as_bytes()),
            ModelRewrite::None => (0..0, &[]),
        }
    }
}

/// The `endpoint` label of a request rolter answers itself.
fn local_endpoint_label(path: &str) -> &'static str {
    match path {
        "/health" => "health",
        "/ready" => "ready",
        "/metrics" => "metrics",
        _ => "models",
    }
}

/// The gateway application.
pub struct Gateway {
    runtime: Arc<Runtime>,
    pool: pool::UpstreamPool,
    admission: Admission,
    connections: Arc<connection::OpenConnections>,
    retry_budget: retry::RetryBudget,
    /// What each target reports in its own `/v1/models` (kept across reloads).
    models: models::ModelInfoCache,
    /// Where recent long chat bodies' messages ended, to resume the next turn's parse.
    resume: prompt::resume::ResumeCache,
    /// Where each placed turn is told to the other gateways (`[peering]`; closed without).
    peering: Arc<crate::peering::Outbox>,
}

impl Gateway {
    /// A gateway over `runtime`, with an upstream pool sized from pingora's server conf;
    /// `connections` counts its client connections (exported in `/metrics`).
    pub fn new(
        runtime: Arc<Runtime>,
        conf: &ServerConf,
        connections: Arc<connection::OpenConnections>,
    ) -> Self {
        Gateway {
            runtime,
            pool: pool::UpstreamPool::new(conf),
            admission: Admission::new(),
            connections,
            retry_budget: retry::RetryBudget::default(),
            models: Default::default(),
            resume: Default::default(),
            peering: Default::default(),
        }
    }

    /// This gateway telling its peers where it placed each turn through `outbox`.
    pub fn with_peering(mut self, outbox: Arc<crate::peering::Outbox>) -> Self {
        self.peering = outbox;
        self
    }

    async fn handle(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
    ) -> Result<(), GatewayError> {
        let table = self.runtime.table();
        admission::apply_client_limits(session, &table.limits);
        let method = session.req_header().method.clone();
        let path = session.req_header().uri.path().to_string();
        if let Some(auth) = &table.auth {
            // Before the body is read: an unauthenticated client gets no buffer.
            let protected = match path.as_str() {
                "/health" | "/ready" => auth.protect_health,
                "/metrics" => auth.protect_metrics,
                _ => true,
            };
            if protected && !auth.admits_request(&session.req_header().headers) {
                METRICS.auth_failures.inc();
                return Err(GatewayError::Unauthorized);
            }
        }
        let endpoint = match Endpoint::from_path(&path) {
            Some(endpoint) => endpoint,
            None => match path.as_str() {
                "/health" | "/ready" | "/metrics" | "/v1/models" => {
                    ctx.endpoint = local_endpoint_label(&path);
                    if method != http::Method::GET && method != http::Method::HEAD {
                        return Err(GatewayError::MethodNotAllowed(method.to_string()));
                    }
                    return self.serve_local(session, ctx, &path).await;
                }
                p if p.starts_with(responses::BY_ID_PREFIX) => {
                    ctx.endpoint = responses::BY_ID_LABEL;
                    return self.response_by_id(session, ctx, &table, &method, p).await;
                }
                _ => return Err(GatewayError::NotFound(format!("no such endpoint: {path}"))),
            },
        };
        ctx.endpoint = endpoint.label();
        if method != http::Method::POST {
            return Err(GatewayError::MethodNotAllowed(method.to_string()));
        }
        let (mut body, mut charged, _admitted) = self.read_and_admit(session, &table).await?;
        ctx.body_bytes = body.len();
        let headers = &session.req_header().headers;
        // Read only where it matters (the boundary of a multipart form).
        let content_type = endpoint
            .is_form()
            .then(|| headers.get(http::header::CONTENT_TYPE))
            .flatten()
            .map(|v| v.as_bytes());
        let bad = |e: prompt::PromptError| GatewayError::BadRequest(e.to_string());
        // A long chat body continues where its conversation's previous one ended, if seen:
        // only its part from there on is made contiguous and parsed.
        let taken = (endpoint == Endpoint::Chat && body.len() >= SUMMARISE_FROM_BYTES)
            .then(|| self.resume.take(body.pieces()))
            .flatten();
        let mut parsed = match taken {
            Some(taken) => {
                let at = taken.at();
                match prompt::RequestBody::parse_resumed(body.contiguous_from(at), taken) {
                    Some(parsed) => parsed,
                    None => prompt::RequestBody::parse_with(endpoint, body.body(), content_type)
                        .map_err(bad)?,
                }
            }
            None => prompt::RequestBody::parse_walking(
                endpoint,
                body.body(),
                content_type,
                SUMMARISE_FROM_BYTES,
            )
            .map_err(bad)?,
        };
        if parsed.resumed() {
            METRICS.prompts_resumed.inc();
        }
        ctx.stream = parsed.stream;
        let route = table.route(&parsed.model).ok_or_else(|| {
            GatewayError::NotFound(format!("The model '{}' does not exist", parsed.model))
        })?;
        ctx.route = Some(route.alias.clone());
        let session_id = route
            .strategy
            .uses_session_id()
            .then(|| headers.get(SESSION_ID_HEADER))
            .flatten()
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        // Who decides: the target holding the response this one continues; for a
        // pass-through endpoint (no prompt) the least loaded target, or the route's own
        // strategy where it keeps sessions and the client names one; else the route's.
        let keeps_session = session_id.is_some();
        let pinned;
        let strategy: &dyn Strategy = match parsed.previous_response_id.as_deref() {
            Some(id) => match responses::home_in_route(&self.runtime, route, id)? {
                Some(target) => {
                    pinned = Pinned { target };
                    &pinned
                }
                None => &*route.strategy,
            },
            None if !endpoint.has_prompt() && !keeps_session => &LeastLoad,
            None => &*route.strategy,
        };
        // A long prompt is summarised as it is encoded (its length, key and placement
        // keys), never copied whole; a short one is kept, which costs less than hashing
        // its first messages piece by piece.
        let keep_prompt = strategy.uses_prompt() && ctx.body_bytes < SUMMARISE_FROM_BYTES;
        let prompt = if keep_prompt {
            parsed.prompt()
        } else {
            Vec::new()
        };
        let kept_key = if keep_prompt && strategy.uses_prompt_key() {
            crate::prefix::prompt_key(&prompt)
        } else {
            Vec::new()
        };
        let (keep, with_key) = (
            crate::routing::placement::MAX_KEY_BYTES,
            strategy.uses_prompt_key(),
        );
        let mut summary = (strategy.uses_prompt() && !keep_prompt)
            .then(|| parsed.summary_with(keep, with_key, &self.resume));
        if summary.is_none() {
            parsed.remember_walk(&self.resume);
        }
        let model = if parsed.model_is_json {
            ModelRewrite::Json(parsed.model_span.clone())
        } else {
            ModelRewrite::Raw(parsed.model_span.clone())
        };
        let learn = endpoint == Endpoint::Responses;
        // The parsed messages (escaped text decoded into owned strings, non-text payloads
        // as JSON values) are not needed past this point: not held through the exchange.
        drop(parsed);
        if let Some(None) = summary {
            // Resumed from a state saved for other options (a conversation whose turns
            // changed routes): the whole body is parsed for the summary.
            let whole = prompt::RequestBody::parse(endpoint, body.body()).map_err(bad)?;
            summary = Some(Some(whole.summary(keep, with_key)));
        }
        let summary = summary.flatten();
        ctx.strategy = strategy.name();
        let header_ids = strategy
            .uses_token_ids()
            .then(|| headers.get(TOKEN_IDS_HEADER))
            .flatten()
            .and_then(|v| prompt::parse_token_ids(v.as_bytes()));
        // No ids header: the route's tokenizer computes vLLM's ids (large bodies off the
        // request loop); a failure routes without ids, as a missing header does.
        let tokenizes = matches!(endpoint, Endpoint::Chat | Endpoint::Completions);
        let token_ids = match (header_ids, &route.tokenizer) {
            (None, Some(tok)) if strategy.uses_token_ids() && tokenizes => {
                match tok.ids(endpoint, body.body()).await {
                    Ok(ids) => Some(ids),
                    Err(e) => {
                        log::debug!("route {}: no token ids: {e}", route.alias);
                        None
                    }
                }
            }
            (ids, _) => ids,
        };
        let session_id = session_id.filter(|_| strategy.uses_session_id());
        // One clock read serves the routing input and the first attempt.
        let at = Instant::now();
        let client = self.client_info(session, &table);
        let request = Prepared {
            input: RouteInput {
                prompt: &prompt,
                prompt_key: summary.as_ref().map_or(&kept_key, |s| &s.key),
                facts: summary.as_ref().map(PromptFacts::of),
                token_ids: token_ids.as_deref(),
                session_id: session_id.as_deref(),
                now_ms: ms_at(at),
            },
            body: &mut body,
            charged: &mut charged,
            model,
            learn,
            client,
            at,
        };
        self.forward(session, ctx, &table, route, strategy, request)
            .await
    }

    /// Read the request body under the table's limits, then take an admission slot. The
    /// body's buffer stays charged while it is kept: until the upstream's response header
    /// is in (`upstream::Outgoing`), or the request ends before that. The slot is held
    /// until the response ends, however it ends; it is taken once the body is in, so slow
    /// senders cannot hold the slots (their memory is the byte budget's).
    async fn read_and_admit(
        &self,
        session: &mut Session,
        table: &RouteTable,
    ) -> Result<
        (
            framing::BodyBuf,
            admission::BodyBytes<'_>,
            admission::Admitted<'_>,
        ),
        GatewayError,
    > {
        let limits = &table.limits;
        let mut charged = self.admission.body_bytes();
        let body = body::read_body(
            session,
            limits.max_body_bytes,
            Duration::from_millis(limits.client_body_timeout_ms),
            &mut charged,
            limits.max_buffered_body_bytes,
        )
        .await?;
        let admitted = self.admit(table)?;
        Ok((body, charged, admitted))
    }

    /// How `target` is reached: its peer, its pool of idle connections, its timeouts.
    fn upstream_for<'t>(
        &self,
        table: &RouteTable,
        target: &'t RouteTarget,
        retry_on_status: bool,
    ) -> Upstream<'t> {
        Upstream {
            peer: &target.peer,
            idle: target
                .idle
                .get_or_init(|| self.pool.stack_for(&target.peer))
                .as_deref(),
            label: target.state.label(),
            idle_timeout: Duration::from_millis(table.limits.upstream_idle_timeout_ms),
            retry_on_status,
        }
    }

    /// A slot under `limits.max_inflight`, or 503.
    fn admit(&self, table: &RouteTable) -> Result<admission::Admitted<'_>, GatewayError> {
        let limit = table.limits.max_inflight;
        self.admission
            .try_admit(limit)
            .ok_or(GatewayError::Overloaded { limit })
    }

    /// What the upstream is told about the client.
    fn client_info(&self, session: &Session, table: &RouteTable) -> upstream::ClientInfo {
        upstream::ClientInfo {
            x_forwarded_for: table.forwarding.x_forwarded_for,
            addr: session
                .client_addr()
                .and_then(|a| a.as_inet())
                .map(|a| a.ip().to_canonical()),
        }
    }

    /// Try the request on the strategy's choice, then, while an attempt fails before any
    /// response byte reached the client (`ExchangeError::Retryable`), on the next-best
    /// target not tried yet: at most `retry.retries` times, each after a jittered
    /// back-off, none starting past `retry.deadline_ms`, and each taken from the retry
    /// budget. Relay the first answer.
    async fn forward(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        table: &RouteTable,
        route: &Route,
        strategy: &dyn Strategy,
        mut request: Prepared<'_, '_>,
    ) -> Result<(), GatewayError> {
        let retry = &table.retry;
        self.retry_budget.record_request(request.at);
        let deadline = request.at + Duration::from_millis(retry.deadline_ms);
        let mut excluded = Vec::new();
        let mut last_error = None;
        // The clock as of the last step: read once per attempt, not per use.
        let mut now = request.at;
        // Each pass either makes an attempt or excludes a target, so this terminates.
        while excluded.len() < route.targets.len() {
            let candidates = route.candidates(now);
            let view = FleetView {
                candidates: &candidates,
                excluded: &excluded,
            };
            let Some(decision) = strategy.select(&request.input, &view) else {
                break;
            };
            let target = &route.targets[decision.target];
            let Some(ticket) = target.state.breaker.ticket(ms_at(now)) else {
                // Another request took this open circuit's single half-open probe.
                excluded.push(decision.target);
                continue;
            };
            ctx.attempts += 1;
            ctx.target = Some(target.state.label().to_string());
            ctx.reason = decision.reason.as_str();
            ctx.score = decision.score;
            // Whether a failure of this attempt could be followed by another: decided
            // before it starts, so that a 502/503 answer is kept from the client only
            // when another attempt will (most likely) replace it.
            let others = strategy.fails_over() && view.eligible().any(|i| i != decision.target);
            let blocked = self.retry_blocker(ctx.attempts, others, now, deadline, retry, false);
            let attempt = Attempt::begin(route, strategy, &request.input, &view, decision, ticket);
            if let Some(conversation) = attempt
                .decision
                .conversation
                .filter(|_| strategy.hears_peers())
            {
                let (label, new_work) = (target.state.label(), attempt.decision.new_work);
                self.peering
                    .tell(&route.alias, label, conversation, new_work);
            }
            let result = self
                .exchange(session, table, &attempt, &mut request, blocked.is_none())
                .await;
            now = attempt.settle(&result, &table.breaker);
            // A target removed meanwhile has had its series dropped: count nothing
            // against it (the access log still names it).
            ctx.counted = target.state.is_retired();
            route.metrics.attempt(match &result {
                Ok(_) => "answered",
                Err(ExchangeError::Retryable(_, reason)) => reason.as_str(),
                Err(ExchangeError::Final(_)) => "failed",
            });
            match result {
                Ok(outcome) => {
                    if let Some(why) = blocked.filter(|_| matches!(outcome.status, 502 | 503)) {
                        route.metrics.retry_refused(why);
                    }
                    ctx.status = outcome.status;
                    ctx.counted |= http::StatusCode::from_u16(outcome.status).is_ok();
                    return Ok(());
                }
                Err(ExchangeError::Retryable(e, reason)) => {
                    excluded.push(decision.target);
                    let refused =
                        self.retry_blocker(ctx.attempts, others, now, deadline, retry, true);
                    if let Some(why) = refused {
                        log::warn!("{e}; not retried ({why})");
                        route.metrics.retry_refused(why);
                        last_error = Some(e);
                        break;
                    }
                    let pause = retry::backoff(retry, ctx.retried.len() as u32 + 1);
                    log::warn!(
                        "{e}; retrying on the next-best target in {} ms",
                        pause.as_millis()
                    );
                    route.metrics.retry(reason.as_str());
                    ctx.retried.push(reason.as_str());
                    last_error = Some(e);
                    if !pause.is_zero() {
                        tokio::time::sleep(pause).await;
                        now = Instant::now();
                    }
                }
                Err(ExchangeError::Final(e)) => return Err(e),
            }
        }
        Err(last_error.unwrap_or_else(|| GatewayError::NoEligibleTarget(route.alias.clone())))
    }

    /// Why no retry may follow attempt number `attempts` at `now` (a label for
    /// `rolter_retries_refused_total{reason}`), `others` saying whether an eligible target
    /// not tried yet is left and the strategy may go there; or `None` when one may: then,
    /// if `withdraw`, it is taken from the budget.
    fn retry_blocker(
        &self,
        attempts: usize,
        others: bool,
        now: Instant,
        deadline: Instant,
        retry: &crate::config::RetryConfig,
        withdraw: bool,
    ) -> Option<&'static str> {
        if attempts > retry.retries as usize {
            return Some("attempts");
        }
        if !others {
            return Some("no_target");
        }
        // The back-off must end before the deadline too.
        if now + Duration::from_millis(retry.max_backoff_ms) >= deadline {
            return Some("deadline");
        }
        let budget = if withdraw {
            self.retry_budget.try_withdraw(now, retry)
        } else {
            self.retry_budget.has_room(now, retry)
        };
        (!budget).then_some("budget")
    }

    /// One attempt's exchange: send the request to its target and relay the answer,
    /// within the route's total limit.
    async fn exchange(
        &self,
        session: &mut Session,
        table: &RouteTable,
        attempt: &Attempt<'_>,
        request: &mut Prepared<'_, '_>,
        retry_on_status: bool,
    ) -> Result<upstream::ExchangeOutcome, ExchangeError> {
        let target = attempt.target;
        let (model_span, model) = request.model.replacement(target);
        let auth = match (&target.authorization, &table.auth) {
            (Some(key), _) => upstream::UpstreamAuth::Replace(key.expose()),
            // The client's key was for rolter.
            (None, Some(_)) => upstream::UpstreamAuth::Drop,
            (None, None) => upstream::UpstreamAuth::Forward,
        };
        let head = upstream::encode_head(
            session.req_header(),
            &target.host,
            &target.base_path,
            request.body.len() - model_span.len() + model.len(),
            request.client,
            auth,
        );
        let up = self.upstream_for(table, target, retry_on_status);
        let out = upstream::Outgoing {
            body: &mut *request.body,
            head: &head,
            model_span,
            model,
            charge: &mut *request.charged,
        };
        let learn = request.learn;
        let responses = self.runtime.responses();
        let exchange = async {
            let answer = upstream::send(&self.pool, &up, session, out, attempt.started).await?;
            // A Responses answer's id is learnt as it passes: the replica holds it now.
            // The answer's own framing decides how to read it, not what the client asked.
            let mut sniffer = (learn && (200..300).contains(&answer.status))
                .then(|| ResponseIdSniffer::new(answer.is_event_stream()));
            let mut observe = |chunk: &[u8]| {
                let found = sniffer.as_mut().and_then(|s| s.feed(chunk));
                if let Some(id) = found {
                    responses.learn(&id, target.state.label(), crate::fleet::now_ms());
                }
            };
            let done = || attempt.upstream_done();
            upstream::relay(&self.pool, &up, session, answer, &mut observe, &done).await
        };
        match attempt.route.total_timeout {
            None => exchange.await,
            Some(limit) => match tokio::time::timeout(limit, exchange).await {
                Ok(result) => result,
                Err(_) => Err(ExchangeError::Final(GatewayError::UpstreamTimeout {
                    target: target.state.label().to_string(),
                    reason: format!("no complete response within {} ms", limit.as_millis()),
                })),
            },
        }
    }

    async fn serve_local(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        path: &str,
    ) -> Result<(), GatewayError> {
        let (status, content_type, body) = match path {
            "/health" => (200, "text/plain", Bytes::from_static(b"ok\n")),
            "/ready" => {
                let table = self.runtime.table();
                if table.has_eligible_target() {
                    (200, "text/plain", Bytes::from_static(b"ready\n"))
                } else {
                    (
                        503,
                        "text/plain",
                        Bytes::from_static(b"no eligible target\n"),
                    )
                }
            }
            "/metrics" => {
                let text = crate::fleet::export::scrape(self.runtime.registry(), || {
                    METRICS.admitted.set(self.admission.inflight() as i64);
                    METRICS
                        .client_connections
                        .set(self.connections.count() as i64);
                    METRICS
                        .buffered_body_bytes
                        .set(self.admission.buffered() as i64);
                    METRICS
                        .response_ids
                        .set(self.runtime.responses().len() as i64);
                });
                (200, "text/plain; version=0.0.4", Bytes::from(text))
            }
            _ => {
                let table = self.runtime.table();
                self.refresh_model_info(&table).await;
                (
                    200,
                    "application/json",
                    models::listing(&table, &self.models),
                )
            }
        };
        ctx.status = status;
        respond(session, status, content_type, body, &[]).await
    }
}

/// Write a complete small response.
async fn respond(
    session: &mut Session,
    status: u16,
    content_type: &str,
    body: Bytes,
    extra: &[(&'static str, &str)],
) -> Result<(), GatewayError> {
    let gone = |e: Box<pingora::Error>| GatewayError::client_write(&e);
    let mut h = ResponseHeader::build(status, Some(3 + extra.len())).map_err(gone)?;
    h.insert_header(http::header::CONTENT_TYPE, content_type)
        .map_err(gone)?;
    h.insert_header(http::header::CONTENT_LENGTH, body.len().to_string())
        .map_err(gone)?;
    for (k, v) in extra {
        h.insert_header(*k, *v).map_err(gone)?;
    }
    let head_only = session.req_header().method == http::Method::HEAD;
    session
        .write_response_header(Box::new(h), head_only)
        .await
        .map_err(gone)?;
    if !head_only {
        session
            .write_response_body(Some(body), true)
            .await
            .map_err(gone)?;
    }
    Ok(())
}

#[async_trait]
impl ProxyHttp for Gateway {
    type CTX = RequestCtx;

    /// No downstream modules: pingora's default registers a (disabled) response
    /// compression module whose context is built and consulted on every request; the
    /// gateway relays upstream bodies as they are.
    fn init_downstream_modules(&self, _modules: &mut pingora::modules::http::HttpModules) {}

    fn new_ctx(&self) -> RequestCtx {
        RequestCtx {
            started: Some(Instant::now()),
            ..Default::default()
        }
    }

    async fn request_filter(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
    ) -> pingora::Result<bool> {
        let Err(e) = self.handle(session, ctx).await else {
            return Ok(true);
        };
        ctx.error = Some(e.kind());
        ctx.status = e.status();
        METRICS.errors.with_label_values(&[e.kind()]).inc();
        // An interim answer (the `100 Continue` of `Expect: 100-continue`) is not an
        // answer: the error still gets its own.
        let answered = session
            .response_written()
            .is_some_and(|h| !h.status.is_informational());
        if e.client_unreachable() || answered {
            // Nothing more can be said to this client; make pingora drop the connection. A
            // downstream write error is one pingora answers nothing to (its default
            // `fail_to_proxy` would otherwise try a bare 500 on a connection already used).
            return Err(
                pingora::Error::explain(pingora::ErrorType::WriteError, e.to_string()).into_down(),
            );
        }
        // The request body may be unread (413, 408, ...): never reuse this connection.
        session.set_keepalive(None);
        let extra: &[(&'static str, &str)] = match e.status() {
            503 => &[("retry-after", RETRY_AFTER_SECS)],
            401 => &[("www-authenticate", "Bearer")],
            _ => &[],
        };
        if let Err(write_err) = respond(
            session,
            e.status(),
            "application/json",
            Bytes::from(e.body()),
            extra,
        )
        .await
        {
            return Err(pingora::Error::explain(
                pingora::ErrorType::WriteError,
                write_err.to_string(),
            )
            .into_down());
        }
        body::discard_rest(session).await;
        Ok(true)
    }

    /// A client that left or stopped reading is routine, not a gateway error: it is counted
    /// (`rolter_request_errors_total{kind="client_disconnect"}` or `"client_write_timeout"`)
    /// and in the access line, and pingora's own `ERROR` line for it is left out.
    fn suppress_error_log(
        &self,
        _session: &Session,
        ctx: &RequestCtx,
        _e: &pingora::Error,
    ) -> bool {
        matches!(
            ctx.error,
            Some(GatewayError::CLIENT_GONE | GatewayError::CLIENT_WRITE_TIMEOUT)
        )
    }

    async fn upstream_peer(
        &self,
        _session: &mut Session,
        _ctx: &mut RequestCtx,
    ) -> pingora::Result<Box<HttpPeer>> {
        // Unreachable: request_filter answers every request (see the module docs).
        Err(pingora::Error::explain(
            pingora::ErrorType::InternalError,
            "rolter forwards in request_filter; upstream_peer is never used",
        ))
    }

    async fn logging(
        &self,
        session: &mut Session,
        _e: Option<&pingora::Error>,
        ctx: &mut RequestCtx,
    ) {
        let req = session.req_header();
        let status = http::StatusCode::from_u16(ctx.status).ok();
        crate::metrics::endpoint_answered(
            if ctx.endpoint.is_empty() {
                "unknown"
            } else {
                ctx.endpoint
            },
            status,
        );
        // The status's own text (`StatusCode::as_str`): no per-request string.
        if !ctx.counted {
            METRICS
                .requests
                .with_label_values(&[
                    ctx.route.as_deref().unwrap_or("-"),
                    ctx.target.as_deref().unwrap_or("-"),
                    status.as_ref().map_or("0", |s| s.as_str()),
                ])
                .inc();
        }
        if !log::log_enabled!(target: "access", log::Level::Info) {
            return;
        }
        let ms = ctx.started.map_or(0.0, |s| s.elapsed().as_secs_f64() * 1e3);
        log::info!(
            target: "access",
            "method={} path={} endpoint={} status={} route={} target={} strategy={} reason={} score={} attempts={} retried={} stream={} body_bytes={} error={} ms={:.2}",
            req.method,
            req.uri.path(),
            if ctx.endpoint.is_empty() { "-" } else { ctx.endpoint },
            ctx.status,
            ctx.route.as_deref().unwrap_or("-"),
            ctx.target.as_deref().unwrap_or("-"),
            if ctx.strategy.is_empty() { "-" } else { ctx.strategy },
            if ctx.reason.is_empty() { "-" } else { ctx.reason },
            ctx.score.map_or("-".to_string(), |s| format!("{s:.3}")),
            ctx.attempts,
            if ctx.retried.is_empty() { "-".to_string() } else { ctx.retried.join(",") },
            ctx.stream,
            ctx.body_bytes,
            ctx.error.unwrap_or("-"),
            ms,
        );
    }
}
