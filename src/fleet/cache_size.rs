//! The replicas whose KV-cache size is read from their own metrics (`cache_size_poll`
//! reads; the route table lists them): where to read, and where a size goes.
//!
//! Owns: [`CacheSizeEndpoint`], each target's [`ReportedSize`] cell and the rule for who
//! may write it. Must not: do I/O (that is `cache_size_poll`) or decide anything with the
//! size (routing reads [`TargetState::reported_cache_tokens`] through the route table).
//!
//! ## Generations
//! Every table build takes a new generation and hands each target's cell to it: to the
//! build's endpoints when the target is read, else to nobody (the size is dropped). A read
//! publishes only into cells its own generation holds, under the cell's lock, so a read of
//! the table a reload is replacing, still in flight while the new table is built and
//! swapped in, cannot bring back a size the reload dropped or override a trie cap it set.
//! The lock is per target and never taken on the request path, which reads the size with
//! one atomic load.

use super::TargetState;
use crate::metrics::METRICS;
use crate::routing::cache_aware::trie_bytes_for_kv_cache;
use parking_lot::Mutex;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The next table generation (0 is "no reads").
static NEXT_GENERATION: AtomicU64 = AtomicU64::new(1);

/// A fresh generation for a table being built.
pub fn next_generation() -> u64 {
    NEXT_GENERATION.fetch_add(1, Ordering::Relaxed)
}

/// One target's KV-cache size as its replica's metrics report it.
#[derive(Debug, Default)]
pub struct ReportedSize {
    /// Tokens (0 = none); read lock-free.
    tokens: AtomicU64,
    /// The generation whose reads may write (0 = none).
    writer: Mutex<u64>,
}

impl ReportedSize {
    /// The size last published (0 = none).
    pub fn tokens(&self) -> u64 {
        self.tokens.load(Ordering::Relaxed)
    }

    /// Give the cell to `generation`'s reads, keeping the size; or, with `None`, to nobody,
    /// dropping it. Returns the size kept.
    pub fn hand_over(&self, generation: Option<u64>) -> u64 {
        let mut writer = self.writer.lock();
        *writer = generation.unwrap_or(0);
        if generation.is_none() {
            self.tokens.store(0, Ordering::Relaxed);
        }
        self.tokens()
    }

    /// Publish `tokens` read by `generation`, running `changed` (under the cell's lock)
    /// when the size is new. Refused (false) when another generation holds the cell.
    pub fn publish(&self, generation: u64, tokens: u64, changed: impl FnOnce()) -> bool {
        let writer = self.writer.lock();
        if *writer != generation || generation == 0 {
            return false;
        }
        if self.tokens.swap(tokens, Ordering::Relaxed) != tokens {
            changed();
        }
        true
    }
}

/// One replica whose cache size is read: its address and every target state on it.
pub struct CacheSizeEndpoint {
    /// The table generation this endpoint belongs to (see the module docs).
    pub generation: u64,
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
    /// The targets on this replica and the `prompt_bytes_per_token` their tries are sized
    /// with (of the last route that reads the target).
    pub targets: Vec<(Arc<TargetState>, f64)>,
}

impl CacheSizeEndpoint {
    /// Publish a size: every target cell this endpoint's generation holds, and its trie's
    /// byte cap when the size changed; the gauge when any took it.
    pub fn publish(&self, tokens: u64) {
        let mut taken = false;
        for (state, bytes_per_token) in &self.targets {
            taken |= state.cache_size.publish(self.generation, tokens, || {
                state
                    .trie
                    .set_max_bytes(trie_bytes_for_kv_cache(Some(tokens), *bytes_per_token));
            });
        }
        if taken {
            METRICS
                .kv_cache_reported_tokens
                .with_label_values(&[&self.provider])
                .set(tokens.min(i64::MAX as u64) as i64);
        }
    }

    /// The size last published for any of its targets (0 = none yet).
    pub fn known_tokens(&self) -> u64 {
        self.targets
            .iter()
            .map(|(s, _)| s.reported_cache_tokens())
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_generation_holding_the_cell_writes_it() {
        let cell = ReportedSize::default();
        let (old, new) = (next_generation(), next_generation());
        assert!(!cell.publish(old, 100, || panic!("nobody holds it yet")));
        assert_eq!(cell.hand_over(Some(old)), 0);
        let mut changes = 0;
        assert!(cell.publish(old, 100, || changes += 1));
        assert!(
            cell.publish(old, 100, || changes += 1),
            "same size: no change"
        );
        assert_eq!((cell.tokens(), changes), (100, 1));
        // A reload keeps the reads: the size stays, the old table's reads are refused.
        assert_eq!(cell.hand_over(Some(new)), 100);
        assert!(!cell.publish(old, 999, || panic!("stale generation")));
        assert!(cell.publish(new, 200, || changes += 1));
        assert_eq!((cell.tokens(), changes), (200, 2));
        // A reload that stops the reads drops the size; no late read brings it back.
        assert_eq!(cell.hand_over(None), 0);
        assert!(!cell.publish(new, 300, || panic!("nobody reads it now")));
        assert!(!cell.publish(0, 300, || panic!("generation 0 never writes")));
        assert_eq!(cell.tokens(), 0);
    }
}
