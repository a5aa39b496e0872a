//! Per-target live state that outlives config reloads: in-flight counters (and, as they
//! land, health, cooldown, circuit state and prefix state), keyed by
//! (provider, upstream model).
//!
//! Owns: [`TargetState`], the [`Registry`] that hands out one state per key, and the
//! RAII [`InflightGuard`]. Everything here is read on the request path, so it is atomics
//! only — no locks. Must not: make routing decisions (that is `routing`) or do I/O.

use crate::metrics::METRICS;
use dashmap::DashMap;
use prometheus::IntGauge;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

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
}

impl TargetState {
    fn new(key: TargetKey) -> Self {
        let label = key.label();
        let inflight_gauge = METRICS.inflight.with_label_values(&[&label]);
        inflight_gauge.set(0);
        TargetState {
            key,
            label,
            inflight: AtomicU64::new(0),
            inflight_gauge,
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

    /// Requests in flight right now.
    pub fn inflight(&self) -> u64 {
        self.inflight.load(Ordering::Relaxed)
    }

    /// Whether the target may be chosen now.
    pub fn eligible(&self) -> bool {
        true
    }

    /// Count a request in flight until the returned guard drops.
    pub fn start_request(self: &Arc<Self>) -> InflightGuard {
        self.inflight.fetch_add(1, Ordering::Relaxed);
        self.inflight_gauge.inc();
        InflightGuard(self.clone())
    }
}

/// Holds one in-flight slot on a target; releases it on drop, whatever the outcome
/// (success, error, client disconnect, panic unwinding).
#[derive(Debug)]
pub struct InflightGuard(Arc<TargetState>);

impl InflightGuard {
    /// The target this slot is on.
    pub fn target(&self) -> &Arc<TargetState> {
        &self.0
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::Relaxed);
        self.0.inflight_gauge.dec();
    }
}

/// One [`TargetState`] per key for the life of the process; reloads look states up here
/// so a target that survives a reload keeps its counters and caches.
#[derive(Debug, Default)]
pub struct Registry {
    targets: DashMap<TargetKey, Arc<TargetState>>,
}

impl Registry {
    /// The state for `key`, created on first use.
    pub fn get_or_create(&self, key: &TargetKey) -> Arc<TargetState> {
        if let Some(t) = self.targets.get(key) {
            return t.clone();
        }
        self.targets
            .entry(key.clone())
            .or_insert_with(|| Arc::new(TargetState::new(key.clone())))
            .clone()
    }

    /// Forget targets not in `keep` (after a reload removed them). States still held by
    /// in-flight requests live on until those finish.
    pub fn retain(&self, keep: &std::collections::HashSet<TargetKey>) {
        self.targets.retain(|k, _| keep.contains(k));
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
        drop(g2);
        assert_eq!(t.inflight(), 0);
        assert!(Arc::ptr_eq(&t, &reg.get_or_create(&key)));
    }
}
