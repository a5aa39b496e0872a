//! Semantic checks the type system cannot express: references between sections,
//! uniqueness, URL shape, value ranges. Each problem is one line naming its key.

use super::{Config, Discovery, LmcacheConfig, IP_PLACEHOLDER, PINGORA_MAX_HEADER_BYTES};
use crate::egress::{self, EgressPolicy};
use std::collections::HashSet;

/// Largest `load_cost_tokens`: a million tokens per queued request already means "never
/// move for load"; bounded so the cost arithmetic stays far from overflow and infinity.
const MAX_LOAD_COST_TOKENS: f64 = 1e6;
/// Largest `balance_abs`: beyond any realistic in-flight count (`limits.max_inflight`
/// defaults far below it), i.e. "no guard".
const MAX_BALANCE_ABS: u64 = 1_000_000;

/// Every semantic problem in `config`, in file order.
pub(super) fn problems(config: &Config) -> Vec<String> {
    let mut out = Vec::new();
    // Bad `[egress]` entries are reported; the good ones still check the endpoints.
    let (policy, egress_problems) = EgressPolicy::compile(&config.egress);
    let mut names = HashSet::new();
    for (i, p) in config.providers.iter().enumerate() {
        if p.kv_cache_tokens == Some(0) {
            // 0 would read as "unknown" to the placement rule but cap the trie at one chunk.
            out.push(format!(
                "providers[{i}].kv_cache_tokens: must be greater than 0 (omit it when unknown)"
            ));
        }
        if p.name.is_empty() {
            out.push(format!("providers[{i}].name: must not be empty"));
        } else if !names.insert(p.name.as_str()) {
            out.push(format!(
                "providers[{i}].name: duplicate provider name \"{}\"",
                p.name
            ));
        }
        if !p.metrics_path.is_empty() {
            if !p.metrics_path.starts_with('/') {
                out.push(format!(
                    "providers[{i}].metrics_path: must start with '/' (\"\" = never read)"
                ));
            } else if let Err(e) =
                pingora::http::RequestHeader::build("GET", p.metrics_path.as_bytes(), None)
            {
                out.push(format!(
                    "providers[{i}].metrics_path: not a valid request path: {e}"
                ));
            }
        }
        let h = &p.health;
        if !h.path.starts_with('/') {
            out.push(format!("providers[{i}].health.path: must start with '/'"));
        } else if let Err(e) = pingora::http::RequestHeader::build("GET", h.path.as_bytes(), None) {
            // The prober builds exactly this request; a path it cannot build is refused here.
            out.push(format!(
                "providers[{i}].health.path: not a valid request path: {e}"
            ));
        }
        for (key, value) in [
            ("interval_ms", h.interval_ms),
            ("timeout_ms", h.timeout_ms),
            ("healthy_threshold", h.healthy_threshold as u64),
            ("unhealthy_threshold", h.unhealthy_threshold as u64),
        ] {
            if value == 0 {
                out.push(format!(
                    "providers[{i}].health.{key}: must be greater than 0"
                ));
            }
        }
        if let Err(why) = check_api_base(&p.api_base) {
            out.push(format!(
                "providers[{i}].api_base: bad URL \"{}\": {why}",
                p.api_base
            ));
        } else {
            out.extend(endpoint_egress_problem(
                &policy,
                i,
                &p.name,
                "api_base",
                &p.api_base,
            ));
        }
        if p.name.contains('@') {
            // `name@address` names one discovered target (see `runtime::build`).
            out.push(format!("providers[{i}].name: must not contain '@'"));
        }
        if let Some(lmcache) = &p.lmcache {
            if p.discovery == Discovery::Dns {
                out.push(format!(
                    "providers[{i}].lmcache: not supported with discovery = \"dns\" (one status endpoint cannot describe many replicas)"
                ));
            } else {
                out.extend(lmcache_problems(&policy, i, &p.name, lmcache));
            }
        }
        if let Some(kv) = &p.kv_events {
            out.extend(kv_events_problems(&policy, i, &p.name, kv, p.discovery));
        }
        out.extend(key_problems(i, p));
        if p.discovery == Discovery::Dns && !(1..=MAX_DNS_REFRESH_S).contains(&p.refresh_s) {
            out.push(format!(
                "providers[{i}].refresh_s: must be between 1 and {MAX_DNS_REFRESH_S}"
            ));
        }
    }
    let mut aliases = HashSet::new();
    for (i, r) in config.routes.iter().enumerate() {
        if r.model.is_empty() {
            out.push(format!("routes[{i}].model: must not be empty"));
        } else if !aliases.insert(r.model.as_str()) {
            out.push(format!(
                "routes[{i}].model: duplicate route for model \"{}\"",
                r.model
            ));
        }
        if r.targets.is_empty() {
            out.push(format!(
                "routes[{i}].targets: a route needs at least one target"
            ));
        }
        if !(0.0..=1.0).contains(&r.cache_threshold) {
            out.push(format!(
                "routes[{i}].cache_threshold: must be between 0 and 1"
            ));
        }
        if !(r.load_cost_tokens >= 0.0 && r.load_cost_tokens <= MAX_LOAD_COST_TOKENS) {
            out.push(format!(
                "routes[{i}].load_cost_tokens: must be between 0 and {MAX_LOAD_COST_TOKENS}"
            ));
        }
        if r.balance_abs.is_some_and(|v| v > MAX_BALANCE_ABS) {
            out.push(format!(
                "routes[{i}].balance_abs: must be at most {MAX_BALANCE_ABS}"
            ));
        }
        if !(r.balance_rel >= 1.0 && r.balance_rel <= 100.0) {
            out.push(format!(
                "routes[{i}].balance_rel: must be between 1 and 100"
            ));
        }
        if !(r.load_bound == 0.0 || (r.load_bound >= 1.0 && r.load_bound <= 100.0)) {
            out.push(format!(
                "routes[{i}].load_bound: must be 0 (no bound) or between 1 and 100"
            ));
        }
        if !(r.share_bound == 0.0 || (r.share_bound >= 1.0 && r.share_bound <= 100.0)) {
            out.push(format!(
                "routes[{i}].share_bound: must be 0 (no bound) or between 1 and 100"
            ));
        }
        if r.trie_max_nodes < 2 || r.trie_max_nodes > crate::prefix::trie::MAX_NODES_LIMIT {
            out.push(format!(
                "routes[{i}].trie_max_nodes: must be between 2 and {}",
                crate::prefix::trie::MAX_NODES_LIMIT
            ));
        }
        if !(r.prompt_bytes_per_token >= 0.5 && r.prompt_bytes_per_token <= 64.0) {
            out.push(format!(
                "routes[{i}].prompt_bytes_per_token: must be between 0.5 and 64"
            ));
        }
        // 0 would time out every request of the route (504) and trip the breakers of
        // targets it shares with other routes; `[limits]` refuses 0 for the same keys.
        // (`total_timeout_ms = 0` means "no limit", as under `[limits]`.)
        for (key, value) in [
            ("connect_timeout_ms", r.timeouts.connect_timeout_ms),
            ("read_timeout_ms", r.timeouts.read_timeout_ms),
        ] {
            if value == Some(0) {
                out.push(format!(
                    "routes[{i}].timeouts.{key}: must be greater than 0"
                ));
            }
        }
        if r.session_ttl_s == 0 || r.session_cap == 0 {
            out.push(format!(
                "routes[{i}]: session_ttl_s and session_cap must be greater than 0"
            ));
        }
        if r.session_ttl_s > crate::routing::session::MAX_SESSION_TTL_S {
            out.push(format!(
                "routes[{i}].session_ttl_s: must be at most {} (30 days)",
                crate::routing::session::MAX_SESSION_TTL_S
            ));
        }
        let w = &r.pipeline;
        for (key, v) in [
            ("static_weight", w.static_weight),
            ("load", w.load),
            ("prefix", w.prefix),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                out.push(format!(
                    "routes[{i}].pipeline.{key}: must be a finite number >= 0"
                ));
            }
        }
        let mut seen = HashSet::new();
        for (j, t) in r.targets.iter().enumerate() {
            if !names.contains(t.provider.as_str()) {
                out.push(format!(
                    "routes[{i}].targets[{j}].provider: unknown provider \"{}\"",
                    t.provider
                ));
            }
            if t.model.is_empty() {
                out.push(format!("routes[{i}].targets[{j}].model: must not be empty"));
            }
            if t.weight == 0 {
                out.push(format!(
                    "routes[{i}].targets[{j}].weight: must be at least 1"
                ));
            }
            if !seen.insert((t.provider.as_str(), t.model.as_str())) {
                out.push(format!(
                    "routes[{i}].targets[{j}]: duplicate target {}/{}",
                    t.provider, t.model
                ));
            }
        }
    }
    let b = &config.breaker;
    for (key, value) in [
        ("breaker.failure_threshold", b.failure_threshold as u64),
        ("breaker.cooldown_ms", b.cooldown_ms),
        ("breaker.max_cooldown_ms", b.max_cooldown_ms),
        (
            "breaker.open_after_cooldowns",
            b.open_after_cooldowns as u64,
        ),
        ("breaker.open_ms", b.open_ms),
    ] {
        if value == 0 {
            out.push(format!("{key}: must be greater than 0"));
        }
    }
    let l = &config.limits;
    for (key, value) in [
        ("limits.max_body_bytes", l.max_body_bytes as u64),
        ("limits.connect_timeout_ms", l.connect_timeout_ms),
        ("limits.read_timeout_ms", l.read_timeout_ms),
        ("limits.client_body_timeout_ms", l.client_body_timeout_ms),
        (
            "limits.upstream_idle_timeout_ms",
            l.upstream_idle_timeout_ms,
        ),
        ("limits.max_inflight", l.max_inflight as u64),
        ("limits.client_write_timeout_ms", l.client_write_timeout_ms),
        ("limits.max_connections", l.max_connections as u64),
        (
            "limits.client_header_timeout_ms",
            l.client_header_timeout_ms,
        ),
        ("limits.max_header_bytes", l.max_header_bytes as u64),
        (
            "limits.response_affinity_cap",
            l.response_affinity_cap as u64,
        ),
        ("limits.response_affinity_ttl_s", l.response_affinity_ttl_s),
    ] {
        if value == 0 {
            out.push(format!("{key}: must be greater than 0"));
        }
    }
    if l.max_header_bytes > PINGORA_MAX_HEADER_BYTES {
        out.push(format!(
            "limits.max_header_bytes: must be at most {PINGORA_MAX_HEADER_BYTES} (pingora refuses larger header sections itself, with a bare 400)"
        ));
    }
    if l.max_buffered_body_bytes < l.max_body_bytes {
        out.push(format!(
            "limits.max_buffered_body_bytes: must be at least limits.max_body_bytes ({}), or a body at that limit could never be accepted",
            l.max_body_bytes
        ));
    }
    out.extend(retry_problems(&config.retry));
    out.extend(peering_problems(&config.peering, &policy));
    if let Some(auth) = &config.auth {
        if auth.keys_file.is_none() && auth.keys_env.is_none() {
            out.push("auth: needs keys_file or keys_env (or both)".into());
        }
        if auth.keys_env.as_deref() == Some("") {
            out.push("auth.keys_env: must name an environment variable".into());
        }
    }
    out.extend(egress_problems);
    out
}

/// Longest `refresh_s` of a DNS-discovered provider (an hour).
const MAX_DNS_REFRESH_S: u64 = 3_600;
/// Longest retry budget window, seconds.
const MAX_BUDGET_WINDOW_S: u64 = 300;

/// Problems of `[retry]`.
fn retry_problems(r: &super::RetryConfig) -> Vec<String> {
    let mut out = Vec::new();
    if r.retries > super::MAX_RETRIES {
        out.push(format!(
            "retry.retries: must be at most {}",
            super::MAX_RETRIES
        ));
    }
    if r.backoff_ms > r.max_backoff_ms {
        out.push("retry.backoff_ms: must be at most retry.max_backoff_ms".into());
    }
    if r.deadline_ms == 0 {
        out.push("retry.deadline_ms: must be greater than 0".into());
    }
    if !(r.budget_ratio.is_finite() && (0.0..=10.0).contains(&r.budget_ratio)) {
        out.push("retry.budget_ratio: must be between 0 and 10".into());
    }
    if !(1..=MAX_BUDGET_WINDOW_S).contains(&r.budget_window_s) {
        out.push(format!(
            "retry.budget_window_s: must be between 1 and {MAX_BUDGET_WINDOW_S}"
        ));
    }
    out
}

/// Problems of `[peering]`: addresses are `ip:port` literals (a name could later resolve
/// past the egress policy); `listen` a specific address (peers accept notes only from the
/// address they list); each peer of its address family, allowed by `[egress]`, not
/// `listen` itself.
fn peering_problems(p: &super::PeeringConfig, policy: &EgressPolicy) -> Vec<String> {
    let mut out = Vec::new();
    let parse = |key: String, text: &str, out: &mut Vec<String>| match text
        .parse::<std::net::SocketAddr>()
    {
        Ok(a) if a.port() != 0 => Some(a),
        _ => {
            out.push(format!("{key}: \"{text}\" is not an ip:port address"));
            None
        }
    };
    let listen = p
        .listen
        .as_deref()
        .and_then(|l| parse("peering.listen".into(), l, &mut out));
    if let Some(l) = listen.filter(|l| l.ip().is_unspecified()) {
        // A wildcard socket sends from whichever address the route out picks, which the
        // peers may not list (they accept notes only from the addresses they list).
        out.push(format!(
            "peering.listen: {l} is not a specific address (peers accept notes only from the address they list for this gateway)"
        ));
    }
    if p.key_file.is_some() && p.key_env.is_some() {
        out.push("peering: key_file and key_env are exclusive (one key for the group)".into());
    }
    if p.listen.is_none() && (p.key_file.is_some() || p.key_env.is_some()) {
        out.push("peering.listen: must be set when a key is".into());
    }
    match (&p.listen, p.peers.len()) {
        (Some(_), 0) => out.push("peering.peers: must name at least one peer".into()),
        (None, n) if n > 0 => out.push("peering.listen: must be set when peers are".into()),
        (_, n) if n > super::MAX_PEERS => {
            out.push(format!("peering.peers: at most {} peers", super::MAX_PEERS))
        }
        _ => {}
    }
    let mut seen = HashSet::new();
    for (i, text) in p.peers.iter().enumerate() {
        let key = format!("peering.peers[{i}]");
        let Some(addr) = parse(key.clone(), text, &mut out) else {
            continue;
        };
        if Some(addr) == listen {
            out.push(format!("{key}: is this gateway's own listen address"));
        } else if listen.is_some_and(|l| l.is_ipv4() != addr.ip().to_canonical().is_ipv4()) {
            out.push(format!(
                "{key}: {addr} cannot be reached from listen's address family"
            ));
        } else if !seen.insert(addr) {
            out.push(format!("{key}: duplicate peer {addr}"));
        } else if let Err(e) = policy.check_addr(addr.ip()) {
            out.push(format!("{key}: {e}"));
        }
    }
    out
}

/// Problems of a provider's `api_key` / `api_key_env`. A problem never quotes the key.
fn key_problems(i: usize, p: &super::ProviderConfig) -> Vec<String> {
    let mut out = Vec::new();
    if p.api_key.is_some() && p.api_key_env.is_some() {
        out.push(format!(
            "providers[{i}]: api_key and api_key_env are exclusive"
        ));
    }
    if let Some(key) = &p.api_key {
        if let Err(why) = check_api_key(key.expose()) {
            out.push(format!("providers[{i}].api_key: {why}"));
        }
    }
    if p.api_key_env.as_deref() == Some("") {
        out.push(format!(
            "providers[{i}].api_key_env: must name an environment variable"
        ));
    }
    out
}

/// Whether `key` can be sent in an `Authorization: Bearer` header: non-empty, visible
/// ASCII only (no space, no control character). The reason never quotes the key.
pub fn check_api_key(key: &str) -> Result<(), &'static str> {
    if key.is_empty() {
        return Err("must not be empty");
    }
    if !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("must be visible ASCII characters only (no spaces or control characters)");
    }
    Ok(())
}

/// The egress problem of an endpoint a provider names, as one config problem line:
/// `providers[i].<key>: provider "<name>": <host or address> is denied by egress rule ...`.
/// Literal addresses and host names are checked here, before any DNS; the addresses a
/// name resolves to are checked when routes are built (`runtime`) and on every
/// reconnect or poll. `url` is any `scheme://host[:port]/...` (http, tcp, ...); a URL
/// without a host yields nothing here (its shape is the caller's check).
pub fn endpoint_egress_problem(
    policy: &EgressPolicy,
    index: usize,
    provider: &str,
    key: &str,
    url: &str,
) -> Option<String> {
    let (host, _) = egress::url_host_port(url, 0)?;
    let err = policy.check_host(&host).err()?;
    Some(format!(
        "providers[{index}].{key}: provider \"{provider}\": {err}"
    ))
}

/// Whether a ZMQ endpoint is a wildcard bind (`tcp://*:port`): a local listen
/// address, not a destination, so egress does not apply.
pub fn is_bind_endpoint(endpoint: &str) -> bool {
    endpoint.strip_prefix("tcp://").is_some_and(|rest| {
        rest.starts_with("*:") || rest.starts_with("[::]:") || rest.starts_with("0.0.0.0:")
    })
}

/// Check a `tcp://host:port` ZMQ endpoint's shape: a wildcard bind, or exactly what
/// the loader can resolve (the host and port [`egress::url_host_port`] reads).
pub fn check_zmq_endpoint(endpoint: &str) -> Result<(), String> {
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or("expected tcp://host:port")?;
    let (host, port) = rest.rsplit_once(':').ok_or("missing :port")?;
    if host.is_empty() {
        return Err("missing host".into());
    }
    let port = port
        .parse::<u16>()
        .map_err(|_| format!("bad port \"{port}\""))?;
    if is_bind_endpoint(endpoint) {
        return Ok(());
    }
    match egress::url_host_port(endpoint, 0) {
        Some((_, p)) if p == port => Ok(()),
        _ => Err(format!("bad host \"{host}\", expected tcp://host:port")),
    }
}

/// Shape and egress problems of one `[providers.kv_events]`.
fn kv_events_problems(
    policy: &EgressPolicy,
    i: usize,
    name: &str,
    kv: &super::KvEventsConfig,
    discovery: Discovery,
) -> Vec<String> {
    let mut out = Vec::new();
    let endpoints = [
        ("endpoint", Some(&kv.endpoint)),
        ("replay_endpoint", kv.replay_endpoint.as_ref()),
    ];
    for (key, url) in endpoints {
        let Some(url) = url else { continue };
        let templated = url.contains(IP_PLACEHOLDER);
        if !templated && discovery == Discovery::Dns {
            out.push(format!(
                "providers[{i}].kv_events.{key}: with discovery = \"dns\" each address has its own stream: use tcp://{IP_PLACEHOLDER}:port"
            ));
            continue;
        }
        if templated && discovery != Discovery::Dns {
            out.push(format!(
                "providers[{i}].kv_events.{key}: {IP_PLACEHOLDER} is only for discovery = \"dns\""
            ));
            continue;
        }
        // A template's shape is checked with a documentation address in place of
        // `{ip}`; each discovered address is egress-checked when it is found.
        let shape = url.replace(IP_PLACEHOLDER, "192.0.2.1");
        if let Err(why) = check_zmq_endpoint(&shape) {
            out.push(format!(
                "providers[{i}].kv_events.{key}: bad endpoint \"{url}\": {why}"
            ));
        } else if templated {
            if url.matches(IP_PLACEHOLDER).count() != 1 || !url.starts_with("tcp://{ip}:") {
                out.push(format!(
                    "providers[{i}].kv_events.{key}: bad endpoint \"{url}\": expected tcp://{IP_PLACEHOLDER}:port"
                ));
            }
        } else if !(key == "endpoint" && is_bind_endpoint(url)) {
            out.extend(endpoint_egress_problem(
                policy,
                i,
                name,
                &format!("kv_events.{key}"),
                url,
            ));
        }
    }
    if kv.replay_endpoint.as_deref().is_some_and(is_bind_endpoint) {
        out.push(format!(
            "providers[{i}].kv_events.replay_endpoint: must name the replica, not a wildcard"
        ));
    }
    if kv.staleness_ms == 0 || kv.max_blocks == 0 {
        out.push(format!(
            "providers[{i}].kv_events: staleness_ms and max_blocks must be greater than 0"
        ));
    }
    let range = super::MESSAGE_BYTES_RANGE;
    if !range.contains(&kv.max_message_bytes) {
        out.push(format!(
            "providers[{i}].kv_events.max_message_bytes: must be between {} and {}",
            range.start(),
            range.end()
        ));
    }
    out
}

/// Shape, timing and egress problems of one `[providers.lmcache]`.
fn lmcache_problems(
    policy: &EgressPolicy,
    i: usize,
    provider: &str,
    l: &LmcacheConfig,
) -> Vec<String> {
    let mut out = Vec::new();
    match check_status_url(&l.endpoint) {
        Err(why) => out.push(format!(
            "providers[{i}].lmcache.endpoint: bad URL \"{}\": {why}",
            l.endpoint
        )),
        Ok(()) => out.extend(endpoint_egress_problem(
            policy,
            i,
            provider,
            "lmcache.endpoint",
            &l.endpoint,
        )),
    }
    for (key, value) in [
        ("interval_ms", l.interval_ms),
        ("timeout_ms", l.timeout_ms),
        ("stale_after_ms", l.stale_after_ms),
    ] {
        if value == 0 {
            out.push(format!(
                "providers[{i}].lmcache.{key}: must be greater than 0"
            ));
        }
    }
    // A good result must outlive the wait for the next one, or every controller
    // flaps to neutral between polls.
    if l.stale_after_ms < l.interval_ms.saturating_add(l.timeout_ms) {
        out.push(format!(
            "providers[{i}].lmcache.stale_after_ms: must be at least interval_ms + timeout_ms ({})",
            l.interval_ms.saturating_add(l.timeout_ms)
        ));
    }
    out
}

/// A status endpoint URL: `http://host:port/path[?query]`.
pub fn check_status_url(url: &str) -> Result<(), String> {
    let uri: http::Uri = url.parse().map_err(|e| format!("{e}"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some(other) => return Err(format!("unsupported scheme \"{other}\" (plain http only)")),
        None => return Err("missing scheme, expected http://host:port/path".into()),
    }
    let authority = uri.authority().ok_or("missing host")?;
    if authority.host().is_empty() {
        return Err("missing host".into());
    }
    if authority.as_str().contains('@') {
        return Err("credentials in the URL are not supported".into());
    }
    Ok(())
}

/// An upstream base URL: `http://host:port[/prefix]`, nothing else.
pub fn check_api_base(url: &str) -> Result<(), String> {
    let uri: http::Uri = url.parse().map_err(|e| format!("{e}"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => return Err("https upstreams are not supported (plain http only)".into()),
        Some(other) => return Err(format!("unsupported scheme \"{other}\"")),
        None => return Err("missing scheme, expected http://host:port".into()),
    }
    let authority = uri.authority().ok_or("missing host")?;
    if authority.host().is_empty() {
        return Err("missing host".into());
    }
    if authority.as_str().contains('@') {
        return Err("credentials in the URL are not supported".into());
    }
    if uri.query().is_some() {
        return Err("a query string is not allowed".into());
    }
    Ok(())
}
