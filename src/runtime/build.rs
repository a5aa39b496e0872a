//! Turning a validated `Config` into a [`RouteTable`]: every provider address resolved
//! and egress-checked, every strategy constructed, target state found in (or added to) the
//! registry.
//!
//! Owns the load-time work. Must not: be called on the request path (it resolves names).

use super::auth::{self, ClientAuth};
use super::discovery::{self, DiscoveredProvider, DnsBoard};
use super::table::{KvEntry, KvSpec, Route, RouteTable, RouteTarget};
use super::LoadError;
use crate::config::Secret;
use crate::config::{self, Config, Discovery, KvEventsConfig, LmcacheConfig, ProviderConfig};
use crate::config::{RouteConfig, StrategyKind};
use crate::egress::{self, EgressPolicy, OutboundError, Resolver, SystemResolver};
use crate::fleet::cache_size::CacheSizeEndpoint;
use crate::fleet::lmcache::{LmcacheBoard, LmcacheEndpoint};
use crate::fleet::probe::ProviderEntry;
use crate::fleet::{Registry, TargetKey};
use crate::routing::{self, SessionTable, Strategy};
use pingora::upstreams::peer::HttpPeer;
use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// What building a table needs besides the config: the name resolver and the state
/// that outlives one table generation (besides the target [`Registry`]).
pub struct LoadContext {
    /// Resolves every configured host name (injectable for tests).
    pub resolver: Arc<dyn Resolver>,
    /// LMCache status cells, kept across reloads.
    pub lmcache: LmcacheBoard,
    /// The last good address set of every `discovery = "dns"` provider.
    pub dns: DnsBoard,
    /// The live table's route tokenizers, reused by a reload when their files did not
    /// change.
    pub tokenizers: crate::tokenize::board::TokenizerBoard,
}

impl Default for LoadContext {
    /// The system resolver and no status yet.
    fn default() -> Self {
        LoadContext {
            resolver: Arc::new(SystemResolver),
            lmcache: LmcacheBoard::default(),
            dns: DnsBoard::default(),
            tokenizers: Default::default(),
        }
    }
}

/// Where a build takes the addresses of `discovery = "dns"` providers from.
#[derive(Clone, Copy)]
pub(super) enum DnsSource<'a> {
    /// Resolve every name now (a load or reload); a name that does not resolve keeps its
    /// last good set from the [`DnsBoard`] (none yet: no targets until it resolves).
    Resolve,
    /// The board as it stands (a rebuild after the discovery service updated it), from
    /// the same config as this live table: its client keys and route tokenizers are
    /// reused rather than read from disk again (their files may be mid-edit, and a
    /// tokenizer's cache of earlier turns stays warm).
    Board(&'a RouteTable),
}

/// One upstream address a provider stands for: the provider itself (static), or one
/// address its name resolved to (`discovery = "dns"`), with everything that is per
/// address.
struct Instance {
    /// The provider's name, or `name@address` for a discovered address: the identity of
    /// its targets, health, KV-event state and metric labels.
    name: String,
    addr: SocketAddr,
    kv_spec: Option<KvSpec>,
}

impl RouteTable {
    /// Build live routes from a validated config, resolving every provider address.
    pub fn build(config: &Config, origin: &str, registry: &Registry) -> Result<Self, LoadError> {
        Self::build_with(config, origin, registry, &LoadContext::default())
    }

    /// [`build`](Self::build) with a given resolver and LMCache status board.
    pub fn build_with(
        config: &Config,
        origin: &str,
        registry: &Registry,
        ctx: &LoadContext,
    ) -> Result<Self, LoadError> {
        Self::build_from(config, origin, registry, ctx, DnsSource::Resolve)
    }

    /// [`build_with`](Self::build_with), taking discovered addresses from `dns`.
    pub(super) fn build_from(
        config: &Config,
        origin: &str,
        registry: &Registry,
        ctx: &LoadContext,
        dns: DnsSource<'_>,
    ) -> Result<Self, LoadError> {
        let limits = config.limits.clone();
        // The config was validated: every `[egress]` entry compiles.
        let egress = Arc::new(EgressPolicy::compile(&config.egress).0);
        // Phase 1: everything that can fail (resolution, egress checks of resolved
        // addresses, secrets from the environment and key files), touching no state that
        // outlives this call, so a rejected reload leaves the registry and the boards
        // exactly as they were.
        let auth = match dns {
            DnsSource::Board(live) => live.auth.clone(),
            DnsSource::Resolve => config
                .auth
                .as_ref()
                .map(|a| ClientAuth::load(a, origin).map(Arc::new))
                .transpose()?,
        };
        let peering_key = match dns {
            DnsSource::Board(live) => live.peering.key.clone(),
            DnsSource::Resolve => peering_key(&config.peering, origin)?,
        };
        let mut resolved = Vec::with_capacity(config.providers.len());
        let mut discovered = Vec::new();
        for (index, p) in config.providers.iter().enumerate() {
            let authorization = upstream_authorization(p, origin, index)?;
            if p.discovery == Discovery::Dns {
                let (upstream, addrs) = discover_provider(p, origin, index, ctx, &egress, dns)?;
                let instances = addrs
                    .iter()
                    .map(|&ip| Instance {
                        name: format!("{}@{ip}", p.name),
                        addr: SocketAddr::new(ip, upstream.addr.port()),
                        kv_spec: p.kv_events.as_ref().map(|k| templated_kv_spec(k, ip)),
                    })
                    .collect();
                discovered.push(DiscoveredProvider {
                    name: p.name.clone(),
                    host: upstream.name.clone(),
                    port: upstream.addr.port(),
                    refresh: Duration::from_secs(p.refresh_s),
                    addrs,
                });
                resolved.push((upstream, instances, authorization));
                continue;
            }
            let upstream = resolve_provider(&p.api_base, origin, index, &p.name, ctx, &egress)?;
            if let Some(l) = &p.lmcache {
                check_lmcache(&p.name, l, origin, index, ctx, &egress)?;
            }
            let kv_spec = match &p.kv_events {
                None => None,
                Some(k) => {
                    let resolve = |key: &'static str, url: &str| {
                        resolve_zmq(url, key, origin, index, &p.name, ctx, &egress)
                    };
                    let bind = config::is_bind_endpoint(&k.endpoint);
                    Some(KvSpec {
                        endpoint: if bind {
                            k.endpoint.clone()
                        } else {
                            resolve("kv_events.endpoint", &k.endpoint)?
                        },
                        bind,
                        topic: k.topic.clone(),
                        replay_endpoint: k
                            .replay_endpoint
                            .as_deref()
                            .map(|r| resolve("kv_events.replay_endpoint", r))
                            .transpose()?,
                        staleness_ms: k.staleness_ms,
                        max_message_bytes: k.max_message_bytes,
                    })
                }
            };
            let instance = Instance {
                name: p.name.clone(),
                addr: upstream.addr,
                kv_spec,
            };
            resolved.push((upstream, vec![instance], authorization));
        }
        // Tokenizers load here too (a broken directory rejects the file; a relative path
        // is relative to the routing file, which `-d` does not move). A reload reuses a
        // live tokenizer whose files did not change; a discovery rebuild (same config)
        // takes the live table's as they are.
        let base = Path::new(origin).parent().unwrap_or(Path::new(""));
        let mut tokenizers = Vec::with_capacity(config.routes.len());
        let mut loaded = Vec::new();
        for (index, r) in config.routes.iter().enumerate() {
            let live = match dns {
                DnsSource::Board(live) => live.route(&r.model).and_then(|r| r.tokenizer.clone()),
                DnsSource::Resolve => None,
            };
            let tok = match &r.tokenizer {
                None => None,
                Some(_) if live.is_some() => live,
                Some(dir) => {
                    let l = ctx
                        .tokenizers
                        .get_or_load(&base.join(dir), r.tokenizer_cache_bytes)
                        .map_err(|error| LoadError::Tokenizer {
                            path: origin.to_owned(),
                            index,
                            error,
                        })?;
                    let tok = l.tokenizer.clone();
                    loaded.push(l);
                    Some(tok)
                }
            };
            tokenizers.push(tok);
        }
        // Phase 2: bind to the long-lived state (cannot fail).
        if matches!(dns, DnsSource::Resolve) {
            ctx.tokenizers.keep(loaded);
        }
        for d in &discovered {
            ctx.dns.put(&d.name, &d.host, d.port, &d.addrs);
            crate::metrics::METRICS
                .discovered_addresses
                .with_label_values(&[&d.name])
                .set(d.addrs.len() as i64);
        }
        let mut providers: HashMap<&str, ProviderTargets> = HashMap::new();
        let mut entries = Vec::new();
        let mut lmcache = HashMap::new();
        let mut kv: Vec<KvEntry> = Vec::new();
        for (p, (upstream, instances, authorization)) in config.providers.iter().zip(resolved) {
            for inst in &instances {
                let state = registry.provider_health(&inst.name);
                state.set_enabled(p.health.enabled);
                entries.push(ProviderEntry {
                    name: inst.name.clone(),
                    addr: inst.addr,
                    host: upstream.host.clone(),
                    health: p.health.clone(),
                    state,
                });
                if let (Some(k), Some(spec)) = (&p.kv_events, &inst.kv_spec) {
                    kv.push(KvEntry {
                        provider: inst.name.clone(),
                        spec: spec.clone(),
                        state: registry.kv_state(&inst.name, k.max_blocks),
                    });
                }
            }
            if let Some(l) = &p.lmcache {
                let status = ctx.lmcache.get_or_create(
                    &p.name,
                    &l.endpoint,
                    Duration::from_millis(l.stale_after_ms),
                );
                let ep =
                    LmcacheEndpoint::new(&p.name, l, status).expect("validated lmcache.endpoint");
                lmcache.insert(p.name.as_str(), Arc::new(ep));
            }
            providers.insert(
                p.name.as_str(),
                ProviderTargets {
                    upstream,
                    instances,
                    authorization,
                },
            );
        }
        let mut routes = HashMap::new();
        let mut cache_size: BTreeMap<String, CacheSizeEndpoint> = BTreeMap::new();
        let generation = crate::fleet::cache_size::next_generation();
        for (route_index, (r, tokenizer)) in config.routes.iter().zip(tokenizers).enumerate() {
            let ms = |route: Option<u64>, global: u64| route.unwrap_or(global);
            let timeouts = PeerTimeouts {
                connect_ms: ms(r.timeouts.connect_timeout_ms, limits.connect_timeout_ms),
                read_ms: ms(r.timeouts.read_timeout_ms, limits.read_timeout_ms),
            };
            let total_ms = ms(r.timeouts.total_timeout_ms, limits.total_timeout_ms);
            let mut targets: Vec<RouteTarget> = Vec::with_capacity(r.targets.len());
            for t in &r.targets {
                let provider = &providers[t.provider.as_str()];
                // A target shared by routes with different caps takes the last one.
                let provider_config = config
                    .providers
                    .iter()
                    .find(|p| p.name == t.provider)
                    .expect("validated target provider");
                let kv_cache_tokens = provider_config.kv_cache_tokens;
                let metrics_path = provider_config.metrics_path.as_str();
                let reads_size = kv_cache_tokens.is_none()
                    && !metrics_path.is_empty()
                    && uses_cache_size(r.strategy);
                if kv_cache_tokens.is_none() && metrics_path.is_empty() && sizes_tries(r.strategy) {
                    log::warn!(
                        "{origin}: routes[{route_index}] ({}): provider \"{}\" has no kv_cache_tokens \
                         and metrics_path = \"\": its prefix trie does not forget what the replica evicts \
                         and the cache-pressure rules are off for it; set it to what vLLM logs as \
                         \"GPU KV cache size: N tokens\"",
                        r.model,
                        t.provider
                    );
                }
                for inst in &provider.instances {
                    let key = TargetKey {
                        provider: inst.name.clone(),
                        model: t.model.clone(),
                    };
                    let state = registry.get_or_create(&key);
                    state.trie.set_max_nodes(r.trie_max_nodes);
                    // A size read from the replica caps the trie after the loop, whichever
                    // route comes last.
                    state
                        .trie
                        .set_max_bytes(routing::cache_aware::trie_bytes_for_kv_cache(
                            kv_cache_tokens,
                            r.prompt_bytes_per_token,
                        ));
                    let up = &provider.upstream;
                    if reads_size {
                        let ep = cache_size.entry(inst.name.clone()).or_insert_with(|| {
                            CacheSizeEndpoint {
                                generation,
                                provider: inst.name.clone(),
                                host_name: up.name.clone(),
                                addr: inst.addr,
                                authority: up.host.clone(),
                                path: metrics_path.to_string(),
                                targets: Vec::new(),
                            }
                        });
                        ep.targets.retain(|(s, _)| !Arc::ptr_eq(s, &state));
                        ep.targets.push((state.clone(), r.prompt_bytes_per_token));
                    }
                    targets.push(RouteTarget {
                        state,
                        peer: make_peer(inst.addr, &timeouts),
                        idle: Default::default(),
                        host: up.host.clone(),
                        base_path: up.base_path.clone(),
                        upstream_model_json: crate::prompt::quote_model(&t.model),
                        upstream_model: t.model.clone(),
                        weight: t.weight,
                        authorization: provider.authorization.clone(),
                        lmcache: lmcache.get(t.provider.as_str()).map(|e| e.status.clone()),
                        kv: kv
                            .iter()
                            .find(|e| e.provider == inst.name)
                            .map(|e| e.state.clone()),
                        kv_cache_tokens: kv_cache_tokens.unwrap_or(0) as f64,
                    });
                }
            }
            let strategy = strategy_for(
                r,
                registry.session_table(&r.model, r.session_ttl_s, r.session_cap),
            );
            let route = Route {
                alias: r.model.clone(),
                metrics: crate::metrics::RouteMetrics::new(
                    &r.model,
                    strategy.name(),
                    targets.len(),
                    routing::Reason::ALL.len(),
                ),
                strategy,
                targets,
                total_timeout: (total_ms > 0).then(|| Duration::from_millis(total_ms)),
                tokenizer,
            };
            routes.insert(r.model.clone(), Arc::new(route));
        }
        // Every target's reported size goes to this table's reads, or, read by none of its
        // endpoints, is dropped (it would outlive the setting that stopped the reads); a
        // size kept caps the trie, whichever route sized it last.
        for t in routes.values().flat_map(|r: &Arc<Route>| r.targets.iter()) {
            let read = cache_size
                .values()
                .flat_map(|ep| ep.targets.iter())
                .find(|(s, _)| Arc::ptr_eq(s, &t.state));
            let kept = t.state.cache_size.hand_over(read.map(|_| generation));
            if let Some((state, bytes_per_token)) = read.filter(|_| kept > 0) {
                state
                    .trie
                    .set_max_bytes(routing::cache_aware::trie_bytes_for_kv_cache(
                        Some(kept),
                        *bytes_per_token,
                    ));
            }
        }
        let cache_size = cache_size.into_values().map(Arc::new).collect();
        let mut lmcache: Vec<Arc<LmcacheEndpoint>> = lmcache.into_values().collect();
        lmcache.sort_by(|a, b| a.provider.cmp(&b.provider));
        Ok(RouteTable {
            routes,
            providers: entries,
            limits,
            breaker: config.breaker.clone(),
            forwarding: config.forwarding.clone(),
            retry: config.retry.clone(),
            auth,
            egress,
            lmcache,
            cache_size,
            kv,
            discovered,
            peering: super::table::PeeringSettings {
                key: peering_key,
                ..super::table::PeeringSettings::from_config(&config.peering)
            },
        })
    }
}

/// The key `[peering]` points at (a file or an environment variable; surrounding whitespace
/// is not part of it), if any.
fn peering_key(p: &config::PeeringConfig, origin: &str) -> Result<Option<Secret>, LoadError> {
    let (key, secret) = match (&p.key_file, &p.key_env) {
        (Some(file), _) => (
            "peering.key_file",
            std::fs::read(file)
                .map_err(|e| format!("cannot read {file}: {e}"))
                .and_then(|bytes| {
                    String::from_utf8(bytes).map_err(|_| {
                        format!("{file} is not UTF-8 text (e.g. `openssl rand -hex 32`)")
                    })
                }),
        ),
        (None, Some(var)) => (
            "peering.key_env",
            auth::read_env_secret(var).map(|s| s.expose().to_string()),
        ),
        (None, None) => return Ok(None),
    };
    let fail = |reason: String| LoadError::Secret {
        path: origin.to_string(),
        key: key.to_string(),
        reason,
    };
    let secret = secret.map_err(fail)?;
    let trimmed = secret.trim();
    if trimmed.len() < config::MIN_PEERING_KEY_BYTES {
        return Err(fail(format!(
            "a key of {} bytes; at least {} needed (e.g. `openssl rand -hex 32`)",
            trimmed.len(),
            config::MIN_PEERING_KEY_BYTES
        )));
    }
    Ok(Some(Secret::new(trimmed.to_string())))
}

/// A provider's targets-to-be: its `api_base`, its addresses and its upstream key.
struct ProviderTargets {
    upstream: ResolvedProvider,
    instances: Vec<Instance>,
    authorization: Option<Secret>,
}

/// The `Authorization` value sent to provider `p` (`Bearer <key>`), if it has a key.
fn upstream_authorization(
    p: &ProviderConfig,
    origin: &str,
    index: usize,
) -> Result<Option<Secret>, LoadError> {
    let key = match (&p.api_key, &p.api_key_env) {
        (Some(key), _) => key.clone(),
        (None, Some(var)) => {
            let key_name = format!("providers[{index}].api_key_env");
            let fail = |reason: String| LoadError::Secret {
                path: origin.to_string(),
                key: key_name.clone(),
                reason,
            };
            let key = auth::read_env_secret(var).map_err(fail)?;
            config::check_api_key(key.expose())
                .map_err(|why| fail(format!("the value of {var} {why}")))?;
            key
        }
        (None, None) => return Ok(None),
    };
    Ok(Some(Secret::new(format!("Bearer {}", key.expose()))))
}

/// The KV-event stream of discovered address `ip`: the endpoint templates with `{ip}`
/// replaced (the address already passed the egress policy with the provider's name).
fn templated_kv_spec(k: &KvEventsConfig, ip: IpAddr) -> KvSpec {
    let text = match ip {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => format!("[{v6}]"),
    };
    let fill = |t: &str| t.replace(config::IP_PLACEHOLDER, &text);
    KvSpec {
        endpoint: fill(&k.endpoint),
        bind: false,
        topic: k.topic.clone(),
        replay_endpoint: k.replay_endpoint.as_deref().map(fill),
        staleness_ms: k.staleness_ms,
        max_message_bytes: k.max_message_bytes,
    }
}

/// The addresses of a `discovery = "dns"` provider for this build (see [`DnsSource`]),
/// with its `api_base` parts. A denied name fails the load; so does a name whose every
/// address is denied. A name that does not resolve keeps its last good set.
fn discover_provider(
    p: &ProviderConfig,
    origin: &str,
    index: usize,
    ctx: &LoadContext,
    policy: &EgressPolicy,
    source: DnsSource<'_>,
) -> Result<(ResolvedProvider, Vec<IpAddr>), LoadError> {
    let uri: http::Uri = p.api_base.parse().expect("validated api_base");
    let authority = uri.authority().expect("validated api_base");
    let port = authority.port_u16().unwrap_or(80);
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    let upstream = ResolvedProvider {
        // The port is what matters here; each instance has its own address.
        addr: SocketAddr::new(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), port),
        name: host.clone(),
        host: authority.to_string(),
        base_path: uri.path().trim_end_matches('/').to_string(),
    };
    let last_good = || ctx.dns.get(&p.name, &host, port).unwrap_or_default();
    let addrs = match source {
        DnsSource::Board(_) => last_good(),
        DnsSource::Resolve => {
            match discovery::resolve(ctx.resolver.as_ref(), policy, &host, port) {
                Ok(addrs) => addrs,
                Err(OutboundError::Egress(error)) => {
                    return Err(LoadError::Egress {
                        path: origin.to_string(),
                        index,
                        provider: p.name.clone(),
                        key: "api_base",
                        error,
                    })
                }
                Err(OutboundError::Resolve { reason, .. }) => {
                    let kept = last_good();
                    crate::metrics::METRICS
                        .discovery
                        .with_label_values(&[&p.name, "failed"])
                        .inc();
                    log::warn!(
                        "{origin}: providers[{index}].api_base: cannot resolve \"{authority}\": {reason}; keeping the last {} address(es)",
                        kept.len()
                    );
                    kept
                }
            }
        }
    };
    Ok((upstream, addrs))
}

struct ResolvedProvider {
    addr: SocketAddr,
    /// The host name (or literal address) of `api_base`.
    name: String,
    /// `Host` header value (`api_base`'s authority).
    host: String,
    base_path: String,
}

fn resolve_provider(
    api_base: &str,
    origin: &str,
    index: usize,
    provider: &str,
    ctx: &LoadContext,
    policy: &EgressPolicy,
) -> Result<ResolvedProvider, LoadError> {
    // Shape was validated by `config`; only resolution can fail here.
    let uri: http::Uri = api_base.parse().expect("validated api_base");
    let authority = uri.authority().expect("validated api_base");
    let port = authority.port_u16().unwrap_or(80);
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let at = Origin {
        path: origin,
        index,
        provider,
    };
    let addrs = resolve_outbound(&at, "api_base", host, port, authority.as_str(), ctx, policy)?;
    let addr = SocketAddr::new(addrs[0], port);
    Ok(ResolvedProvider {
        addr,
        name: host.to_string(),
        host: authority.to_string(),
        base_path: uri.path().trim_end_matches('/').to_string(),
    })
}

struct PeerTimeouts {
    connect_ms: u64,
    read_ms: u64,
}

/// Check `[providers.lmcache]`'s current addresses against the egress policy. A denied
/// address fails the load; a name that does not resolve yet does not (the poller
/// re-resolves on every poll; until then the controller is neutral).
fn check_lmcache(
    provider: &str,
    l: &LmcacheConfig,
    origin: &str,
    index: usize,
    ctx: &LoadContext,
    policy: &EgressPolicy,
) -> Result<(), LoadError> {
    let (host, port) = egress::url_host_port(&l.endpoint, 80).expect("validated lmcache.endpoint");
    let at = Origin {
        path: origin,
        index,
        provider,
    };
    let authority = format!("{host}:{port}");
    match resolve_outbound(
        &at,
        "lmcache.endpoint",
        &host,
        port,
        &authority,
        ctx,
        policy,
    ) {
        Ok(_) => Ok(()),
        Err(LoadError::Resolve { reason, .. }) => {
            log::warn!(
                "{origin}: providers[{index}].lmcache.endpoint: cannot resolve \"{authority}\": {reason}; the controller stays neutral until it resolves"
            );
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// Resolve and egress-check a `tcp://host:port` ZMQ endpoint the gateway connects to
/// into `tcp://ip:port` (a wildcard bind is not a destination: the caller keeps it).
fn resolve_zmq(
    url: &str,
    key: &'static str,
    origin: &str,
    index: usize,
    provider: &str,
    ctx: &LoadContext,
    policy: &EgressPolicy,
) -> Result<String, LoadError> {
    let (host, port) = egress::url_host_port(url, 0).expect("validated zmq endpoint");
    let at = Origin {
        path: origin,
        index,
        provider,
    };
    let addrs = resolve_outbound(
        &at,
        key,
        &host,
        port,
        &format!("{host}:{port}"),
        ctx,
        policy,
    )?;
    Ok(format!("tcp://{}", SocketAddr::new(addrs[0], port)))
}

/// Where an outbound endpoint is configured, for error messages.
struct Origin<'a> {
    path: &'a str,
    index: usize,
    provider: &'a str,
}

/// Resolve `host` and check the name and every address against the egress policy,
/// mapping failures to the load error that names the file, provider and key.
fn resolve_outbound(
    at: &Origin,
    key: &'static str,
    host: &str,
    port: u16,
    authority: &str,
    ctx: &LoadContext,
    policy: &EgressPolicy,
) -> Result<Vec<std::net::IpAddr>, LoadError> {
    egress::resolve_checked(ctx.resolver.as_ref(), policy, host, port).map_err(|e| match e {
        OutboundError::Egress(error) => LoadError::Egress {
            path: at.path.to_string(),
            index: at.index,
            provider: at.provider.to_string(),
            key,
            error,
        },
        OutboundError::Resolve { reason, .. } => LoadError::Resolve {
            path: at.path.to_string(),
            index: at.index,
            key,
            authority: authority.to_string(),
            reason,
        },
    })
}

fn make_peer(addr: SocketAddr, t: &PeerTimeouts) -> HttpPeer {
    let mut peer = HttpPeer::new(addr, false, String::new());
    peer.options.connection_timeout = Some(Duration::from_millis(t.connect_ms));
    peer.options.read_timeout = Some(Duration::from_millis(t.read_ms));
    peer.options.write_timeout = Some(Duration::from_millis(t.read_ms));
    peer
}

/// Whether `strategy` keeps per-target prefix tries sized from `kv_cache_tokens`.
fn sizes_tries(strategy: StrategyKind) -> bool {
    matches!(strategy, StrategyKind::CacheAware | StrategyKind::Pipeline)
}

/// Whether `strategy` uses a replica's cache size (its tries, or precise_cache_aware's
/// room), so a provider without `kv_cache_tokens` has it read from `metrics_path`.
fn uses_cache_size(strategy: StrategyKind) -> bool {
    sizes_tries(strategy) || strategy == StrategyKind::PreciseCacheAware
}

/// Build the strategy a route asks for; `sessions` is the route's (reload-surviving)
/// session table.
fn strategy_for(route: &RouteConfig, sessions: Arc<SessionTable>) -> Box<dyn Strategy> {
    match route.strategy {
        StrategyKind::RoundRobin => Box::new(routing::RoundRobin::default()),
        StrategyKind::LeastLoad => Box::new(routing::LeastLoad),
        StrategyKind::CacheAware => Box::new(
            routing::CacheAware::new(route.placement_rule(), route.prompt_bytes_per_token)
                .remembering(sessions),
        ),
        StrategyKind::Pipeline => {
            let w = &route.pipeline;
            let weights = routing::PipelineWeights {
                static_weight: w.static_weight,
                load: w.load,
                prefix: w.prefix,
            };
            Box::new(routing::Pipeline::new(
                weights,
                sessions,
                route.pipeline_rule(),
                route.prompt_bytes_per_token,
            ))
        }
        StrategyKind::LmcacheAware => Box::new(routing::LmcacheAware),
        StrategyKind::PreciseCacheAware => {
            Box::new(routing::PreciseCacheAware::new(route.placement_rule()).remembering(sessions))
        }
    }
}
