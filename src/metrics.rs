//! The Prometheus metrics rolter exports, as typed handles in one registry (the
//! `prometheus` crate's default registry, which pingora's own metrics also use).
//!
//! Owns: metric names, help texts and label sets. Must not: decide anything; callers
//! record outcomes here. Hot-path users keep pre-resolved handles (see `fleet`).

use prometheus::{
    exponential_buckets, register_histogram_vec, register_int_counter, register_int_counter_vec,
    register_int_gauge, register_int_gauge_vec, Encoder, HistogramVec, IntCounterVec, IntGauge,
    IntGaugeVec, TextEncoder,
};
use prometheus::{Histogram, IntCounter};
use std::sync::{LazyLock, OnceLock};

/// All of rolter's metric handles.
pub struct Metrics {
    /// Requests answered, by route alias, target and HTTP status.
    pub requests: IntCounterVec,
    /// Requests by API endpoint (`prompt::Endpoint::label`, or a local one) and status.
    pub endpoint_requests: IntCounterVec,
    /// Responses API ids remembered (refreshed at scrape time).
    pub response_ids: IntGauge,
    /// Requests rejected or failed before/while proxying, by kind.
    pub errors: IntCounterVec,
    /// Requests in flight per target.
    pub inflight: IntGaugeVec,
    /// Requests admitted by the global cap (`limits.max_inflight`), refreshed at scrape time.
    pub admitted: IntGauge,
    /// Request-body bytes held (`limits.max_buffered_body_bytes`), refreshed at scrape time.
    pub buffered_body_bytes: IntGauge,
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
    /// Prompts evicted from a target's trie by its node or byte cap (caught up at scrape time).
    pub trie_evictions: IntCounterVec,
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
    /// A provider's KV-cache size in tokens as its events showed it (0 until it evicted).
    pub kv_cache_learned_tokens: IntGaugeVec,
    /// LMCache status polls by provider and result (ok, error, invalid, timeout, denied).
    pub lmcache_polls: IntCounterVec,
    /// A replica's KV-cache size in tokens as its Prometheus metrics report it (0 until read).
    pub kv_cache_reported_tokens: IntGaugeVec,
    /// Reads of a replica's cache size by provider and result (ok, error, invalid,
    /// timeout, denied).
    pub cache_size_reads: IntCounterVec,
    /// Client connections open now (`limits.max_connections`), refreshed at scrape time.
    pub client_connections: IntGauge,
    /// Client connections closed at accept because `limits.max_connections` were open.
    pub connections_refused: IntCounter,
    /// Upstream attempts by route and result: answered (relayed to the client), failed
    /// (not retryable), or the reason a retryable one failed (connect, reset, 502, 503).
    pub attempts: IntCounterVec,
    /// Retries started, by route and the reason the attempt before failed.
    pub retries: IntCounterVec,
    /// Retryable failures not retried, by route and why: attempts (retry.retries used),
    /// no_target, deadline, budget.
    pub retries_refused: IntCounterVec,
    /// Client requests refused for a missing or wrong key (`[auth]`).
    pub auth_failures: IntCounter,
    /// Long chat bodies whose parse resumed where their conversation's previous body
    /// ended (`prompt::resume`).
    pub prompts_resumed: IntCounter,
    /// DNS discovery resolutions by provider and result: unchanged, changed, failed.
    pub discovery: IntCounterVec,
    /// Addresses (targets per route) a DNS-discovered provider has now.
    pub discovered_addresses: IntGaugeVec,
    /// Peering notes (`[peering]`) by event: sent (per peer), received, dropped (queue
    /// full, or peering stopped), refused (per datagram: not from a peer, or malformed),
    /// ignored, send_failed, unsendable (a name too long for the wire).
    pub peer_notes: IntCounterVec,
    /// 1 while the peering socket is bound (`[peering] listen`), else 0.
    pub peering_listening: IntGauge,
}

/// `rolter_upstream_connections_total{reused="false"}` and `{reused="true"}`, indexed by
/// `reused as usize`, resolved once (one is bumped per proxied request).
pub static UPSTREAM_CONNECTIONS: LazyLock<[prometheus::IntCounter; 2]> = LazyLock::new(|| {
    ["false", "true"].map(|r| METRICS.upstream_connections.with_label_values(&[r]))
});

/// One route's series of the per-request metrics, each resolved on its first use (a label
/// lookup hashes every label value and takes the vector's lock; a route's series are few
/// and fixed). Series are created only when first bumped, as with a direct lookup.
pub struct RouteMetrics {
    route: String,
    strategy: &'static str,
    /// `rolter_routing_decisions_total`, by the decision reason's index.
    decisions: Vec<OnceLock<IntCounter>>,
    prefix_score: OnceLock<Histogram>,
    /// `rolter_requests_total{status="200"}`, by target index.
    answered_ok: Vec<OnceLock<IntCounter>>,
    /// `rolter_upstream_attempts_total{result="answered"}`.
    attempts_answered: OnceLock<IntCounter>,
}

impl RouteMetrics {
    /// Handles for `route` routed by `strategy` over `targets` targets, with `reasons`
    /// possible decision reasons.
    pub fn new(route: &str, strategy: &'static str, targets: usize, reasons: usize) -> Self {
        RouteMetrics {
            route: route.to_string(),
            strategy,
            decisions: (0..reasons).map(|_| OnceLock::new()).collect(),
            prefix_score: OnceLock::new(),
            answered_ok: (0..targets).map(|_| OnceLock::new()).collect(),
            attempts_answered: OnceLock::new(),
        }
    }

    /// Count one upstream attempt that ended with `result`.
    pub fn attempt(&self, result: &'static str) {
        let series = || METRICS.attempts.with_label_values(&[&self.route, result]);
        if result == "answered" {
            self.attempts_answered.get_or_init(series).inc();
        } else {
            series().inc();
        }
    }

    /// Count one retry after an attempt failed for `reason`.
    pub fn retry(&self, reason: &'static str) {
        METRICS
            .retries
            .with_label_values(&[&self.route, reason])
            .inc();
    }

    /// Count one retryable failure not retried, and why.
    pub fn retry_refused(&self, why: &'static str) {
        METRICS
            .retries_refused
            .with_label_values(&[&self.route, why])
            .inc();
    }

    /// Count one routing decision with reason number `index` (label `reason`). An index
    /// past the resolved ones (a reason missing from `Reason::ALL`) is counted by lookup
    /// instead of panicking on the request path.
    pub fn decision(&self, index: usize, reason: &'static str) {
        let series = || {
            METRICS
                .decisions
                .with_label_values(&[self.strategy, reason])
        };
        match self.decisions.get(index) {
            Some(cell) => cell.get_or_init(series).inc(),
            None => series().inc(),
        }
    }

    /// Record a decision's prefix score.
    pub fn prefix_score(&self, score: f64) {
        self.prefix_score
            .get_or_init(|| METRICS.prefix_score.with_label_values(&[self.strategy]))
            .observe(score);
    }

    /// Count one request answered by target number `index` (label `target`) with `status`.
    pub fn answered(&self, index: usize, target: &str, status: http::StatusCode) {
        let series = || {
            METRICS
                .requests
                .with_label_values(&[&self.route, target, status.as_str()])
        };
        match self.answered_ok.get(index) {
            Some(cell) if status == http::StatusCode::OK => cell.get_or_init(series).inc(),
            _ => series().inc(),
        }
    }
}

/// The process-wide metrics.
pub static METRICS: LazyLock<Metrics> = LazyLock::new(|| {
    Metrics {
    requests: register_int_counter_vec!(
        "rolter_requests_total",
        "Requests answered, by route alias, target and HTTP status",
        &["route", "target", "status"]
    )
    .expect("register rolter_requests_total"),
    endpoint_requests: register_int_counter_vec!(
        "rolter_endpoint_requests_total",
        "Requests by API endpoint and HTTP status",
        &["endpoint", "status"]
    )
    .expect("register rolter_endpoint_requests_total"),
    response_ids: register_int_gauge!(
        "rolter_response_affinity_ids",
        "Responses API ids remembered with the replica holding each"
    )
    .expect("register rolter_response_affinity_ids"),
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
    buffered_body_bytes: register_int_gauge!(
        "rolter_buffered_body_bytes",
        concat!(
            "Request-body buffer bytes held now (being read, or sent and waiting for the ",
            "answer to start), counted against limits.max_buffered_body_bytes"
        )
    )
    .expect("register rolter_buffered_body_bytes"),
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
    reloads: {
        let reloads = register_int_counter_vec!(
            "rolter_config_reloads_total",
            "Routing file reloads (SIGHUP) by result: ok or failed",
            &["result"]
        )
        .expect("register rolter_config_reloads_total");
        // Both series exist from the start, so an alert on `failed` sees its first one.
        for result in ["ok", "failed"] {
            reloads.with_label_values(&[result]);
        }
        reloads
    },
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
    trie_evictions: register_int_counter_vec!(
        "rolter_trie_evictions_total",
        "Prompts evicted from a target's prefix trie by its node or byte cap",
        &["target"]
    )
    .expect("register rolter_trie_evictions_total"),
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
    kv_cache_learned_tokens: register_int_gauge_vec!(
        "rolter_kv_cache_learned_tokens",
        "KV-cache size in tokens the provider's events showed (most blocks resident once it evicted one; 0 until then)",
        &["provider"]
    )
    .expect("register rolter_kv_cache_learned_tokens"),
    lmcache_polls: register_int_counter_vec!(
        "rolter_lmcache_polls_total",
        "LMCache status polls by provider and result (ok, error, invalid, timeout, denied)",
        &["provider", "result"]
    )
    .expect("register rolter_lmcache_polls_total"),
    kv_cache_reported_tokens: register_int_gauge_vec!(
        "rolter_kv_cache_reported_tokens",
        "KV-cache size in tokens the provider's replica reports in its metrics (vllm:cache_config_info; 0 until read)",
        &["provider"]
    )
    .expect("register rolter_kv_cache_reported_tokens"),
    cache_size_reads: register_int_counter_vec!(
        "rolter_cache_size_reads_total",
        "Reads of a replica's KV-cache size from its metrics, by provider and result (ok, error, invalid, timeout, denied)",
        &["provider", "result"]
    )
    .expect("register rolter_cache_size_reads_total"),
    client_connections: register_int_gauge!(
        "rolter_client_connections",
        "Client connections open now, counted against limits.max_connections"
    )
    .expect("register rolter_client_connections"),
    connections_refused: register_int_counter!(
        "rolter_client_connections_refused_total",
        "Client connections closed at accept because limits.max_connections were open"
    )
    .expect("register rolter_client_connections_refused_total"),
    attempts: register_int_counter_vec!(
        "rolter_upstream_attempts_total",
        "Upstream attempts by route and result (answered, failed, or the retryable failure: connect, reset, 502, 503)",
        &["route", "result"]
    )
    .expect("register rolter_upstream_attempts_total"),
    retries: register_int_counter_vec!(
        "rolter_retries_total",
        "Retries on another target, by route and the failure of the attempt before",
        &["route", "reason"]
    )
    .expect("register rolter_retries_total"),
    retries_refused: register_int_counter_vec!(
        "rolter_retries_refused_total",
        "Retryable failures not retried, by route and why (attempts, no_target, deadline, budget)",
        &["route", "reason"]
    )
    .expect("register rolter_retries_refused_total"),
    prompts_resumed: register_int_counter!(
        "rolter_prompts_resumed_total",
        "Long chat bodies whose parse resumed where their conversation's previous body ended"
    )
    .expect("register rolter_prompts_resumed_total"),
    auth_failures: register_int_counter!(
        "rolter_auth_failures_total",
        "Client requests refused with 401 for a missing or wrong key"
    )
    .expect("register rolter_auth_failures_total"),
    discovery: register_int_counter_vec!(
        "rolter_discovery_resolutions_total",
        "DNS discovery resolutions by provider and result (unchanged, changed, failed)",
        &["provider", "result"]
    )
    .expect("register rolter_discovery_resolutions_total"),
    discovered_addresses: register_int_gauge_vec!(
        "rolter_discovered_addresses",
        "Addresses a discovery = \"dns\" provider resolves to now (each one a target)",
        &["provider"]
    )
    .expect("register rolter_discovered_addresses"),
    peer_notes: register_int_counter_vec!(
        "rolter_peer_notes_total",
        "Peering notes by event (sent, received, dropped, refused, unauthenticated, ignored, send_failed, unsendable)",
        &["event"]
    )
    .expect("register rolter_peer_notes_total"),
    peering_listening: register_int_gauge!(
        "rolter_peering_listening",
        "1 while the [peering] socket is bound, else 0 (off, or its address still taken)"
    )
    .expect("register rolter_peering_listening"),
}
});

/// The `kind` labels of `rolter_kv_stream_total`, in `fleet::export`'s order.
pub const KV_STREAM_KINDS: [&str; 15] = [
    "batches",
    "block_stored",
    "block_removed",
    "all_blocks_cleared",
    "decode_errors",
    "gaps",
    "restarts",
    "replays_ok",
    "replays_failed",
    "rebuilds",
    "stale",
    "connects",
    "evictions",
    "protocol_errors",
    "disconnects",
];

/// Held while a scrape mirrors live sources into the registry (`catch_up` reads a counter
/// and then raises it, so two scrapes at once would both add the same delta), while a
/// reload drops removed state and its series, and while a health probe sets a provider's
/// gauge (so none re-creates a series a reload just dropped). Never taken on the request
/// path.
pub static EXPORT_LOCK: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

/// Raise a counter mirroring a monotonic source to the source's value (under
/// [`EXPORT_LOCK`]).
pub fn catch_up(counter: &prometheus::IntCounter, value: u64) {
    let delta = value.saturating_sub(counter.get());
    if delta > 0 {
        counter.inc_by(delta);
    }
}

/// Mirror a target's prefix-trie size and evictions (called at scrape time).
pub fn export_trie(target: &str, nodes: usize, evictions: u64) {
    METRICS
        .trie_nodes
        .with_label_values(&[target])
        .set(nodes as i64);
    catch_up(
        &METRICS.trie_evictions.with_label_values(&[target]),
        evictions,
    );
}

/// Drop every series of `vec` whose label `name` is `value`, whatever its other labels
/// (a scan of the vector's series: for reloads and discovery, never the request path).
fn remove_where<T: prometheus::core::MetricVecBuilder>(
    vec: &prometheus::core::MetricVec<T>,
    name: &str,
    value: &str,
) {
    use prometheus::core::Collector;
    for family in vec.collect() {
        for metric in family.get_metric() {
            let labels = metric.get_label();
            if !labels
                .iter()
                .any(|l| l.name() == name && l.value() == value)
            {
                continue;
            }
            let all: std::collections::HashMap<&str, &str> =
                labels.iter().map(|l| (l.name(), l.value())).collect();
            let _ = vec.remove(&all);
        }
    }
}

/// Drop every series of a target a reload or DNS discovery removed (its state is dropped
/// too; if it comes back it starts from zero, histograms included: requests still in
/// flight on the old state observe into handles no longer exported). Its request and
/// breaker counters go as well: under discovery, addresses come and go for good, and a
/// series per address ever seen would grow without bound.
pub fn forget_target(target: &str) {
    let m = &*METRICS;
    let _ = m.inflight.remove_label_values(&[target]);
    let _ = m.trie_nodes.remove_label_values(&[target]);
    let _ = m.trie_evictions.remove_label_values(&[target]);
    let _ = m.upstream_ttfb.remove_label_values(&[target]);
    let _ = m.upstream_latency.remove_label_values(&[target]);
    remove_where(&m.requests, "target", target);
    remove_where(&m.breaker_events, "target", target);
}

/// Drop the series of a provider a reload or DNS discovery removed: its health gauge and
/// probe counters and LMCache poll counters.
pub fn forget_provider(provider: &str) {
    let m = &*METRICS;
    let _ = m.provider_healthy.remove_label_values(&[provider]);
    remove_where(&m.health_checks, "provider", provider);
    remove_where(&m.lmcache_polls, "provider", provider);
    remove_where(&m.cache_size_reads, "provider", provider);
    let _ = m.kv_cache_reported_tokens.remove_label_values(&[provider]);
}

/// Drop the discovery series of a provider no longer discovered by DNS.
pub fn forget_discovery(provider: &str) {
    let _ = METRICS
        .discovered_addresses
        .remove_label_values(&[provider]);
    remove_where(&METRICS.discovery, "provider", provider);
}

/// Drop the health gauge of a provider whose checks are off (nothing probes it).
pub fn forget_health_gauge(provider: &str) {
    let _ = METRICS.provider_healthy.remove_label_values(&[provider]);
}

/// Drop the KV-event series of a provider whose `[providers.kv_events]` a reload removed
/// (its stream state is dropped, so the mirrored counters restart from zero).
pub fn forget_kv_stream(provider: &str) {
    let m = &*METRICS;
    for kind in KV_STREAM_KINDS {
        let _ = m.kv_stream.remove_label_values(&[provider, kind]);
    }
    let _ = m.kv_trusted.remove_label_values(&[provider]);
    let _ = m.kv_connected.remove_label_values(&[provider]);
    let _ = m.kv_index_blocks.remove_label_values(&[provider]);
    let _ = m.kv_cache_learned_tokens.remove_label_values(&[provider]);
}

/// Drop the cache size a provider's replica reported, once nothing reads it any more.
pub fn forget_reported_cache_size(provider: &str) {
    let _ = METRICS
        .kv_cache_reported_tokens
        .remove_label_values(&[provider]);
}

/// Drop the session gauge of a route a reload removed.
pub fn forget_route(alias: &str) {
    let _ = METRICS.sessions.remove_label_values(&[alias]);
}

/// Every `endpoint` label of `rolter_endpoint_requests_total`: the forwarded endpoints
/// (`prompt::Endpoint::label`), the requests naming a stored response, the ones rolter
/// answers itself, and `unknown` (no such path).
pub const ENDPOINT_LABELS: [&str; 21] = [
    "chat_completions",
    "completions",
    "responses",
    "messages",
    "messages_count_tokens",
    "embeddings",
    "rerank",
    "score",
    "pooling",
    "classify",
    "tokenize",
    "detokenize",
    "chat_render",
    "audio_transcriptions",
    "audio_translations",
    "responses_by_id",
    "models",
    "health",
    "ready",
    "metrics",
    "unknown",
];

/// Count one request on `endpoint` answered with `status` (`None`: no status, counted as
/// "0"). A 200 on a known endpoint (nearly every request) bumps a series resolved once,
/// not a labelled lookup per request.
pub fn endpoint_answered(endpoint: &str, status: Option<http::StatusCode>) {
    static OK: LazyLock<Vec<IntCounter>> = LazyLock::new(|| {
        ENDPOINT_LABELS
            .iter()
            .map(|l| METRICS.endpoint_requests.with_label_values(&[l, "200"]))
            .collect()
    });
    if status == Some(http::StatusCode::OK) {
        if let Some(i) = ENDPOINT_LABELS.iter().position(|l| *l == endpoint) {
            OK[i].inc();
            return;
        }
    }
    METRICS
        .endpoint_requests
        .with_label_values(&[endpoint, status.as_ref().map_or("0", |s| s.as_str())])
        .inc();
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_endpoint_label_is_listed_and_counted() {
        for e in crate::prompt::Endpoint::ALL {
            assert!(ENDPOINT_LABELS.contains(&e.label()), "{e:?}");
        }
        let series = |status| {
            METRICS
                .endpoint_requests
                .with_label_values(&["score", status])
                .get()
        };
        let (ok, bad) = (series("200"), series("400"));
        endpoint_answered("score", Some(http::StatusCode::OK));
        endpoint_answered("score", Some(http::StatusCode::BAD_REQUEST));
        assert_eq!((series("200"), series("400")), (ok + 1, bad + 1));
    }

    #[test]
    fn route_handles_bump_the_labelled_series() {
        let m = RouteMetrics::new("rm-test-route", "cache_aware", 2, 3);
        let ok = || {
            METRICS
                .requests
                .with_label_values(&["rm-test-route", "p/t1", "200"])
                .get()
        };
        let failed = || {
            METRICS
                .requests
                .with_label_values(&["rm-test-route", "p/t1", "502"])
                .get()
        };
        let (ok0, failed0) = (ok(), failed());
        m.answered(1, "p/t1", http::StatusCode::OK);
        m.answered(1, "p/t1", http::StatusCode::OK);
        m.answered(1, "p/t1", http::StatusCode::BAD_GATEWAY);
        assert_eq!((ok() - ok0, failed() - failed0), (2, 1));

        let hits = || {
            METRICS
                .decisions
                .with_label_values(&["cache_aware", "rm-test-reason"])
                .get()
        };
        let hits0 = hits();
        m.decision(2, "rm-test-reason");
        m.decision(2, "rm-test-reason");
        m.decision(7, "rm-test-reason"); // past the resolved reasons: looked up, no panic
        assert_eq!(hits() - hits0, 3);

        let scores = || {
            METRICS
                .prefix_score
                .with_label_values(&["cache_aware"])
                .get_sample_count()
        };
        let scores0 = scores();
        m.prefix_score(0.75);
        assert_eq!(scores() - scores0, 1);
    }
}
