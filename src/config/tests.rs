use super::*;

const GOOD: &str = r#"
[[providers]]
name = "a"
kind = "openai_compatible"
api_base = "http://127.0.0.1:8001"

[[providers]]
name = "b"
kind = "openai_compatible"
api_base = "http://localhost:8002/prefix"

[[routes]]
model = "llama"
strategy = "round_robin"
[[routes.targets]]
provider = "a"
model = "meta-llama/Llama-3.1-8B-Instruct"
[[routes.targets]]
provider = "b"
model = "meta-llama/Llama-3.1-8B-Instruct"
weight = 2

[limits]
max_body_bytes = 65536
"#;

#[test]
fn good_file_parses_with_defaults() {
    let c = parse(GOOD, "good.toml").expect("valid");
    assert_eq!(c.providers.len(), 2);
    assert_eq!(c.routes[0].strategy, StrategyKind::RoundRobin);
    assert_eq!(c.routes[0].targets[0].weight, 1);
    assert_eq!(c.routes[0].targets[1].weight, 2);
    assert_eq!(c.limits.max_body_bytes, 65536);
    assert_eq!(c.limits.connect_timeout_ms, DEFAULT_CONNECT_TIMEOUT_MS);
}

#[test]
fn metrics_path_is_a_request_path_or_empty() {
    let c = parse(GOOD, "good.toml").expect("valid");
    assert_eq!(c.providers[0].metrics_path, "/metrics");
    let with = |path: &str| {
        GOOD.replacen(
            "api_base = \"http://127.0.0.1:8001\"",
            &format!("api_base = \"http://127.0.0.1:8001\"\nmetrics_path = {path:?}"),
            1,
        )
    };
    let off = parse(&with(""), "off.toml").expect("\"\" turns the read off");
    assert_eq!(off.providers[0].metrics_path, "");
    assert_eq!(
        parse(&with("/v2/metrics?x=1"), "q.toml")
            .expect("a path")
            .providers[0]
            .metrics_path,
        "/v2/metrics?x=1"
    );
    for bad in ["metrics", "http://x/metrics"] {
        let err = parse(&with(bad), "bad.toml").unwrap_err().to_string();
        assert!(
            err.contains("providers[0].metrics_path: must start with '/'"),
            "{bad}: {err}"
        );
    }
    let err = parse(&with("/me trics"), "bad.toml")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("providers[0].metrics_path: not a valid request path"),
        "{err}"
    );
}

#[test]
fn every_problem_is_reported_on_its_own_line() {
    let bad = GOOD
        .replace(
            "api_base = \"http://localhost:8002/prefix\"",
            "api_base = \"ftp//nope\"\ncolour = \"red\"",
        )
        .replace("provider = \"a\"", "provider = \"zzz\"");
    let err = parse(&bad, "bad.toml").unwrap_err();
    let text = err.to_string();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(lines.iter().all(|l| l.starts_with("bad.toml: ")), "{text}");
    assert!(text.contains("providers.1.colour: unknown key"), "{text}");
    assert!(
        text.contains("routes[0].targets[0].provider: unknown provider \"zzz\""),
        "{text}"
    );
    assert!(
        text.contains("providers[1].api_base: bad URL \"ftp//nope\""),
        "{text}"
    );
}

#[test]
fn bad_strategy_names_line_and_choices() {
    let bad = GOOD.replace("round_robin", "fastest");
    let text = parse(&bad, "s.toml").unwrap_err().to_string();
    assert_eq!(text.lines().count(), 1, "{text}");
    assert!(text.contains("line 14"), "{text}");
    assert!(
        text.contains("fastest") && text.contains("least_load"),
        "{text}"
    );
}

#[test]
fn duplicates_and_empty_routes_are_rejected() {
    let bad = format!(
        "{GOOD}\n[[providers]]\nname = \"a\"\nkind = \"openai_compatible\"\napi_base = \"http://h:1\"\n\
         [[routes]]\nmodel = \"llama\"\nstrategy = \"least_load\"\n"
    );
    let problems = parse(&bad, "d.toml").unwrap_err().problems();
    assert!(
        problems
            .iter()
            .any(|p| p.contains("duplicate provider name \"a\"")),
        "{problems:?}"
    );
    assert!(
        problems
            .iter()
            .any(|p| p.contains("duplicate route for model \"llama\"")),
        "{problems:?}"
    );
    assert!(
        problems
            .iter()
            .any(|p| p.contains("routes[1].targets: a route needs at least one target")),
        "{problems:?}"
    );
}

#[test]
fn api_base_shapes() {
    assert!(validate::check_api_base("http://10.0.0.1:8000").is_ok());
    assert!(validate::check_api_base("http://vllm-1:8000/v0").is_ok());
    assert!(validate::check_api_base("https://x:1").is_err());
    assert!(validate::check_api_base("localhost:8000").is_err());
    assert!(validate::check_api_base("http://u:p@h:1").is_err());
    assert!(validate::check_api_base("not a url").is_err());
}

/// GOOD with `[providers.lmcache]` under provider "b" (the second provider).
fn with_lmcache(section: &str) -> String {
    GOOD.replace(
        "api_base = \"http://localhost:8002/prefix\"\n",
        &format!("api_base = \"http://localhost:8002/prefix\"\n[providers.lmcache]\n{section}\n"),
    )
}

#[test]
fn lmcache_section_and_strategy_parse_with_defaults() {
    let text = with_lmcache("endpoint = \"http://vllm-2:9000/cache/status\"")
        .replace("round_robin", "lmcache_aware");
    let c = parse(&text, "l.toml").expect("valid");
    assert_eq!(c.routes[0].strategy, StrategyKind::LmcacheAware);
    assert_eq!(c.routes[0].strategy.as_str(), "lmcache_aware");
    assert!(c.providers[0].lmcache.is_none());
    let l = c.providers[1].lmcache.as_ref().unwrap();
    assert_eq!(l.endpoint, "http://vllm-2:9000/cache/status");
    assert_eq!(l.interval_ms, DEFAULT_LMCACHE_INTERVAL_MS);
    assert_eq!(l.timeout_ms, DEFAULT_LMCACHE_TIMEOUT_MS);
    assert_eq!(l.stale_after_ms, DEFAULT_LMCACHE_STALE_AFTER_MS);
    assert!(c.egress.allow.is_empty() && c.egress.deny.is_empty());
    assert!(c.egress.deny_defaults);
}

#[test]
fn denied_lmcache_endpoints_fail_naming_provider_key_and_rule() {
    for (endpoint, rule) in [
        (
            "http://169.254.169.254/latest",
            "deny \"169.254.0.0/16\" (built-in",
        ),
        (
            "http://metadata.google.internal/status",
            "deny \"metadata.google.internal\" (built-in: GCP metadata service)",
        ),
        (
            "http://[fd00:ec2::254]:80/",
            "deny \"fd00:ec2::254/128\" (built-in",
        ),
        (
            "http://100.100.100.200/",
            "deny \"100.100.100.200/32\" (built-in",
        ),
    ] {
        let text = with_lmcache(&format!("endpoint = \"{endpoint}\""));
        let problems = parse(&text, "e.toml").unwrap_err().problems();
        assert_eq!(problems.len(), 1, "{problems:?}");
        let p = &problems[0];
        assert!(
            p.starts_with("providers[1].lmcache.endpoint: provider \"b\": "),
            "{p}"
        );
        assert!(
            p.contains("is denied by egress rule") && p.contains(rule),
            "{p}"
        );
    }
    // A rule of the operator's own, with its key.
    let text = format!(
        "{}\n[egress]\ndeny = [\"10.0.0.0/8\", \".internal\"]\n",
        with_lmcache("endpoint = \"http://status.internal:9000/s\"")
    );
    let err = parse(&text, "o.toml").unwrap_err().to_string();
    assert_eq!(
        err,
        "o.toml: providers[1].lmcache.endpoint: provider \"b\": host \"status.internal\" is denied \
         by egress rule deny \".internal\" (egress.deny[1])"
    );
}

#[test]
fn egress_applies_to_api_base_and_allow_lists() {
    let text = format!("{GOOD}\n[egress]\nallow = [\"10.0.0.0/8\"]\n");
    let problems = parse(&text, "a.toml").unwrap_err().problems();
    // 127.0.0.1 is a literal: refused now; "localhost" may still resolve into 10/8.
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(
        problems[0],
        "providers[0].api_base: provider \"a\": address 127.0.0.1 matches no egress allow rule (egress.allow)"
    );
    let text = format!("{GOOD}\n[egress]\nallow = [\"127.0.0.0/8\", \"localhost\"]\n");
    assert!(parse(&text, "a.toml").is_ok());
    let text = GOOD.replace("127.0.0.1:8001", "169.254.1.1:8001");
    let problems = parse(&text, "a.toml").unwrap_err().problems();
    assert!(
        problems[0]
            .starts_with("providers[0].api_base: provider \"a\": address 169.254.1.1 is denied"),
        "{problems:?}"
    );
    // Built-in rules can be switched off as a whole.
    let text = format!("{text}\n[egress]\ndeny_defaults = false\n");
    assert!(parse(&text, "a.toml").is_ok());
}

#[test]
fn bad_egress_entries_and_lmcache_values_are_each_reported() {
    let text = format!(
        "{}\n[egress]\nallow = [\"10.0.0.0/40\"]\ndeny = [\"*.corp\"]\nmode = \"strict\"\n",
        with_lmcache(
            "endpoint = \"https://vllm-2:9000/s\"\ninterval_ms = 0\ntimeout_ms = 500\nstale_after_ms = 400"
        )
    );
    let problems = parse(&text, "b.toml").unwrap_err().problems();
    let expect = [
        "egress.mode: unknown key",
        "providers[1].lmcache.endpoint: bad URL \"https://vllm-2:9000/s\": unsupported scheme \"https\"",
        "providers[1].lmcache.interval_ms: must be greater than 0",
        "providers[1].lmcache.stale_after_ms: must be at least interval_ms + timeout_ms (500)",
        "egress.allow[0]: \"10.0.0.0/40\": not a valid CIDR",
        "egress.deny[0]: \"*.corp\": write \".corp\"",
    ];
    assert_eq!(problems.len(), expect.len(), "{problems:#?}");
    for (p, e) in problems.iter().zip(expect) {
        assert!(p.starts_with(e), "{p} should start with {e}");
    }
    let text = with_lmcache("endpoint = \"http://h/s\"\ncolour = 1");
    let problems = parse(&text, "c.toml").unwrap_err().problems();
    assert_eq!(problems, vec!["providers.1.lmcache.colour: unknown key"]);
}

#[test]
fn endpoint_egress_problem_is_reusable_for_any_scheme() {
    let policy = crate::egress::EgressPolicy::default();
    assert_eq!(
        endpoint_egress_problem(
            &policy,
            3,
            "vllm-4",
            "kv_events.endpoint",
            "tcp://vllm-4:5557"
        ),
        None
    );
    let p = endpoint_egress_problem(
        &policy,
        3,
        "vllm-4",
        "kv_events.endpoint",
        "tcp://169.254.169.254:5557",
    )
    .unwrap();
    assert!(
        p.starts_with("providers[3].kv_events.endpoint: provider \"vllm-4\": address 169.254.169.254 is denied by egress rule deny \"169.254.0.0/16\""),
        "{p}"
    );
}

/// Regression (fuzz/fuzz_targets/config_parse.rs): keys and values quoted in a problem
/// may hold control characters; each problem must still be exactly one line.
#[test]
fn control_characters_in_keys_and_values_stay_on_one_line() {
    let text = GOOD.replace(
        "api_base = \"http://localhost:8002/prefix\"",
        "api_base = \"http://x\\ny\"\n\"a\\nb\\r\\u0007\" = 1",
    ) + "\"top\\nkey\" = 2\n";
    let err = parse(&text, "nl.toml").unwrap_err();
    let message = err.to_string();
    let lines: Vec<&str> = message.lines().collect();
    assert_eq!(lines.len(), err.problems().len(), "{message}");
    assert!(
        lines.iter().all(|l| l.starts_with("nl.toml: ")),
        "{message}"
    );
    assert!(message.contains("a\\nb\\r\\u{7}: unknown key"), "{message}");
    assert!(message.contains("top\\nkey: unknown key"), "{message}");
    assert!(message.contains("bad URL \"http://x\\ny\""), "{message}");
    // A syntax error quoting such a key is one line too.
    let err = parse("\"a\\nb\" = 1\n\"a\\nb\" = 2\n", "dup.toml").unwrap_err();
    assert_eq!(err.to_string().lines().count(), 1, "{err}");
}

#[test]
fn kv_cache_tokens_and_prompt_bytes_per_token() {
    let c = parse(GOOD, "good.toml").unwrap();
    assert_eq!(c.providers[0].kv_cache_tokens, None);
    assert_eq!(
        c.routes[0].prompt_bytes_per_token,
        crate::routing::cache_aware::DEFAULT_PROMPT_BYTES_PER_TOKEN
    );
    let sized = GOOD
        .replace(
            "api_base = \"http://127.0.0.1:8001\"",
            "api_base = \"http://127.0.0.1:8001\"\nkv_cache_tokens = 131072",
        )
        .replace(
            "strategy = \"round_robin\"",
            "strategy = \"cache_aware\"\nprompt_bytes_per_token = 6.5",
        );
    let c = parse(&sized, "sized.toml").unwrap();
    assert_eq!(c.providers[0].kv_cache_tokens, Some(131072));
    assert_eq!(c.routes[0].prompt_bytes_per_token, 6.5);
    let err = parse(&sized.replace("= 131072", "= 0"), "zero.toml")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("providers[0].kv_cache_tokens: must be greater than 0"),
        "{err}"
    );
    for bad in ["0", "-1", "65.0", "nan"] {
        let text = GOOD.replace(
            "strategy = \"round_robin\"",
            &format!("strategy = \"cache_aware\"\nprompt_bytes_per_token = {bad}"),
        );
        let err = parse(&text, "bad.toml").unwrap_err().to_string();
        assert!(
            err.contains("routes[0].prompt_bytes_per_token"),
            "{bad}: {err}"
        );
    }
}

/// Regression: a health path with a space or a control character passed the leading-'/'
/// check and then panicked the health prober, stopping every active health check.
#[test]
fn health_path_the_prober_cannot_request_is_rejected() {
    for path in ["/health check", "/health\\u0007", "/a\\tb"] {
        let text = GOOD.replace(
            "api_base = \"http://127.0.0.1:8001\"",
            &format!("api_base = \"http://127.0.0.1:8001\"\n[providers.health]\npath = \"{path}\""),
        );
        let problems = parse(&text, "h.toml").unwrap_err().problems();
        assert_eq!(problems.len(), 1, "{path}: {problems:?}");
        assert!(
            problems[0].starts_with("providers[0].health.path: not a valid request path"),
            "{path}: {problems:?}"
        );
    }
    let text = GOOD.replace(
        "api_base = \"http://127.0.0.1:8001\"",
        "api_base = \"http://127.0.0.1:8001\"\n[providers.health]\npath = \"/v1/health?x=1\"",
    );
    assert!(parse(&text, "h.toml").is_ok());
}

/// Regression: `tcp://a:b:5557` or a host with a space passed the endpoint check, then
/// the loader found no host in it and panicked (`expect("validated zmq endpoint")`), at
/// start and under `-t`.
#[test]
fn zmq_endpoints_the_loader_cannot_resolve_are_rejected() {
    for ok in [
        "tcp://vllm-1:5557",
        "tcp://10.0.0.1:5557",
        "tcp://[::1]:5557",
        "tcp://*:5557",
        "tcp://0.0.0.0:5557",
        "tcp://[::]:5557",
    ] {
        assert_eq!(validate::check_zmq_endpoint(ok), Ok(()), "{ok}");
    }
    for key in ["endpoint", "replay_endpoint"] {
        for bad in ["tcp://a:b:5557", "tcp://host name:5557", "tcp://h\\u0007:1"] {
            let section = if key == "endpoint" {
                format!("endpoint = \"{bad}\"")
            } else {
                format!("endpoint = \"tcp://h:1\"\nreplay_endpoint = \"{bad}\"")
            };
            let text = GOOD.replace(
                "api_base = \"http://127.0.0.1:8001\"",
                &format!("api_base = \"http://127.0.0.1:8001\"\n[providers.kv_events]\n{section}"),
            );
            let problems = parse(&text, "z.toml").unwrap_err().problems();
            assert_eq!(problems.len(), 1, "{bad}: {problems:?}");
            assert!(
                problems[0].starts_with(&format!("providers[0].kv_events.{key}: bad endpoint")),
                "{bad}: {problems:?}"
            );
        }
    }
}

/// Regression: `[routes.timeouts]` accepted 0 for the connect and read timeouts (refused
/// under `[limits]`): every request on the route failed 504 and tripped the breakers of
/// targets shared with other routes.
#[test]
fn zero_route_connect_and_read_timeouts_are_rejected() {
    let with = |timeouts: &str| {
        GOOD.replace(
            "[limits]",
            &format!("[routes.timeouts]\n{timeouts}\n\n[limits]"),
        )
    };
    let problems = parse(
        &with("connect_timeout_ms = 0\nread_timeout_ms = 0"),
        "t.toml",
    )
    .unwrap_err()
    .problems();
    assert_eq!(
        problems,
        vec![
            "routes[0].timeouts.connect_timeout_ms: must be greater than 0",
            "routes[0].timeouts.read_timeout_ms: must be greater than 0",
        ]
    );
    let c = parse(
        &with("connect_timeout_ms = 1\nread_timeout_ms = 1\ntotal_timeout_ms = 0"),
        "t.toml",
    )
    .expect("0 total means no limit");
    assert_eq!(c.routes[0].timeouts.read_timeout_ms, Some(1));
}

/// Regression: `session_ttl_s = 18446744073709552` passed; the session table's
/// `ttl_s * 1000` then overflowed (a panic in debug, a 384 ms TTL in release).
#[test]
fn session_ttl_is_bounded_to_30_days() {
    let with = |ttl: u64| {
        GOOD.replace(
            "strategy = \"round_robin\"",
            &format!("strategy = \"round_robin\"\nsession_ttl_s = {ttl}"),
        )
    };
    let max = crate::routing::session::MAX_SESSION_TTL_S;
    assert_eq!(max, 2_592_000);
    assert!(parse(&with(max), "s.toml").is_ok());
    for ttl in [max + 1, 18_446_744_073_709_552] {
        let problems = parse(&with(ttl), "s.toml").unwrap_err().problems();
        assert_eq!(
            problems,
            vec!["routes[0].session_ttl_s: must be at most 2592000 (30 days)"]
        );
    }
}

/// `[providers.kv_events] max_message_bytes`: defaulted, and refused outside its range.
#[test]
fn kv_events_max_message_bytes_is_defaulted_and_bounded() {
    let with = |extra: &str| {
        GOOD.replace(
            "api_base = \"http://127.0.0.1:8001\"",
            &format!(
                "api_base = \"http://127.0.0.1:8001\"\n[providers.kv_events]\n\
                 endpoint = \"tcp://127.0.0.1:5557\"\n{extra}"
            ),
        )
    };
    let cfg = parse(&with(""), "z.toml").unwrap();
    let kv = cfg.providers[0].kv_events.as_ref().unwrap();
    assert_eq!(kv.max_message_bytes, super::DEFAULT_MAX_MESSAGE_BYTES);
    for bad in [0u64, 65_535, (1 << 30) + 1] {
        let problems = parse(&with(&format!("max_message_bytes = {bad}")), "z.toml")
            .unwrap_err()
            .problems();
        assert_eq!(problems.len(), 1, "{bad}: {problems:?}");
        assert!(
            problems[0].starts_with("providers[0].kv_events.max_message_bytes: must be between"),
            "{bad}: {problems:?}"
        );
    }
    assert!(parse(&with("max_message_bytes = 65536"), "z.toml").is_ok());
}

#[test]
fn client_connection_limits_have_defaults_and_bounds() {
    let c = parse(GOOD, "good.toml").expect("valid");
    assert_eq!(c.limits.max_connections, DEFAULT_MAX_CONNECTIONS);
    assert_eq!(
        c.limits.client_header_timeout_ms,
        DEFAULT_CLIENT_HEADER_TIMEOUT_MS
    );
    assert_eq!(c.limits.max_header_bytes, DEFAULT_MAX_HEADER_BYTES);
    assert_eq!(c.forwarding.x_forwarded_for, XForwardedFor::Append);
    let at_pingoras = GOOD.replace(
        "max_body_bytes = 65536",
        "max_body_bytes = 65536\nmax_header_bytes = 1048575\n[forwarding]\nx_forwarded_for = \"replace\"",
    );
    let c = parse(&at_pingoras, "max.toml").expect("valid");
    assert_eq!(c.limits.max_header_bytes, PINGORA_MAX_HEADER_BYTES);
    assert_eq!(c.forwarding.x_forwarded_for, XForwardedFor::Replace);
    let bad = GOOD.replace(
        "max_body_bytes = 65536",
        "max_body_bytes = 65536\nmax_connections = 0\nclient_header_timeout_ms = 0\nmax_header_bytes = 1048576",
    );
    let text = parse(&bad, "bad.toml").unwrap_err().to_string();
    for line in [
        "limits.max_connections: must be greater than 0",
        "limits.client_header_timeout_ms: must be greater than 0",
        "limits.max_header_bytes: must be at most 1048575",
    ] {
        assert!(text.contains(line), "{line} missing in {text}");
    }
    let text = parse(
        &format!("{GOOD}\n[forwarding]\nx_forwarded_for = \"sometimes\"\n"),
        "xff.toml",
    )
    .unwrap_err()
    .to_string();
    assert!(
        text.contains("unknown variant `sometimes`, expected one of `append`, `replace`, `off`"),
        "{text}"
    );
}

/// The placement rule's keys: defaulted to the documented values, refused outside their
/// ranges (one line each), and carried into the route's rule.
#[test]
fn placement_keys_are_defaulted_and_bounded() {
    let with = |extra: &str| {
        GOOD.replace(
            "strategy = \"round_robin\"",
            &format!("strategy = \"cache_aware\"\n{extra}"),
        )
    };
    let c = parse(&with(""), "p.toml").unwrap();
    let rule = c.routes[0].placement_rule();
    assert_eq!(rule, crate::routing::placement::PlacementRule::default());
    assert_eq!(rule.load_cost_tokens, 200.0);
    assert_eq!((rule.balance_abs, rule.balance_rel), (5, 1.3));
    assert_eq!(rule.load_bound, 1.5);
    assert_eq!(rule.share_bound, 1.15);
    assert!(rule.group_homes);
    // Pipeline has its own `balance_abs` default; a set value applies to every strategy.
    assert_eq!(c.routes[0].pipeline_rule().balance_abs, 6);
    let set = parse(&with("balance_abs = 4"), "p.toml").unwrap();
    assert_eq!(set.routes[0].placement_rule().balance_abs, 4);
    assert_eq!(set.routes[0].pipeline_rule().balance_abs, 4);
    let c = parse(
        &with("load_cost_tokens = 0\nbalance_abs = 0\nbalance_rel = 1.0\nload_bound = 0\ngroup_homes = false\nshare_bound = 0"),
        "p.toml",
    )
    .unwrap();
    assert_eq!(c.routes[0].placement_rule().balance_abs, 0);
    assert_eq!(c.routes[0].placement_rule().load_bound, 0.0);
    assert_eq!(c.routes[0].placement_rule().share_bound, 0.0);
    assert!(!c.routes[0].placement_rule().group_homes);
    for (bad, key) in [
        ("load_cost_tokens = -1.0", "load_cost_tokens"),
        ("load_cost_tokens = nan", "load_cost_tokens"),
        ("load_cost_tokens = 2e6", "load_cost_tokens"),
        ("balance_abs = 1000001", "balance_abs"),
        ("balance_rel = 0.9", "balance_rel"),
        ("balance_rel = inf", "balance_rel"),
        ("load_bound = 0.5", "load_bound"),
        ("load_bound = nan", "load_bound"),
        ("share_bound = 0.9", "share_bound"),
        ("share_bound = nan", "share_bound"),
        ("prompt_bytes_per_token = 1e-306", "prompt_bytes_per_token"),
    ] {
        let problems = parse(&with(bad), "p.toml").unwrap_err().problems();
        assert_eq!(problems.len(), 1, "{bad}: {problems:?}");
        assert!(
            problems[0].starts_with(&format!("routes[0].{key}: must be")),
            "{bad}: {problems:?}"
        );
    }
}

#[test]
fn peering_takes_ip_port_literals_allowed_by_egress() {
    let c = parse(
        &format!("{GOOD}\n[peering]\nlisten = \"127.0.0.1:7100\"\npeers = [\"127.0.0.2:7100\", \"127.0.0.1:7102\"]\n"),
        "p.toml",
    )
    .expect("valid");
    assert_eq!(c.peering.listen.as_deref(), Some("127.0.0.1:7100"));
    assert_eq!(c.peering.peers.len(), 2);
    assert_eq!(
        parse(GOOD, "p.toml").unwrap().peering,
        PeeringConfig::default()
    );
    let problems = |section: &str| {
        parse(&format!("{GOOD}\n{section}"), "p.toml")
            .unwrap_err()
            .problems()
    };
    assert_eq!(
        problems("[peering]\nlisten = \"127.0.0.1:7100\"\n"),
        ["peering.peers: must name at least one peer"]
    );
    assert_eq!(
        problems("[peering]\npeers = [\"127.0.0.1:7101\"]\n"),
        ["peering.listen: must be set when peers are"]
    );
    assert_eq!(
        problems("[peering]\nlisten = \"gw-1:7100\"\npeers = [\"gw-2:7100\", \"127.0.0.1:0\"]\n"),
        [
            "peering.listen: \"gw-1:7100\" is not an ip:port address",
            "peering.peers[0]: \"gw-2:7100\" is not an ip:port address",
            "peering.peers[1]: \"127.0.0.1:0\" is not an ip:port address",
        ]
    );
    assert_eq!(
        problems(
            "[peering]\nlisten = \"127.0.0.1:7100\"\npeers = [\"127.0.0.1:7100\", \"127.0.0.1:7101\", \"127.0.0.1:7101\"]\n"
        ),
        [
            "peering.peers[0]: is this gateway's own listen address",
            "peering.peers[2]: duplicate peer 127.0.0.1:7101",
        ]
    );
    assert_eq!(
        problems(
            "[peering]\nlisten = \"0.0.0.0:7100\"\npeers = [\"10.0.0.12:7100\", \"[fd00::12]:7100\"]\n"
        ),
        [
            "peering.listen: 0.0.0.0:7100 is not a specific address (peers accept notes only from the address they list for this gateway)",
            "peering.peers[1]: [fd00::12]:7100 cannot be reached from listen's address family",
        ]
    );
    assert_eq!(
        problems(
            "[peering]\nlisten = \"127.0.0.1:7100\"\npeers = [\"127.0.0.1:7101\"]\nkey_file = \"k\"\nkey_env = \"K\"\n"
        ),
        ["peering: key_file and key_env are exclusive (one key for the group)"]
    );
    assert_eq!(
        problems("[peering]\nkey_env = \"K\"\n"),
        ["peering.listen: must be set when a key is"]
    );
    let denied =
        problems("[peering]\nlisten = \"10.0.0.11:7100\"\npeers = [\"169.254.169.254:7100\"]\n");
    assert_eq!(denied.len(), 1, "{denied:?}");
    assert!(
        denied[0].starts_with("peering.peers[0]: address 169.254.169.254 is denied by egress rule"),
        "{denied:?}"
    );
}
