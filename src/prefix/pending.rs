//! Blocks a replica is about to hold: the chained block hashes of requests routed to it
//! in the last few seconds, before its KV events announce them.
//!
//! A replica publishes `BlockStored` only once it has computed the blocks, a prefill
//! (plus any queueing) after the gateway routed the request. Without this overlay a
//! burst of requests sharing a new prefix sees an empty index and scatters: every
//! replica then computes the same prefix. Precise routing therefore counts a block as
//! held when the residency index has it *or* it was routed here within
//! [`PENDING_TTL_MS`] and the replica has not reported evicting it since (each note
//! carries the index's stamp; [`ResidencyIndex::with_evictions`] tells when a block
//! went), in the same chained hashes ([`PrefixChain`]).
//!
//! Owns only that short-lived set, and whether anything was noted since it was last
//! cleared (precise routing's test for a replica that holds nothing). Bounded in entries
//! (oldest dropped first); entries expire by time, read lazily. One mutex per target,
//! held for a few hash-map operations; no I/O, no clock of its own (callers pass
//! `now_ms`).

use std::collections::{HashMap, VecDeque};

use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use super::residency::{PrefixChain, ResidencyIndex};

/// How long a routed request's blocks count as held before its replica's events confirm
/// them: a prefill plus queueing at a busy replica, with room to spare. Blocks the
/// replica confirms stop needing the overlay; ones it never stores (a failed request)
/// stop counting after this.
pub const PENDING_TTL_MS: u64 = 3_000;
/// Default cap on pending blocks per target (1M tokens at vLLM's 16-token blocks).
pub const DEFAULT_MAX_PENDING: usize = 1 << 16;

/// The pending-block set of one target.
#[derive(Debug)]
pub struct PendingBlocks {
    inner: Mutex<Inner>,
    max_entries: usize,
    /// Whether anything was noted since the set was made or last cleared.
    noted: AtomicBool,
}

#[derive(Debug, Default)]
struct Inner {
    /// Own block hash → (expiry in ms, the index's stamp when noted).
    expiry: HashMap<u64, (u64, u64)>,
    /// Insertion order with the expiry written then; stale pairs (re-noted since) are
    /// skipped when popped.
    order: VecDeque<(u64, u64)>,
}

impl Default for PendingBlocks {
    fn default() -> Self {
        PendingBlocks::new(DEFAULT_MAX_PENDING)
    }
}

impl PendingBlocks {
    /// An empty set holding at most `max_entries` blocks.
    pub fn new(max_entries: usize) -> Self {
        PendingBlocks {
            inner: Mutex::new(Inner::default()),
            max_entries: max_entries.max(1),
            noted: AtomicBool::new(false),
        }
    }

    /// Note the blocks of `chain` from block `from` on as routed here at `now_ms`, when the
    /// replica's index stood at `stamp` ([`ResidencyIndex::stamp`]).
    pub fn note(&self, chain: &PrefixChain, from: usize, now_ms: u64, stamp: u64) {
        let hashes = chain.hashes().get(from..).unwrap_or(&[]);
        if hashes.is_empty() {
            return;
        }
        let expires = now_ms.saturating_add(PENDING_TTL_MS);
        self.noted.store(true, Ordering::Relaxed);
        let mut inner = self.inner.lock();
        inner.drop_expired(now_ms);
        for &h in hashes.iter().take(self.max_entries) {
            inner.expiry.insert(h, (expires, stamp));
            inner.order.push_back((h, expires));
        }
        while inner.expiry.len() > self.max_entries {
            inner.pop_oldest();
        }
        // Keep the queue O(entries) when the same blocks are noted again and again.
        if inner.order.len() > 2 * self.max_entries.max(inner.expiry.len()) {
            let Inner { expiry, order } = &mut *inner;
            order.retain(|(h, e)| expiry.get(h).is_some_and(|v| v.0 == *e));
        }
    }

    /// How many blocks of `chain`, starting at block `from`, are pending in a row at
    /// `now_ms` (the caller passes the length of the resident run as `from`): noted, not
    /// expired, and not evicted by the replica since the note (per `index`).
    pub fn run_from(
        &self,
        chain: &PrefixChain,
        from: usize,
        now_ms: u64,
        index: &ResidencyIndex,
    ) -> usize {
        let hashes = chain.hashes().get(from..).unwrap_or(&[]);
        if hashes.is_empty() {
            return 0;
        }
        let inner = self.inner.lock();
        if inner.expiry.is_empty() {
            return 0;
        }
        index.with_evictions(|evicted_at| {
            hashes
                .iter()
                .take_while(|&&h| {
                    inner.expiry.get(&h).is_some_and(|&(expires, noted)| {
                        expires > now_ms && evicted_at(h).is_none_or(|at| at <= noted)
                    })
                })
                .count()
        })
    }

    /// Blocks currently held (expired ones not yet dropped included).
    pub fn len(&self) -> usize {
        self.inner.lock().expiry.len()
    }

    /// True when nothing is pending.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether a request was routed here since the set was made or last cleared, expired
    /// or not: a replica this gateway sent a prompt is not one that holds nothing, whatever
    /// its index shows (its events may be late, or lost in a gap).
    pub fn noted_since_clear(&self) -> bool {
        self.noted.load(Ordering::Relaxed)
    }

    /// Forget everything (the replica restarted or cleared its cache).
    pub fn clear(&self) {
        *self.inner.lock() = Inner::default();
        self.noted.store(false, Ordering::Relaxed);
    }
}

impl Inner {
    fn drop_expired(&mut self, now_ms: u64) {
        while let Some(&(_, e)) = self.order.front() {
            if e > now_ms {
                break;
            }
            self.pop_oldest();
        }
    }

    fn pop_oldest(&mut self) {
        if let Some((h, e)) = self.order.pop_front() {
            if self.expiry.get(&h).is_some_and(|v| v.0 == e) {
                self.expiry.remove(&h);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idx() -> ResidencyIndex {
        ResidencyIndex::new(10)
    }

    fn chain(n: u32) -> PrefixChain {
        PrefixChain::new(&(0..n * 4).collect::<Vec<u32>>(), 4, None)
    }

    #[test]
    fn noted_blocks_count_until_they_expire() {
        let p = PendingBlocks::default();
        let c = chain(5);
        assert_eq!(p.run_from(&c, 0, 0, &idx()), 0);
        p.note(&c, 2, 1000, 0);
        assert_eq!(
            p.run_from(&c, 0, 1000, &idx()),
            0,
            "block 0 was resident, not pending"
        );
        assert_eq!(p.run_from(&c, 2, 1000, &idx()), 3);
        assert_eq!(p.run_from(&c, 2, 1000 + PENDING_TTL_MS - 1, &idx()), 3);
        assert_eq!(
            p.run_from(&c, 2, 1000 + PENDING_TTL_MS, &idx()),
            0,
            "expired"
        );
        // A longer request sharing the prefix runs through the noted blocks only.
        assert_eq!(p.run_from(&chain(8), 2, 1500, &idx()), 3);
    }

    #[test]
    fn the_set_is_bounded_oldest_first() {
        let p = PendingBlocks::new(4);
        p.note(&chain(3), 0, 0, 0);
        let other = PrefixChain::new(&[9; 12], 4, None);
        p.note(&other, 0, 1, 0);
        assert!(p.len() <= 4);
        assert_eq!(p.run_from(&other, 0, 2, &idx()), 3, "the newest survive");
        assert_eq!(
            p.run_from(&chain(3), 0, 2, &idx()),
            0,
            "the oldest went first"
        );
    }

    #[test]
    fn renoting_the_same_blocks_keeps_memory_bounded() {
        let p = PendingBlocks::new(8);
        let c = chain(4);
        for t in 0..10_000u64 {
            p.note(&c, 0, t, 0);
        }
        assert_eq!(p.len(), 4);
        assert!(p.inner.lock().order.len() <= 2 * 8 + 4);
        assert_eq!(
            p.run_from(&c, 0, 10_000, &idx()),
            4,
            "refreshed by the last note"
        );
    }

    #[test]
    fn clear_forgets() {
        let p = PendingBlocks::default();
        assert!(!p.noted_since_clear());
        p.note(&chain(2), 0, 0, 0);
        // Expired, the note no longer counts as pending, but the target was sent a prompt.
        assert_eq!(p.run_from(&chain(2), 0, PENDING_TTL_MS, &idx()), 0);
        assert!(p.noted_since_clear());
        p.clear();
        assert!(p.is_empty());
        assert!(!p.noted_since_clear());
        assert_eq!(p.run_from(&chain(2), 0, 1, &idx()), 0);
    }

    #[test]
    fn a_block_evicted_after_its_note_stops_the_run_one_evicted_before_does_not() {
        use crate::prefix::event::{BlockHash, BlockRemoved, BlockStored, KvEvent};
        let tokens: Vec<u32> = (0..8).collect();
        let c = PrefixChain::new(&tokens, 4, None);
        let index = ResidencyIndex::new(10);
        let store = KvEvent::BlockStored(BlockStored {
            block_hashes: vec![BlockHash(1), BlockHash(2)],
            parent_block_hash: None,
            token_ids: tokens.clone(),
            block_size: 4,
            lora_id: None,
            medium: None,
            lora_name: None,
            extra_keys: None,
            group_idx: None,
        });
        let remove = KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![BlockHash(1), BlockHash(2)],
            medium: None,
            group_idx: None,
        });
        // Stored and evicted a while ago, then routed here again: counts.
        index.apply(std::slice::from_ref(&store));
        index.apply(std::slice::from_ref(&remove));
        let p = PendingBlocks::default();
        p.note(&c, 0, 100, index.stamp());
        assert_eq!(p.run_from(&c, 0, 200, &index), 2);
        // Evicted after this note: the replica's word wins.
        index.apply(&[store]);
        index.apply(&[remove]);
        assert_eq!(p.run_from(&c, 0, 300, &index), 0);
    }
}
