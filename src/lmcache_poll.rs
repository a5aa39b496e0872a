//! LMCache status polling: one task per `[providers.lmcache]` endpoint reads
//! `GET endpoint` → `{"occupancy": 0..1, "cache_available": bool}` every `interval_ms`
//! and publishes the answer in that provider's [`LmcacheStatus`], which the request
//! path reads lock-free (one `ArcSwapOption` load) when it builds routing candidates.
//!
//! Owns: the poll itself ([`Poller`]) and the pingora background service that runs the polls
//! ([`LmcachePollService`]). The status cells ([`LmcacheStatus`], kept across reloads by
//! [`LmcacheBoard`]) live in `fleet::lmcache`. Must not: make routing decisions (`routing::lmcache` does,
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
//! every 250 ms, `runtime::generations`); the cells live in the [`LmcacheBoard`], so a reload
//! keeps the last answers of endpoints that still exist.
//!
//! The request itself is [`crate::http_get`] (pingora's HTTP/1 connector, plain `http://`
//! like `api_base`, a fresh connection each poll, so a re-pointed name takes effect on
//! the next poll and no pooled connection outlives an egress decision).

use crate::egress::{self, EgressPolicy, OutboundError, Resolver};
pub use crate::fleet::lmcache::{BoardKey, LmcacheBoard, LmcacheEndpoint, LmcacheStatus};
use crate::http_get::{self, Get};
use crate::metrics::METRICS;
pub use crate::routing::LmcacheView;
use crate::runtime::generations::run_per_table;
use crate::runtime::Runtime;
use async_trait::async_trait;
use bytes::Bytes;
use pingora::connectors::http::v1::Connector;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use serde::Deserialize;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

/// Largest status body accepted; the real one is ~50 bytes, anything this big is wrong.
pub const MAX_STATUS_BODY_BYTES: usize = 64 * 1024;

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

/// What one poll found.
pub type PollResult = http_get::PollResult<LmcacheView>;

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
        let req = Get {
            addr,
            authority: &ep.authority,
            path: &ep.path,
            accept: "application/json",
            timeout: ep.timeout,
            max_body_bytes: MAX_STATUS_BODY_BYTES,
        };
        http_get::get(&self.connector, &req)
            .await
            .map_err(PollResult::from)
    }
}

/// The background service running every endpoint's poll task (see the module docs).
pub struct LmcachePollService(pub Arc<Runtime>);

#[async_trait]
impl BackgroundService for LmcachePollService {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let poller = Arc::new(Poller::new(self.0.resolver()));
        run_per_table(&self.0, &mut shutdown, |table, tasks| {
            for ep in table.lmcache_endpoints() {
                let (poller, ep, policy) = (poller.clone(), ep.clone(), table.egress().clone());
                tasks.spawn(async move { poller.run(&ep, &policy).await });
            }
        })
        .await;
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
}
