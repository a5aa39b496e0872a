//! A replica's KV-cache size read from its own metrics (`cache_size_poll`): a provider
//! without `kv_cache_tokens` gets the size vLLM publishes as `vllm:cache_config_info`,
//! and its prefix trie forgets what a cache that size would have evicted.

mod common;

use common::*;
use rolter_loadtest::{spawn_fleet, FleetConfig, FleetHandle};
use std::time::Duration;

/// Providers r0 and r1 over the fleet's two replicas, neither with `kv_cache_tokens`; r1
/// has `metrics_path = ""`. Route `a` is cache_aware over r0, route `b` over r1.
fn routes(fleet: &FleetHandle) -> String {
    let mut s = String::new();
    for (i, r) in fleet.replicas().iter().enumerate() {
        let path = if i == 1 { "metrics_path = \"\"\n" } else { "" };
        s += &format!(
            "[[providers]]\nname = \"r{i}\"\nkind = \"openai_compatible\"\napi_base = \"{}\"\n{path}\
             [providers.health]\nenabled = false\n\n",
            r.base_url(),
        );
    }
    for (i, alias) in ["a", "b"].iter().enumerate() {
        s += &format!(
            "[[routes]]\nmodel = \"{alias}\"\nstrategy = \"cache_aware\"\n\
             [[routes.targets]]\nprovider = \"r{i}\"\nmodel = \"sim-model\"\n"
        );
    }
    s
}

/// The cache of each of [`small_fleet`]'s replicas: 64 blocks of 16 tokens.
const SMALL_CACHE_TOKENS: f64 = 1024.0;

/// Two simulated replicas (no KV events) with [`SMALL_CACHE_TOKENS`] of cache each.
async fn small_fleet() -> FleetHandle {
    let mut cfg = FleetConfig {
        kv_events: None,
        ..FleetConfig::default()
    };
    cfg.replica.cache_blocks = 64;
    assert_eq!(
        (cfg.replica.cache_blocks * cfg.replica.block_size) as f64,
        SMALL_CACHE_TOKENS
    );
    spawn_fleet(cfg).await.unwrap()
}

fn prompt(alias: &str, topic: usize) -> String {
    let system = format!(
        "Topic {topic}. {}",
        "Cite every source you use. ".repeat(80)
    );
    serde_json::json!({
        "model": alias,
        "max_tokens": 1,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "go"},
        ],
    })
    .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replicas_cache_size_is_read_from_its_metrics_and_caps_its_trie() {
    let fleet = small_fleet().await;
    let want = SMALL_CACHE_TOKENS;
    let gw = Gateway::start(&routes(&fleet)).await;

    let reported = "rolter_kv_cache_reported_tokens{provider=\"r0\"}";
    assert!(
        eventually(Duration::from_secs(10), || async {
            gw.metric(reported).await == Some(want)
        })
        .await,
        "r0's size: {:?}, want {want}",
        gw.metric(reported).await
    );
    assert!(gw
        .metric("rolter_cache_size_reads_total{provider=\"r0\",result=\"ok\"}")
        .await
        .is_some_and(|n| n >= 1.0));
    // metrics_path = "": never read.
    assert_eq!(
        gw.metric("rolter_kv_cache_reported_tokens{provider=\"r1\"}")
            .await,
        None
    );
    assert!(!gw
        .get_text("/metrics")
        .await
        .contains("rolter_cache_size_reads_total{provider=\"r1\""));

    // The same distinct prompts, ~2.2 KB each, through both routes: 1,024 tokens of cache
    // (4 prompt bytes a token) hold fewer than two of them, so r0's trie forgets; r1's,
    // unsized, keeps them all.
    for topic in 0..8 {
        for alias in ["a", "b"] {
            let (status, _, body) = post_chat(&gw, prompt(alias, topic)).await;
            assert_eq!(status, 200, "{body}");
        }
    }
    let evictions = |target: &'static str| {
        let gw = &gw;
        async move {
            gw.metric(&format!(
                "rolter_trie_evictions_total{{target=\"{target}\"}}"
            ))
            .await
            .unwrap_or(0.0)
        }
    };
    assert!(evictions("r0/sim-model").await >= 6.0);
    assert_eq!(evictions("r1/sim-model").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_without_the_size_is_counted_retried_and_still_served() {
    let stub = Stub::start("a").await.unwrap();
    let gw = Gateway::start(&routes_toml(&[stub.url()], "cache_aware", "")).await;
    // The stub answers /metrics with an echo of the request, no size in it: every read is
    // counted as invalid and retried (after 1 s, 2 s, …).
    let errors = "rolter_cache_size_reads_total{provider=\"p0\",result=\"invalid\"}";
    assert!(
        eventually(Duration::from_secs(10), || async {
            gw.metric(errors).await.is_some_and(|n| n >= 2.0)
        })
        .await,
        "errors: {:?}",
        gw.metric(errors).await
    );
    assert_eq!(
        gw.metric("rolter_kv_cache_reported_tokens{provider=\"p0\"}")
            .await,
        None
    );
    let (status, _, body) = post_chat(&gw, chat_body("alias", "hello", false)).await;
    assert_eq!(status, 200, "{body}");
}

/// A reload that sets `kv_cache_tokens` stops the reads and drops the size read before:
/// the configured one rules, and nothing stale is left behind in the metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_size_replaces_the_read_one_on_reload() {
    let fleet = small_fleet().await;
    let text = routes(&fleet);
    let gw = Gateway::start(&text).await;
    let reported = "rolter_kv_cache_reported_tokens{provider=\"r0\"}";
    assert!(
        eventually(Duration::from_secs(10), || async {
            gw.metric(reported).await == Some(SMALL_CACHE_TOKENS)
        })
        .await
    );
    let sized = text.replacen(
        "name = \"r0\"\n",
        "name = \"r0\"\nkv_cache_tokens = 4096\n",
        1,
    );
    assert_ne!(sized, text);
    let tmp = gw.routes.with_extension("tmp");
    std::fs::write(&tmp, sized).unwrap();
    std::fs::rename(&tmp, &gw.routes).unwrap();
    gw.signal("HUP");
    assert!(
        eventually(Duration::from_secs(10), || async {
            gw.metric("rolter_config_reloads_total{result=\"ok\"}")
                .await
                == Some(1.0)
        })
        .await
    );
    assert!(
        eventually(Duration::from_secs(5), || async {
            gw.metric(reported).await.is_none()
        })
        .await,
        "the size read before the reload is still exported"
    );
    // A replica still listed would be read again at once (every reload restarts the reads).
    let reads = "rolter_cache_size_reads_total{provider=\"r0\",result=\"ok\"}";
    let before = gw.metric(reads).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(gw.metric(reads).await, before, "read after the reload");
}
