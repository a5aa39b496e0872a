//! The routing file's shape, as serde types. Defaults live here as named constants.

pub use crate::egress::EgressConfig;
use serde::Deserialize;

/// Default cap on a buffered request body (SPEC §3: 4 MiB).
pub const DEFAULT_MAX_BODY_BYTES: usize = 4 * 1024 * 1024;
/// Default TCP connect timeout to an upstream.
pub const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 2_000;
/// Default read timeout on an upstream response (the whole header, or between body chunks).
/// Long: a non-streaming completion of a long prompt can take minutes of prefill + decode.
pub const DEFAULT_READ_TIMEOUT_MS: u64 = 300_000;
/// Default time a client has to send the whole request body (slow-body defence).
pub const DEFAULT_CLIENT_BODY_TIMEOUT_MS: u64 = 30_000;
/// Default cap on requests being proxied at once (all routes), counted from the end of
/// the body's read. vLLM runs at most 256 sequences per replica (`--max-num-seqs`
/// default), so 1024 keeps a four-replica fleet's batches full; beyond it clients get 503.
pub const DEFAULT_MAX_INFLIGHT: usize = 1024;
/// Default cap on the bytes of request-body buffers held at once, over all connections:
/// bodies being read, or sent and waiting for the upstream's answer to start (then the
/// buffer is freed). It bounds buffered-body memory however many clients send at once. A
/// body is charged for what it holds: the bytes that arrived (in pieces: 64 bytes more
/// each, and a piece gathered from a trickle of short chunks its whole capacity: a body
/// is charged at most twice its bytes and 32 KiB) and nothing ahead of them, so clients
/// that dribble bodies hold little
/// of it (and no `max_inflight` slot).
/// 1 GiB: 256 bodies at the 4 MiB limit, or 32k prompts of 32 KiB. Beyond it: 503.
pub const DEFAULT_MAX_BUFFERED_BODY_BYTES: usize = 1 << 30;
/// Default time an idle client connection is kept open for its next request, seconds
/// (pingora keep-alive granularity). 60 s is what pingora itself allows a new
/// connection to send its first request; pingora would keep a reused HTTP/1.1
/// connection idle forever without it.
pub const DEFAULT_CLIENT_KEEPALIVE_TIMEOUT_S: u64 = 60;
/// Default time one write to a client may block (a client that stops reading a
/// stream): after it the exchange ends and the upstream connection is freed.
pub const DEFAULT_CLIENT_WRITE_TIMEOUT_MS: u64 = 60_000;
/// Default cap on open client connections; more are closed at accept. An idle connection
/// costs a few KiB (no read buffer until a request starts), one sending a header up to
/// `max_header_bytes`. Keep the process's file limit above it (the systemd unit: 65536).
pub const DEFAULT_MAX_CONNECTIONS: usize = 10_000;
/// Default time a request header has to arrive whole: from the accept for a connection's
/// first request, from its first byte for a later one (nginx's `client_header_timeout`,
/// whose default is 60 s; clients send a header at once, so a quarter of that).
pub const DEFAULT_CLIENT_HEADER_TIMEOUT_MS: u64 = 15_000;
/// Default cap on a request header section (request line and fields), below pingora's fixed
/// 1 MiB: browsers and HTTP clients send a few KiB; nginx's default caps a header at 32 KiB.
pub const DEFAULT_MAX_HEADER_BYTES: usize = 64 * 1024;
/// pingora 0.9.1's own cap on a request header section (`MAX_HEADER_SIZE`): above it pingora
/// answers a bare 400 first, so `max_header_bytes` may not exceed it.
pub const PINGORA_MAX_HEADER_BYTES: usize = 1_048_575;
/// Default idle time of a pooled upstream connection. vLLM's uvicorn closes idle
/// keep-alive connections after 5 s (`--timeout-keep-alive` default), so stay below it.
pub const DEFAULT_UPSTREAM_IDLE_TIMEOUT_MS: u64 = 4_000;
/// Default time between two polls of an LMCache status endpoint.
pub const DEFAULT_LMCACHE_INTERVAL_MS: u64 = 1_000;
/// Default limit on one status poll (resolution, connect, request and body); a slower
/// controller is neutral. Half the interval, so a slow poll never delays the next one.
pub const DEFAULT_LMCACHE_TIMEOUT_MS: u64 = 500;
/// Default age after which a status result is ignored (neutral): three intervals, so a
/// single late or lost poll does not flap the controller to neutral.
pub const DEFAULT_LMCACHE_STALE_AFTER_MS: u64 = 3_000;

/// A whole routing file.
#[derive(Debug, Clone, Deserialize, Default)]
pub struct Config {
    /// Upstream endpoints, by name.
    #[serde(default)]
    pub providers: Vec<ProviderConfig>,
    /// Model aliases clients ask for, each with a strategy and targets.
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    /// Request size and timeout limits.
    #[serde(default)]
    pub limits: LimitsConfig,
    /// Passive health: cooldown and circuit breaking on failed requests.
    #[serde(default)]
    pub breaker: BreakerConfig,
    /// Which hosts and addresses the gateway may contact on its own (see `egress`).
    #[serde(default)]
    pub egress: EgressConfig,
    /// Headers rolter adds to the requests it forwards.
    #[serde(default)]
    pub forwarding: ForwardingConfig,
    /// Retries of failed attempts on other targets, and their budget.
    #[serde(default)]
    pub retry: RetryConfig,
    /// Client keys: when present, every proxied request needs one.
    #[serde(default)]
    pub auth: Option<AuthConfig>,
    /// Other gateways in front of the same fleet, told where each conversation went.
    #[serde(default)]
    pub peering: PeeringConfig,
}

/// Most `[peering] peers`.
pub const MAX_PEERS: usize = 64;
/// Shortest `[peering]` key in bytes of text (e.g. `openssl rand -hex 32`: 64 characters).
pub const MIN_PEERING_KEY_BYTES: usize = 32;

/// `[peering]`: gateways behind one L4 balancer tell each other, in UDP datagrams, which
/// target each conversation's turn went to, so a turn reaching the gateway that did not
/// serve the turn before follows it (`peering`). Off unless `listen` is set.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct PeeringConfig {
    /// UDP `ip:port` this gateway receives its peers' notes on and sends its own from
    /// (a peer accepts notes only from an address in its own `peers`). Read at start.
    pub listen: Option<String>,
    /// The other gateways' `listen` addresses (`ip:port`, no names).
    pub peers: Vec<String>,
    /// A file holding the key every gateway of the group seals its datagrams with (at least
    /// 32 bytes, surrounding whitespace ignored): with a key, datagrams without its seal are
    /// refused. Read at start and on every reload.
    pub key_file: Option<String>,
    /// An environment variable holding that key instead.
    pub key_env: Option<String>,
}

/// A secret from the routing file (an API key): its `Debug` never shows the value, so a
/// `{:?}` of any config type cannot leak it into a log or `-t` output.
#[derive(Clone, PartialEq, Eq, Hash, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// Wrap a value read from elsewhere (an environment variable, a key file).
    pub fn new(value: String) -> Self {
        Secret(value)
    }

    /// The secret itself: for the one place that sends or compares it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret([redacted])")
    }
}

/// How a provider's `api_base` host becomes targets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Discovery {
    /// The host's first address, resolved at load (and on every reload): one target.
    #[default]
    Static,
    /// Every address the host resolves to is a target of its own, re-resolved every
    /// `refresh_s` (a Kubernetes headless Service, a DNS round-robin name).
    Dns,
}

/// Default seconds between two resolutions of a `discovery = "dns"` provider: the
/// 10 s of smg's and vllm-router's service discovery; Kubernetes' CoreDNS caches 30 s.
pub const DEFAULT_DNS_REFRESH_S: u64 = 10;
/// The placeholder a `discovery = "dns"` provider's KV-event endpoints carry for each
/// discovered address (`tcp://{ip}:5557`).
pub const IP_PLACEHOLDER: &str = "{ip}";

/// Default retries after a failed first attempt (the seed system's; smg and
/// vllm-router allow up to 5).
pub const DEFAULT_RETRIES: u32 = 2;
/// Most retries a route may ask for.
pub const MAX_RETRIES: u32 = 10;
/// Default first back-off before a retry; each further one doubles it (jittered).
pub const DEFAULT_RETRY_BACKOFF_MS: u64 = 25;
/// Default cap on one back-off.
pub const DEFAULT_RETRY_MAX_BACKOFF_MS: u64 = 250;
/// Default deadline: no retry starts later than this after the request was routed.
pub const DEFAULT_RETRY_DEADLINE_MS: u64 = 10_000;
/// Default retry budget: retries may add at most this fraction of the requests of the
/// last window (Linkerd's and Finagle's default of 20%), so retries cannot amplify an
/// outage.
pub const DEFAULT_RETRY_BUDGET_RATIO: f64 = 0.2;
/// Default window of the retry budget, seconds (Linkerd's default TTL).
pub const DEFAULT_RETRY_BUDGET_WINDOW_S: u64 = 10;
/// Default retries allowed per window whatever the traffic, so a quiet gateway can still
/// retry (Linkerd's 10 per second is for a busier mesh; one per second here).
pub const DEFAULT_RETRY_BUDGET_MIN: u64 = 10;

/// `[retry]`: attempts on other targets for failures before any response byte reached
/// the client.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct RetryConfig {
    /// Retries after the first attempt (0 = none).
    pub retries: u32,
    /// First back-off; doubled for each further retry, jittered.
    pub backoff_ms: u64,
    /// Cap on one back-off.
    pub max_backoff_ms: u64,
    /// No retry starts later than this after the request was routed.
    pub deadline_ms: u64,
    /// Retries may add at most this fraction of the window's requests.
    pub budget_ratio: f64,
    /// The budget's window, seconds.
    pub budget_window_s: u64,
    /// Retries allowed per window whatever the traffic.
    pub budget_min_retries: u64,
}

impl Default for RetryConfig {
    fn default() -> Self {
        RetryConfig {
            retries: DEFAULT_RETRIES,
            backoff_ms: DEFAULT_RETRY_BACKOFF_MS,
            max_backoff_ms: DEFAULT_RETRY_MAX_BACKOFF_MS,
            deadline_ms: DEFAULT_RETRY_DEADLINE_MS,
            budget_ratio: DEFAULT_RETRY_BUDGET_RATIO,
            budget_window_s: DEFAULT_RETRY_BUDGET_WINDOW_S,
            budget_min_retries: DEFAULT_RETRY_BUDGET_MIN,
        }
    }
}

/// `[auth]`: the keys clients must present (`Authorization: Bearer <key>`). The keys
/// themselves are never in the routing file: they come from a file or the environment,
/// read at load (and on every reload).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct AuthConfig {
    /// A file with one accepted key per line (blank lines and `#` comments ignored).
    pub keys_file: Option<String>,
    /// An environment variable holding accepted keys, separated by commas or whitespace.
    pub keys_env: Option<String>,
    /// Whether `GET /metrics` needs a key too.
    pub protect_metrics: bool,
    /// Whether `GET /health` and `GET /ready` need a key too.
    pub protect_health: bool,
}

/// The kind of upstream API a provider speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProviderKind {
    /// vLLM or anything else that serves the OpenAI HTTP API.
    OpenaiCompatible,
}

/// One upstream replica (or load balancer in front of replicas).
#[derive(Debug, Clone, Deserialize)]
pub struct ProviderConfig {
    /// Unique name that routes refer to.
    pub name: String,
    /// API flavour.
    pub kind: ProviderKind,
    /// Base URL, `http://host:port` with an optional path prefix.
    pub api_base: String,
    /// Active health checks (on by default).
    #[serde(default)]
    pub health: HealthConfig,
    /// Optional LMCache status endpoint polled by `lmcache_aware` routes.
    #[serde(default)]
    pub lmcache: Option<LmcacheConfig>,
    /// Optional vLLM KV-event stream feeding `precise_cache_aware` routes.
    #[serde(default)]
    pub kv_events: Option<KvEventsConfig>,
    /// The replica's KV-cache capacity in tokens (vLLM: `num_gpu_blocks` × block size, logged
    /// at start-up as "GPU KV cache size: N tokens"). When set, the prefix trie of each
    /// target on this provider holds at most about what the replica can hold (its byte cap,
    /// `routing::cache_aware::trie_bytes_for_kv_cache`), so the trie forgets prompts the
    /// replica has likely evicted; and the placement rule knows the cache's size
    /// (`Candidate::cache_tokens`: the share bound spills only to a cache holding the
    /// prompt twice; precise_cache_aware's room is half of it less the resident blocks, or
    /// all of it while the replica holds nothing). Unset, rolter reads it from each
    /// replica's [`metrics_path`](Self::metrics_path). Without either (or before the first
    /// read), precise_cache_aware uses the size the replica's KV events show once it has
    /// evicted a block (`ResidencyIndex::capacity_tokens`; a KV connector's failed loads,
    /// LMCache or P/D, evict blocks before the cache is full and end that count early), and
    /// a replica that holds nothing takes any prompt whatever its size.
    #[serde(default)]
    pub kv_cache_tokens: Option<u64>,
    /// Where each replica of this provider serves Prometheus metrics (vLLM: `/metrics`,
    /// at the root whatever `api_base`'s path). When `kv_cache_tokens` is unset and a
    /// cache_aware, pipeline or precise_cache_aware route targets the provider, rolter
    /// reads the size there (`vllm:cache_config_info`: `kv_cache_size_tokens`, else
    /// `num_gpu_blocks` × `block_size`; `cache_size_poll`) and uses it as
    /// `kv_cache_tokens` until a replica reports another. "" = never read.
    #[serde(default = "default_metrics_path")]
    pub metrics_path: String,
    /// Key sent to this provider as `Authorization: Bearer <key>`, in place of anything
    /// the client sent.
    #[serde(default)]
    pub api_key: Option<Secret>,
    /// Environment variable holding that key (read at load); exclusive with `api_key`.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// How `api_base`'s host becomes targets.
    #[serde(default)]
    pub discovery: Discovery,
    /// Seconds between two resolutions under `discovery = "dns"`.
    #[serde(default = "default_dns_refresh_s")]
    pub refresh_s: u64,
}

fn default_metrics_path() -> String {
    "/metrics".to_string()
}

fn default_dns_refresh_s() -> u64 {
    DEFAULT_DNS_REFRESH_S
}

/// Default staleness limit of a KV-event stream: requests were routed to a replica and
/// no batch followed within this long → its index is untrusted.
pub const DEFAULT_KV_STALENESS_MS: u64 = 10_000;
/// Default cap on blocks remembered per replica (covers a 16 GiB-class GPU cache).
pub const DEFAULT_KV_MAX_BLOCKS: usize = 1 << 20;

/// `[providers.kv_events]`: a replica's vLLM V1 KV-event publisher.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct KvEventsConfig {
    /// ZMQ PUB endpoint, `tcp://host:port` (connect), or `tcp://*:port` to bind one
    /// address the replica dials (vLLM connects when its endpoint has no wildcard).
    pub endpoint: String,
    /// Topic prefix to subscribe to ("" = all, vLLM's default).
    #[serde(default)]
    pub topic: String,
    /// Optional replay ROUTER endpoint, `tcp://host:port`, used to repair gaps.
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// Staleness limit (see [`DEFAULT_KV_STALENESS_MS`]).
    #[serde(default = "default_kv_staleness_ms")]
    pub staleness_ms: u64,
    /// Most blocks remembered for this replica.
    #[serde(default = "default_kv_max_blocks")]
    pub max_blocks: usize,
    /// Largest ZMQ frame accepted from the publisher or its replay endpoint; a peer
    /// sending a larger one is disconnected and counted (see
    /// [`DEFAULT_MAX_MESSAGE_BYTES`]).
    #[serde(default = "default_kv_max_message_bytes")]
    pub max_message_bytes: u64,
}

fn default_kv_max_message_bytes() -> u64 {
    DEFAULT_MAX_MESSAGE_BYTES
}

fn default_kv_staleness_ms() -> u64 {
    DEFAULT_KV_STALENESS_MS
}

fn default_kv_max_blocks() -> usize {
    DEFAULT_KV_MAX_BLOCKS
}

/// `[providers.lmcache]`: where and how often to poll a replica's cache status.
#[derive(Debug, Clone, Deserialize)]
pub struct LmcacheConfig {
    /// `http://host:port/path` answering `{"occupancy": 0..1, "cache_available": bool}`.
    pub endpoint: String,
    /// Time between two polls.
    #[serde(default = "default_lmcache_interval_ms")]
    pub interval_ms: u64,
    /// Limit on one poll; a slower answer makes the controller neutral.
    #[serde(default = "default_lmcache_timeout_ms")]
    pub timeout_ms: u64,
    /// Age after which the last good result no longer counts (neutral).
    #[serde(default = "default_lmcache_stale_after_ms")]
    pub stale_after_ms: u64,
}

fn default_lmcache_interval_ms() -> u64 {
    DEFAULT_LMCACHE_INTERVAL_MS
}

fn default_lmcache_timeout_ms() -> u64 {
    DEFAULT_LMCACHE_TIMEOUT_MS
}

fn default_lmcache_stale_after_ms() -> u64 {
    DEFAULT_LMCACHE_STALE_AFTER_MS
}

/// Default bound on one inbound ZMQ frame (see `conf/rolter.example.toml` for how it
/// relates to vLLM's largest batch).
pub const DEFAULT_MAX_MESSAGE_BYTES: u64 = 32 << 20;
/// Accepted values of `max_message_bytes`: from 64 KiB (below that, ordinary batches of
/// a few thousand tokens would be refused) to 1 GiB.
pub const MESSAGE_BYTES_RANGE: std::ops::RangeInclusive<u64> = (64 << 10)..=(1 << 30);

/// Default path probed by active health checks (vLLM serves `GET /health`).
pub const DEFAULT_HEALTH_PATH: &str = "/health";

/// Active health checks of one provider.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct HealthConfig {
    /// Probe at all.
    pub enabled: bool,
    /// Path probed with `GET` (relative to the host, not to `api_base`'s prefix).
    pub path: String,
    /// Time between probes.
    pub interval_ms: u64,
    /// Connect + response timeout of one probe.
    pub timeout_ms: u64,
    /// Consecutive successes that make an unhealthy provider healthy again.
    pub healthy_threshold: u32,
    /// Consecutive failures that make a healthy provider unhealthy.
    pub unhealthy_threshold: u32,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            enabled: true,
            path: DEFAULT_HEALTH_PATH.to_string(),
            interval_ms: 2_000,
            timeout_ms: 1_000,
            healthy_threshold: 1,
            unhealthy_threshold: 2,
        }
    }
}

/// Passive health: what failed requests do to a target's eligibility.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct BreakerConfig {
    /// Consecutive failed requests (connect error, timeout, 5xx) that start a cooldown.
    pub failure_threshold: u32,
    /// First cooldown; each further cooldown in a row doubles it.
    pub cooldown_ms: u64,
    /// Longest cooldown.
    pub max_cooldown_ms: u64,
    /// Cooldowns in a row (without a success between) that open the circuit.
    pub open_after_cooldowns: u32,
    /// How long an open circuit stays open before one half-open probe request.
    pub open_ms: u64,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            failure_threshold: 3,
            cooldown_ms: 1_000,
            max_cooldown_ms: 30_000,
            open_after_cooldowns: 3,
            open_ms: 10_000,
        }
    }
}

/// How a route picks one of its targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StrategyKind {
    /// Rotate through eligible targets.
    RoundRobin,
    /// Fewest requests in flight, random tiebreak.
    LeastLoad,
    /// Filter → weighted score (weight, load, prefix) → argmax, with session affinity.
    Pipeline,
    /// Longest cached prefix (per-target prompt tries), with an overload guard.
    CacheAware,
    /// Exact block residency from each replica's KV-event stream (token ids header).
    PreciseCacheAware,
    /// Prefer free LMCache capacity (`[providers.lmcache]`), balanced by load.
    LmcacheAware,
}

impl StrategyKind {
    /// The name used in the routing file and in metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            StrategyKind::RoundRobin => "round_robin",
            StrategyKind::LeastLoad => "least_load",
            StrategyKind::CacheAware => "cache_aware",
            StrategyKind::Pipeline => "pipeline",
            StrategyKind::LmcacheAware => "lmcache_aware",
            StrategyKind::PreciseCacheAware => "precise_cache_aware",
        }
    }
}

/// A model alias and how to serve it.
#[derive(Debug, Clone, Deserialize)]
pub struct RouteConfig {
    /// The `model` clients send.
    pub model: String,
    /// Target selection strategy.
    pub strategy: StrategyKind,
    /// Where requests for this alias may go.
    #[serde(default)]
    pub targets: Vec<TargetConfig>,
    /// Per-route overrides of `[limits]` timeouts.
    #[serde(default)]
    pub timeouts: RouteTimeouts,
    /// Minimum prefix score to pin a request to its best-matching target (cache_aware).
    #[serde(default = "default_cache_threshold")]
    pub cache_threshold: f64,
    /// Prefill tokens one more request in flight is worth (cache_aware,
    /// precise_cache_aware; see `routing::placement`).
    #[serde(default = "default_load_cost_tokens")]
    pub load_cost_tokens: f64,
    /// Requests in flight beyond the least-loaded target before a best target counts as
    /// truly overloaded (twice that for a conversation's own target). Unset: the
    /// strategy's default (`routing::placement::DEFAULT_BALANCE_ABS`, pipeline's
    /// `routing::pipeline::DEFAULT_PIPELINE_BALANCE_ABS`).
    #[serde(default)]
    pub balance_abs: Option<u64>,
    /// ... and more than this multiple of the least-loaded target's load.
    #[serde(default = "default_balance_rel")]
    pub balance_rel: f64,
    /// New work goes only to targets whose load with it stays within this multiple of the
    /// fleet's mean (or the least loaded); 0 = no bound (cache_aware, precise_cache_aware;
    /// pipeline: the share bound moves new work only off a target past this one, never
    /// with 0).
    #[serde(default = "default_load_bound")]
    pub load_bound: f64,
    /// New work skips targets already given more than this multiple of the mean share of
    /// the recent new work while another within it can take it (it holds the prompt's
    /// prefix, or its cache holds the prompt twice); on more than four eligible targets its
    /// excess over 1 and the 2 × √mean allowance for chance shrink by √(4 / targets); 0 = no
    /// bound (cache_aware, precise_cache_aware; pipeline, only off a target also past
    /// `load_bound` and only to a cache that holds the prompt twice).
    #[serde(default = "default_share_bound")]
    pub share_bound: f64,
    /// Send a new conversation to the home every gateway names for its prefix group
    /// (cache_aware, precise_cache_aware; see `routing::group_homes`).
    #[serde(default = "default_group_homes")]
    pub group_homes: bool,
    /// Node ceiling of each target's prefix trie (its memory bound).
    #[serde(default = "default_trie_max_nodes")]
    pub trie_max_nodes: usize,
    /// Average prompt bytes per token of this route's traffic: turns a provider's
    /// `kv_cache_tokens` into a trie cap, and prompt bytes into the tokens the placement
    /// rule weighs (cache_aware, pipeline).
    #[serde(default = "default_prompt_bytes_per_token")]
    pub prompt_bytes_per_token: f64,
    /// Session affinity lifetime after a session's last request (pipeline).
    #[serde(default = "default_session_ttl_s")]
    pub session_ttl_s: u64,
    /// Most sessions remembered per route (pipeline).
    #[serde(default = "default_session_cap")]
    pub session_cap: usize,
    /// Pipeline score term weights.
    #[serde(default)]
    pub pipeline: PipelineConfig,
    /// The model's Hugging Face tokenizer directory (`tokenizer.json`, `tokenizer_config.json`
    /// with its chat template, ...), relative to the routing file: precise_cache_aware then
    /// computes vLLM's token ids itself when a request carries no ids header (`tokenize/`).
    #[serde(default)]
    pub tokenizer: Option<std::path::PathBuf>,
    /// Memory bound of the tokenizer's cache of earlier messages' ids, in bytes.
    #[serde(default = "default_tokenizer_cache_bytes")]
    pub tokenizer_cache_bytes: usize,
}

fn default_tokenizer_cache_bytes() -> usize {
    crate::tokenize::DEFAULT_CACHE_BYTES
}

/// Pipeline score term weights (see `routing::pipeline`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct PipelineConfig {
    /// Weight of the randomised static-weight term.
    pub static_weight: f64,
    /// Weight of the load term.
    pub load: f64,
    /// Weight of the prefix-affinity term.
    pub prefix: f64,
}

impl Default for PipelineConfig {
    fn default() -> Self {
        let w = crate::routing::PipelineWeights::default();
        PipelineConfig {
            static_weight: w.static_weight,
            load: w.load,
            prefix: w.prefix,
        }
    }
}

fn default_session_ttl_s() -> u64 {
    crate::routing::session::DEFAULT_SESSION_TTL_S
}

fn default_session_cap() -> usize {
    crate::routing::session::DEFAULT_SESSION_CAP
}

fn default_cache_threshold() -> f64 {
    crate::routing::cache_aware::DEFAULT_CACHE_THRESHOLD
}

fn default_load_cost_tokens() -> f64 {
    crate::routing::placement::DEFAULT_LOAD_COST_TOKENS
}

fn default_balance_rel() -> f64 {
    crate::routing::placement::DEFAULT_BALANCE_REL
}

fn default_group_homes() -> bool {
    crate::routing::placement::DEFAULT_GROUP_HOMES
}

fn default_load_bound() -> f64 {
    crate::routing::placement::DEFAULT_LOAD_BOUND
}

fn default_share_bound() -> f64 {
    crate::routing::placement::DEFAULT_SHARE_BOUND
}

fn default_prompt_bytes_per_token() -> f64 {
    crate::routing::cache_aware::DEFAULT_PROMPT_BYTES_PER_TOKEN
}

fn default_trie_max_nodes() -> usize {
    crate::prefix::trie::DEFAULT_MAX_NODES
}

/// Per-route timeout overrides; unset keys fall back to `[limits]`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct RouteTimeouts {
    /// TCP connect timeout.
    pub connect_timeout_ms: Option<u64>,
    /// Idle read timeout on the upstream response.
    pub read_timeout_ms: Option<u64>,
    /// Whole-exchange limit (selection to last byte).
    pub total_timeout_ms: Option<u64>,
}

/// One (provider, upstream model) a route may send to.
#[derive(Debug, Clone, Deserialize)]
pub struct TargetConfig {
    /// Name of a `[[providers]]` entry.
    pub provider: String,
    /// The model name sent upstream in place of the alias.
    pub model: String,
    /// Relative weight (pipeline, weighted fallbacks). At least 1.
    #[serde(default = "default_weight")]
    pub weight: u32,
}

fn default_weight() -> u32 {
    1
}

/// `[forwarding]`: what rolter tells an upstream about the client.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct ForwardingConfig {
    /// What to send upstream as `X-Forwarded-For`.
    pub x_forwarded_for: XForwardedFor,
}

/// `forwarding.x_forwarded_for`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum XForwardedFor {
    /// The client's list, if it sent one, with the client's address appended (nginx's
    /// `$proxy_add_x_forwarded_for`).
    #[default]
    Append,
    /// Only the client's address: rolter is the first proxy, and whatever list a client
    /// sends is dropped.
    Replace,
    /// The client's header as sent, if any; rolter adds nothing.
    Off,
}

/// Size and time limits.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct LimitsConfig {
    /// Largest accepted request body; larger gets 413.
    pub max_body_bytes: usize,
    /// TCP connect timeout to an upstream.
    pub connect_timeout_ms: u64,
    /// Read timeout on the upstream response: for the whole response head (1xx
    /// included), then between body chunks; exceeded gives 504.
    pub read_timeout_ms: u64,
    /// Time a client has to deliver its request body.
    pub client_body_timeout_ms: u64,
    /// How long a pooled upstream connection may sit idle.
    pub upstream_idle_timeout_ms: u64,
    /// Whole-exchange limit (selection to last byte); 0 = none. Exceeded before the
    /// response started gives 504; after, the stream is cut.
    pub total_timeout_ms: u64,
    /// Requests being proxied at once, over all routes; beyond it 503 + Retry-After.
    pub max_inflight: usize,
    /// Bytes of request bodies held at once, over all connections; beyond it 503 +
    /// Retry-After.
    pub max_buffered_body_bytes: usize,
    /// Idle time of a kept-alive client connection between requests, seconds;
    /// 0 closes every client connection after its response.
    pub client_keepalive_timeout_s: u64,
    /// Longest a single write to a client may block.
    pub client_write_timeout_ms: u64,
    /// Client connections open at once; more are closed at accept.
    pub max_connections: usize,
    /// Time a request header has to arrive whole (first request: from the accept; later
    /// ones: from their first byte); exceeded gives 408.
    pub client_header_timeout_ms: u64,
    /// Largest request header section; larger gets 431.
    pub max_header_bytes: usize,
    /// Most Responses API ids remembered (response id → replica holding it).
    pub response_affinity_cap: usize,
    /// Seconds a remembered response id is kept after it was learnt.
    pub response_affinity_ttl_s: u64,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            connect_timeout_ms: DEFAULT_CONNECT_TIMEOUT_MS,
            read_timeout_ms: DEFAULT_READ_TIMEOUT_MS,
            client_body_timeout_ms: DEFAULT_CLIENT_BODY_TIMEOUT_MS,
            upstream_idle_timeout_ms: DEFAULT_UPSTREAM_IDLE_TIMEOUT_MS,
            total_timeout_ms: 0,
            max_inflight: DEFAULT_MAX_INFLIGHT,
            max_buffered_body_bytes: DEFAULT_MAX_BUFFERED_BODY_BYTES,
            client_keepalive_timeout_s: DEFAULT_CLIENT_KEEPALIVE_TIMEOUT_S,
            client_write_timeout_ms: DEFAULT_CLIENT_WRITE_TIMEOUT_MS,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            client_header_timeout_ms: DEFAULT_CLIENT_HEADER_TIMEOUT_MS,
            max_header_bytes: DEFAULT_MAX_HEADER_BYTES,
            response_affinity_cap: crate::routing::responses::DEFAULT_RESPONSE_CAP,
            response_affinity_ttl_s: crate::routing::responses::DEFAULT_RESPONSE_TTL_S,
        }
    }
}

impl RouteConfig {
    /// The placement rule this route's keys describe.
    pub fn placement_rule(&self) -> crate::routing::placement::PlacementRule {
        crate::routing::placement::PlacementRule {
            threshold: self.cache_threshold,
            load_cost_tokens: self.load_cost_tokens,
            balance_abs: self
                .balance_abs
                .unwrap_or(crate::routing::placement::DEFAULT_BALANCE_ABS),
            balance_rel: self.balance_rel,
            load_bound: self.load_bound,
            share_bound: self.share_bound,
            group_homes: self.group_homes,
        }
    }

    /// The placement rule as the pipeline strategy uses it: its own `balance_abs` default.
    pub fn pipeline_rule(&self) -> crate::routing::placement::PlacementRule {
        crate::routing::placement::PlacementRule {
            balance_abs: self
                .balance_abs
                .unwrap_or(crate::routing::pipeline::DEFAULT_PIPELINE_BALANCE_ABS),
            ..self.placement_rule()
        }
    }
}
