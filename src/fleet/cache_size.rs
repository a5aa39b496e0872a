//! The replicas whose KV-cache size is read from their own metrics (`cache_size_poll`
//! reads; the route table lists them): where to read, and where a size goes.
//!
//! Owns: [`CacheSizeEndpoint`] and publishing a size into its target states. Must not: do
//! I/O (that is `cache_size_poll`) or decide anything with the size (routing reads
//! [`TargetState::reported_cache_tokens`] through the route table).

use super::TargetState;
use crate::metrics::METRICS;
use std::net::SocketAddr;
use std::sync::Arc;

/// One replica whose cache size is read: its address and every target state on it.
pub struct CacheSizeEndpoint {
    /// The provider (instance) name: metric label and log subject.
    pub provider: String,
    /// `api_base`'s host name (or literal address), for the egress check.
    pub host_name: String,
    /// Where to connect (the address the proxy forwards to).
    pub addr: SocketAddr,
    /// `Host` header value.
    pub authority: String,
    /// Request path (`metrics_path`).
    pub path: String,
    /// The targets on this replica and the `prompt_bytes_per_token` of the route sizing
    /// each one's trie (a target shared by routes takes the last, as at load).
    pub targets: Vec<(Arc<TargetState>, f64)>,
}

impl CacheSizeEndpoint {
    /// Publish a size: every target state's cell, and its trie's byte cap.
    pub fn publish(&self, tokens: u64) {
        for (state, bytes_per_token) in &self.targets {
            state.set_reported_cache_tokens(tokens);
            state
                .trie
                .set_max_bytes(crate::routing::cache_aware::trie_bytes_for_kv_cache(
                    Some(tokens),
                    *bytes_per_token,
                ));
        }
        METRICS
            .kv_cache_reported_tokens
            .with_label_values(&[&self.provider])
            .set(tokens.min(i64::MAX as u64) as i64);
    }

    /// The size last published (0 = none yet).
    pub fn known_tokens(&self) -> u64 {
        self.targets
            .first()
            .map_or(0, |(s, _)| s.reported_cache_tokens())
    }
}
