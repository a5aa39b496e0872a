//! The Prometheus metrics rolter exports, as typed handles in one registry (the
//! `prometheus` crate's default registry, which pingora's own metrics also use).
//!
//! Owns: metric names, help texts and label sets. Must not: decide anything; callers
//! record outcomes here. Hot-path users keep pre-resolved handles (see `fleet`).

use prometheus::{
    exponential_buckets, register_histogram_vec, register_int_counter_vec, register_int_gauge,
    register_int_gauge_vec, Encoder, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec,
    TextEncoder,
};
use std::sync::LazyLock;

/// All of rolter's metric handles.
pub struct Metrics {
    /// Requests answered, by route alias, target and HTTP status.
    pub requests: IntCounterVec,
    /// Requests rejected or failed before/while proxying, by kind.
    pub errors: IntCounterVec,
    /// Requests in flight per target.
    pub inflight: IntGaugeVec,
    /// Requests admitted by the global cap (`limits.max_inflight`), refreshed at scrape time.
    pub admitted: IntGauge,
    /// Total upstream latency (selection to last byte) per target.
    pub upstream_latency: HistogramVec,
    /// Time to the upstream's response header per target.
    pub upstream_ttfb: HistogramVec,
    /// Routing decisions by strategy and reason.
    pub decisions: IntCounterVec,
    /// Routing file reloads by result (ok / failed).
    pub reloads: IntCounterVec,
    /// Upstream connections by whether they came from the pool (reused=true/false).
    pub upstream_connections: IntCounterVec,
    /// Active health probes by provider and result.
    pub health_checks: IntCounterVec,
    /// 1 if a provider passes its health checks, else 0.
    pub provider_healthy: IntGaugeVec,
    /// Passive-health events per target: cooldown, circuit_open, circuit_close.
    pub breaker_events: IntCounterVec,
    /// Prefix match score of routed requests, by strategy.
    pub prefix_score: HistogramVec,
    /// Prefix trie nodes per target (refreshed at scrape time).
    pub trie_nodes: IntGaugeVec,
    /// Prompts evicted from a target's trie by its node cap (refreshed at scrape time).
    pub trie_evictions: IntGaugeVec,
    /// Sessions in a route's affinity table (refreshed at scrape time).
    pub sessions: IntGaugeVec,
    /// KV-event stream counters per provider and kind (batches, events by type, decode
    /// errors, gaps, restarts, replays, staleness, ...), mirrored at scrape time.
    pub kv_stream: IntCounterVec,
    /// 1 if a provider's KV-event index is trusted (in sequence, fresh), else 0.
    pub kv_trusted: IntGaugeVec,
    /// 1 if a provider's KV-event socket is up, else 0.
    pub kv_connected: IntGaugeVec,
    /// GPU-resident blocks in a provider's residency index.
    pub kv_index_blocks: IntGaugeVec,
    /// LMCache status polls by provider and result (ok, error, invalid, timeout, denied).
    pub lmcache_polls: IntCounterVec,
}

/// The process-wide metrics.
pub static METRICS: LazyLock<Metrics> = LazyLock::new(|| Metrics {
    requests: register_int_counter_vec!(
        "rolter_requests_total",
        "Requests answered, by route alias, target and HTTP status",
        &["route", "target", "status"]
    )
    .expect("register rolter_requests_total"),
    errors: register_int_counter_vec!(
        "rolter_request_errors_total",
        "Requests that ended in an error, by kind",
        &["kind"]
    )
    .expect("register rolter_request_errors_total"),
    inflight: register_int_gauge_vec!(
        "rolter_inflight_requests",
        "Requests in flight per target (selection until the response ends)",
        &["target"]
    )
    .expect("register rolter_inflight_requests"),
    admitted: register_int_gauge!(
        "rolter_admitted_requests",
        "Requests being proxied now, counted against limits.max_inflight"
    )
    .expect("register rolter_admitted_requests"),
    upstream_latency: register_histogram_vec!(
        "rolter_upstream_latency_seconds",
        "Upstream latency from target selection to the last response byte",
        &["target"],
        exponential_buckets(0.001, 2.0, 20).expect("buckets")
    )
    .expect("register rolter_upstream_latency_seconds"),
    upstream_ttfb: register_histogram_vec!(
        "rolter_upstream_ttfb_seconds",
        "Time from target selection to the upstream response header",
        &["target"],
        exponential_buckets(0.0005, 2.0, 20).expect("buckets")
    )
    .expect("register rolter_upstream_ttfb_seconds"),
    decisions: register_int_counter_vec!(
        "rolter_routing_decisions_total",
        "Routing decisions by strategy and reason",
        &["strategy", "reason"]
    )
    .expect("register rolter_routing_decisions_total"),
    reloads: register_int_counter_vec!(
        "rolter_config_reloads_total",
        "Routing file reloads by result",
        &["result"]
    )
    .expect("register rolter_config_reloads_total"),
    upstream_connections: register_int_counter_vec!(
        "rolter_upstream_connections_total",
        "Upstream HTTP sessions by whether the connection was reused from the pool",
        &["reused"]
    )
    .expect("register rolter_upstream_connections_total"),
    health_checks: register_int_counter_vec!(
        "rolter_health_checks_total",
        "Active health probes by provider and result",
        &["provider", "result"]
    )
    .expect("register rolter_health_checks_total"),
    provider_healthy: register_int_gauge_vec!(
        "rolter_provider_healthy",
        "1 if the provider passes its active health checks, else 0",
        &["provider"]
    )
    .expect("register rolter_provider_healthy"),
    breaker_events: register_int_counter_vec!(
        "rolter_breaker_events_total",
        "Passive-health transitions per target (cooldown, circuit_open, circuit_close)",
        &["target", "event"]
    )
    .expect("register rolter_breaker_events_total"),
    prefix_score: register_histogram_vec!(
        "rolter_prefix_match_score",
        "Best prefix match score (0..1) of routed requests, by strategy",
        &["strategy"],
        vec![0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0]
    )
    .expect("register rolter_prefix_match_score"),
    trie_nodes: register_int_gauge_vec!(
        "rolter_trie_nodes",
        "Nodes in a target's prefix trie",
        &["target"]
    )
    .expect("register rolter_trie_nodes"),
    trie_evictions: register_int_gauge_vec!(
        "rolter_trie_evictions",
        "Prompts evicted from a target's prefix trie by its node cap (cumulative)",
        &["target"]
    )
    .expect("register rolter_trie_evictions"),
    sessions: register_int_gauge_vec!(
        "rolter_sessions",
        "Sessions in a route's affinity table",
        &["route"]
    )
    .expect("register rolter_sessions"),
    kv_stream: register_int_counter_vec!(
        "rolter_kv_stream_total",
        "KV-event stream counters by provider and kind",
        &["provider", "kind"]
    )
    .expect("register rolter_kv_stream_total"),
    kv_trusted: register_int_gauge_vec!(
        "rolter_kv_stream_trusted",
        "1 if the provider's KV-event residency index is trusted (in sequence, fresh)",
        &["provider"]
    )
    .expect("register rolter_kv_stream_trusted"),
    kv_connected: register_int_gauge_vec!(
        "rolter_kv_stream_connected",
        "1 if the provider's KV-event socket is up",
        &["provider"]
    )
    .expect("register rolter_kv_stream_connected"),
    kv_index_blocks: register_int_gauge_vec!(
        "rolter_kv_index_blocks",
        "GPU-resident blocks in the provider's residency index",
        &["provider"]
    )
    .expect("register rolter_kv_index_blocks"),
    lmcache_polls: register_int_counter_vec!(
        "rolter_lmcache_polls_total",
        "LMCache status polls by provider and result (ok, error, invalid, timeout, denied)",
        &["provider", "result"]
    )
    .expect("register rolter_lmcache_polls_total"),
});

/// Mirror a provider's KV-event stream state into the metrics (called at scrape time;
/// the stream's counters only grow, so the Prometheus counters catch up by the delta).
pub fn export_kv_stream(provider: &str, kv: &crate::fleet::KvState) {
    use std::sync::atomic::Ordering::Relaxed;
    let st = &kv.stream;
    let m = &*METRICS;
    for (kind, value) in [
        ("batches", &st.batches),
        ("block_stored", &st.events_stored),
        ("block_removed", &st.events_removed),
        ("all_blocks_cleared", &st.events_cleared),
        ("decode_errors", &st.decode_errors),
        ("gaps", &st.gaps),
        ("restarts", &st.restarts),
        ("replays_ok", &st.replays_ok),
        ("replays_failed", &st.replays_failed),
        ("rebuilds", &st.rebuilds),
        ("stale", &st.stale),
        ("connects", &st.connects),
        ("evictions", &st.evictions),
    ] {
        let c = m.kv_stream.with_label_values(&[provider, kind]);
        let delta = value.load(Relaxed).saturating_sub(c.get());
        if delta > 0 {
            c.inc_by(delta);
        }
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
}

/// Render every registered metric in the Prometheus text format.
pub fn render() -> Vec<u8> {
    let families = prometheus::gather();
    let mut out = Vec::with_capacity(16 * 1024);
    TextEncoder::new()
        .encode(&families, &mut out)
        .expect("text encoding to a Vec cannot fail");
    out
}
