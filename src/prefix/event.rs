//! The KV-cache events the residency index applies: the block types of vLLM's
//! `BlockStored` / `BlockRemoved` / `AllBlocksCleared`, as plain data.
//!
//! Owns the types only. Decoding them from the wire is `kv_events::decode`'s job; applying
//! them is [`super::residency`]'s. Must not: parse bytes, or depend on anything outside
//! `prefix/`.

/// A vLLM block hash normalised to one key type (see the module header).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u64);

impl BlockHash {
    /// A signed hash (older vLLM, Python `hash()`), kept as its two's complement.
    pub fn from_i64(h: i64) -> Self {
        BlockHash(h as u64)
    }

    /// A binary hash: its last 8 bytes big-endian, as vLLM converts bytes to int.
    pub fn from_bytes(b: &[u8]) -> Self {
        let tail = &b[b.len().saturating_sub(8)..];
        let mut buf = [0u8; 8];
        buf[8 - tail.len()..].copy_from_slice(tail);
        BlockHash(u64::from_be_bytes(buf))
    }
}

/// Where a block lives: vLLM's `medium` (`MEDIUM_GPU = "GPU"`, `"CPU"`, `"STORAGE"`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Medium {
    /// GPU memory (vLLM's own block pool).
    Gpu,
    /// CPU memory (offloading connector).
    Cpu,
    /// Disk / remote storage tier.
    Storage,
    /// Any other tier name a connector reports.
    Other(String),
}

impl Medium {
    /// Parse vLLM's medium string (case-insensitive for the known tiers).
    pub fn parse(s: &str) -> Self {
        if s.eq_ignore_ascii_case("GPU") {
            Medium::Gpu
        } else if s.eq_ignore_ascii_case("CPU") {
            Medium::Cpu
        } else if s.eq_ignore_ascii_case("STORAGE") {
            Medium::Storage
        } else {
            Medium::Other(s.to_string())
        }
    }

    /// The wire spelling.
    pub fn as_str(&self) -> &str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
            Medium::Storage => "STORAGE",
            Medium::Other(s) => s,
        }
    }
}

/// One item of a block's `extra_keys` tuple (LoRA name, multimodal hash, cache salt,
/// prompt-embedding hash, ...).
#[derive(Debug, Clone, PartialEq)]
pub enum ExtraKey {
    /// A string item (LoRA name, mm identifier, cache salt).
    Str(String),
    /// An integer item (e.g. an offset).
    Int(i64),
    /// A binary item (e.g. a prompt-embedding hash).
    Bytes(Vec<u8>),
    /// Anything else (floats, nested values): kept only as an opaque marker.
    Other,
}

/// `BlockStored`: full blocks entered the cache.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockStored {
    /// Engine hashes of the stored blocks, in chain order.
    pub block_hashes: Vec<BlockHash>,
    /// Engine hash of the block before the first stored one (`None` = prefix start).
    pub parent_block_hash: Option<BlockHash>,
    /// The stored blocks' tokens, concatenated (empty in offloading-connector
    /// announcements of copies of already-known blocks).
    pub token_ids: Vec<u32>,
    /// Tokens per block (0 in offloading-connector announcements without tokens).
    pub block_size: u32,
    /// Deprecated LoRA id (kept by vLLM for compatibility).
    pub lora_id: Option<i64>,
    /// Tier the blocks were stored in (`None` before vLLM reported it: GPU).
    pub medium: Option<Medium>,
    /// LoRA adapter name (the key vLLM hashes).
    pub lora_name: Option<String>,
    /// Per-block extra hash keys (one entry per stored block, `None` = no extras).
    pub extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
    /// KV-cache group of the blocks (hybrid models).
    pub group_idx: Option<u32>,
}

/// `BlockRemoved`: blocks left the cache (of the given tier).
#[derive(Debug, Clone, PartialEq)]
pub struct BlockRemoved {
    /// Engine hashes of the removed blocks.
    pub block_hashes: Vec<BlockHash>,
    /// Tier the blocks were removed from (`None` before vLLM reported it: GPU).
    pub medium: Option<Medium>,
    /// KV-cache group of the blocks.
    pub group_idx: Option<u32>,
}

/// One decoded KV-cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Blocks stored.
    BlockStored(BlockStored),
    /// Blocks removed.
    BlockRemoved(BlockRemoved),
    /// The whole prefix cache was reset.
    AllBlocksCleared,
}
