//! LMCache status polling: one task per `[providers.lmcache]` endpoint reads
//! `GET endpoint` → `{"occupancy": 0..1, "cache_available": bool}` every `interval_ms`
//! and publishes the answer in that provider's [`LmcacheStatus`], which the request
//! path reads lock-free (one `ArcSwapOption` load) when it builds routing candidates.
//!
//! Owns: the status cells ([`LmcacheStatus`], kept across reloads by [`LmcacheBoard`]),
//! the poll itself ([`Poller`]) and the pingora background service that runs the polls
//! ([`LmcachePollService`]). Must not: make routing decisions (`routing::lmcache` does,
//! on the [`LmcacheView`] published here) or touch the request path beyond the cell.
//!
//! ## A poll, and when a controller is neutral
//! Every poll re-resolves the endpoint's host through the injectable [`Resolver`] and
//! re-checks the name and **every** resolved address against the current egress policy
//! ([`egress::resolve_checked`]); a denied destination is not contacted, the poll is
//! counted as `denied` and the controller turns neutral. Resolution, connect, request
//! and body together are bounded by `timeout_ms`. Any failure — denied, unresolvable,
//! refused, non-2xx, larger than [`MAX_STATUS_BODY_BYTES`], not the JSON shape, an
//! occupancy outside `[0, 1]`, slower than the timeout — clears the cell at once, so the
//! controller is neutral from that moment; a good answer older than `stale_after_ms` is
//! neutral too (checked by the reader, so a stuck poller cannot keep a value alive).
//! Neutral is `None` in [`crate::routing::Candidate::lmcache`].
//!
//! ## One service for all endpoints
//! Pingora fixes its background services at startup, but SIGHUP may add, remove or
//! change `[providers.lmcache]` sections. So one service runs one task per endpoint of
//! the *current* route table and restarts the set when the table is swapped (checked
//! every [`RECONCILE_INTERVAL`]); the cells live in the [`LmcacheBoard`], so a reload
//! keeps the last answers of endpoints that still exist.
//!
//! HTTP goes through pingora-core's HTTP/1 connector, the one the proxy already uses:
//! no second HTTP stack in the binary, and plain `http://` like `api_base`. Each poll
//! uses a fresh connection (`connection: close`), so a re-pointed name takes effect on
//! the next poll and no pooled connection outlives an egress decision.

use crate::config::LmcacheConfig;
use crate::egress::{self, EgressError, EgressPolicy, OutboundError, Resolver};
use crate::metrics::METRICS;
pub use crate::routing::LmcacheView;
use crate::runtime::{RouteTable, Runtime};
use arc_swap::ArcSwapOption;
use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use dashmap::DashMap;
use pingora::connectors::http::v1::Connector;
use pingora::http::RequestHeader;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use pingora::upstreams::peer::HttpPeer;
use serde::Deserialize;
use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// Largest status body accepted; the real one is ~50 bytes, anything this big is wrong.
pub const MAX_STATUS_BODY_BYTES: usize = 64 * 1024;
/// How often the service checks whether a reload swapped the route table.
pub const RECONCILE_INTERVAL: Duration = Duration::from_millis(250);

/// The wire shape of a status answer (unknown fields are ignored).
#[derive(Debug, Deserialize)]
struct StatusBody {
    occupancy: f64,
    cache_available: bool,
}

/// Parse and range-check a status body.
pub fn parse_status(body: &[u8]) -> Result<LmcacheView, String> {
    let s: StatusBody = serde_json::from_slice(body)
        .map_err(|e| format!("not {{\"occupancy\": 0..1, \"cache_available\": bool}}: {e}"))?;
    if !(0.0..=1.0).contains(&s.occupancy) {
        return Err(format!("occupancy {} is outside [0, 1]", s.occupancy));
    }
    Ok(LmcacheView {
        occupancy: s.occupancy,
        cache_available: s.cache_available,
    })
}

/// A good answer and when it arrived.
#[derive(Debug, Clone, Copy)]
struct Sample {
    view: LmcacheView,
    at: Instant,
}

/// One controller's last good answer, shared by the poller (writer) and every route
/// target on that provider (readers). Lock-free on both sides.
#[derive(Debug)]
pub struct LmcacheStatus {
    sample: ArcSwapOption<Sample>,
    stale_after_ms: AtomicU64,
}

impl LmcacheStatus {
    /// An empty (neutral) cell whose answers go stale after `stale_after`.
    pub fn new(stale_after: Duration) -> Self {
        LmcacheStatus {
            sample: ArcSwapOption::empty(),
            stale_after_ms: AtomicU64::new(stale_after.as_millis() as u64),
        }
    }

    /// The answer as routing should see it at `now`: `None` (neutral) if there is none
    /// or it is older than the staleness limit.
    pub fn view(&self, now: Instant) -> Option<LmcacheView> {
        let guard = self.sample.load();
        let sample = guard.as_deref()?;
        let limit = Duration::from_millis(self.stale_after_ms.load(Ordering::Relaxed));
        (now.saturating_duration_since(sample.at) <= limit).then_some(sample.view)
    }

    /// Publish a good answer received at `at`.
    pub fn record(&self, view: LmcacheView, at: Instant) {
        self.sample.store(Some(Arc::new(Sample { view, at })));
    }

    /// Forget the last answer (the controller is neutral from now on).
    pub fn clear(&self) {
        self.sample.store(None);
    }

    fn set_stale_after(&self, stale_after: Duration) {
        self.stale_after_ms
            .store(stale_after.as_millis() as u64, Ordering::Relaxed);
    }
}

/// Identity of a status cell across reloads: (provider, endpoint URL).
pub type BoardKey = (String, String);

/// One [`LmcacheStatus`] per (provider, endpoint) for the life of the process, so a
/// reload keeps the last answers of endpoints it did not change.
#[derive(Debug, Default)]
pub struct LmcacheBoard {
    cells: DashMap<BoardKey, Arc<LmcacheStatus>>,
}

impl LmcacheBoard {
    /// The cell for (`provider`, `endpoint`), created on first use; `stale_after` is
    /// (re)applied either way.
    pub fn get_or_create(
        &self,
        provider: &str,
        endpoint: &str,
        stale_after: Duration,
    ) -> Arc<LmcacheStatus> {
        let cell = self
            .cells
            .entry((provider.to_string(), endpoint.to_string()))
            .or_insert_with(|| Arc::new(LmcacheStatus::new(stale_after)))
            .clone();
        cell.set_stale_after(stale_after);
        cell
    }

    /// Forget cells not in `keep` (after a reload removed their sections).
    pub fn retain(&self, keep: &HashSet<BoardKey>) {
        self.cells.retain(|k, _| keep.contains(k));
    }

    /// Number of cells.
    pub fn len(&self) -> usize {
        self.cells.len()
    }

    /// Whether there are no cells.
    pub fn is_empty(&self) -> bool {
        self.cells.is_empty()
    }
}

/// One `[providers.lmcache]` section, parsed and bound to its status cell.
#[derive(Debug)]
pub struct LmcacheEndpoint {
    /// Provider name (metric label).
    pub provider: String,
    /// The configured URL.
    pub url: String,
    host: String,
    port: u16,
    authority: String,
    path: String,
    /// Time between polls.
    pub interval: Duration,
    /// Limit on one poll.
    pub timeout: Duration,
    /// Where answers are published.
    pub status: Arc<LmcacheStatus>,
}

impl LmcacheEndpoint {
    /// Bind a validated section to `status`.
    pub fn new(
        provider: &str,
        config: &LmcacheConfig,
        status: Arc<LmcacheStatus>,
    ) -> Result<Self, String> {
        let uri: http::Uri = config.endpoint.parse().map_err(|e| format!("{e}"))?;
        let authority = uri.authority().ok_or("missing host")?;
        let (host, port) = egress::url_host_port(&config.endpoint, 80).ok_or("missing host")?;
        Ok(LmcacheEndpoint {
            provider: provider.to_string(),
            url: config.endpoint.clone(),
            host,
            port,
            authority: authority.to_string(),
            path: uri
                .path_and_query()
                .map_or("/".to_string(), |pq| pq.as_str().to_string()),
            interval: Duration::from_millis(config.interval_ms),
            timeout: Duration::from_millis(config.timeout_ms),
            status,
        })
    }

    /// The host name (or literal address) polled.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The port polled.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The cell's identity in the [`LmcacheBoard`].
    pub fn key(&self) -> BoardKey {
        (self.provider.clone(), self.url.clone())
    }
}

/// What one poll found.
#[derive(Debug, Clone, PartialEq)]
pub enum PollResult {
    /// A well-formed answer.
    Ok(LmcacheView),
    /// Unresolvable, unreachable, broken connection or non-2xx.
    Error(String),
    /// Answered, but not the status shape or out of range.
    Invalid(String),
    /// Slower than `timeout_ms`.
    Timeout,
    /// The name or one of its addresses is denied by the egress policy: not contacted.
    Denied(EgressError),
}

impl PollResult {
    /// Metric label: ok, error, invalid, timeout, denied.
    pub fn label(&self) -> &'static str {
        match self {
            PollResult::Ok(_) => "ok",
            PollResult::Error(_) => "error",
            PollResult::Invalid(_) => "invalid",
            PollResult::Timeout => "timeout",
            PollResult::Denied(_) => "denied",
        }
    }
}

impl std::fmt::Display for PollResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PollResult::Ok(v) => write!(
                f,
                "ok: occupancy {} cache_available {}",
                v.occupancy, v.cache_available
            ),
            PollResult::Error(why) => write!(f, "error: {why}"),
            PollResult::Invalid(why) => write!(f, "invalid answer: {why}"),
            PollResult::Timeout => write!(f, "timed out"),
            PollResult::Denied(e) => write!(f, "not polled: {e}"),
        }
    }
}

/// Polls status endpoints: resolver + egress check + one HTTP GET.
pub struct Poller {
    connector: Connector,
    resolver: Arc<dyn Resolver>,
}

impl Poller {
    /// A poller resolving names with `resolver`.
    pub fn new(resolver: Arc<dyn Resolver>) -> Self {
        Poller {
            connector: Connector::new(None),
            resolver,
        }
    }

    /// One poll of `ep` under `policy`, bounded by `ep.timeout`; publishes nothing.
    pub async fn poll_once(&self, ep: &LmcacheEndpoint, policy: &Arc<EgressPolicy>) -> PollResult {
        tokio::time::timeout(ep.timeout, self.attempt(ep, policy))
            .await
            .unwrap_or(PollResult::Timeout)
    }

    /// One poll, published to `ep.status` (a failure clears it) and counted in metrics.
    pub async fn refresh(&self, ep: &LmcacheEndpoint, policy: &Arc<EgressPolicy>) -> PollResult {
        let result = self.poll_once(ep, policy).await;
        match &result {
            PollResult::Ok(view) => ep.status.record(*view, Instant::now()),
            _ => ep.status.clear(),
        }
        METRICS
            .lmcache_polls
            .with_label_values(&[&ep.provider, result.label()])
            .inc();
        result
    }

    /// Poll `ep` every `ep.interval` until cancelled; logs when the outcome changes kind.
    pub async fn run(&self, ep: &LmcacheEndpoint, policy: &Arc<EgressPolicy>) {
        let mut ticks = tokio::time::interval(ep.interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last = "";
        loop {
            ticks.tick().await;
            let result = self.refresh(ep, policy).await;
            if result.label() != last {
                match &result {
                    PollResult::Ok(_) => {
                        log::info!("lmcache status of {} ({}): {result}", ep.provider, ep.url)
                    }
                    _ => log::warn!(
                        "lmcache status of {} ({}) is neutral: {result}",
                        ep.provider,
                        ep.url
                    ),
                }
                last = result.label();
            }
        }
    }

    async fn attempt(&self, ep: &LmcacheEndpoint, policy: &Arc<EgressPolicy>) -> PollResult {
        let (resolver, policy, host, port) = (
            self.resolver.clone(),
            policy.clone(),
            ep.host.clone(),
            ep.port,
        );
        // Resolvers may block (getaddrinfo): keep them off the async workers.
        let resolved = tokio::task::spawn_blocking(move || {
            egress::resolve_checked(resolver.as_ref(), &policy, &host, port)
        })
        .await;
        let addrs = match resolved {
            Ok(Ok(addrs)) => addrs,
            Ok(Err(OutboundError::Egress(e))) => return PollResult::Denied(e),
            Ok(Err(e)) => return PollResult::Error(e.to_string()),
            Err(e) => return PollResult::Error(format!("resolver task failed: {e}")),
        };
        let addr = SocketAddr::new(addrs[0], ep.port);
        match self.fetch(addr, ep).await {
            Ok(body) => match parse_status(&body) {
                Ok(view) => PollResult::Ok(view),
                Err(why) => PollResult::Invalid(why),
            },
            Err(result) => result,
        }
    }

    async fn fetch(&self, addr: SocketAddr, ep: &LmcacheEndpoint) -> Result<Bytes, PollResult> {
        let failed = |e: Box<pingora::Error>| {
            use pingora::ErrorType::*;
            match e.etype() {
                ConnectTimedout | ReadTimedout | WriteTimedout => PollResult::Timeout,
                _ => PollResult::Error(format!("{addr}: {e}")),
            }
        };
        let mut peer = HttpPeer::new(addr, false, String::new());
        peer.options.connection_timeout = Some(ep.timeout);
        peer.options.read_timeout = Some(ep.timeout);
        peer.options.write_timeout = Some(ep.timeout);
        let (mut http, _) = self
            .connector
            .get_http_session(&peer)
            .await
            .map_err(failed)?;
        http.read_timeout = Some(ep.timeout);
        http.write_timeout = Some(ep.timeout);
        let mut req =
            RequestHeader::build(http::Method::GET, ep.path.as_bytes(), Some(3)).map_err(failed)?;
        req.insert_header(http::header::HOST, &ep.authority)
            .map_err(failed)?;
        req.insert_header(http::header::ACCEPT, "application/json")
            .map_err(failed)?;
        req.insert_header(http::header::CONNECTION, "close")
            .map_err(failed)?;
        http.write_request_header(Box::new(req))
            .await
            .map_err(failed)?;
        http.finish_body().await.map_err(failed)?;
        http.read_response().await.map_err(failed)?;
        let status = http.get_status().map_or(0, |s| s.as_u16());
        if !(200..300).contains(&status) {
            return Err(PollResult::Error(format!("HTTP {status}")));
        }
        let mut body = BytesMut::new();
        while !http.is_body_done() {
            match http.read_body_bytes().await.map_err(failed)? {
                Some(chunk) => body.extend_from_slice(&chunk),
                None => break,
            }
            if body.len() > MAX_STATUS_BODY_BYTES {
                return Err(PollResult::Invalid(format!(
                    "body larger than {MAX_STATUS_BODY_BYTES} bytes"
                )));
            }
        }
        Ok(body.freeze())
    }
}

/// The background service running every endpoint's poll task (see the module docs).
pub struct LmcachePollService(pub Arc<Runtime>);

#[async_trait]
impl BackgroundService for LmcachePollService {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let poller = Arc::new(Poller::new(self.0.resolver()));
        let mut tasks = tokio::task::JoinSet::new();
        let mut current: Weak<RouteTable> = Weak::new();
        loop {
            let table = self.0.table();
            if !std::ptr::eq(current.as_ptr(), Arc::as_ptr(&table)) {
                // Stop the old generation's polls (abort, and wait until they are gone).
                tasks.shutdown().await;
                for ep in table.lmcache_endpoints() {
                    let (poller, ep, policy) = (poller.clone(), ep.clone(), table.egress().clone());
                    tasks.spawn(async move { poller.run(&ep, &policy).await });
                }
                current = Arc::downgrade(&table);
            }
            drop(table);
            tokio::select! {
                _ = tokio::time::sleep(RECONCILE_INTERVAL) => {}
                _ = shutdown.changed() => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_bodies_are_parsed_and_range_checked() {
        assert_eq!(
            parse_status(br#"{"occupancy": 0.25, "cache_available": true, "extra": 1}"#),
            Ok(LmcacheView {
                occupancy: 0.25,
                cache_available: true
            })
        );
        assert!(parse_status(br#"{"occupancy": 0, "cache_available": false}"#).is_ok());
        assert!(parse_status(br#"{"occupancy": 1, "cache_available": true}"#).is_ok());
        for bad in [
            &br#"{"occupancy": 1.5, "cache_available": true}"#[..],
            br#"{"occupancy": -0.1, "cache_available": true}"#,
            br#"{"occupancy": "0.5", "cache_available": true}"#,
            br#"{"occupancy": 0.5}"#,
            br#"{"occupancy": 0.5, "cache_available": 1}"#,
            b"<html>oops</html>",
            b"",
        ] {
            assert!(
                parse_status(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn a_status_goes_neutral_when_stale_or_cleared() {
        let cell = LmcacheStatus::new(Duration::from_millis(100));
        let t0 = Instant::now();
        assert_eq!(cell.view(t0), None, "nothing yet");
        let v = LmcacheView {
            occupancy: 0.5,
            cache_available: true,
        };
        cell.record(v, t0);
        assert_eq!(cell.view(t0), Some(v));
        assert_eq!(cell.view(t0 + Duration::from_millis(100)), Some(v));
        assert_eq!(cell.view(t0 + Duration::from_millis(101)), None, "stale");
        cell.record(v, t0);
        cell.clear();
        assert_eq!(cell.view(t0), None, "cleared by a failed poll");
    }

    #[test]
    fn the_board_keeps_cells_across_lookups_and_retains() {
        let board = LmcacheBoard::default();
        let a = board.get_or_create("p", "http://h/s", Duration::from_secs(1));
        let b = board.get_or_create("p", "http://h/s", Duration::from_millis(10));
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(a.stale_after_ms.load(Ordering::Relaxed), 10, "re-applied");
        let c = board.get_or_create("p", "http://h/other", Duration::from_secs(1));
        assert!(!Arc::ptr_eq(&a, &c), "a changed endpoint starts neutral");
        board.retain(&HashSet::from([(
            "p".to_string(),
            "http://h/other".to_string(),
        )]));
        assert_eq!(board.len(), 1);
    }

    #[test]
    fn endpoints_parse_host_port_and_path() {
        let config = LmcacheConfig {
            endpoint: "http://status.test:9000/cache/status?x=1".into(),
            interval_ms: 100,
            timeout_ms: 50,
            stale_after_ms: 300,
        };
        let cell = Arc::new(LmcacheStatus::new(Duration::from_millis(300)));
        let ep = LmcacheEndpoint::new("p", &config, cell).unwrap();
        assert_eq!((ep.host(), ep.port()), ("status.test", 9000));
        assert_eq!(ep.path, "/cache/status?x=1");
        assert_eq!(ep.authority, "status.test:9000");
        let config = LmcacheConfig {
            endpoint: "http://[::1]".into(),
            ..config
        };
        let ep = LmcacheEndpoint::new("p", &config, Arc::new(LmcacheStatus::new(Duration::ZERO)))
            .unwrap();
        assert_eq!((ep.host(), ep.port(), ep.path.as_str()), ("::1", 80, "/"));
    }
}
