//! The LMCache status cells: one controller's last good answer, shared lock-free by its
//! poller (the writer, `lmcache_poll`) and every route target on that provider (readers),
//! and the board that keeps them across reloads; plus the endpoint description a route
//! table binds to its cell.
//!
//! Owns the cells and their staleness rule. Must not: do I/O (polling is `lmcache_poll`'s)
//! or make routing decisions (`routing::lmcache` does, on the [`LmcacheView`] read here).

use crate::config::LmcacheConfig;
use crate::egress;
use crate::routing::LmcacheView;
use arc_swap::ArcSwapOption;
use dashmap::DashMap;
use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    pub(crate) host: String,
    pub(crate) port: u16,
    pub(crate) authority: String,
    pub(crate) path: String,
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

#[cfg(test)]
mod tests {
    use super::*;

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
