//! Per-target live state that outlives config reloads: in-flight counters (and, as they
//! land, health, cooldown, circuit state and prefix state), keyed by
//! (provider, upstream model).
//!
//! Owns: [`TargetState`], per-provider active health ([`ProviderHealth`]), the
//! [`Registry`] that hands out one state per key, and the RAII [`InflightGuard`].
//! Everything read on the request path is atomics — no locks. Must not: make routing
//! decisions (that is `routing`). The only I/O is the health prober in [`probe`].

pub mod breaker;
pub mod cache_size;
pub mod export;
pub mod idle;
pub mod lmcache;
pub mod probe;
pub mod recent;

use crate::metrics::METRICS;
use crate::prefix::StreamState;
use crate::prefix::{PendingBlocks, PrefixTrie, ResidencyIndex};
use crate::routing::SessionTable;
use breaker::Breaker;
use dashmap::DashMap;
use prometheus::IntGauge;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Instant;

static EPOCH: LazyLock<Instant> = LazyLock::new(Instant::now);

/// Milliseconds on the process's monotonic clock (the breakers' time base).
pub fn now_ms() -> u64 {
    ms_at(Instant::now())
}

/// [`now_ms`] of an instant already read (the request path reads the clock once per step
/// and derives both from it).
pub fn ms_at(at: Instant) -> u64 {
    at.saturating_duration_since(*EPOCH).as_millis() as u64
}

/// Active health of one provider (all its targets share it), fed by [`probe`].
/// New providers start healthy, like pingora-load-balancing's backends; so does a
/// provider whose health checks are switched off ([`set_enabled`](Self::set_enabled)).
#[derive(Debug)]
pub struct ProviderHealth {
    healthy: AtomicBool,
    /// Consecutive probe results that disagree with `healthy`.
    streak: AtomicU32,
    /// Whether active health checks are on; when off, probe results are ignored.
    enabled: AtomicBool,
}

impl Default for ProviderHealth {
    fn default() -> Self {
        ProviderHealth {
            healthy: AtomicBool::new(true),
            streak: AtomicU32::new(0),
            enabled: AtomicBool::new(true),
        }
    }
}

impl ProviderHealth {
    /// Whether the last probes say the provider is up.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Acquire)
    }

    /// Switch active health checks on or off (each table build applies the file's
    /// `health.enabled`). Switching off makes the provider healthy: nothing probes it
    /// any more, so a down verdict would otherwise hold forever. A probe still running
    /// when it was switched off cannot undo that ([`observe`](Self::observe) ignores it).
    pub fn set_enabled(&self, enabled: bool) {
        // SeqCst: ordered against `observe`'s flip (see there).
        self.enabled.store(enabled, Ordering::SeqCst);
        if !enabled {
            self.streak.store(0, Ordering::Release);
            self.healthy.store(true, Ordering::SeqCst);
        }
    }

    /// Whether active health checks are on.
    pub fn is_enabled(&self) -> bool {
        self.enabled.load(Ordering::Acquire)
    }

    /// Record one probe result; flips after `threshold` consecutive disagreeing results.
    /// Returns true if the health flipped. Ignored while checks are off.
    pub fn observe(&self, ok: bool, healthy_threshold: u32, unhealthy_threshold: u32) -> bool {
        if !self.is_enabled() {
            return false;
        }
        let healthy = self.is_healthy();
        if ok == healthy {
            self.streak.store(0, Ordering::Release);
            return false;
        }
        let threshold = if ok {
            healthy_threshold
        } else {
            unhealthy_threshold
        };
        if self.streak.fetch_add(1, Ordering::AcqRel) + 1 >= threshold {
            self.streak.store(0, Ordering::Release);
            // Checks may have been switched off since the check above, and `set_enabled`'s
            // "healthy" may already be stored: re-read `enabled` after this store
            // (SeqCst on both sides: either `set_enabled`'s stores come after this one, or
            // this re-read sees them off and restores "healthy").
            self.healthy.store(ok, Ordering::SeqCst);
            if !self.enabled.load(Ordering::SeqCst) {
                self.healthy.store(true, Ordering::SeqCst);
                return false;
            }
            return true;
        }
        false
    }
}

/// Identity of a target across reloads.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TargetKey {
    /// Provider name from the routing file.
    pub provider: String,
    /// Model name sent upstream.
    pub model: String,
}

impl TargetKey {
    /// `provider/model`, the label used in metrics and logs.
    pub fn label(&self) -> String {
        format!("{}/{}", self.provider, self.model)
    }
}

/// Live state of one target.
#[derive(Debug)]
pub struct TargetState {
    key: TargetKey,
    label: String,
    inflight: AtomicU64,
    inflight_gauge: IntGauge,
    /// Set once a reload or DNS discovery removed the target: requests still in flight
    /// on it must not re-create the metric series its removal dropped.
    retired: AtomicBool,
    /// This target's series of the upstream histograms, resolved once (a label lookup per
    /// request hashes the label and takes the vector's lock).
    ttfb: prometheus::Histogram,
    latency: prometheus::Histogram,
    health: Arc<ProviderHealth>,
    /// Passive health (cooldown, circuit).
    pub breaker: Breaker,
    /// Keys of the prompts this target has served (cache_aware / pipeline prefix state).
    pub trie: PrefixTrie,
    /// New work placed here recently (the placement rule's `share_bound`).
    pub placed: recent::RecentCount,
    /// The replica's KV-cache size in tokens as its own metrics report it (`cache_size_poll`
    /// writes it through the table's [`cache_size::CacheSizeEndpoint`]s), kept across
    /// reloads that keep the reads, like the trie it sizes.
    pub cache_size: cache_size::ReportedSize,
}

impl TargetState {
    fn new(key: TargetKey, health: Arc<ProviderHealth>) -> Self {
        let label = key.label();
        let inflight_gauge = METRICS.inflight.with_label_values(&[&label]);
        inflight_gauge.set(0);
        TargetState {
            ttfb: METRICS.upstream_ttfb.with_label_values(&[&label]),
            latency: METRICS.upstream_latency.with_label_values(&[&label]),
            key,
            label,
            inflight: AtomicU64::new(0),
            inflight_gauge,
            retired: AtomicBool::new(false),
            health,
            breaker: Breaker::default(),
            trie: PrefixTrie::default(),
            placed: recent::RecentCount::default(),
            cache_size: cache_size::ReportedSize::default(),
        }
    }

    /// The target's identity.
    pub fn key(&self) -> &TargetKey {
        &self.key
    }

    /// `provider/model`.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Record one answered exchange: time to the response header and to its last byte.
    pub fn observe_upstream(&self, ttfb: std::time::Duration, total: std::time::Duration) {
        self.ttfb.observe(ttfb.as_secs_f64());
        self.latency.observe(total.as_secs_f64());
    }

    /// Whether a reload or DNS discovery removed this target (its series are dropped).
    pub fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }

    /// The replica's KV-cache size in tokens as its metrics last reported it (0 = unread).
    pub fn reported_cache_tokens(&self) -> u64 {
        self.cache_size.tokens()
    }

    /// Requests in flight right now.
    pub fn inflight(&self) -> u64 {
        self.inflight.load(Ordering::Relaxed)
    }

    /// Whether the target may be chosen at `now_ms`: its provider passes health
    /// checks, it is not cooling down, and its circuit is closed or ready to probe.
    pub fn eligible(&self, now_ms: u64) -> bool {
        self.health.is_healthy() && self.breaker.eligible(now_ms)
    }

    /// The provider's active health.
    pub fn health(&self) -> &Arc<ProviderHealth> {
        &self.health
    }

    /// Count a request in flight until the returned guard drops.
    pub fn start_request(self: &Arc<Self>) -> InflightGuard {
        self.inflight.fetch_add(1, Ordering::Relaxed);
        self.inflight_gauge.inc();
        InflightGuard(self.clone(), AtomicBool::new(false))
    }
}

/// Holds one in-flight slot on a target; releases it on drop, whatever the outcome
/// (success, error, client disconnect, panic unwinding), or earlier through
/// [`release`](Self::release).
#[derive(Debug)]
pub struct InflightGuard(Arc<TargetState>, AtomicBool);

impl InflightGuard {
    /// The target this slot is on.
    pub fn target(&self) -> &Arc<TargetState> {
        &self.0
    }

    /// Give the slot back now (the upstream is done with the request); dropping the guard
    /// later releases nothing more. Idempotent.
    pub fn release(&self) {
        if !self.1.swap(true, Ordering::AcqRel) {
            self.0.inflight.fetch_sub(1, Ordering::Relaxed);
            self.0.inflight_gauge.dec();
        }
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.release();
    }
}

/// One [`TargetState`] per key for the life of the process; reloads look states up here
/// so a target that survives a reload keeps its counters and caches.
#[derive(Debug, Default)]
pub struct Registry {
    targets: DashMap<TargetKey, Arc<TargetState>>,
    providers: DashMap<String, Arc<ProviderHealth>>,
    sessions: DashMap<String, Arc<SessionTable>>,
    kv: DashMap<String, Arc<KvState>>,
}

/// A replica's KV-event state: the residency index its stream feeds and the stream's
/// health. Keyed by provider (one vLLM replica), shared by all its targets, kept
/// across reloads.
pub struct KvState {
    /// Blocks the replica reported resident.
    pub index: Arc<ResidencyIndex>,
    /// Sequence / staleness / counters of its stream.
    pub stream: Arc<StreamState>,
    /// Blocks routed there whose events have not arrived yet (precise routing).
    pub pending: PendingBlocks,
}

impl std::fmt::Debug for KvState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvState")
            .field("blocks", &self.index.block_count())
            .field("trusted", &self.stream.is_trusted())
            .finish()
    }
}

impl Registry {
    /// The state for `key`, created on first use.
    pub fn get_or_create(&self, key: &TargetKey) -> Arc<TargetState> {
        if let Some(t) = self.targets.get(key) {
            return t.clone();
        }
        let health = self.provider_health(&key.provider);
        self.targets
            .entry(key.clone())
            .or_insert_with(|| Arc::new(TargetState::new(key.clone(), health)))
            .clone()
    }

    /// The active-health record of a provider, created on first use.
    pub fn provider_health(&self, provider: &str) -> Arc<ProviderHealth> {
        if let Some(h) = self.providers.get(provider) {
            return h.clone();
        }
        self.providers
            .entry(provider.to_string())
            .or_default()
            .clone()
    }

    /// Forget targets not in `keep` and providers not in `providers` (after a reload
    /// removed them). States still held by in-flight requests live on until those finish.
    pub fn retain(
        &self,
        keep: &std::collections::HashSet<TargetKey>,
        providers: &std::collections::HashSet<String>,
    ) {
        self.targets.retain(|k, t| {
            let kept = keep.contains(k);
            if !kept {
                t.retired.store(true, Ordering::Release);
            }
            kept
        });
        self.providers.retain(|name, _| providers.contains(name));
    }

    /// Forget session tables of routes that no longer exist.
    pub fn retain_sessions(&self, aliases: &std::collections::HashSet<String>) {
        self.sessions.retain(|alias, _| aliases.contains(alias));
    }

    /// A route's session table (keyed by alias, so sessions survive reloads), with
    /// its settings updated to `ttl_s` / `cap`.
    pub fn session_table(&self, alias: &str, ttl_s: u64, cap: usize) -> Arc<SessionTable> {
        let table = self
            .sessions
            .entry(alias.to_string())
            .or_insert_with(|| Arc::new(SessionTable::new(ttl_s, cap)))
            .clone();
        table.configure(ttl_s, cap);
        table
    }

    /// A provider's KV-event state (kept across reloads, so its index survives), with
    /// its index capped at `max_blocks` (entries past a lowered cap are evicted now and
    /// counted as the stream's evictions).
    pub fn kv_state(&self, provider: &str, max_blocks: usize) -> Arc<KvState> {
        let state = self
            .kv
            .entry(provider.to_string())
            .or_insert_with(|| {
                Arc::new(KvState {
                    index: Arc::new(ResidencyIndex::new(max_blocks)),
                    stream: Arc::new(StreamState::new()),
                    pending: PendingBlocks::default(),
                })
            })
            .clone();
        let evicted = state.index.set_max_entries(max_blocks);
        StreamState::bump(&state.stream.evictions, evicted);
        state
    }

    /// Every provider's KV-event state.
    pub fn kv_states(&self) -> Vec<(String, Arc<KvState>)> {
        self.kv
            .iter()
            .map(|e| (e.key().clone(), e.value().clone()))
            .collect()
    }

    /// Forget KV state of providers that no longer have `[providers.kv_events]`.
    pub fn retain_kv(&self, providers: &std::collections::HashSet<String>) {
        self.kv.retain(|p, _| providers.contains(p));
    }

    /// The session table of the route `alias`, if it has one (never creates it).
    pub fn sessions_of(&self, alias: &str) -> Option<Arc<SessionTable>> {
        self.sessions.get(alias).map(|t| t.clone())
    }

    /// Every route's session table, by alias.
    pub fn session_tables(&self) -> Vec<(String, Arc<SessionTable>)> {
        self.sessions
            .iter()
            .map(|e| (e.key().clone(), e.value().clone()))
            .collect()
    }

    /// Every known target's state.
    pub fn targets(&self) -> Vec<Arc<TargetState>> {
        self.targets.iter().map(|e| e.value().clone()).collect()
    }

    /// Number of known targets.
    pub fn len(&self) -> usize {
        self.targets.len()
    }

    /// Whether no target is known.
    pub fn is_empty(&self) -> bool {
        self.targets.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disabling_health_checks_makes_a_down_provider_healthy_for_good() {
        let h = ProviderHealth::default();
        assert!(h.observe(false, 1, 1));
        assert!(!h.is_healthy());
        h.set_enabled(false);
        assert!(h.is_healthy());
        // A probe that was running when checks were switched off lands late.
        assert!(!h.observe(false, 1, 1));
        assert!(h.is_healthy());
        h.set_enabled(true);
        assert!(h.observe(false, 1, 1));
        assert!(!h.is_healthy());
    }

    #[test]
    fn guard_counts_and_releases() {
        let reg = Registry::default();
        let key = TargetKey {
            provider: "fleet-test".into(),
            model: "m".into(),
        };
        let t = reg.get_or_create(&key);
        let g1 = t.start_request();
        let g2 = t.start_request();
        assert_eq!(t.inflight(), 2);
        drop(g1);
        assert_eq!(t.inflight(), 1);
        // An early release counts once, however often it is called and then dropped.
        g2.release();
        g2.release();
        assert_eq!(t.inflight(), 0);
        drop(g2);
        assert_eq!(t.inflight(), 0);
        assert!(Arc::ptr_eq(&t, &reg.get_or_create(&key)));
    }
}
