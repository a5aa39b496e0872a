//! Command-line flags of the simulated fleet, shared by `rolter-sim` and `rolter-load compare`.
//!
//! Owns the mapping from flags to [`FleetConfig`] and the startup announcement line; defaults
//! are the library defaults (fast, for tests), documented in `--help`.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use crate::cache::VLLM_DEFAULT_BLOCK_SIZE;
use crate::cost::CostModel;
use crate::fleet::{FleetConfig, FleetHandle, KvEventsConfig};
use crate::kv_events::publisher::VLLM_DEFAULT_BUFFER_STEPS;
use crate::kv_events::{BatchLayout, EventFields, EventLayout, HashRepr, WireFormat};
use crate::replica::{
    ReplicaConfig, DEFAULT_CACHE_BLOCKS, DEFAULT_MAX_RUNNING, DEFAULT_MAX_TOKENS, DEFAULT_MODEL,
};

/// Flags describing a simulated fleet.
#[derive(Debug, Clone, Args)]
pub struct SimArgs {
    /// Number of replicas.
    #[arg(long, default_value_t = 4)]
    pub replicas: usize,
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// HTTP port of replica 0 (replica i: +i); 0 picks free ports.
    #[arg(long, default_value_t = 8001)]
    pub base_port: u16,
    /// KV-event PUB port of replica 0 (replica i: +2i, replay +2i+1); 0 picks free ports.
    #[arg(long, default_value_t = 5557)]
    pub kv_base_port: u16,
    /// Served model name (metrics label; the only model accepted with --strict-model).
    #[arg(long, default_value = DEFAULT_MODEL)]
    pub model: String,
    /// Answer 404 for any other model, like vLLM.
    #[arg(long)]
    pub strict_model: bool,
    /// Tokens per KV block.
    #[arg(long, default_value_t = VLLM_DEFAULT_BLOCK_SIZE)]
    pub block_size: usize,
    /// Cache capacity per replica, in blocks.
    #[arg(long, default_value_t = DEFAULT_CACHE_BLOCKS)]
    pub cache_blocks: usize,
    /// Block-hash seed for every replica (default: a different seed per replica).
    #[arg(long)]
    pub hash_seed: Option<u64>,
    /// Requests running at once per replica; others wait.
    #[arg(long, default_value_t = DEFAULT_MAX_RUNNING)]
    pub max_running: usize,
    /// Prefill cost per uncached prompt token, microseconds.
    #[arg(long, default_value_t = 1.0)]
    pub prefill_us_per_token: f64,
    /// Decode cost per output token, microseconds.
    #[arg(long, default_value_t = 50.0)]
    pub decode_us_per_token: f64,
    /// Fixed cost of each prefill, microseconds.
    #[arg(long, default_value_t = 0.0)]
    pub base_latency_us: f64,
    /// Output tokens when a request sets no max_tokens.
    #[arg(long, default_value_t = DEFAULT_MAX_TOKENS)]
    pub default_max_tokens: usize,
    /// Don't serve GET /cache/status.
    #[arg(long)]
    pub no_lmcache: bool,
    /// Don't publish KV events.
    #[arg(long)]
    pub no_kv_events: bool,
    /// Don't bind the replay ROUTER socket.
    #[arg(long)]
    pub no_replay: bool,
    /// KV-event topic; `{replica}` becomes the replica index (vLLM's default: empty).
    #[arg(long, default_value = "")]
    pub topic: String,
    /// Event layout: array (vLLM ≤ 0.23) or map (≥ 0.24).
    #[arg(long, value_enum, default_value_t = EventLayout::Array)]
    pub kv_layout: EventLayout,
    /// Outer batch layout (vLLM releases: array).
    #[arg(long, value_enum, default_value_t = BatchLayout::Array)]
    pub kv_batch_layout: BatchLayout,
    /// Block-hash representation on the wire.
    #[arg(long, value_enum, default_value_t = HashRepr::U64)]
    pub kv_hash: HashRepr,
    /// Which optional event fields to write.
    #[arg(long, value_enum, default_value_t = EventFields::LoraName)]
    pub kv_fields: EventFields,
    /// Include the topic frame in replay replies (vLLM ≥ 0.26).
    #[arg(long)]
    pub replay_topic_frame: bool,
    /// Replay buffer length in batches.
    #[arg(long, default_value_t = VLLM_DEFAULT_BUFFER_STEPS)]
    pub replay_buffer: usize,
    /// Write each replica's live KV stream to DIR/replica-{i}.bin (+ .jsonl).
    #[arg(long)]
    pub events_dump: Option<PathBuf>,
    /// Tokenize prompts and replies with this Hugging Face tokenizer directory (as the
    /// gateway's `tokenizer` route key does) instead of the built-in word tokenizer; with
    /// `rolter-load compare`, the driver's `x-rolter-vllm-token-ids` use it too.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
}

fn micros(us: f64) -> Duration {
    Duration::from_secs_f64(us.max(0.0) / 1e6)
}

impl SimArgs {
    /// The tokenizer `--tokenizer` names (exits with the reason if it cannot be loaded).
    pub fn prompt_tokenizer(&self) -> crate::tokenizer::PromptTokenizer {
        crate::tokenizer::PromptTokenizer::load(self.tokenizer.as_deref()).unwrap_or_else(|e| {
            eprintln!("--tokenizer: {e}");
            std::process::exit(2)
        })
    }

    /// The fleet these flags describe.
    pub fn fleet_config(&self) -> FleetConfig {
        FleetConfig {
            replicas: self.replicas,
            host: self.host,
            http_base_port: self.base_port,
            kv_base_port: self.kv_base_port,
            replica: ReplicaConfig {
                model: self.model.clone(),
                strict_model: self.strict_model,
                block_size: self.block_size.max(1),
                cache_blocks: self.cache_blocks,
                hash_seed: self.hash_seed,
                cost: CostModel {
                    prefill_per_token: micros(self.prefill_us_per_token),
                    decode_per_token: micros(self.decode_us_per_token),
                    base_latency: micros(self.base_latency_us),
                },
                max_running: self.max_running.max(1),
                default_max_tokens: self.default_max_tokens,
                lmcache_status: !self.no_lmcache,
                tokenizer: self.prompt_tokenizer(),
            },
            kv_events: (!self.no_kv_events).then(|| KvEventsConfig {
                topic: self.topic.clone(),
                wire: WireFormat {
                    layout: self.kv_layout,
                    batch_layout: self.kv_batch_layout,
                    hash: self.kv_hash,
                    fields: self.kv_fields,
                    data_parallel_rank: 0,
                },
                replay: !self.no_replay,
                replay_topic_frame: self.replay_topic_frame,
                buffer_steps: self.replay_buffer,
                dump_dir: self.events_dump.clone(),
            }),
        }
    }
}

/// One JSON line describing a running fleet: what `rolter-sim` prints first on stdout.
pub fn announcement(fleet: &FleetHandle) -> serde_json::Value {
    let replicas: Vec<_> = fleet
        .replicas()
        .iter()
        .map(|r| {
            serde_json::json!({
                "index": r.index,
                "http": r.http_addr.to_string(),
                "api_base": r.base_url(),
                "kv_events": r.kv_events_endpoint(),
                "kv_replay": r.kv_replay_endpoint(),
                "kv_topic": r.kv_topic(),
                "lmcache_status": r.lmcache_status_url(),
            })
        })
        .collect();
    serde_json::json!({ "replicas": replicas })
}
