//! Active health checks: a pingora background service that probes every provider of
//! the live route table with `GET <health.path>` on its interval, using
//! pingora-load-balancing's `HttpHealthCheck` for the probe itself, and feeds the
//! results into each provider's [`ProviderHealth`](super::ProviderHealth).
//!
//! Reads the live providers (through [`Providers`], the runtime) on every tick, so providers added or removed by
//! a reload are picked up without restarting the service.

use super::ProviderHealth;
use crate::config::HealthConfig;
use crate::metrics::METRICS;
use async_trait::async_trait;
use pingora::lb::health_check::{HealthCheck, HttpHealthCheck};
use pingora::lb::Backend;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// How often the service looks for due probes.
const TICK: Duration = Duration::from_millis(100);

/// A provider as the health prober sees it.
#[derive(Clone)]
pub struct ProviderEntry {
    /// Name from the routing file.
    pub name: String,
    /// Resolved address.
    pub addr: SocketAddr,
    /// `Host` header value.
    pub host: String,
    /// Active health-check settings.
    pub health: HealthConfig,
    /// Where probe results go.
    pub state: Arc<ProviderHealth>,
}

impl PartialEq for ProviderEntry {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
            && self.addr == other.addr
            && self.host == other.host
            && self.health == other.health
            && Arc::ptr_eq(&self.state, &other.state)
    }
}

/// Where the prober reads the providers of the live configuration (the runtime's current
/// route table), on every tick.
pub trait Providers: Send + Sync + 'static {
    /// The providers of the live configuration.
    fn current(&self) -> Vec<ProviderEntry>;
}

/// The health-check background service.
pub struct HealthProber(pub Arc<dyn Providers>);

struct Probe {
    /// `None` when the entry's request could not be built: the provider is skipped
    /// (logged once per entry) rather than panicking the service, which would stop the
    /// health checks of every provider.
    check: Option<Arc<HttpHealthCheck>>,
    /// The provider entry the check was built for (rebuilt if a reload changed it).
    entry: ProviderEntry,
    next_due: Instant,
    /// The probe in flight, if any: the next one starts only after it ends, so results
    /// reach [`ProviderHealth::observe`](super::ProviderHealth::observe) one at a time and in
    /// order even when a probe (up to twice `timeout_ms`) outlasts `interval_ms`.
    running: Option<tokio::task::JoinHandle<()>>,
}

/// The probe of `entry`, or why its request cannot be built.
fn build_check(entry: &ProviderEntry) -> Result<HttpHealthCheck, pingora::BError> {
    let mut check = HttpHealthCheck::new(&entry.host, false);
    check.req = pingora::http::RequestHeader::build("GET", entry.health.path.as_bytes(), None)?;
    check.req.insert_header("host", entry.host.as_str())?;
    let timeout = Some(Duration::from_millis(entry.health.timeout_ms));
    check.peer_template.options.connection_timeout = timeout;
    check.peer_template.options.read_timeout = timeout;
    check.peer_template.options.write_timeout = timeout;
    Ok(check)
}

/// [`build_check`], logging a provider it cannot probe.
fn checked(entry: &ProviderEntry) -> Option<Arc<HttpHealthCheck>> {
    match build_check(entry) {
        Ok(check) => Some(Arc::new(check)),
        Err(e) => {
            log::warn!(
                "provider {}: health checks skipped: cannot build GET {:?}: {e}",
                entry.name,
                entry.health.path
            );
            None
        }
    }
}

#[async_trait]
impl BackgroundService for HealthProber {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut probes: HashMap<String, Probe> = HashMap::new();
        let mut ticker = tokio::time::interval(TICK);
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                _ = shutdown.changed() => return,
            }
            let providers = self.0.current();
            probes.retain(|name, _| providers.iter().any(|p| &p.name == name));
            let now = Instant::now();
            for entry in providers.iter().filter(|p| p.health.enabled) {
                let probe = probes.entry(entry.name.clone()).or_insert_with(|| Probe {
                    check: checked(entry),
                    entry: entry.clone(),
                    next_due: now,
                    running: None,
                });
                if probe.entry != *entry {
                    probe.check = checked(entry);
                    probe.entry = entry.clone();
                }
                let Some(check) = probe.check.clone() else {
                    continue;
                };
                if now < probe.next_due || probe.running.as_ref().is_some_and(|t| !t.is_finished())
                {
                    continue;
                }
                probe.next_due = now + Duration::from_millis(entry.health.interval_ms);
                let entry = entry.clone();
                let live = self.0.clone();
                probe.running = Some(tokio::spawn(async move {
                    let backend = Backend {
                        addr: pingora::protocols::l4::socket::SocketAddr::Inet(entry.addr),
                        weight: 1,
                        ext: Default::default(),
                    };
                    let limit = Duration::from_millis(entry.health.timeout_ms.saturating_mul(2));
                    let ok = matches!(
                        tokio::time::timeout(limit, check.check(&backend)).await,
                        Ok(Ok(()))
                    );
                    let h = &entry.state;
                    if h.observe(
                        ok,
                        entry.health.healthy_threshold,
                        entry.health.unhealthy_threshold,
                    ) {
                        log::warn!(
                            "provider {} is now {}",
                            entry.name,
                            if ok { "healthy" } else { "unhealthy" }
                        );
                    }
                    // Not for a provider a reload or discovery removed, or whose checks it
                    // switched off, while this probe ran: that would re-create the series
                    // the reload dropped (it drops them under this lock).
                    let _exporting = crate::metrics::EXPORT_LOCK.lock();
                    if live
                        .current()
                        .iter()
                        .any(|p| p.name == entry.name && p.health.enabled)
                    {
                        METRICS
                            .health_checks
                            .with_label_values(&[
                                entry.name.as_str(),
                                if ok { "ok" } else { "failed" },
                            ])
                            .inc();
                        METRICS
                            .provider_healthy
                            .with_label_values(&[&entry.name])
                            .set(i64::from(h.is_healthy()));
                    }
                }));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(path: &str) -> ProviderEntry {
        ProviderEntry {
            name: "probe-test".into(),
            addr: "127.0.0.1:9".parse().unwrap(),
            host: "127.0.0.1:9".into(),
            health: HealthConfig {
                path: path.into(),
                ..HealthConfig::default()
            },
            state: Default::default(),
        }
    }

    /// Regression: an unbuildable path panicked the service loop (`expect`), which
    /// stopped the health checks of every provider; now that one provider is skipped.
    #[test]
    fn unbuildable_health_path_skips_the_provider_instead_of_panicking() {
        assert!(checked(&entry("/health")).is_some());
        assert!(checked(&entry("/health check")).is_none());
        assert!(checked(&entry("/h\u{7}")).is_none());
    }
}
