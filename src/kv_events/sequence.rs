//! Sequence tracking and trust state of one replica's KV-event stream.
//!
//! Owns the pure bookkeeping the subscriber needs to decide what a batch means for
//! the target's index ([`SeqTracker`]) ; the lock-free per-target state the router
//! and metrics read ([`StreamState`]) lives in `prefix::stream_state`. No sockets, no clocks of its own (callers pass
//! `now`), no index access.
//!
//! Trust means "the index reports no block the replica does not hold": missed stores
//! only make it under-report, a missed removal (a sequence gap) may make it lie.
//! Rules (SPEC §4.1):
//! - vLLM numbers batches from 0 per publisher process. `seq == last + 1` is in
//!   order; `seq > last + 1` is a gap (batches lost); `seq <= last` means the
//!   publisher restarted (its cache is empty: clear the index). A stream id in the
//!   sequence frame that changes is a restart too.
//! - A gap is repaired by replaying from the last applied sequence: if the replayed
//!   batch at that sequence is byte-identical to the one applied (same
//!   [`payload_digest`]), the stream continued and the missing batches are applied;
//!   otherwise the publisher restarted or its buffer no longer covers the gap, and
//!   the index is cleared and rebuilt from what follows (a cleared index is trusted:
//!   it under-reports only).
//! - Silence is not staleness: a stream is stale only when requests that should
//!   make the replica store blocks were routed to it and no batch followed within
//!   the staleness limit, or when its socket is down.

use super::decode::STREAM_ID_LEN;
pub use crate::prefix::stream_state::{StreamState, StreamStats};

/// What a batch's sequence number says about the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqClass {
    /// Nothing applied yet: the first batch we see.
    First,
    /// `seq == last + 1`.
    InOrder,
    /// Already covered by a replay that overlapped the live stream: skip it.
    Duplicate,
    /// `seq > last + 1`: batches `expected..seq` were lost.
    Gap {
        /// The sequence number that should have come next.
        expected: u64,
    },
    /// The sequence went back (or the stream id changed): the publisher restarted.
    Restart,
}

/// Digest of a batch payload, to recognise the same batch when it is replayed
/// (vLLM's replay buffer keeps the exact bytes it published). FNV-1a, 64-bit.
pub fn payload_digest(payload: &[u8]) -> u64 {
    const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;
    payload.iter().fold(FNV_OFFSET, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(FNV_PRIME)
    })
}

/// The last applied batch of a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    /// Its sequence number.
    pub seq: u64,
    /// Its [`payload_digest`].
    pub digest: u64,
}

/// Sequence bookkeeping for one stream (pure; see the module header).
#[derive(Debug, Clone, Default)]
pub struct SeqTracker {
    last: Option<Applied>,
    stream_id: Option<[u8; STREAM_ID_LEN]>,
    /// After a replay, live batches in `(after, through]` were already applied
    /// (`after = None`: everything up to `through`).
    skip: Option<(Option<u64>, u64)>,
}

impl SeqTracker {
    /// A tracker that has applied nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// Classify a batch before applying it.
    pub fn classify(&self, seq: u64, stream_id: Option<[u8; STREAM_ID_LEN]>) -> SeqClass {
        if let (Some(known), Some(id)) = (self.stream_id, stream_id) {
            if known != id {
                return SeqClass::Restart;
            }
        }
        if let Some((after, through)) = self.skip {
            if seq <= through && after.is_none_or(|a| seq > a) {
                return SeqClass::Duplicate;
            }
        }
        match self.last {
            None => SeqClass::First,
            Some(a) if a.seq.checked_add(1) == Some(seq) => SeqClass::InOrder,
            Some(a) if seq > a.seq => SeqClass::Gap {
                expected: a.seq + 1,
            },
            Some(_) => SeqClass::Restart,
        }
    }

    /// Record a batch as applied.
    pub fn accept(&mut self, seq: u64, stream_id: Option<[u8; STREAM_ID_LEN]>, digest: u64) {
        self.last = Some(Applied { seq, digest });
        if stream_id.is_some() {
            self.stream_id = stream_id;
        }
        if self.skip.is_some_and(|(_, through)| seq > through) {
            self.skip = None;
        }
    }

    /// A replay applied the batches after `after` through `through`: live batches in
    /// that range, still queued from while the replay ran, are duplicates. Anything
    /// at or below `after` is not (it would mean a restart).
    pub fn replayed(&mut self, after: Option<u64>, through: u64) {
        self.skip = Some((after, through));
    }

    /// Forget everything (the index was cleared).
    pub fn reset(&mut self) {
        *self = Self::default();
    }

    /// The last applied batch, if any.
    pub fn last(&self) -> Option<Applied> {
        self.last
    }

    /// Whether a batch with `stream_id` can belong to the stream applied so far (an
    /// absent id on either side matches anything).
    pub fn same_stream(&self, stream_id: Option<[u8; STREAM_ID_LEN]>) -> bool {
        match (self.stream_id, stream_id) {
            (Some(known), Some(id)) => known == id,
            _ => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_order_gaps_restarts_and_replay_overlap() {
        let mut t = SeqTracker::new();
        assert_eq!(t.classify(5, None), SeqClass::First);
        t.accept(5, None, 1);
        assert_eq!(t.classify(6, None), SeqClass::InOrder);
        assert_eq!(t.classify(9, None), SeqClass::Gap { expected: 6 });
        assert_eq!(
            t.classify(5, None),
            SeqClass::Restart,
            "a repeat means a restart from 0"
        );
        assert_eq!(t.classify(0, None), SeqClass::Restart);
        // A replay applied 6..=9; live 7..=9 buffered meanwhile are duplicates,
        // but a batch at or below the pre-replay sequence is a restart.
        t.accept(9, None, 2);
        t.replayed(Some(5), 9);
        assert_eq!(t.classify(8, None), SeqClass::Duplicate);
        assert_eq!(t.classify(4, None), SeqClass::Restart);
        assert_eq!(t.classify(10, None), SeqClass::InOrder);
        t.accept(10, None, 3);
        assert_eq!(t.classify(8, None), SeqClass::Restart, "skip window closed");
        assert_eq!(t.last(), Some(Applied { seq: 10, digest: 3 }));
    }

    #[test]
    fn stream_id_change_is_a_restart() {
        let mut t = SeqTracker::new();
        t.accept(3, Some([1; STREAM_ID_LEN]), 0);
        assert_eq!(t.classify(4, Some([1; STREAM_ID_LEN])), SeqClass::InOrder);
        assert_eq!(t.classify(4, Some([2; STREAM_ID_LEN])), SeqClass::Restart);
        assert!(t.same_stream(Some([1; STREAM_ID_LEN])) && t.same_stream(None));
        assert!(!t.same_stream(Some([2; STREAM_ID_LEN])));
        t.reset();
        assert_eq!(t.classify(0, None), SeqClass::First);
        assert!(t.same_stream(Some([2; STREAM_ID_LEN])));
    }

    #[test]
    fn digest_tells_payloads_apart() {
        assert_eq!(payload_digest(b"abc"), payload_digest(b"abc"));
        assert_ne!(payload_digest(b"abc"), payload_digest(b"abd"));
    }
}
