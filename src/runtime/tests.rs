//! Tests of loading, building and reloading route tables.

use super::*;
use crate::egress::StaticResolver;
use std::time::Duration;

/// Providers `names` (each on loopback, the first with lmcache + kv_events) and one
/// route over all of them with `strategy`.
fn routes(names: &[&str], strategy: &str, extra_api_base: Option<&str>) -> String {
    let mut s = String::new();
    for (i, n) in names.iter().enumerate() {
        s += &format!(
            "[[providers]]\nname = \"{n}\"\nkind = \"openai_compatible\"\napi_base = \"http://127.0.0.1:{}\"\n",
            9000 + i
        );
        if i == 0 {
            s += "[providers.lmcache]\nendpoint = \"http://127.0.0.1:9100/status\"\n";
            s += "[providers.kv_events]\nendpoint = \"tcp://127.0.0.1:5557\"\n";
        }
    }
    if let Some(api_base) = extra_api_base {
        s += &format!(
            "[[providers]]\nname = \"extra\"\nkind = \"openai_compatible\"\napi_base = \"{api_base}\"\n"
        );
    }
    s += &format!("[[routes]]\nmodel = \"alias\"\nstrategy = \"{strategy}\"\n");
    for n in names {
        s += &format!("[[routes.targets]]\nprovider = \"{n}\"\nmodel = \"m\"\n");
    }
    s
}

fn key(provider: &str) -> TargetKey {
    TargetKey {
        provider: provider.into(),
        model: "m".into(),
    }
}

fn static_ctx() -> LoadContext {
    LoadContext {
        resolver: Arc::new(StaticResolver::default()),
        ..Default::default()
    }
}

/// `text` as `routes.toml` in a fresh temp directory for test `tag`: (dir, path).
fn routes_file(tag: &str, text: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("rolter-runtime-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("routes.toml");
    std::fs::write(&path, text).unwrap();
    (dir, path)
}

#[test]
fn a_load_that_fails_late_leaves_the_shared_state_untouched() {
    let ctx = static_ctx();
    let registry = Registry::default();
    // The extra provider's name does not resolve: the last check to run fails.
    let text = routes(&["a", "b"], "cache_aware", Some("http://nowhere.test:8000"));
    let config = config::parse(&text, "r.toml").unwrap();
    let err = RouteTable::build_with(&config, "r.toml", &registry, &ctx)
        .err()
        .expect("unresolvable");
    assert!(err.to_string().contains("nowhere.test"), "{err}");
    assert!(registry.is_empty(), "no target state created");
    assert!(registry.kv_states().is_empty(), "no KV state created");
    assert!(ctx.lmcache.is_empty(), "no lmcache cell created");
}

#[test]
fn a_reload_keeps_the_state_of_remaining_targets_and_rejects_a_bad_file() {
    let (dir, path) = routes_file("reload", &routes(&["a", "b"], "cache_aware", None));
    let rt = Runtime::load_with(&path, static_ctx()).unwrap();
    let a = rt.registry().get_or_create(&key("a"));
    a.trie.insert(b"a known prompt");
    let kv_a = rt.registry().kv_states()[0].1.clone();
    let ok = || METRICS.reloads.with_label_values(&["ok"]).get();
    let failed = || METRICS.reloads.with_label_values(&["failed"]).get();

    // Strategy changed, b removed, c added: a keeps its state (same Arc, same trie).
    let ok_before = ok();
    std::fs::write(&path, routes(&["a", "c"], "pipeline", None)).unwrap();
    rt.reload().unwrap();
    assert!(ok() > ok_before);
    let table = rt.table();
    let route = table.route("alias").unwrap();
    assert_eq!(route.strategy.name(), "pipeline");
    assert!(Arc::ptr_eq(&route.targets[0].state, &a));
    assert_eq!(a.trie.match_len(b"a known prompt"), b"a known prompt".len());
    assert!(Arc::ptr_eq(route.targets[0].kv.as_ref().unwrap(), &kv_a));
    assert_eq!(rt.registry().targets().len(), 2, "b is forgotten, c is new");
    assert!(!table.target_keys().contains(&key("b")));

    // A bad file changes nothing.
    let failed_before = failed();
    std::fs::write(&path, "[[routes]]\nmodel = 1\n").unwrap();
    assert!(rt.reload().is_err());
    assert!(failed() > failed_before);
    assert!(Arc::ptr_eq(&rt.table(), &table), "old table stays");

    // Back: a still has its prompt, b starts afresh.
    std::fs::write(&path, routes(&["a", "b"], "cache_aware", None)).unwrap();
    rt.reload().unwrap();
    let table = rt.table();
    let route = table.route("alias").unwrap();
    assert_eq!(route.strategy.name(), "cache_aware");
    assert!(Arc::ptr_eq(&route.targets[0].state, &a));
    assert_eq!(route.targets[1].state.trie.node_count(), 0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A provider's `kv_cache_tokens` sets its targets' trie byte cap at every load: set,
/// changed and removed by reloads, with the node cap from the route each time.
#[test]
fn a_reload_sets_each_trie_cap_and_cache_size_from_the_provider() {
    let with_cache = |tokens: Option<u64>| {
        let text = routes(&["a"], "cache_aware", None);
        let text = match tokens {
            Some(t) => text.replacen(
                "api_base = \"http://127.0.0.1:9000\"\n",
                &format!("api_base = \"http://127.0.0.1:9000\"\nkv_cache_tokens = {t}\n"),
                1,
            ),
            None => text,
        };
        text.replacen(
            "strategy = \"cache_aware\"\n",
            "strategy = \"cache_aware\"\ntrie_max_nodes = 5000\n",
            1,
        )
    };
    let (dir, path) = routes_file("kvcap", &with_cache(Some(8192)));
    let rt = Runtime::load_with(&path, static_ctx()).unwrap();
    let a = rt.registry().get_or_create(&key("a"));
    let cap = |tokens| crate::routing::cache_aware::trie_bytes_for_kv_cache(Some(tokens), 4.0);
    // The cache size the placement rule sees (`share_bound`), in tokens.
    let cache_tokens = |rt: &Runtime| -> f64 {
        let table = rt.table();
        table
            .route("alias")
            .unwrap()
            .candidates(std::time::Instant::now())[0]
            .cache_tokens
    };
    assert_eq!(a.trie.max_bytes(), cap(8192));
    assert_eq!(a.trie.max_nodes(), 5000);
    assert_eq!(cache_tokens(&rt), 8192.0);
    std::fs::write(&path, with_cache(Some(1024))).unwrap();
    rt.reload().unwrap();
    assert_eq!(a.trie.max_bytes(), cap(1024));
    assert_eq!(cache_tokens(&rt), 1024.0);
    std::fs::write(&path, with_cache(None)).unwrap();
    rt.reload().unwrap();
    assert_eq!(a.trie.max_bytes(), usize::MAX, "no cache size: no byte cap");
    assert_eq!(cache_tokens(&rt), 0.0, "no cache size: unknown");
    assert_eq!(a.trie.max_nodes(), 5000);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Which replicas have their cache size read from their metrics: those without
/// `kv_cache_tokens`, with a `metrics_path`, in a route whose strategy uses the size. A
/// size read sizes the trie and reaches the placement rule, survives a reload that keeps
/// the reads, and is dropped by one that stops them.
#[test]
fn cache_sizes_are_read_only_where_used_and_unset_and_kept_while_read() {
    let read = |rt: &Runtime| -> Vec<String> {
        let table = rt.table();
        table
            .cache_size_endpoints()
            .iter()
            .map(|e| format!("{}{}", e.provider, e.path))
            .collect()
    };
    let (dir, path) = routes_file("sizes", &routes(&["a", "b", "c"], "cache_aware", None));
    let rt = Runtime::load_with(&path, static_ctx()).unwrap();
    assert_eq!(read(&rt), ["a/metrics", "b/metrics", "c/metrics"]);
    for strategy in ["pipeline", "precise_cache_aware"] {
        std::fs::write(&path, routes(&["a"], strategy, None)).unwrap();
        rt.reload().unwrap();
        assert_eq!(read(&rt), ["a/metrics"], "{strategy}");
    }
    for strategy in ["round_robin", "least_load", "lmcache_aware"] {
        std::fs::write(&path, routes(&["a"], strategy, None)).unwrap();
        rt.reload().unwrap();
        assert!(read(&rt).is_empty(), "{strategy}");
    }
    let text = routes(&["a", "b", "c"], "cache_aware", None)
        .replacen(
            "api_base = \"http://127.0.0.1:9001\"\n",
            "api_base = \"http://127.0.0.1:9001\"\nkv_cache_tokens = 4096\n",
            1,
        )
        .replacen(
            "api_base = \"http://127.0.0.1:9002\"\n",
            "api_base = \"http://127.0.0.1:9002\"\nmetrics_path = \"/v2/stats\"\n",
            1,
        );
    std::fs::write(&path, &text).unwrap();
    rt.reload().unwrap();
    assert_eq!(read(&rt), ["a/metrics", "c/v2/stats"]);

    // A size read for a: its trie's cap and the rule's cache size, kept by a reload.
    let a = rt.registry().get_or_create(&key("a"));
    rt.table().cache_size_endpoints()[0].publish(2048);
    let cap = crate::routing::cache_aware::trie_bytes_for_kv_cache(Some(2048), 4.0);
    let size_of_a = |rt: &Runtime| -> f64 {
        rt.table()
            .route("alias")
            .unwrap()
            .candidates(std::time::Instant::now())[0]
            .cache_tokens
    };
    assert_eq!(a.trie.max_bytes(), cap);
    assert_eq!(size_of_a(&rt), 2048.0);
    rt.reload().unwrap();
    assert_eq!(a.trie.max_bytes(), cap, "a reload keeps the size read");
    assert_eq!(size_of_a(&rt), 2048.0);
    // The old table's reads can no longer write it.
    let old_reads = rt.table();
    rt.reload().unwrap();
    old_reads.cache_size_endpoints()[0].publish(999);
    assert_eq!(
        size_of_a(&rt),
        2048.0,
        "a read of a replaced table is refused"
    );
    rt.table().cache_size_endpoints()[0].publish(2048);
    // A later route over the same target that does not read it leaves the cap alone.
    let shared = format!(
        "{text}[[routes]]\nmodel = \"plain\"\nstrategy = \"round_robin\"\n\
         [[routes.targets]]\nprovider = \"a\"\nmodel = \"m\"\n"
    );
    std::fs::write(&path, &shared).unwrap();
    rt.reload().unwrap();
    assert_eq!(a.trie.max_bytes(), cap, "whichever route comes last");
    assert_eq!(size_of_a(&rt), 2048.0);
    // Reads off for a: the size goes with them.
    std::fs::write(
        &path,
        text.replacen(
            "api_base = \"http://127.0.0.1:9000\"\n",
            "api_base = \"http://127.0.0.1:9000\"\nmetrics_path = \"\"\n",
            1,
        ),
    )
    .unwrap();
    rt.reload().unwrap();
    assert_eq!(read(&rt), ["c/v2/stats"]);
    assert_eq!(a.reported_cache_tokens(), 0);
    assert_eq!(a.trie.max_bytes(), usize::MAX);
    assert_eq!(size_of_a(&rt), 0.0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_new_work_a_target_was_given_reaches_the_strategy_and_survives_a_reload() {
    let (dir, path) = routes_file("placed", &routes(&["a", "b"], "cache_aware", None));
    let rt = Runtime::load_with(&path, static_ctx()).unwrap();
    let a = rt.registry().get_or_create(&key("a"));
    let now = std::time::Instant::now();
    let now_ms = crate::fleet::ms_at(now);
    for _ in 0..3 {
        a.placed.note(now_ms);
    }
    let placed = |rt: &Runtime| -> Vec<f64> {
        let table = rt.table();
        let route = table.route("alias").unwrap();
        route.candidates(now).iter().map(|c| c.placed).collect()
    };
    assert_eq!(placed(&rt), [3.0, 0.0]);
    rt.reload().unwrap();
    assert_eq!(placed(&rt), [3.0, 0.0]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Regression: checks switched off for a provider the probes had marked down left
/// it ineligible forever (nothing probed it back up): no eligible target, /ready 503.
#[test]
fn switching_health_checks_off_makes_a_down_provider_eligible_again() {
    let text = routes(&["hoff"], "round_robin", None);
    let (dir, path) = routes_file("health", &text);
    let rt = Runtime::load_with(&path, static_ctx()).unwrap();
    let health = rt.registry().provider_health("hoff");
    assert!(health.observe(false, 1, 1));
    let gauge = || METRICS.provider_healthy.with_label_values(&["hoff"]);
    gauge().set(0);
    assert!(!rt.table().has_eligible_target());

    let off = text.replace(
        "[providers.lmcache]",
        "[providers.health]\nenabled = false\n[providers.lmcache]",
    );
    std::fs::write(&path, off).unwrap();
    rt.reload().unwrap();
    assert!(rt.table().has_eligible_target());
    assert!(Arc::ptr_eq(&health, &rt.registry().provider_health("hoff")));
    // A probe that was still running lands after the reload: ignored.
    assert!(!health.observe(false, 1, 1));
    assert!(rt.table().has_eligible_target());
    let exported = crate::metrics::render();
    assert!(
        !String::from_utf8_lossy(&exported).contains("provider=\"hoff\""),
        "the stale down gauge stays"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Regression: a target a reload removed kept its upstream TTFB and latency
/// histogram series (its in-flight and trie series were dropped).
#[test]
fn a_removed_target_loses_its_upstream_histograms() {
    let (dir, path) = routes_file("forget", &routes(&["fgt-a", "fgt-b"], "round_robin", None));
    let rt = Runtime::load_with(&path, static_ctx()).unwrap();
    let b = rt.registry().get_or_create(&key("fgt-b"));
    b.observe_upstream(Duration::from_millis(5), Duration::from_millis(9));
    let exported = || String::from_utf8(crate::metrics::render()).unwrap();
    for series in [
        "rolter_upstream_ttfb_seconds_count",
        "rolter_upstream_latency_seconds_count",
    ] {
        assert!(exported().contains(&format!("{series}{{target=\"fgt-b/m\"}} 1")));
    }
    std::fs::write(&path, routes(&["fgt-a"], "round_robin", None)).unwrap();
    rt.reload().unwrap();
    // A request still in flight on the removed state does not bring them back.
    b.observe_upstream(Duration::from_millis(5), Duration::from_millis(9));
    let text = exported();
    assert!(!text.contains("target=\"fgt-b/m\""), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Regression: a reload changing `kv_events.max_blocks` was accepted but ignored:
/// the provider's index kept the cap it was created with.
#[test]
fn a_reload_applies_a_new_kv_events_max_blocks_to_the_kept_index() {
    let text = routes(&["mb-a"], "round_robin", None);
    let (dir, path) = routes_file("maxblocks", &text);
    let rt = Runtime::load_with(&path, static_ctx()).unwrap();
    let index = rt.registry().kv_states()[0].1.index.clone();
    assert_eq!(
        index.max_entries(),
        crate::prefix::residency::DEFAULT_MAX_ENTRIES
    );
    let capped = text.replace(
        "endpoint = \"tcp://127.0.0.1:5557\"\n",
        "endpoint = \"tcp://127.0.0.1:5557\"\nmax_blocks = 5\n",
    );
    assert_ne!(capped, text);
    std::fs::write(&path, capped).unwrap();
    rt.reload().unwrap();
    let kept = rt.registry().kv_states()[0].1.index.clone();
    assert!(Arc::ptr_eq(&kept, &index), "the index survives the reload");
    assert_eq!(index.max_entries(), 5);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A `discovery = "dns"` provider named `name` on `fleet.test:8000` (health checks off),
/// with KV-event endpoints `kv` (a template unless `{ip}` is left out), and a
/// round-robin route over it.
fn dns_routes(name: &str, kv: &str) -> String {
    format!(
        r#"[[providers]]
name = "{name}"
kind = "openai_compatible"
api_base = "http://fleet.test:8000"
discovery = "dns"
refresh_s = 5
[providers.health]
enabled = false
[providers.kv_events]
endpoint = "{kv}"
replay_endpoint = "tcp://{{ip}}:5558"
[[routes]]
model = "alias"
strategy = "round_robin"
[[routes.targets]]
provider = "{name}"
model = "m"
"#
    )
}

fn ip(s: &str) -> std::net::IpAddr {
    s.parse().unwrap()
}

/// The `{ip}` template is the only way a DNS provider names its KV-event endpoints, and
/// is for DNS providers only.
#[test]
fn kv_event_endpoint_templates_go_with_dns_discovery_only() {
    let err = config::parse(&dns_routes("t", "tcp://127.0.0.1:5557"), "r.toml")
        .expect_err("a fixed endpoint under dns");
    assert!(err.to_string().contains("use tcp://{ip}:port"), "{err}");
    let fixed =
        routes(&["a"], "round_robin", None).replace("tcp://127.0.0.1:5557", "tcp://{ip}:5557");
    let err = config::parse(&fixed, "r.toml").expect_err("a template without dns");
    assert!(err.to_string().contains("only for discovery"), "{err}");
    let err = config::parse(&dns_routes("t", "tcp://x{ip}:5557"), "r.toml")
        .expect_err("{ip} not the whole host");
    assert!(
        err.to_string().contains("expected tcp://{ip}:port"),
        "{err}"
    );
    assert!(config::parse(&dns_routes("t", "tcp://{ip}:5557"), "r.toml").is_ok());
}

/// Every allowed address is a target of its own with its own KV-event stream; an address
/// the egress policy denies is left out; a name that stops resolving keeps its last good
/// set on a reload and the failure is counted.
#[test]
fn a_dns_provider_has_one_target_and_kv_stream_per_allowed_address() {
    let resolver = Arc::new(StaticResolver::default());
    resolver.set(
        "fleet.test",
        &[ip("127.0.0.2"), ip("169.254.169.254"), ip("127.0.0.1")],
    );
    let ctx = LoadContext {
        resolver: resolver.clone(),
        ..Default::default()
    };
    let (dir, path) = routes_file("dns-build", &dns_routes("dnsb", "tcp://{ip}:5557"));
    let rt = Runtime::load_with(&path, ctx).unwrap();
    let table = rt.table();
    let d = &table.discovered()[0];
    assert_eq!(
        (d.name.as_str(), d.host.as_str(), d.port),
        ("dnsb", "fleet.test", 8000)
    );
    assert_eq!(d.addrs, vec![ip("127.0.0.1"), ip("127.0.0.2")]);
    assert_eq!(d.refresh, Duration::from_secs(5));
    let mut keys: Vec<String> = table.target_keys().iter().map(|k| k.label()).collect();
    keys.sort();
    assert_eq!(keys, ["dnsb@127.0.0.1/m", "dnsb@127.0.0.2/m"]);
    let route = table.route("alias").unwrap();
    for t in &route.targets {
        assert_eq!(t.host, "fleet.test:8000", "requests keep the name as Host");
    }
    let mut streams: Vec<(String, String, Option<String>)> = table
        .kv_streams()
        .iter()
        .map(|e| {
            (
                e.provider.clone(),
                e.spec.endpoint.clone(),
                e.spec.replay_endpoint.clone(),
            )
        })
        .collect();
    streams.sort();
    assert_eq!(
        streams,
        [1, 2].map(|i| (
            format!("dnsb@127.0.0.{i}"),
            format!("tcp://127.0.0.{i}:5557"),
            Some(format!("tcp://127.0.0.{i}:5558"))
        ))
    );

    // The name stops resolving: a reload keeps the last good set, and counts the failure.
    let failed = || {
        METRICS
            .discovery
            .with_label_values(&["dnsb", "failed"])
            .get()
    };
    let before = failed();
    resolver.set("fleet.test", &[]);
    rt.reload().unwrap();
    assert_eq!(rt.table().discovered()[0].addrs, d.addrs);
    assert_eq!(rt.table().target_keys(), table.target_keys());
    assert_eq!(failed(), before + 1);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A target discovery removes is retired and loses all its series, counters included;
/// the one that stays keeps its state.
#[test]
fn an_address_discovery_drops_loses_its_state_and_every_series() {
    let resolver = Arc::new(StaticResolver::default());
    resolver.set("fleet.test", &[ip("127.0.0.1"), ip("127.0.0.2")]);
    let ctx = LoadContext {
        resolver,
        ..Default::default()
    };
    let (dir, path) = routes_file("dns-drop", &dns_routes("dnsd", "tcp://{ip}:5557"));
    let rt = Runtime::load_with(&path, ctx).unwrap();
    let state = |addr: &str| rt.registry().get_or_create(&key(&format!("dnsd@{addr}")));
    let (stays, goes) = (state("127.0.0.1"), state("127.0.0.2"));
    let gone = "dnsd@127.0.0.2";
    METRICS
        .requests
        .with_label_values(&["alias", &format!("{gone}/m"), "200"])
        .inc();
    METRICS
        .breaker_events
        .with_label_values(&[&format!("{gone}/m"), "cooldown"])
        .inc();
    METRICS.health_checks.with_label_values(&[gone, "ok"]).inc();
    assert!(String::from_utf8(crate::metrics::render())
        .unwrap()
        .contains(gone));

    assert!(rt
        .apply_discovered(
            "dnsd",
            "fleet.test",
            8000,
            &[ip("127.0.0.1"), ip("127.0.0.2")],
            &[ip("127.0.0.1")]
        )
        .unwrap());
    assert!(goes.is_retired() && !stays.is_retired());
    assert!(
        Arc::ptr_eq(&stays, &state("127.0.0.1")),
        "the kept target keeps its state"
    );
    assert_eq!(rt.table().discovered()[0].addrs, vec![ip("127.0.0.1")]);
    let text = String::from_utf8(crate::metrics::render()).unwrap();
    assert!(!text.contains(gone), "{text}");
    assert!(
        text.contains("rolter_discovered_addresses{provider=\"dnsd\"} 1"),
        "{text}"
    );
    // Another port or host than the table's, or a set compared with an older one than
    // the live set: nothing done (a reload changed it).
    assert!(!rt
        .apply_discovered(
            "dnsd",
            "other.test",
            8000,
            &[ip("127.0.0.1")],
            &[ip("127.0.0.3")]
        )
        .unwrap());
    assert!(!rt
        .apply_discovered(
            "dnsd",
            "fleet.test",
            8000,
            &[ip("127.0.0.1"), ip("127.0.0.2")],
            &[ip("127.0.0.3")]
        )
        .unwrap());
    assert_eq!(rt.table().discovered()[0].addrs, vec![ip("127.0.0.1")]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A discovery rebuild reuses the live table's route tokenizers and client keys (same
/// config): nothing is read from disk again, and the tokenizer's cache stays warm.
#[test]
fn a_discovery_rebuild_keeps_the_tokenizer_and_client_keys() {
    let resolver = Arc::new(StaticResolver::default());
    resolver.set("fleet.test", &[ip("127.0.0.1")]);
    let ctx = LoadContext {
        resolver,
        ..Default::default()
    };
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tokenizer/llama3")
        .display()
        .to_string();
    let (dir, path) = routes_file(
        "dns-keep",
        &dns_routes("dnsk", "tcp://{ip}:5557").replace(
            "strategy = \"round_robin\"\n",
            &format!("strategy = \"precise_cache_aware\"\ntokenizer = \"{fixture}\"\n"),
        ),
    );
    let keys = dir.join("keys");
    std::fs::write(&keys, "sk-client\n").unwrap();
    let text = std::fs::read_to_string(&path).unwrap()
        + &format!("[auth]\nkeys_file = \"{}\"\n", keys.display());
    std::fs::write(&path, text).unwrap();
    let rt = Runtime::load_with(&path, ctx).unwrap();
    let before = rt.table();
    let tok = before.route("alias").unwrap().tokenizer.clone().unwrap();
    let auth = before.auth.clone().unwrap();
    // The key file goes away: a rebuild must not need it.
    std::fs::remove_file(&keys).unwrap();
    assert!(rt
        .apply_discovered(
            "dnsk",
            "fleet.test",
            8000,
            &[ip("127.0.0.1")],
            &[ip("127.0.0.1"), ip("127.0.0.2")]
        )
        .unwrap());
    let after = rt.table();
    assert_eq!(after.route("alias").unwrap().targets.len(), 2);
    assert!(Arc::ptr_eq(
        &tok,
        after.route("alias").unwrap().tokenizer.as_ref().unwrap()
    ));
    assert!(Arc::ptr_eq(&auth, after.auth.as_ref().unwrap()));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A SIGHUP reload of an unchanged tokenizer directory keeps the loaded tokenizer (and
/// its warm cache); the table is new.
#[test]
fn a_reload_reuses_an_unchanged_tokenizer() {
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tokenizer/llama3")
        .display()
        .to_string();
    let routes = format!(
        "[[providers]]\nname = \"p\"\nkind = \"openai_compatible\"\napi_base = \"http://127.0.0.1:9\"\n\
         [[routes]]\nmodel = \"alias\"\nstrategy = \"precise_cache_aware\"\ntokenizer = \"{fixture}\"\n\
         [[routes.targets]]\nprovider = \"p\"\nmodel = \"m\"\n"
    );
    let (dir, path) = routes_file("tok-reload", &routes);
    let rt = Runtime::load(&path).unwrap();
    let before = rt.table();
    let tok = before.route("alias").unwrap().tokenizer.clone().unwrap();
    rt.reload().unwrap();
    let after = rt.table();
    assert!(!Arc::ptr_eq(&before, &after), "a new table was installed");
    assert!(Arc::ptr_eq(
        &tok,
        after.route("alias").unwrap().tokenizer.as_ref().unwrap()
    ));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A peer's note lands in the route's session table marked as a peer's, and counts as new
/// work on its target only when it was; notes for a route whose strategy does not use them,
/// or for a target this gateway does not have, change nothing.
#[test]
fn a_peers_note_reaches_the_session_table_and_the_share_counts() {
    let text = routes(&["a", "b"], "cache_aware", None)
        + "[[routes]]\nmodel = \"rr\"\nstrategy = \"round_robin\"\n[[routes.targets]]\nprovider = \"a\"\nmodel = \"m\"\n";
    let (dir, path) = routes_file("peer-note", &text);
    let rt = Runtime::load_with(&path, static_ctx()).unwrap();
    let table = rt.table();
    let now_ms = crate::fleet::ms_at(std::time::Instant::now());
    let apply = |route, label, conversation, new_work| {
        let note = crate::peering::wire::Note {
            route,
            label,
            conversation,
            new_work,
        };
        crate::peering::apply(&rt, &table, &note, now_ms)
    };
    assert!(apply("alias", "b/m", 7, true));
    assert!(apply("alias", "b/m", 8, false));
    assert!(!apply("alias", "zz/m", 9, true), "an unknown target");
    assert!(
        !apply("rr", "a/m", 10, true),
        "a strategy that does not use notes"
    );
    assert!(!apply("nope", "a/m", 11, true), "an unknown route");
    let sessions = rt.registry().sessions_of("alias").unwrap();
    assert_eq!(
        sessions.conversation_entry(7, now_ms),
        Some((Arc::from("b/m"), true))
    );
    assert_eq!(
        sessions.conversation_entry(8, now_ms),
        Some((Arc::from("b/m"), true))
    );
    assert_eq!(
        rt.registry()
            .get_or_create(&key("b"))
            .placed
            .estimate(now_ms),
        1.0
    );
    assert_eq!(
        rt.registry()
            .get_or_create(&key("a"))
            .placed
            .estimate(now_ms),
        0.0
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A `[peering]` key is read from its file at load (whitespace around it ignored) and on
/// reload; a missing file or a key under 256 bits rejects the file, naming the key, never
/// showing the value.
#[test]
fn a_peering_key_is_read_at_load_and_a_short_one_is_refused() {
    let base = routes(&["a"], "cache_aware", None);
    let (dir, path) = routes_file("peer-key", &base);
    let key_file = dir.join("peering.key");
    let with_key = format!(
        "{base}\n[peering]\nlisten = \"127.0.0.1:7100\"\npeers = [\"127.0.0.2:7100\"]\nkey_file = \"{}\"\n",
        key_file.display()
    );
    std::fs::write(&path, &with_key).unwrap();
    // The load's error with the key file holding `contents` (none: no file).
    let refused = |contents: Option<&[u8]>| {
        if let Some(c) = contents {
            std::fs::write(&key_file, c).unwrap();
        }
        Runtime::load_with(&path, static_ctx())
            .err()
            .expect("the key was accepted")
            .to_string()
    };
    let err = refused(None);
    assert!(
        err.contains("peering.key_file") && err.contains("cannot read"),
        "{err}"
    );
    let err = refused(Some(b"  short-secret-of-31-bytes-xxxxxx\n"));
    assert!(
        err.contains("peering.key_file") && err.contains("31 bytes"),
        "{err}"
    );
    assert!(!err.contains("short-secret"), "the key leaked: {err}");
    let err = refused(Some(&[0xff; 40]));
    assert!(err.contains("not UTF-8 text"), "{err}");
    std::fs::write(&key_file, format!("{}\n", "ab".repeat(32))).unwrap();
    let rt = Runtime::load_with(&path, static_ctx()).unwrap();
    assert!(rt.table().peering.key.is_some());
    // A reload without the key goes back to unsealed datagrams.
    std::fs::write(
        &path,
        with_key.replace(&format!("key_file = \"{}\"\n", key_file.display()), ""),
    )
    .unwrap();
    rt.reload().unwrap();
    assert!(rt.table().peering.key.is_none());
    // A reload can add one, here from the environment.
    let var = format!("ROLTER_TEST_PEERING_KEY_{}", std::process::id());
    std::env::set_var(&var, "cd".repeat(16));
    let from_env = with_key.replace(
        &format!("key_file = \"{}\"", key_file.display()),
        &format!("key_env = \"{var}\""),
    );
    std::fs::write(&path, from_env).unwrap();
    rt.reload().unwrap();
    assert_eq!(
        rt.table().peering.key.as_ref().map(|k| k.expose().len()),
        Some(32)
    );
    std::env::remove_var(&var);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The peering socket is bound at start: a reload that moves `listen` is refused (the
/// peers list the address this gateway sends from), one that changes `peers` is applied.
#[test]
fn a_reload_refuses_to_move_the_peering_socket_and_applies_new_peers() {
    let base = routes(&["a"], "cache_aware", None);
    let peering = |listen: &str, peer: &str| {
        format!("{base}\n[peering]\nlisten = \"{listen}\"\npeers = [\"{peer}\"]\n")
    };
    let (dir, path) = routes_file("peer-reload", &peering("127.0.0.1:7100", "127.0.0.2:7100"));
    let rt = Runtime::load_with(&path, static_ctx()).unwrap();
    std::fs::write(&path, peering("127.0.0.1:7100", "127.0.0.3:7100")).unwrap();
    rt.reload().unwrap();
    assert!(rt
        .table()
        .peering
        .accepts("127.0.0.3:7100".parse().unwrap()));
    assert!(!rt
        .table()
        .peering
        .accepts("127.0.0.2:7100".parse().unwrap()));
    std::fs::write(&path, peering("127.0.0.1:7200", "127.0.0.3:7100")).unwrap();
    let err = rt.reload().unwrap_err().to_string();
    assert!(err.contains("peering.listen: changed"), "{err}");
    assert_eq!(
        rt.table().peering.listen,
        Some("127.0.0.1:7100".parse().unwrap())
    );
    let _ = std::fs::remove_dir_all(&dir);
}
