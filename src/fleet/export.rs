//! Scrape-time export: mirrors the fleet's live state (sessions, KV-event streams, tries)
//! into the Prometheus registry when `/metrics` is read.
//!
//! Owns the mapping from fleet state to metric series. Must not: be called on the request
//! path (it takes [`EXPORT_LOCK`]) or change any state but the metric handles.

use super::{KvState, Registry};
use crate::metrics::{catch_up, export_trie, EXPORT_LOCK, KV_STREAM_KINDS, METRICS};

/// Mirror everything the registry holds into the metrics (`also` sets the caller's own
/// gauges under the same export lock) and render the exposition text.
pub fn scrape(registry: &Registry, also: impl FnOnce()) -> Vec<u8> {
    let _exporting = EXPORT_LOCK.lock();
    also();
    for (alias, sessions) in registry.session_tables() {
        METRICS
            .sessions
            .with_label_values(&[&alias])
            .set(sessions.len() as i64);
    }
    for (provider, kv) in registry.kv_states() {
        export_kv_stream(&provider, &kv);
    }
    for t in registry.targets() {
        export_trie(t.label(), t.trie.node_count(), t.trie.evictions());
    }
    crate::metrics::render()
}

/// Mirror a provider's KV-event stream state into the metrics (called at scrape time;
/// the stream's counters only grow, so the Prometheus counters catch up by the delta).
fn export_kv_stream(provider: &str, kv: &KvState) {
    use std::sync::atomic::Ordering::Relaxed;
    let st = &kv.stream;
    let m = &*METRICS;
    let values = [
        &st.batches,
        &st.events_stored,
        &st.events_removed,
        &st.events_cleared,
        &st.decode_errors,
        &st.gaps,
        &st.restarts,
        &st.replays_ok,
        &st.replays_failed,
        &st.rebuilds,
        &st.stale,
        &st.connects,
        &st.evictions,
        &st.protocol_errors,
        &st.disconnects,
    ];
    for (kind, value) in KV_STREAM_KINDS.iter().zip(values) {
        catch_up(
            &m.kv_stream.with_label_values(&[provider, kind]),
            value.load(Relaxed),
        );
    }
    m.kv_trusted
        .with_label_values(&[provider])
        .set(i64::from(st.is_trusted()));
    m.kv_connected
        .with_label_values(&[provider])
        .set(i64::from(st.is_connected()));
    m.kv_index_blocks
        .with_label_values(&[provider])
        .set(kv.index.block_count() as i64);
    m.kv_cache_learned_tokens
        .with_label_values(&[provider])
        .set(kv.index.capacity_tokens().unwrap_or(0) as i64);
}
