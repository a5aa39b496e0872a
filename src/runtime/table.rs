//! One routing-file generation as the request path reads it: routes, their targets and
//! the provider-level settings, immutable once built.
//!
//! Owns the table's shape and its read accessors. Must not: build tables (that is
//! [`super::build`]) or hold anything that must outlive a reload (that is the registry).

use crate::config::{BreakerConfig, LimitsConfig};
use crate::egress::EgressPolicy;
use crate::fleet::lmcache::{LmcacheEndpoint, LmcacheStatus};
use crate::fleet::ms_at;
use crate::fleet::probe::ProviderEntry;
use crate::fleet::{KvState, TargetKey, TargetState};
use crate::routing::{Candidate, KvView, Strategy};
use pingora::upstreams::peer::HttpPeer;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One target of a route, ready to forward to.
pub struct RouteTarget {
    /// Live state shared with every route that uses the same (provider, model).
    pub state: Arc<TargetState>,
    /// The upstream peer (resolved address, timeouts).
    pub peer: HttpPeer,
    /// The peer's idle upstream connections, found in the gateway's pool on first use (a
    /// reload builds new targets, so a changed address gets its own stack).
    pub idle: std::sync::OnceLock<Option<Arc<crate::fleet::idle::IdleStack>>>,
    /// `Host` header value for the upstream.
    pub host: String,
    /// Path prefix from `api_base` ("" if none), prepended to the request path.
    pub base_path: String,
    /// Model name sent upstream, as a JSON string literal (`prompt::quote_model`).
    pub upstream_model_json: String,
    /// Model name sent upstream, as is (a multipart form field's value).
    pub upstream_model: String,
    /// Configured weight.
    pub weight: u32,
    /// `Bearer <key>` sent as `Authorization` to this target's provider, in place of
    /// the client's, if the provider has `api_key` / `api_key_env`.
    pub authorization: Option<crate::config::Secret>,
    /// The provider's LMCache status cell, if it has `[providers.lmcache]`.
    pub lmcache: Option<Arc<LmcacheStatus>>,
    /// The provider's KV-event state, if it has `[providers.kv_events]`.
    pub kv: Option<Arc<KvState>>,
    /// The replica's KV-cache capacity in tokens as configured (the provider's
    /// `kv_cache_tokens`; 0 when unset). [`Self::cache_tokens`] falls back to what the
    /// replica's metrics report.
    pub kv_cache_tokens: f64,
}

impl RouteTarget {
    /// The replica's KV-cache size in tokens: configured, else as its metrics report it,
    /// else 0 (unknown).
    pub fn cache_tokens(&self) -> f64 {
        if self.kv_cache_tokens > 0.0 {
            self.kv_cache_tokens
        } else {
            self.state.reported_cache_tokens() as f64
        }
    }
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

impl Route {
    /// The targets as a strategy sees them at `now`: load, eligibility, prefix and
    /// residency state, fresh LMCache status.
    pub fn candidates(&self, now: Instant) -> Vec<Candidate<'_>> {
        let now_ms = ms_at(now);
        self.targets
            .iter()
            .map(|t| Candidate {
                inflight: t.state.inflight(),
                eligible: t.state.eligible(now_ms),
                weight: t.weight,
                prefix: Some(&t.state.trie),
                label: t.state.label(),
                kv: t.kv.as_deref().map(|kv| KvView {
                    index: &kv.index,
                    trusted: kv.stream.is_trusted(),
                    stream: Some(&kv.stream),
                    pending: Some(&kv.pending),
                }),
                lmcache: t.lmcache.as_ref().and_then(|s| s.view(now)),
                placed: t.state.placed.estimate(now_ms),
                cache_tokens: t.cache_tokens(),
            })
            .collect()
    }
}

/// Everything one routing-file generation defines.
pub struct RouteTable {
    pub(super) routes: HashMap<String, Arc<Route>>,
    /// Providers, in file order.
    pub providers: Vec<ProviderEntry>,
    /// Size and time limits.
    pub limits: LimitsConfig,
    /// Passive-health settings.
    pub breaker: BreakerConfig,
    /// Headers added to forwarded requests.
    pub forwarding: crate::config::ForwardingConfig,
    /// Retries and their budget.
    pub retry: crate::config::RetryConfig,
    /// Client keys, when `[auth]` is on.
    pub auth: Option<Arc<super::auth::ClientAuth>>,
    pub(super) egress: Arc<EgressPolicy>,
    pub(super) lmcache: Vec<Arc<LmcacheEndpoint>>,
    /// Replicas whose cache size is read from their metrics (`cache_size_poll`).
    pub(super) cache_size: Vec<Arc<crate::fleet::cache_size::CacheSizeEndpoint>>,
    pub(super) kv: Vec<KvEntry>,
    /// The `discovery = "dns"` providers and the addresses this table was built with.
    pub(super) discovered: Vec<super::discovery::DiscoveredProvider>,
    /// `[peering]`: the other gateways this one tells where it placed conversations.
    pub peering: PeeringSettings,
}

/// `[peering]` as the live table holds it (validated: every address parsed).
#[derive(Debug, Clone, Default)]
pub struct PeeringSettings {
    /// The socket's address; `None` = peering off.
    pub listen: Option<std::net::SocketAddr>,
    /// Where notes go, and the only sources accepted.
    pub peers: Arc<[std::net::SocketAddr]>,
    /// The key datagrams are sealed with (`[peering] key_file` / `key_env`, at least
    /// `MIN_PEERING_KEY_BYTES`); `None` = unsealed.
    pub key: Option<crate::config::Secret>,
}

impl PeeringSettings {
    /// The settings of a validated `[peering]` (an unparsable address is left out).
    pub fn from_config(c: &crate::config::PeeringConfig) -> Self {
        PeeringSettings {
            listen: c.listen.as_deref().and_then(|l| l.parse().ok()),
            peers: c
                .peers
                .iter()
                .filter_map(|p| p.parse::<std::net::SocketAddr>().ok())
                .map(canonical)
                .collect(),
            key: None,
        }
    }

    /// Whether a datagram from `from` is a peer's (an IPv4 sender seen through a
    /// dual-stack socket as IPv4-mapped counts as itself).
    pub fn accepts(&self, from: std::net::SocketAddr) -> bool {
        self.peers.contains(&canonical(from))
    }

    /// `addr` as the peers list it: an IPv4-mapped IPv6 address as IPv4, no flow or scope
    /// id (what a sealed datagram's tag binds the sender to).
    pub fn canonical(addr: std::net::SocketAddr) -> std::net::SocketAddr {
        canonical(addr)
    }
}

/// `addr` with an IPv4-mapped IPv6 address as IPv4 (and no flow or scope id).
fn canonical(addr: std::net::SocketAddr) -> std::net::SocketAddr {
    std::net::SocketAddr::new(addr.ip().to_canonical(), addr.port())
}

impl RouteTable {
    /// The route for a client-facing model alias.
    pub fn route(&self, alias: &str) -> Option<&Arc<Route>> {
        self.routes.get(alias)
    }

    /// Every route, in alias order (deterministic where several hold one target).
    pub fn routes_by_alias(&self) -> impl Iterator<Item = &Arc<Route>> {
        let mut routes: Vec<&Arc<Route>> = self.routes.values().collect();
        routes.sort_by(|a, b| a.alias.cmp(&b.alias));
        routes.into_iter()
    }

    /// The `discovery = "dns"` providers of this generation, with their addresses.
    pub fn discovered(&self) -> &[super::discovery::DiscoveredProvider] {
        &self.discovered
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

    /// Every replica whose cache size is read from its metrics, by instance name.
    pub fn cache_size_endpoints(&self) -> &[Arc<crate::fleet::cache_size::CacheSizeEndpoint>] {
        &self.cache_size
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
