//! The live routing state: an `ArcSwap<RouteTable>` read once per request, the target
//! [`Registry`] whose per-target state survives reloads, and the SIGHUP reload service.
//!
//! Owns: turning a validated `Config` into a `RouteTable` (DNS resolution of upstreams
//! happens here, at load time, never per request, and every resolved address passes the
//! egress policy), and swapping tables atomically.
//! Must not: parse TOML (that is `config`) or decide routes (that is `routing`).

use crate::config::{
    self, BreakerConfig, Config, ConfigError, HealthConfig, LimitsConfig, LmcacheConfig,
};
use crate::egress::{self, EgressError, EgressPolicy, OutboundError, Resolver, SystemResolver};
use crate::fleet::{KvState, ProviderHealth, Registry, TargetKey, TargetState};
use crate::lmcache_poll::{LmcacheBoard, LmcacheEndpoint, LmcacheStatus};
use crate::metrics::METRICS;
use crate::routing::{self, Strategy};
use arc_swap::ArcSwap;
use async_trait::async_trait;
use bytes::Bytes;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use pingora::upstreams::peer::HttpPeer;
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;

/// Why a routing file could not become live routes.
#[derive(Debug, Error)]
pub enum LoadError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("{path}: providers[{index}].{key}: cannot resolve \"{authority}\": {reason}")]
    Resolve {
        path: String,
        index: usize,
        key: &'static str,
        authority: String,
        reason: String,
    },
    #[error("{path}: routes[{index}].tokenizer: {error}")]
    Tokenizer {
        path: String,
        index: usize,
        error: crate::tokenize::LoadError,
    },
    #[error("{path}: providers[{index}].{key}: provider \"{provider}\": {error}")]
    Egress {
        path: String,
        index: usize,
        provider: String,
        key: &'static str,
        error: EgressError,
    },
}

/// One target of a route, ready to forward to.
pub struct RouteTarget {
    /// Live state shared with every route that uses the same (provider, model).
    pub state: Arc<TargetState>,
    /// The upstream peer (resolved address, timeouts).
    pub peer: HttpPeer,
    /// The peer's idle upstream connections, found in the gateway's pool on first use (a
    /// reload builds new targets, so a changed address gets its own stack).
    pub idle: std::sync::OnceLock<Option<Arc<crate::proxy::pool::IdleStack>>>,
    /// `Host` header value for the upstream.
    pub host: String,
    /// Path prefix from `api_base` ("" if none), prepended to the request path.
    pub base_path: String,
    /// Model name sent upstream, as a JSON string literal (`prompt::quote_model`).
    pub upstream_model_json: String,
    /// Configured weight.
    pub weight: u32,
    /// The provider's LMCache status cell, if it has `[providers.lmcache]`.
    pub lmcache: Option<Arc<LmcacheStatus>>,
    /// The provider's KV-event state, if it has `[providers.kv_events]`.
    pub kv: Option<Arc<KvState>>,
}

/// One `[providers.kv_events]` stream, resolved and egress-checked at load.
#[derive(Clone)]
pub struct KvEntry {
    /// Provider name.
    pub provider: String,
    /// What the subscriber connects to (addresses, not names: resolved at load so a
    /// name cannot later resolve past the egress policy).
    pub spec: KvSpec,
    /// Index and stream state fed by the subscriber.
    pub state: Arc<KvState>,
}

/// A subscriber's settings; a change restarts it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvSpec {
    /// `tcp://ip:port` to connect to, or the configured wildcard (`tcp://*:port`) to bind.
    pub endpoint: String,
    /// Bind `endpoint` rather than connect to it: decided from the configured text
    /// ([`config::is_bind_endpoint`]), never from the address a name resolved to.
    pub bind: bool,
    /// Topic prefix.
    pub topic: String,
    /// `tcp://ip:port` of the replay ROUTER.
    pub replay_endpoint: Option<String>,
    /// Staleness limit.
    pub staleness_ms: u64,
    /// Largest inbound ZMQ frame.
    pub max_message_bytes: u64,
}

/// A model alias with its strategy and targets.
pub struct Route {
    /// The alias clients ask for.
    pub alias: String,
    /// How a target is chosen.
    pub strategy: Box<dyn Strategy>,
    /// Targets in config order (indices are what strategies return).
    pub targets: Vec<RouteTarget>,
    /// Whole-exchange limit for this route, if any.
    pub total_timeout: Option<Duration>,
    /// This route's per-request metric series, resolved once.
    pub metrics: crate::metrics::RouteMetrics,
    /// The model's tokenizer, when the route names one (`tokenize/`).
    pub tokenizer: Option<Arc<crate::tokenize::RouteTokenizer>>,
}

/// A provider as the health prober sees it.
#[derive(Clone)]
pub struct ProviderEntry {
    /// Name from the routing file.
    pub name: String,
    /// Resolved address.
    pub addr: SocketAddr,
    /// `Host` header value.
    pub host: String,
    /// Active health-check settings.
    pub health: HealthConfig,
    /// Where probe results go.
    pub state: Arc<ProviderHealth>,
}

impl PartialEq for ProviderEntry {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
            && self.addr == other.addr
            && self.host == other.host
            && self.health == other.health
            && Arc::ptr_eq(&self.state, &other.state)
    }
}

/// Everything one routing-file generation defines.
pub struct RouteTable {
    routes: HashMap<String, Arc<Route>>,
    /// Providers, in file order.
    pub providers: Vec<ProviderEntry>,
    /// Size and time limits.
    pub limits: LimitsConfig,
    /// Passive-health settings.
    pub breaker: BreakerConfig,
    /// Headers added to forwarded requests.
    pub forwarding: crate::config::ForwardingConfig,
    models_json: Bytes,
    egress: Arc<EgressPolicy>,
    lmcache: Vec<Arc<LmcacheEndpoint>>,
    kv: Vec<KvEntry>,
}

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
    /// The route for a client-facing model alias.
    pub fn route(&self, alias: &str) -> Option<&Arc<Route>> {
        self.routes.get(alias)
    }

    /// The `GET /v1/models` response body.
    pub fn models_json(&self) -> Bytes {
        self.models_json.clone()
    }

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
                        weight: t.weight,
                        lmcache: lmcache.get(t.provider.as_str()).map(|e| e.status.clone()),
                        kv: kv
                            .iter()
                            .find(|e| e.provider == t.provider)
                            .map(|e| e.state.clone()),
                    }
                })
                .collect();
            let strategy = routing::build(
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
        let mut aliases: Vec<&String> = routes.keys().collect();
        aliases.sort();
        let data: Vec<serde_json::Value> = aliases
            .iter()
            .map(|a| serde_json::json!({"id": a, "object": "model", "created": 0, "owned_by": "rolter"}))
            .collect();
        let models_json =
            Bytes::from(serde_json::json!({"object": "list", "data": data}).to_string());
        let mut lmcache: Vec<Arc<LmcacheEndpoint>> = lmcache.into_values().collect();
        lmcache.sort_by(|a, b| a.provider.cmp(&b.provider));
        Ok(RouteTable {
            routes,
            providers: entries,
            limits,
            breaker: config.breaker.clone(),
            forwarding: config.forwarding.clone(),
            models_json,
            egress,
            lmcache,
            kv,
        })
    }

    /// Every `[providers.kv_events]` stream of this generation.
    pub fn kv_streams(&self) -> &[KvEntry] {
        &self.kv
    }

    /// The egress policy of this generation.
    pub fn egress(&self) -> &Arc<EgressPolicy> {
        &self.egress
    }

    /// Every `[providers.lmcache]` endpoint of this generation, by provider name.
    pub fn lmcache_endpoints(&self) -> &[Arc<LmcacheEndpoint>] {
        &self.lmcache
    }

    /// Whether any route has a target that may be chosen now (readiness).
    pub fn has_eligible_target(&self) -> bool {
        self.routes.values().any(|r| {
            r.targets
                .iter()
                .any(|t| t.state.eligible(crate::fleet::now_ms()))
        })
    }

    /// Keys of every target this table routes to.
    pub fn target_keys(&self) -> HashSet<TargetKey> {
        self.routes
            .values()
            .flat_map(|r| r.targets.iter().map(|t| t.state.key().clone()))
            .collect()
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

/// The process's routing state.
pub struct Runtime {
    table: ArcSwap<RouteTable>,
    registry: Registry,
    routes_path: PathBuf,
    ctx: LoadContext,
}

impl Runtime {
    /// Load the routing file at `path` and build the first table.
    pub fn load(path: &Path) -> Result<Self, LoadError> {
        Self::load_with(path, LoadContext::default())
    }

    /// [`load`](Self::load) with a given resolver (tests) and status board.
    pub fn load_with(path: &Path, ctx: LoadContext) -> Result<Self, LoadError> {
        let registry = Registry::default();
        let table = Self::read_table(path, &registry, &ctx)?;
        Ok(Runtime {
            table: ArcSwap::from_pointee(table),
            registry,
            routes_path: path.to_path_buf(),
            ctx,
        })
    }

    fn read_table(
        path: &Path,
        registry: &Registry,
        ctx: &LoadContext,
    ) -> Result<RouteTable, LoadError> {
        let config = config::load_file(path)?;
        RouteTable::build_with(&config, &path.display().to_string(), registry, ctx)
    }

    /// The resolver every configured name goes through.
    pub fn resolver(&self) -> Arc<dyn Resolver> {
        self.ctx.resolver.clone()
    }

    /// The current table (one atomic load; hold it for the whole request).
    pub fn table(&self) -> Arc<RouteTable> {
        self.table.load_full()
    }

    /// The per-target state registry.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Re-read the routing file; swap it in if valid, keep the old table if not.
    /// Every outcome is logged and counted in `rolter_config_reloads_total{result}`.
    pub fn reload(&self) -> Result<(), LoadError> {
        let table = match Self::read_table(&self.routes_path, &self.registry, &self.ctx) {
            Ok(table) => table,
            Err(e) => {
                METRICS.reloads.with_label_values(&["failed"]).inc();
                log::error!(
                    "reload of {} rejected, keeping the previous routes: {e}",
                    self.routes_path.display()
                );
                return Err(e);
            }
        };
        let keep = table.target_keys();
        let providers: HashSet<String> = table.providers.iter().map(|p| p.name.clone()).collect();
        let aliases: HashSet<String> = table.routes.keys().cloned().collect();
        let keep_lmcache = table.lmcache.iter().map(|e| e.key()).collect();
        let keep_kv: HashSet<String> = table.kv.iter().map(|e| e.provider.clone()).collect();
        let unprobed: Vec<String> = (table.providers.iter())
            .filter(|p| !p.health.enabled)
            .map(|p| p.name.clone())
            .collect();
        let routes = table.routes.len();
        // The swap: requests that loaded the old table finish on it.
        let old = self.table.swap(Arc::new(table));
        // Held from dropping the removed state to dropping its series: a scrape exports
        // from the registry under this lock, so it sees a removed target either with its
        // series still to be dropped or not at all, and cannot re-create a dropped series.
        let exporting = crate::metrics::EXPORT_LOCK.lock();
        self.registry.retain(&keep, &providers);
        self.registry.retain_sessions(&aliases);
        self.ctx.lmcache.retain(&keep_lmcache);
        self.registry.retain_kv(&keep_kv);
        // Drop the series of what is gone, so no gauge reports a removed target and a
        // re-added one starts from zero (its state starts afresh too).
        let old_keys = old.target_keys();
        let removed: Vec<&TargetKey> = old_keys.difference(&keep).collect();
        for key in &removed {
            crate::metrics::forget_target(&key.label());
        }
        for p in old
            .providers
            .iter()
            .filter(|p| !providers.contains(&p.name))
        {
            crate::metrics::forget_provider(&p.name);
        }
        // Nothing probes a provider whose checks are off: no health gauge, as at start.
        for name in &unprobed {
            crate::metrics::forget_provider(name);
        }
        for e in old.kv.iter().filter(|e| !keep_kv.contains(&e.provider)) {
            crate::metrics::forget_kv_stream(&e.provider);
        }
        for alias in old.routes.keys().filter(|a| !aliases.contains(*a)) {
            crate::metrics::forget_route(alias);
        }
        drop(exporting);
        METRICS.reloads.with_label_values(&["ok"]).inc();
        log::info!(
            "reloaded routes from {}: {routes} routes, {} targets ({} added, {} removed)",
            self.routes_path.display(),
            keep.len(),
            keep.difference(&old_keys).count(),
            removed.len(),
        );
        Ok(())
    }
}

/// Background service: re-read the routing file on every SIGHUP.
pub struct ReloadOnSighup(pub Arc<Runtime>);

#[async_trait]
impl BackgroundService for ReloadOnSighup {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        use tokio::signal::unix::{signal, SignalKind};
        let mut hup = match signal(SignalKind::hangup()) {
            Ok(s) => s,
            Err(e) => {
                log::error!("cannot listen for SIGHUP, reload disabled: {e}");
                return;
            }
        };
        log::info!("SIGHUP re-reads {}", self.0.routes_path.display());
        loop {
            tokio::select! {
                _ = hup.recv() => {
                    // Reading the file and resolving upstreams blocks: keep it off the
                    // async workers (and off the request path). Reloads run one at a
                    // time; a SIGHUP during one is delivered once it ends.
                    let runtime = self.0.clone();
                    if let Err(e) = tokio::task::spawn_blocking(move || runtime.reload()).await {
                        // `reload` logs and counts its own outcomes; this is a panic.
                        METRICS.reloads.with_label_values(&["failed"]).inc();
                        log::error!("reload aborted, keeping the previous routes: {e}");
                    }
                }
                _ = shutdown.changed() => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::egress::StaticResolver;

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
}
