//! The load driver against an in-process fleet: closed and open loop, headers, counters,
//! the routing file `compare` writes, and `compare` itself with the gateway-less strategies.
//! Loopback only, port 0, small workloads, bounded by the runner's deadline.

use std::sync::Arc;
use std::time::Duration;

use rolter_loadtest::load::compare::{compare, run_strategy, CompareArgs, DriverArgs};
use rolter_loadtest::load::report::summarize;
use rolter_loadtest::load::routes::{routes_toml, routes_toml_with};
use rolter_loadtest::load::runner::{run, Dispatch, Mode, RunOptions};
use rolter_loadtest::load::scrape::scrape_all;
use rolter_loadtest::load::upper_bound::upper_bound;
use rolter_loadtest::load::workload::{generate, WorkloadKind, WorkloadSpec};
use rolter_loadtest::sim_args::SimArgs;
use rolter_loadtest::{spawn_fleet, FleetConfig};

fn small_multi_turn() -> WorkloadSpec {
    WorkloadSpec {
        sessions: 6,
        turns: 3,
        prefixes: 2,
        prefix_tokens: 200,
        user_tokens: 10,
        max_tokens: 4,
        ..WorkloadSpec::default()
    }
}

fn opts(mode: Mode) -> RunOptions {
    RunOptions {
        mode,
        request_timeout: Duration::from_secs(10),
        max_duration: Duration::from_secs(20),
        ..RunOptions::default()
    }
}

#[tokio::test]
async fn closed_loop_round_robin_counts_add_up() {
    let fleet = spawn_fleet(FleetConfig {
        replicas: 3,
        ..FleetConfig::default()
    })
    .await
    .unwrap();
    let urls = fleet.base_urls();
    let sessions = Arc::new(generate(&small_multi_turn()));
    let client = reqwest::Client::new();
    let before = scrape_all(&client, &urls).await.unwrap();
    let out = run(
        sessions.clone(),
        Dispatch::RoundRobin(urls.clone()),
        opts(Mode::Closed { clients: 3 }),
    )
    .await;
    let after = scrape_all(&client, &urls).await.unwrap();
    assert_eq!(out.requests.len(), 18);
    assert!(
        out.requests.iter().all(|r| r.ok),
        "{:?}",
        out.requests[0].error
    );
    assert!(out.requests.iter().all(|r| r.ttft.unwrap() <= r.e2e));
    let report = summarize("rr", &out, &before, &after);
    assert_eq!(report.errors, 0);
    assert_eq!(report.shares, vec![1.0 / 3.0; 3]);
    assert!((report.max_over_mean - 1.0).abs() < 1e-9);
    let stats = fleet.stats();
    let q: u64 = stats.iter().map(|s| s.prefix_cache_queries).sum();
    let h: u64 = stats.iter().map(|s| s.prefix_cache_hits).sum();
    assert!((report.hit_rate - h as f64 / q as f64).abs() < 1e-9);
    // Never above one replica with an unbounded cache.
    assert!(report.hit_rate <= upper_bound(&sessions, 16).rate() + 1e-9);

    // The driver sent both headers, and the token ids are the replica's own prompt tokens.
    let rec = &fleet.replica(0).recent_requests()[0];
    let ids = rec.token_ids_header.as_ref().unwrap();
    assert_eq!(ids.split(',').count(), rec.prompt_tokens);
    assert!(rec.session_id.as_ref().unwrap().starts_with('s'));
    assert_eq!(rec.model.as_deref(), Some("sim"));
    fleet.shutdown().await;
}

#[tokio::test]
async fn one_session_on_one_replica_reaches_the_upper_bound() {
    let fleet = spawn_fleet(FleetConfig {
        replicas: 2,
        ..FleetConfig::default()
    })
    .await
    .unwrap();
    let urls = fleet.base_urls();
    let spec = WorkloadSpec {
        sessions: 1,
        turns: 4,
        ..small_multi_turn()
    };
    let sessions = Arc::new(generate(&spec));
    run(
        sessions.clone(),
        Dispatch::SessionHash(urls.clone()),
        opts(Mode::Closed { clients: 1 }),
    )
    .await;
    // One session on one replica with ample cache: exactly the upper bound.
    let stats = fleet.stats();
    let q: u64 = stats.iter().map(|s| s.prefix_cache_queries).sum();
    let h: u64 = stats.iter().map(|s| s.prefix_cache_hits).sum();
    assert_eq!(upper_bound(&sessions, 16).hits, h);
    assert_eq!(upper_bound(&sessions, 16).queries, q);
    // Turn 2's prompt is turn 1's prompt + reply + more: its history hits.
    let served = stats.iter().filter(|s| s.requests > 0).count();
    assert_eq!(served, 1);
    let recs: Vec<_> = fleet
        .replicas()
        .iter()
        .flat_map(|r| r.recent_requests())
        .collect();
    let t = &recs[1];
    assert!(t.cached_tokens > 200, "{t:?}");
    fleet.shutdown().await;
}

#[tokio::test]
async fn open_loop_poisson_sends_everything_once() {
    let fleet = spawn_fleet(FleetConfig::default()).await.unwrap();
    let spec = WorkloadSpec {
        workload: WorkloadKind::FewShot,
        requests: 20,
        prefix_tokens: 100,
        ..small_multi_turn()
    };
    let sessions = Arc::new(generate(&spec));
    let t0 = std::time::Instant::now();
    let out = run(
        sessions,
        Dispatch::Single(fleet.replica(0).base_url()),
        opts(Mode::Open { rate: 200.0 }),
    )
    .await;
    assert_eq!(out.requests.len(), 20);
    assert!(out.requests.iter().all(|r| r.ok));
    // 20 arrivals at 200/s take about 100 ms; bounded well below the deadline.
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert_eq!(fleet.replica(0).stats().requests, 20);
    fleet.shutdown().await;
}

#[tokio::test]
async fn errors_are_counted_not_fatal() {
    let out = run(
        Arc::new(generate(&WorkloadSpec {
            sessions: 2,
            turns: 2,
            ..small_multi_turn()
        })),
        // Nothing listens on port 9 of loopback (discard service is not run here).
        Dispatch::Single("http://127.0.0.1:9".into()),
        opts(Mode::Closed { clients: 2 }),
    )
    .await;
    assert_eq!(out.requests.len(), 4);
    assert!(out.requests.iter().all(|r| !r.ok && r.error.is_some()));
}

#[tokio::test]
async fn routing_file_and_direct_compare() {
    let fleet = spawn_fleet(FleetConfig::default()).await.unwrap();
    for strategy in [
        "round_robin",
        "cache_aware",
        "precise_cache_aware",
        "lmcache_aware",
    ] {
        let text = routes_toml(&fleet, strategy, "sim", "sim-model");
        let v: toml::Value = toml::from_str(&text).unwrap();
        let providers = v["providers"].as_array().unwrap();
        assert_eq!(providers.len(), 2);
        assert_eq!(providers[0]["kind"].as_str(), Some("openai_compatible"));
        assert_eq!(
            providers[1]["api_base"].as_str(),
            Some(fleet.replica(1).base_url().as_str())
        );
        assert_eq!(
            providers[0].get("kv_events").is_some(),
            strategy == "precise_cache_aware"
        );
        assert_eq!(
            providers[0].get("lmcache").is_some(),
            strategy == "lmcache_aware"
        );
        let cfg = FleetConfig::default().replica;
        assert_eq!(
            providers[0]
                .get("kv_cache_tokens")
                .and_then(|t| t.as_integer()),
            matches!(strategy, "cache_aware" | "pipeline" | "precise_cache_aware")
                .then_some((cfg.cache_blocks * cfg.block_size) as i64)
        );
        if strategy == "precise_cache_aware" {
            let kv = &providers[0]["kv_events"];
            assert_eq!(
                kv["endpoint"].as_str(),
                fleet.replica(0).kv_events_endpoint().as_deref()
            );
            assert!(kv["replay_endpoint"]
                .as_str()
                .unwrap()
                .starts_with("tcp://"));
        }
        let route = &v["routes"][0];
        assert_eq!(route["model"].as_str(), Some("sim"));
        assert_eq!(route["strategy"].as_str(), Some(strategy));
        assert_eq!(route["targets"].as_array().unwrap().len(), 2);
        assert_eq!(route["targets"][1]["provider"].as_str(), Some("sim-1"));
    }
    // --route-option lines land in the route's table, not in a target's.
    let text = routes_toml_with(
        &fleet,
        "cache_aware",
        "sim",
        "sim-model",
        &["trie_max_nodes = 5000".to_string()],
        &[],
        true,
    );
    let v: toml::Value = toml::from_str(&text).unwrap();
    assert_eq!(v["routes"][0]["trie_max_nodes"].as_integer(), Some(5000));
    assert!(v["routes"][0]["targets"][0].get("trie_max_nodes").is_none());
    // --provider-option lines land in every provider's table, not in its kv_events.
    let text = routes_toml_with(
        &fleet,
        "precise_cache_aware",
        "sim",
        "sim-model",
        &[],
        &["metrics_path = \"\"".to_string()],
        true,
    );
    let v: toml::Value = toml::from_str(&text).unwrap();
    for p in v["providers"].as_array().unwrap() {
        assert_eq!(p["metrics_path"].as_str(), Some(""));
        assert!(p["kv_events"].get("metrics_path").is_none());
    }
    assert!(v["routes"][0].get("metrics_path").is_none());
    // --without-kv-cache-tokens: no provider gets a cache size; the rest is unchanged.
    for strategy in ["cache_aware", "precise_cache_aware"] {
        let text = routes_toml_with(&fleet, strategy, "sim", "sim-model", &[], &[], false);
        let v: toml::Value = toml::from_str(&text).unwrap();
        let providers = v["providers"].as_array().unwrap();
        assert!(providers.iter().all(|p| p.get("kv_cache_tokens").is_none()));
        assert_eq!(
            providers[0].get("kv_events").is_some(),
            strategy == "precise_cache_aware"
        );
    }
    fleet.shutdown().await;

    // compare's per-strategy step, without a gateway.
    use clap::Parser;
    #[derive(Parser)]
    struct A {
        #[command(flatten)]
        sim: SimArgs,
        #[command(flatten)]
        driver: DriverArgs,
        #[command(flatten)]
        compare: CompareArgs,
    }
    let a = A::parse_from(["x", "--replicas", "2", "--clients", "4"]);
    let sessions = Arc::new(generate(&small_multi_turn()));
    let dir = std::env::temp_dir();
    let rr = run_strategy(
        "direct_round_robin",
        sessions.clone(),
        &a.sim,
        &a.driver,
        &a.compare,
        1,
        &dir,
    )
    .await
    .unwrap();
    assert_eq!((rr.requests, rr.errors), (18, 0));
    // A missing gateway binary is an error naming the strategy, not a hang.
    let mut bad = a.compare.clone();
    bad.gateway = "/nonexistent/rolter".into();
    let err = run_strategy("round_robin", sessions, &a.sim, &a.driver, &bad, 1, &dir)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("round_robin"), "{err}");
}

#[derive(clap::Parser)]
struct CompareCli {
    #[command(flatten)]
    sim: SimArgs,
    #[command(flatten)]
    driver: DriverArgs,
    #[command(flatten)]
    compare: CompareArgs,
}

#[tokio::test]
async fn repeats_run_every_strategy_each_round_and_report_medians() {
    use clap::Parser;
    let dir = std::env::temp_dir().join(format!("rolter-load-test-repeats-{}", std::process::id()));
    let out = dir.join("r.md");
    let a = CompareCli::parse_from([
        "x",
        "--replicas",
        "2",
        "--clients",
        "4",
        "--strategies",
        "direct_round_robin,direct_session_hash,smg_cache_aware",
        "--repeats",
        "2",
        "--peer-venv",
        "/nonexistent/venv",
        "--out",
        out.to_str().unwrap(),
    ]);
    let md = compare(&small_multi_turn(), &a.sim, &a.driver, &a.compare)
        .await
        .unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.with_extension("json")).unwrap())
            .unwrap();
    assert_eq!(json["repeats"], 2);
    let summaries = json["strategies"].as_array().unwrap();
    let names: Vec<&str> = summaries
        .iter()
        .map(|s| s["strategy"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["direct_round_robin", "direct_session_hash"]);
    for s in summaries {
        assert_eq!(s["runs"], 2);
        assert_eq!(s["requests"], 36);
        assert_eq!(s["errors"], 0);
        let (lo, mid, hi) = (
            s["hit_rate_min"].as_f64().unwrap(),
            s["hit_rate"].as_f64().unwrap(),
            s["hit_rate_max"].as_f64().unwrap(),
        );
        assert!(lo <= mid && mid <= hi && lo > 0.0, "{s}");
    }
    // Session-sticky routing keeps each conversation's cache: it beats round robin.
    assert!(summaries[1]["hit_rate"].as_f64() > summaries[0]["hit_rate"].as_f64());
    assert_eq!(json["runs"].as_array().unwrap().len(), 4);
    assert!(md.contains("| direct_round_robin | 2 |"), "{md}");
    assert!(md.contains("direct_session_hash #2"), "{md}");
    // A peer that is not installed is a "Not run" row, not a failed comparison.
    assert!(
        md.contains("Not run: `smg_cache_aware`") && md.contains("peers.sh"),
        "{md}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A readiness endpoint that reports `healthy_workers` from a shared counter.
async fn readiness_server(healthy: Arc<std::sync::atomic::AtomicUsize>) -> u16 {
    use axum::{routing::get, Json, Router};
    let app = Router::new().route(
        "/readiness",
        get(move || {
            let h = healthy.load(std::sync::atomic::Ordering::Relaxed);
            async move { Json(serde_json::json!({"status": "ready", "healthy_workers": h})) }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    port
}

#[tokio::test]
async fn a_peer_is_ready_only_once_every_worker_is_healthy() {
    use rolter_loadtest::load::gateway::{start, Launch};
    use rolter_loadtest::load::peer::Readiness;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let dir = std::env::temp_dir().join(format!("rolter-load-test-ready-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // The "peer" is a process that just stays up; readiness is served beside it.
    let healthy = Arc::new(AtomicUsize::new(1));
    let port = readiness_server(healthy.clone()).await;
    let launch = |timeout_ms: u64, log: &str| Launch {
        program: std::path::Path::new("sleep"),
        args: vec!["30".into()],
        env: Vec::new(),
        port,
        ready: Readiness::HealthyWorkers(2),
        log: dir.join(log),
        ready_timeout: Duration::from_millis(timeout_ms),
    };
    // One of two workers healthy: never ready.
    let err = start(launch(600, "a.log")).await.err().unwrap();
    assert!(err.contains("not ready"), "{err}");
    // The second registers a moment later: ready then.
    let h = healthy.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        h.store(2, Ordering::Relaxed);
    });
    let gw = start(launch(10_000, "b.log")).await.unwrap();
    assert_eq!(gw.base_url, format!("http://127.0.0.1:{port}"));
    gw.stop().await;
    // A process that exits before it is ready is reported with its log's last line (written
    // with a variable set in its environment).
    healthy.store(0, Ordering::Relaxed);
    let early = Launch {
        program: std::path::Path::new("sh"),
        args: vec![
            "-c".into(),
            "echo cannot $ROLTER_TEST_WORD >&2; exit 3".into(),
        ],
        env: vec![("ROLTER_TEST_WORD".into(), "bind".into())],
        ..launch(10_000, "c.log")
    };
    let err = start(early).await.err().unwrap();
    assert!(
        err.contains("exited") && err.contains("cannot bind"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
