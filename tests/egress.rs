//! The egress policy on resolved addresses when routes are built (in-process, with the
//! injectable test resolver: no DNS, no sockets).

use rolter::config;
use rolter::egress::StaticResolver;
use rolter::fleet::Registry;
use rolter::runtime::{LoadContext, LoadError, RouteTable};
use std::net::IpAddr;
use std::sync::Arc;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn routes(api_base: &str, lmcache: Option<&str>, egress: &str) -> String {
    let lmcache = lmcache.map_or(String::new(), |e| {
        format!("[providers.lmcache]\nendpoint = \"{e}\"\n")
    });
    format!(
        "[[providers]]\nname = \"vllm-1\"\nkind = \"openai_compatible\"\napi_base = \"{api_base}\"\n{lmcache}\n\
         [[routes]]\nmodel = \"m\"\nstrategy = \"lmcache_aware\"\n\
         [[routes.targets]]\nprovider = \"vllm-1\"\nmodel = \"up\"\n{egress}"
    )
}

fn build(text: &str, ctx: &LoadContext) -> Result<RouteTable, LoadError> {
    let config = config::parse(text, "r.toml").expect("valid before resolution");
    RouteTable::build_with(&config, "r.toml", &Registry::default(), ctx)
}

fn ctx(names: &[(&str, &[&str])]) -> LoadContext {
    let resolver = StaticResolver::default();
    for (name, addrs) in names {
        resolver.set(name, &addrs.iter().map(|a| ip(a)).collect::<Vec<_>>());
    }
    LoadContext {
        resolver: Arc::new(resolver),
        ..Default::default()
    }
}

#[test]
fn an_api_base_name_with_one_denied_address_fails_the_load() {
    let ctx = ctx(&[("vllm.test", &["127.0.0.1", "169.254.169.254"])]);
    let err = build(&routes("http://vllm.test:8000", None, ""), &ctx)
        .err()
        .expect("denied")
        .to_string();
    assert!(
        err.starts_with(
            "r.toml: providers[0].api_base: provider \"vllm-1\": address 169.254.169.254 of \"vllm.test\" \
             is denied by egress rule deny \"169.254.0.0/16\" (built-in: IPv4 link-local"
        ),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
}

#[test]
fn an_lmcache_name_resolving_to_a_denied_address_fails_the_load() {
    let ctx = ctx(&[
        ("vllm.test", &["127.0.0.1"]),
        ("status.test", &["fd00:ec2::254"]),
    ]);
    let text = routes(
        "http://vllm.test:8000",
        Some("http://status.test:9000/cache/status"),
        "",
    );
    let err = build(&text, &ctx).err().expect("denied").to_string();
    assert_eq!(
        err,
        "r.toml: providers[0].lmcache.endpoint: provider \"vllm-1\": address fd00:ec2::254 of \
         \"status.test\" is denied by egress rule deny \"fd00:ec2::254/128\" (built-in: AWS instance metadata over IPv6)"
    );
}

#[test]
fn an_unresolvable_lmcache_name_is_not_fatal_and_binds_a_neutral_cell() {
    let ctx = ctx(&[("vllm.test", &["127.0.0.1"])]);
    let text = routes("http://vllm.test:8000", Some("http://nowhere.test/s"), "");
    let table = build(&text, &ctx).expect("builds");
    let eps = table.lmcache_endpoints();
    assert_eq!(eps.len(), 1);
    assert_eq!(
        (eps[0].provider.as_str(), eps[0].host()),
        ("vllm-1", "nowhere.test")
    );
    let target = &table.route("m").unwrap().targets[0];
    let cell = target.lmcache.as_ref().expect("bound to the route target");
    assert!(Arc::ptr_eq(cell, &eps[0].status));
    assert_eq!(
        cell.view(std::time::Instant::now()),
        None,
        "neutral until polled"
    );
    // A rebuild (reload) with the same context keeps the cell.
    let again = build(&text, &ctx).unwrap();
    assert!(Arc::ptr_eq(&again.lmcache_endpoints()[0].status, cell));
}

#[test]
fn an_allow_list_is_applied_to_resolved_addresses() {
    let egress = "[egress]\nallow = [\"10.0.0.0/8\"]\n";
    let text = routes("http://vllm.test:8000", None, egress);
    assert!(build(&text, &ctx(&[("vllm.test", &["10.0.0.7"])])).is_ok());
    let err = build(&text, &ctx(&[("vllm.test", &["10.0.0.7", "192.168.0.1"])]))
        .err()
        .expect("not allowed")
        .to_string();
    assert_eq!(
        err,
        "r.toml: providers[0].api_base: provider \"vllm-1\": address 192.168.0.1 of \"vllm.test\" \
         matches no egress allow rule (egress.allow)"
    );
    // Unresolvable api_base keeps its own message.
    let err = build(&text, &ctx(&[]))
        .err()
        .expect("unresolvable")
        .to_string();
    assert!(
        err.starts_with("r.toml: providers[0].api_base: cannot resolve \"vllm.test:8000\""),
        "{err}"
    );
}

/// Regression: 0.0.0.0 (and `::`) reach loopback on Linux, but passed a deny rule for it,
/// as a literal in the file and as the address a name resolves to.
#[test]
fn an_unspecified_destination_is_checked_as_loopback() {
    let egress = "[egress]\ndeny = [\"127.0.0.0/8\", \"::1\"]\n";
    for api_base in ["http://0.0.0.0:8001", "http://[::]:8001"] {
        let problems = config::parse(&routes(api_base, None, egress), "r.toml")
            .expect_err("denied literal")
            .problems();
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(
            problems[0].starts_with("providers[0].api_base: provider \"vllm-1\": address ")
                && problems[0].contains("is denied by egress rule deny"),
            "{problems:?}"
        );
    }
    let ctx = ctx(&[("zero.test", &["0.0.0.0"])]);
    let err = build(&routes("http://zero.test:8001", None, egress), &ctx)
        .err()
        .expect("denied address")
        .to_string();
    assert!(
        err.contains("address 0.0.0.0 of \"zero.test\" (which reaches 127.0.0.1) is denied"),
        "{err}"
    );
}

/// `[providers.kv_events]` on provider vllm-1 (whose api_base is a plain loopback).
fn with_kv_events(endpoint: &str) -> String {
    routes("http://127.0.0.1:8001", None, "").replace(
        "\n\n[[routes]]",
        &format!("\n[providers.kv_events]\nendpoint = \"{endpoint}\"\n\n[[routes]]"),
    )
}

/// Regression: a kv_events name resolving to 0.0.0.0 was stored as `tcp://0.0.0.0:port`
/// and the subscriber re-read that as a wildcard bind: the gateway listened instead of
/// connecting. Bind vs connect now comes from the configured text only.
#[test]
fn a_kv_events_name_resolving_to_0_0_0_0_is_still_connected_to() {
    let ctx = ctx(&[("zero.test", &["0.0.0.0"])]);
    let table = build(&with_kv_events("tcp://zero.test:5557"), &ctx).expect("allowed");
    let spec = &table.kv_streams()[0].spec;
    assert_eq!(spec.endpoint, "tcp://0.0.0.0:5557");
    assert!(!spec.bind, "a resolved destination must be connected to");
    for wildcard in ["tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://[::]:5557"] {
        let table = build(&with_kv_events(wildcard), &ctx).expect("bind");
        let spec = &table.kv_streams()[0].spec;
        assert!(spec.bind, "{wildcard}");
        assert_eq!(spec.endpoint, wildcard);
    }
}

/// Regression: a kv_events name that did not resolve was reported under
/// `providers[i].api_base`.
#[test]
fn an_unresolvable_kv_events_name_is_reported_under_its_own_key() {
    let ctx = ctx(&[("kv.test", &["127.0.0.1"])]);
    for (key, text) in [
        ("endpoint", with_kv_events("tcp://nowhere.test:5557")),
        (
            "replay_endpoint",
            with_kv_events("tcp://kv.test:5557").replace(
                "5557\"\n",
                "5557\"\nreplay_endpoint = \"tcp://nowhere.test:5558\"\n",
            ),
        ),
    ] {
        let err = build(&text, &ctx).err().expect("unresolvable").to_string();
        assert!(
            err.starts_with(&format!(
                "r.toml: providers[0].kv_events.{key}: cannot resolve \"nowhere.test:"
            )),
            "{err}"
        );
    }
}
