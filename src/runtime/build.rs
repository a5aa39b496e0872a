//! Turning a validated `Config` into a [`RouteTable`]: every provider address resolved
//! and egress-checked, every strategy constructed, target state found in (or added to) the
//! registry.
//!
//! Owns the load-time work. Must not: be called on the request path (it resolves names).

use super::table::{KvEntry, KvSpec, Route, RouteTable, RouteTarget};
use super::LoadError;
use crate::config::{self, Config, LmcacheConfig};
use crate::config::{RouteConfig, StrategyKind};
use crate::egress::{self, EgressPolicy, OutboundError, Resolver, SystemResolver};
use crate::fleet::lmcache::{LmcacheBoard, LmcacheEndpoint};
use crate::fleet::probe::ProviderEntry;
use crate::fleet::{Registry, TargetKey};
use crate::routing::{self, SessionTable, Strategy};
use pingora::upstreams::peer::HttpPeer;
use std::collections::HashMap;
use std::net::SocketAddr;
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
}

impl Default for LoadContext {
    /// The system resolver and no status yet.
    fn default() -> Self {
        LoadContext {
            resolver: Arc::new(SystemResolver),
            lmcache: LmcacheBoard::default(),
        }
    }
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
        let limits = config.limits.clone();
        // The config was validated: every `[egress]` entry compiles.
        let egress = Arc::new(EgressPolicy::compile(&config.egress).0);
        // Phase 1: everything that can fail (resolution, egress checks of resolved
        // addresses), touching no state that outlives this call, so a rejected reload
        // leaves the registry and the status board exactly as they were.
        let mut resolved = Vec::with_capacity(config.providers.len());
        for (index, p) in config.providers.iter().enumerate() {
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
            resolved.push((upstream, kv_spec));
        }
        // Tokenizers load here too (a broken directory rejects the file; a relative path
        // is relative to the routing file, which `-d` does not move).
        let base = Path::new(origin).parent().unwrap_or(Path::new(""));
        let mut tokenizers = Vec::with_capacity(config.routes.len());
        for (index, r) in config.routes.iter().enumerate() {
            let tok = match &r.tokenizer {
                None => None,
                Some(dir) => Some(Arc::new(
                    crate::tokenize::RouteTokenizer::load(&base.join(dir), r.tokenizer_cache_bytes)
                        .map_err(|error| LoadError::Tokenizer {
                            path: origin.to_owned(),
                            index,
                            error,
                        })?,
                )),
            };
            tokenizers.push(tok);
        }
        // Phase 2: bind to the long-lived state (cannot fail).
        let mut providers = HashMap::new();
        let mut entries = Vec::new();
        let mut lmcache = HashMap::new();
        let mut kv: Vec<KvEntry> = Vec::new();
        for (p, (upstream, kv_spec)) in config.providers.iter().zip(resolved) {
            let state = registry.provider_health(&p.name);
            state.set_enabled(p.health.enabled);
            entries.push(ProviderEntry {
                name: p.name.clone(),
                addr: upstream.addr,
                host: upstream.host.clone(),
                health: p.health.clone(),
                state,
            });
            providers.insert(p.name.as_str(), upstream);
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
            if let (Some(k), Some(spec)) = (&p.kv_events, kv_spec) {
                kv.push(KvEntry {
                    provider: p.name.clone(),
                    spec,
                    state: registry.kv_state(&p.name, k.max_blocks),
                });
            }
        }
        let mut routes = HashMap::new();
        for (r, tokenizer) in config.routes.iter().zip(tokenizers) {
            let ms = |route: Option<u64>, global: u64| route.unwrap_or(global);
            let timeouts = PeerTimeouts {
                connect_ms: ms(r.timeouts.connect_timeout_ms, limits.connect_timeout_ms),
                read_ms: ms(r.timeouts.read_timeout_ms, limits.read_timeout_ms),
            };
            let total_ms = ms(r.timeouts.total_timeout_ms, limits.total_timeout_ms);
            let targets: Vec<RouteTarget> = r
                .targets
                .iter()
                .map(|t| {
                    let up = &providers[t.provider.as_str()];
                    let key = TargetKey {
                        provider: t.provider.clone(),
                        model: t.model.clone(),
                    };
                    let state = registry.get_or_create(&key);
                    // A target shared by routes with different caps takes the last one.
                    let kv_cache_tokens = config
                        .providers
                        .iter()
                        .find(|p| p.name == t.provider)
                        .and_then(|p| p.kv_cache_tokens);
                    state
                        .trie
                        .set_max_nodes(routing::cache_aware::trie_nodes_for_kv_cache(
                            kv_cache_tokens,
                            r.prompt_bytes_per_token,
                            r.trie_max_nodes,
                        ));
                    RouteTarget {
                        state,
                        peer: make_peer(up.addr, &timeouts),
                        idle: Default::default(),
                        host: up.host.clone(),
                        base_path: up.base_path.clone(),
                        upstream_model_json: crate::prompt::quote_model(&t.model),
                        upstream_model: t.model.clone(),
                        weight: t.weight,
                        lmcache: lmcache.get(t.provider.as_str()).map(|e| e.status.clone()),
                        kv: kv
                            .iter()
                            .find(|e| e.provider == t.provider)
                            .map(|e| e.state.clone()),
                    }
                })
                .collect();
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
        let mut lmcache: Vec<Arc<LmcacheEndpoint>> = lmcache.into_values().collect();
        lmcache.sort_by(|a, b| a.provider.cmp(&b.provider));
        Ok(RouteTable {
            routes,
            providers: entries,
            limits,
            breaker: config.breaker.clone(),
            forwarding: config.forwarding.clone(),
            egress,
            lmcache,
            kv,
        })
    }
}

struct ResolvedProvider {
    addr: SocketAddr,
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

/// Build the strategy a route asks for; `sessions` is the route's (reload-surviving)
/// session table.
fn strategy_for(route: &RouteConfig, sessions: Arc<SessionTable>) -> Box<dyn Strategy> {
    match route.strategy {
        StrategyKind::RoundRobin => Box::new(routing::RoundRobin::default()),
        StrategyKind::LeastLoad => Box::new(routing::LeastLoad),
        StrategyKind::CacheAware => Box::new(routing::CacheAware::new(
            route.placement_rule(),
            route.prompt_bytes_per_token,
        )),
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
                route.placement_rule(),
                route.prompt_bytes_per_token,
            ))
        }
        StrategyKind::LmcacheAware => Box::new(routing::LmcacheAware),
        StrategyKind::PreciseCacheAware => {
            Box::new(routing::PreciseCacheAware::new(route.placement_rule()))
        }
    }
}
