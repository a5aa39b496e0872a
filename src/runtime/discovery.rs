//! DNS discovery: every address a `discovery = "dns"` provider's name resolves to is a
//! target of its own, and the name is resolved again every `refresh_s` by
//! [`DiscoveryService`], off the request path (on a blocking thread), through the
//! injectable [`Resolver`] and the egress policy.
//!
//! A changed address set becomes a new route table through the same build-then-swap path
//! as a reload ([`Runtime::apply_discovered`]): addresses that appear get fresh (cold)
//! state; addresses that vanish leave the table, so requests in flight on them finish on
//! the old table (drain) and their state and metric series are dropped. A name that stops
//! resolving keeps its last good set ([`DnsBoard`]) and is counted
//! (`rolter_discovery_resolutions_total{result="failed"}`).
//!
//! Why in `runtime/` (DESIGN.md sketches discovery in `fleet/`): what discovery produces is
//! a route table, built and swapped by the runtime; `fleet` sits below `runtime` and must
//! not import it (tests/architecture.rs), so the service lives beside the SIGHUP reload
//! service it mirrors.
//!
//! Must not: resolve on the request path, or connect to an address the egress policy
//! denies (each address is checked; a denied one is left out and logged).

use super::Runtime;
use crate::egress::{self, EgressPolicy, OutboundError, Resolver};
use crate::metrics::METRICS;
use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// How often the service looks for providers due a resolution.
const TICK: Duration = Duration::from_millis(100);

/// A `discovery = "dns"` provider as a table was built with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiscoveredProvider {
    /// Provider name.
    pub name: String,
    /// The name resolved (`api_base`'s host).
    pub host: String,
    /// `api_base`'s port.
    pub port: u16,
    /// Time between two resolutions.
    pub refresh: Duration,
    /// The addresses (sorted), each one a target.
    pub addrs: Vec<IpAddr>,
}

/// One provider's last good set: the host and port it was resolved for, and the addresses.
type GoodSet = (String, u16, Vec<IpAddr>);

/// The last good address set of every DNS-discovered provider, kept across table
/// generations (not on the request path).
#[derive(Debug, Default)]
pub struct DnsBoard {
    sets: parking_lot::Mutex<HashMap<String, GoodSet>>,
}

impl DnsBoard {
    /// `provider`'s last good set, if it was for the same `host` and `port`.
    pub fn get(&self, provider: &str, host: &str, port: u16) -> Option<Vec<IpAddr>> {
        let sets = self.sets.lock();
        let (h, p, addrs) = sets.get(provider)?;
        (h == host && *p == port).then(|| addrs.clone())
    }

    /// Record `provider`'s current set.
    pub fn put(&self, provider: &str, host: &str, port: u16, addrs: &[IpAddr]) {
        self.sets.lock().insert(
            provider.to_string(),
            (host.to_string(), port, addrs.to_vec()),
        );
    }

    /// Forget providers not in `providers`.
    pub fn retain(&self, providers: &HashSet<&str>) {
        self.sets
            .lock()
            .retain(|p, _| providers.contains(p.as_str()));
    }
}

/// Resolve `host` and keep the addresses the egress policy allows, sorted. A denied name
/// (or a name whose every address is denied) is an egress error; no address at all is a
/// resolution error.
pub fn resolve(
    resolver: &dyn Resolver,
    policy: &EgressPolicy,
    host: &str,
    port: u16,
) -> Result<Vec<IpAddr>, OutboundError> {
    let found = egress::lookup_allowed_name(resolver, policy, host, port)?;
    let mut allowed = Vec::with_capacity(found.len());
    let mut denied = None;
    for ip in found {
        match policy.check_resolved(host, &[ip]) {
            Ok(()) => allowed.push(ip),
            Err(e) => {
                log::warn!("discovery: {host}: address {ip} left out: {e}");
                denied.get_or_insert(e);
            }
        }
    }
    if allowed.is_empty() {
        // Every address was denied (the lookup found at least one).
        return Err(match denied {
            Some(e) => OutboundError::Egress(e),
            None => OutboundError::Resolve {
                host: host.to_string(),
                reason: "no addresses".into(),
            },
        });
    }
    allowed.sort_unstable();
    allowed.dedup();
    Ok(allowed)
}

/// Background service re-resolving every `discovery = "dns"` provider of the live table.
pub struct DiscoveryService(pub Arc<Runtime>);

#[async_trait]
impl BackgroundService for DiscoveryService {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let runtime = &self.0;
        // Each provider's next resolution; a table's build has just resolved the names.
        let mut due: HashMap<String, Instant> = HashMap::new();
        loop {
            let table = runtime.table();
            let now = Instant::now();
            for d in table.discovered() {
                let next = due.entry(d.name.clone()).or_insert(now + d.refresh);
                if now < *next {
                    continue;
                }
                *next = now + d.refresh;
                let (resolver, policy) = (runtime.resolver(), table.egress().clone());
                let (host, port) = (d.host.clone(), d.port);
                // Resolvers may block (getaddrinfo): keep them off the async workers.
                let found = tokio::task::spawn_blocking(move || {
                    resolve(resolver.as_ref(), &policy, &host, port)
                })
                .await;
                let result = match found {
                    Ok(Ok(addrs)) if addrs == d.addrs => "unchanged",
                    Ok(Ok(addrs)) => {
                        let (runtime, found) = (runtime.clone(), d.clone());
                        let applied = tokio::task::spawn_blocking(move || {
                            runtime.apply_discovered(
                                &found.name,
                                &found.host,
                                found.port,
                                &found.addrs,
                                &addrs,
                            )
                        })
                        .await;
                        match applied {
                            Ok(Ok(true)) => "changed",
                            // A reload installed a newer set meanwhile.
                            Ok(Ok(false)) => "unchanged",
                            Ok(Err(e)) => {
                                log::error!(
                                    "discovery: {}: new addresses not applied: {e}",
                                    d.name
                                );
                                "failed"
                            }
                            Err(e) => {
                                log::error!("discovery: {}: rebuild aborted: {e}", d.name);
                                "failed"
                            }
                        }
                    }
                    Ok(Err(e)) => {
                        log::warn!(
                            "discovery: {}: cannot resolve {}: {e}; keeping the last {} address(es)",
                            d.name,
                            d.host,
                            d.addrs.len()
                        );
                        "failed"
                    }
                    Err(e) => {
                        log::error!("discovery: {}: resolution aborted: {e}", d.name);
                        "failed"
                    }
                };
                METRICS
                    .discovery
                    .with_label_values(&[&d.name, result])
                    .inc();
            }
            due.retain(|name, _| table.discovered().iter().any(|d| &d.name == name));
            drop(table);
            tokio::select! {
                _ = tokio::time::sleep(TICK) => {}
                _ = shutdown.changed() => return,
            }
        }
    }
}
