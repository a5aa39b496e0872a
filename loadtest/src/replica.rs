//! One simulated vLLM replica: cache, scheduler slots, cost clock, counters and faults.
//!
//! Owns a request's life inside the engine: wait for one of `max_running` slots, admit the
//! prompt into the prefix cache (publishing the resulting KV events), sleep the prefill time,
//! emit output tokens on the decode clock, store the output's full blocks, release. The HTTP
//! surface lives in `http`; this module never parses requests or writes responses.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde::Serialize;
use tokio::sync::{mpsc, watch, Semaphore};
use tokio::time::Instant;

use crate::cache::{CachedBlock, Lease, PrefixCache, VLLM_DEFAULT_BLOCK_SIZE};
use crate::cost::CostModel;
use crate::kv_events::{KvFault, Publisher, PublisherConfig};
use crate::tokenizer;

/// Default cache capacity in blocks (16,384 tokens at block size 16).
pub const DEFAULT_CACHE_BLOCKS: usize = 1024;
/// Default concurrency limit: vLLM's `max_num_seqs` is larger, but a small K makes queueing
/// visible in a short test.
pub const DEFAULT_MAX_RUNNING: usize = 8;
/// Output length when a request gives no `max_tokens`.
pub const DEFAULT_MAX_TOKENS: usize = 16;
/// Upper bound on output length, whatever the request asks.
pub const MAX_OUTPUT_TOKENS: usize = 4096;
/// How many recent requests a replica remembers for tests.
pub const RECENT_REQUESTS: usize = 256;
/// The served model name when none is configured.
pub const DEFAULT_MODEL: &str = "sim-model";

/// Settings of one replica (the fleet fills in addresses).
#[derive(Debug, Clone)]
pub struct ReplicaConfig {
    /// Model name reported in metrics and, when `strict_model`, the only one accepted.
    pub model: String,
    /// Reject requests for another model with 404 like vLLM (default: accept any).
    pub strict_model: bool,
    pub block_size: usize,
    pub cache_blocks: usize,
    /// Block-hash seed; `None` derives one from the replica index (replicas disagree on hashes,
    /// as vLLM processes with different seeds do).
    pub hash_seed: Option<u64>,
    pub cost: CostModel,
    pub max_running: usize,
    pub default_max_tokens: usize,
    /// Serve `GET /cache/status` (LMCache-style occupancy).
    pub lmcache_status: bool,
    /// How prompts and replies become token ids (`--tokenizer DIR`).
    pub tokenizer: tokenizer::PromptTokenizer,
}

impl Default for ReplicaConfig {
    fn default() -> Self {
        Self {
            model: DEFAULT_MODEL.into(),
            strict_model: false,
            block_size: VLLM_DEFAULT_BLOCK_SIZE,
            cache_blocks: DEFAULT_CACHE_BLOCKS,
            hash_seed: None,
            cost: CostModel::default(),
            max_running: DEFAULT_MAX_RUNNING,
            default_max_tokens: DEFAULT_MAX_TOKENS,
            lmcache_status: true,
            tokenizer: tokenizer::PromptTokenizer::Builtin,
        }
    }
}

/// Fault on the LMCache-style status endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub enum LmcacheFault {
    #[default]
    None,
    /// 500 with a JSON error.
    Error,
    /// 200 with a body that is not the status JSON.
    Garbage,
    /// Never answer (until shutdown).
    Hang,
}

/// Fault on the OpenAI endpoints and `/health`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub enum HttpFault {
    #[default]
    None,
    /// Completions answer 500.
    Error,
    /// Completions never answer (until shutdown).
    Hang,
    /// `/health` answers 503; completions still work.
    Unhealthy,
}

/// The LMCache-style status document.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LmcacheStatus {
    pub occupancy: f64,
    pub cache_available: bool,
}

/// What a replica remembers about a request it received.
#[derive(Debug, Clone, Serialize)]
pub struct RequestRecord {
    pub path: String,
    pub model: Option<String>,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub session_id: Option<String>,
    pub token_ids_header: Option<String>,
    pub body_bytes: usize,
}

/// Counter snapshot of one replica.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct ReplicaStats {
    /// Completion requests received (any outcome).
    pub requests: u64,
    /// Completion requests that finished generating.
    pub requests_ok: u64,
    /// `vllm:prefix_cache_queries` (prompt tokens looked up).
    pub prefix_cache_queries: u64,
    /// `vllm:prefix_cache_hits` (prompt tokens served from cache).
    pub prefix_cache_hits: u64,
    pub generation_tokens: u64,
    pub running: i64,
    pub waiting: i64,
    pub cache_blocks: usize,
    pub cache_capacity: usize,
    pub evictions: u64,
    pub kv_batches: u64,
    pub kv_sent: u64,
    pub kv_replays: u64,
    pub kv_subscribers: usize,
}

#[derive(Debug, Default)]
struct Counters {
    requests: AtomicU64,
    requests_ok: AtomicU64,
    queries: AtomicU64,
    hits: AtomicU64,
    generation_tokens: AtomicU64,
    running: AtomicI64,
    waiting: AtomicI64,
}

#[derive(Debug, Default)]
struct Faults {
    lmcache: LmcacheFault,
    http: HttpFault,
    lmcache_override: Option<LmcacheStatus>,
}

/// A token (or the end) streamed out of the engine.
#[derive(Debug, Clone)]
pub enum GenEvent {
    /// Output token `index` (0 is the first token, at the end of prefill).
    Token { index: usize, word: &'static str },
    /// Generation finished.
    Done(Usage),
}

/// Token accounting of a finished request.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
}

/// The live state of one replica.
pub struct Replica {
    pub index: usize,
    cfg: ReplicaConfig,
    cache: Mutex<PrefixCache>,
    slots: Arc<Semaphore>,
    publisher: Mutex<Option<Publisher>>,
    publisher_cfg: Mutex<Option<PublisherConfig>>,
    counters: Counters,
    faults: Mutex<Faults>,
    recent: Mutex<VecDeque<RequestRecord>>,
    shutdown: watch::Receiver<bool>,
}

impl std::fmt::Debug for Replica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replica")
            .field("index", &self.index)
            .finish()
    }
}

/// Default hash seed of replica `index`.
pub fn default_hash_seed(index: usize) -> u64 {
    tokenizer::splitmix64(0x5eed_0000 + index as u64)
}

impl Replica {
    /// A replica; `publisher` is already bound (its config is kept to rebind on restart).
    pub fn new(
        index: usize,
        cfg: ReplicaConfig,
        publisher: Option<(Publisher, PublisherConfig)>,
        shutdown: watch::Receiver<bool>,
    ) -> Arc<Self> {
        let seed = cfg.hash_seed.unwrap_or_else(|| default_hash_seed(index));
        let (publisher, publisher_cfg) = match publisher {
            Some((p, c)) => (Some(p), Some(c)),
            None => (None, None),
        };
        Arc::new(Self {
            index,
            cache: Mutex::new(PrefixCache::new(cfg.block_size, cfg.cache_blocks, seed)),
            slots: Arc::new(Semaphore::new(cfg.max_running.max(1))),
            publisher: Mutex::new(publisher),
            publisher_cfg: Mutex::new(publisher_cfg),
            counters: Counters::default(),
            faults: Mutex::new(Faults::default()),
            recent: Mutex::new(VecDeque::new()),
            shutdown,
            cfg,
        })
    }

    pub fn config(&self) -> &ReplicaConfig {
        &self.cfg
    }

    /// The KV-event publisher's bound endpoints `(pub, replay)`, if events are on.
    pub fn kv_endpoints(&self) -> Option<(String, Option<String>)> {
        self.publisher.lock().as_ref().map(|p| {
            (
                p.endpoint().to_string(),
                p.replay_endpoint().map(str::to_string),
            )
        })
    }

    /// Count a received completion request and remember it.
    pub fn record_request(&self, rec: RequestRecord) {
        self.counters.requests.fetch_add(1, Ordering::Relaxed);
        let mut recent = self.recent.lock();
        if recent.len() >= RECENT_REQUESTS {
            recent.pop_front();
        }
        recent.push_back(rec);
    }

    /// Fill in the cached-token count of the most recent record with this prompt length.
    fn note_cached(&self, prompt_tokens: usize, cached: usize) {
        let mut recent = self.recent.lock();
        if let Some(r) = recent
            .iter_mut()
            .rev()
            .find(|r| r.prompt_tokens == prompt_tokens)
        {
            r.cached_tokens = cached;
        }
    }

    /// Recent requests, oldest first.
    pub fn recent_requests(&self) -> Vec<RequestRecord> {
        self.recent.lock().iter().cloned().collect()
    }

    /// Start generating `max_tokens` tokens for `prompt`; events arrive on the receiver. Dropping
    /// the receiver cancels the request (its blocks are released).
    pub fn start(
        self: &Arc<Self>,
        prompt: Vec<u32>,
        max_tokens: usize,
    ) -> mpsc::Receiver<GenEvent> {
        let (tx, rx) = mpsc::channel(64);
        let me = self.clone();
        tokio::spawn(async move { me.run(prompt, max_tokens, tx).await });
        rx
    }

    async fn run(self: Arc<Self>, prompt: Vec<u32>, max_tokens: usize, tx: mpsc::Sender<GenEvent>) {
        let n = max_tokens.clamp(1, MAX_OUTPUT_TOKENS);
        let mut shutdown = self.shutdown.clone();
        self.counters.waiting.fetch_add(1, Ordering::Relaxed);
        let permit = tokio::select! {
            p = self.slots.clone().acquire_owned() => p,
            _ = shutdown.wait_for(|s| *s) => {
                self.counters.waiting.fetch_sub(1, Ordering::Relaxed);
                return;
            }
            _ = tx.closed() => {
                self.counters.waiting.fetch_sub(1, Ordering::Relaxed);
                return;
            }
        };
        let Ok(_permit) = permit else { return };
        self.counters.waiting.fetch_sub(1, Ordering::Relaxed);
        self.counters.running.fetch_add(1, Ordering::Relaxed);
        let mut guard = Running {
            replica: &self,
            lease: None,
        };

        let hit = {
            let mut cache = self.cache.lock();
            let adm = cache.admit(&prompt);
            self.counters
                .queries
                .fetch_add(prompt.len() as u64, Ordering::Relaxed);
            self.counters
                .hits
                .fetch_add(adm.hit_tokens as u64, Ordering::Relaxed);
            self.publish(adm.events);
            guard.lease = Some(adm.lease);
            adm.hit_tokens
        };
        self.note_cached(prompt.len(), hit);

        let cost = self.cfg.cost;
        let first_at = Instant::now() + cost.prefill(prompt.len(), hit);
        let (words, out_tokens) = {
            let words = tokenizer::reply_words(&prompt, n);
            let toks = self.cfg.tokenizer.reply_tokens(&words);
            (words, toks)
        };
        for (i, word) in words.iter().enumerate() {
            let at = first_at + cost.decode_offset(i);
            tokio::select! {
                _ = tokio::time::sleep_until(at) => {}
                _ = shutdown.wait_for(|s| *s) => return,
            }
            if tx.send(GenEvent::Token { index: i, word }).await.is_err() {
                return; // client went away: guard releases the blocks
            }
        }

        let mut all = prompt.clone();
        all.extend_from_slice(&out_tokens);
        if let Some(mut lease) = guard.lease.take() {
            let mut cache = self.cache.lock();
            let events = cache.extend(&mut lease, &all);
            self.publish(events);
            cache.release(lease);
        }
        self.counters.requests_ok.fetch_add(1, Ordering::Relaxed);
        self.counters
            .generation_tokens
            .fetch_add(n as u64, Ordering::Relaxed);
        let _ = tx
            .send(GenEvent::Done(Usage {
                prompt_tokens: prompt.len(),
                completion_tokens: n,
                cached_tokens: hit,
            }))
            .await;
    }

    /// Publish events; call with the cache lock held so batches keep the cache's order.
    fn publish(&self, events: Vec<crate::cache::CacheEvent>) {
        if events.is_empty() {
            return;
        }
        if let Some(p) = self.publisher.lock().as_ref() {
            p.publish(events);
        }
    }

    /// vLLM's `POST /reset_prefix_cache`: drop all blocks and publish `AllBlocksCleared`.
    pub fn reset_prefix_cache(&self) {
        let mut cache = self.cache.lock();
        let events = cache.clear();
        self.publish(events);
    }

    /// Apply a KV-event fault. `Restart` also empties the cache silently, as a restarted vLLM.
    pub fn kv_fault(&self, fault: KvFault) {
        let mut cache = self.cache.lock();
        if fault == KvFault::Restart {
            cache.reset();
        }
        if let Some(p) = self.publisher.lock().as_ref() {
            p.fault(fault);
        }
    }

    /// Close the KV-event sockets (subscribers see the peer go away). Idempotent.
    pub async fn stop_publisher(&self) {
        let p = self.publisher.lock().take();
        if let Some(p) = p {
            p.close().await;
        }
    }

    /// Rebind the KV-event sockets on the same endpoints with a fresh sequence and an empty
    /// cache: a vLLM process restart as the event stream sees it.
    pub async fn restart_publisher(&self) -> std::io::Result<()> {
        let old = self.publisher.lock().take();
        let Some(old) = old else { return Ok(()) };
        let (ep, replay) = (
            old.endpoint().to_string(),
            old.replay_endpoint().map(str::to_string),
        );
        old.close().await;
        let mut cfg = self
            .publisher_cfg
            .lock()
            .clone()
            .expect("publisher config kept with publisher");
        cfg.endpoint = ep;
        cfg.replay_endpoint = replay;
        cfg.dump = None;
        let p = Publisher::start(cfg).await?;
        let mut cache = self.cache.lock();
        cache.reset();
        *self.publisher.lock() = Some(p);
        Ok(())
    }

    pub fn set_lmcache_fault(&self, f: LmcacheFault) {
        self.faults.lock().lmcache = f;
    }

    pub fn lmcache_fault(&self) -> LmcacheFault {
        self.faults.lock().lmcache
    }

    /// Force the status endpoint's answer (`None`: computed from the cache).
    pub fn set_lmcache_override(&self, status: Option<LmcacheStatus>) {
        self.faults.lock().lmcache_override = status;
    }

    pub fn set_http_fault(&self, f: HttpFault) {
        self.faults.lock().http = f;
    }

    pub fn http_fault(&self) -> HttpFault {
        self.faults.lock().http
    }

    /// The LMCache-style status: cached blocks / capacity, available.
    pub fn lmcache_status(&self) -> LmcacheStatus {
        if let Some(s) = self.faults.lock().lmcache_override {
            return s;
        }
        let cache = self.cache.lock();
        let occupancy = if cache.capacity() == 0 {
            1.0
        } else {
            cache.len() as f64 / cache.capacity() as f64
        };
        LmcacheStatus {
            occupancy,
            cache_available: true,
        }
    }

    /// Every cached block.
    pub fn cache_snapshot(&self) -> Vec<CachedBlock> {
        self.cache.lock().snapshot()
    }

    /// Tokens this replica would serve from cache for `prompt` right now.
    pub fn hit_tokens(&self, prompt: &[u32]) -> usize {
        self.cache.lock().hit_tokens(prompt)
    }

    /// Chained block hashes this replica computes for `tokens`.
    pub fn chain_hashes(&self, tokens: &[u32]) -> Vec<u64> {
        self.cache.lock().chain_hashes(tokens)
    }

    pub fn stats(&self) -> ReplicaStats {
        let c = &self.counters;
        let (cache_blocks, cache_capacity, evictions) = {
            let cache = self.cache.lock();
            (cache.len(), cache.capacity(), cache.evictions())
        };
        let mut s = ReplicaStats {
            requests: c.requests.load(Ordering::Relaxed),
            requests_ok: c.requests_ok.load(Ordering::Relaxed),
            prefix_cache_queries: c.queries.load(Ordering::Relaxed),
            prefix_cache_hits: c.hits.load(Ordering::Relaxed),
            generation_tokens: c.generation_tokens.load(Ordering::Relaxed),
            running: c.running.load(Ordering::Relaxed),
            waiting: c.waiting.load(Ordering::Relaxed),
            cache_blocks,
            cache_capacity,
            evictions,
            ..ReplicaStats::default()
        };
        if let Some(p) = self.publisher.lock().as_ref() {
            let ps = p.stats();
            s.kv_batches = ps.batches.load(Ordering::Relaxed);
            s.kv_sent = ps.sent.load(Ordering::Relaxed);
            s.kv_replays = ps.replays.load(Ordering::Relaxed);
            s.kv_subscribers = ps.subscribers.load(Ordering::Relaxed);
        }
        s
    }

    /// Prometheus text with vLLM's metric names.
    pub fn metrics_text(&self) -> String {
        let s = self.stats();
        let labels = format!(
            "engine=\"0\",model_name=\"{}\"",
            self.cfg.model.replace('\\', "\\\\").replace('"', "\\\"")
        );
        let usage = if s.cache_capacity == 0 {
            0.0
        } else {
            s.cache_blocks as f64 / s.cache_capacity as f64
        };
        let mut out = String::with_capacity(2048);
        let mut metric = |name: &str, kind: &str, help: &str, value: f64| {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {value:?}\n"
            ));
        };
        metric(
            "vllm:num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
            s.running as f64,
        );
        metric(
            "vllm:num_requests_waiting",
            "gauge",
            "Number of requests waiting to be processed.",
            s.waiting as f64,
        );
        metric(
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
            usage,
        );
        metric(
            "vllm:prefix_cache_queries_total",
            "counter",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_cache_queries as f64,
        );
        metric(
            "vllm:prefix_cache_hits_total",
            "counter",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_cache_hits as f64,
        );
        metric(
            "vllm:prompt_tokens_total",
            "counter",
            "Number of prefill tokens processed.",
            s.prefix_cache_queries as f64,
        );
        metric(
            "vllm:generation_tokens_total",
            "counter",
            "Number of generation tokens processed.",
            s.generation_tokens as f64,
        );
        metric(
            "vllm:request_success_total",
            "counter",
            "Count of successfully processed requests.",
            s.requests_ok as f64,
        );
        metric(
            "rolter_sim_requests_total",
            "counter",
            "Completion requests received by this simulated replica (any outcome).",
            s.requests as f64,
        );
        metric(
            "rolter_sim_kv_event_batches_total",
            "counter",
            "KV-event batches given a sequence number.",
            s.kv_batches as f64,
        );
        // vLLM's CacheConfig as an info metric: one sample, labels = the settings (a
        // subset of vLLM's), value 1. Omitted for an unbounded cache (vLLM always has a size).
        if s.cache_capacity > 0 {
            out.push_str(&format!(
                "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
                 # TYPE vllm:cache_config_info gauge\n\
                 vllm:cache_config_info{{block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",\
                 engine=\"0\",gpu_memory_utilization=\"0.9\",num_cpu_blocks=\"None\",num_gpu_blocks=\"{}\"}} 1.0\n",
                self.cfg.block_size, s.cache_capacity
            ));
        }
        out
    }

    /// Resolves when the fleet shuts down.
    pub async fn until_shutdown(&self) {
        let mut rx = self.shutdown.clone();
        let _ = rx.wait_for(|s| *s).await;
    }

    /// A bounded hang: until shutdown or `limit`.
    pub async fn hang(&self, limit: Duration) {
        let _ = tokio::time::timeout(limit, self.until_shutdown()).await;
    }
}

/// Running-request bookkeeping that also holds on an early exit.
struct Running<'a> {
    replica: &'a Replica,
    lease: Option<Lease>,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        if let Some(lease) = self.lease.take() {
            self.replica.cache.lock().release(lease);
        }
        self.replica
            .counters
            .running
            .fetch_sub(1, Ordering::Relaxed);
    }
}
