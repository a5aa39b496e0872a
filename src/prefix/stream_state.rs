//! The trust and freshness state of one target's residency feed (its KV-event stream).
//!
//! Owns the lock-free per-target state the router and metrics read, and the counters the
//! subscriber bumps. Lives beside the residency index because routing reads it with the
//! index; the subscriber (`kv_events/`) is its only writer except for [`StreamState::note_routed`],
//! which the request path calls. Must not: touch sockets, the index, or clocks other than
//! its own monotonic epoch.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// Sentinel for "no timestamp" in the millisecond atomics.
const NEVER: u64 = u64::MAX;

/// Lock-free state of one target's stream, shared with the router and metrics.
///
/// The subscriber is the only writer of everything except [`Self::note_routed`],
/// which the request path calls. Counters only grow.
#[derive(Debug)]
pub struct StreamState {
    epoch: Instant,
    trusted: AtomicBool,
    connected: AtomicBool,
    last_seq: AtomicU64,
    last_batch_ms: AtomicU64,
    routed_waiting_since_ms: AtomicU64,
    /// Batches received (live and replayed).
    pub batches: AtomicU64,
    /// `BlockStored` events applied.
    pub events_stored: AtomicU64,
    /// `BlockRemoved` events applied.
    pub events_removed: AtomicU64,
    /// `AllBlocksCleared` events applied.
    pub events_cleared: AtomicU64,
    /// Messages that failed to decode.
    pub decode_errors: AtomicU64,
    /// Sequence gaps detected.
    pub gaps: AtomicU64,
    /// Publisher restarts detected (sequence went back or stream id changed).
    pub restarts: AtomicU64,
    /// Replays that repaired a gap (or proved continuity).
    pub replays_ok: AtomicU64,
    /// Replays that failed or could not cover the gap.
    pub replays_failed: AtomicU64,
    /// Times the index was dropped to be rebuilt from new events.
    pub rebuilds: AtomicU64,
    /// Times the stream was declared stale.
    pub stale: AtomicU64,
    /// Socket (re)connections made.
    pub connects: AtomicU64,
    /// Stores skipped for an unknown parent.
    pub orphan_stores: AtomicU64,
    /// Stores skipped for a token count that is not block_size × hashes, or a
    /// block size other than the learned one.
    pub skipped_stores: AtomicU64,
    /// Index entries evicted to stay under the cap.
    pub evictions: AtomicU64,
    /// Peers disconnected for breaking the protocol (a frame over the size limit, a
    /// malformed handshake), on the SUB or the replay DEALER.
    pub protocol_errors: AtomicU64,
    /// Publisher connections that dropped, whatever the reason.
    pub disconnects: AtomicU64,
}

impl Default for StreamState {
    fn default() -> Self {
        Self::new()
    }
}

/// A plain copy of a [`StreamState`]'s counters, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StreamStats {
    /// See [`StreamState::is_trusted`].
    pub trusted: bool,
    /// See [`StreamState::is_connected`].
    pub connected: bool,
    /// Last applied sequence number.
    pub last_seq: Option<u64>,
    /// Batches received.
    pub batches: u64,
    /// `BlockStored` events applied.
    pub events_stored: u64,
    /// `BlockRemoved` events applied.
    pub events_removed: u64,
    /// `AllBlocksCleared` events applied.
    pub events_cleared: u64,
    /// Decode errors.
    pub decode_errors: u64,
    /// Gaps.
    pub gaps: u64,
    /// Restarts.
    pub restarts: u64,
    /// Successful replays.
    pub replays_ok: u64,
    /// Failed replays.
    pub replays_failed: u64,
    /// Index rebuilds.
    pub rebuilds: u64,
    /// Staleness declarations.
    pub stale: u64,
    /// Connections made.
    pub connects: u64,
    /// Orphan stores skipped.
    pub orphan_stores: u64,
    /// Misaligned / foreign-block-size stores skipped.
    pub skipped_stores: u64,
    /// Index evictions.
    pub evictions: u64,
    /// Protocol violations.
    pub protocol_errors: u64,
    /// Dropped publisher connections.
    pub disconnects: u64,
}

impl StreamState {
    /// A fresh state: not connected, trusted (an empty index under-reports only).
    pub fn new() -> Self {
        StreamState {
            epoch: Instant::now(),
            trusted: AtomicBool::new(true),
            connected: AtomicBool::new(false),
            last_seq: AtomicU64::new(NEVER),
            last_batch_ms: AtomicU64::new(NEVER),
            routed_waiting_since_ms: AtomicU64::new(NEVER),
            batches: AtomicU64::new(0),
            events_stored: AtomicU64::new(0),
            events_removed: AtomicU64::new(0),
            events_cleared: AtomicU64::new(0),
            decode_errors: AtomicU64::new(0),
            gaps: AtomicU64::new(0),
            restarts: AtomicU64::new(0),
            replays_ok: AtomicU64::new(0),
            replays_failed: AtomicU64::new(0),
            rebuilds: AtomicU64::new(0),
            stale: AtomicU64::new(0),
            connects: AtomicU64::new(0),
            orphan_stores: AtomicU64::new(0),
            skipped_stores: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            protocol_errors: AtomicU64::new(0),
            disconnects: AtomicU64::new(0),
        }
    }

    /// Milliseconds since this state was created (the clock every `*_ms` uses).
    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Whether the router may score this target from its index. An untrusted
    /// target scores 0 (it is not excluded).
    pub fn is_trusted(&self) -> bool {
        self.trusted.load(Ordering::Acquire)
    }

    /// Whether the subscriber's socket is up.
    pub fn is_connected(&self) -> bool {
        self.connected.load(Ordering::Relaxed)
    }

    /// Request path: a request was routed here that should make the replica store
    /// at least one block (it has more full blocks than the index says are
    /// resident). Starts the staleness clock unless it is already running.
    pub fn note_routed(&self) {
        let now = self.now_ms();
        let _ = self.routed_waiting_since_ms.compare_exchange(
            NEVER,
            now,
            Ordering::AcqRel,
            Ordering::Relaxed,
        );
    }

    /// True when requests were routed here more than `limit_ms` ago and no batch
    /// arrived since.
    pub fn is_stale_at(&self, now_ms: u64, limit_ms: u64) -> bool {
        match self.routed_waiting_since_ms.load(Ordering::Acquire) {
            NEVER => false,
            since => now_ms.saturating_sub(since) > limit_ms,
        }
    }

    /// Milliseconds since the last batch, if one arrived.
    pub fn ms_since_last_batch(&self, now_ms: u64) -> Option<u64> {
        match self.last_batch_ms.load(Ordering::Relaxed) {
            NEVER => None,
            t => Some(now_ms.saturating_sub(t)),
        }
    }

    /// A plain copy of the counters.
    pub fn snapshot(&self) -> StreamStats {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StreamStats {
            trusted: self.is_trusted(),
            connected: self.is_connected(),
            last_seq: match get(&self.last_seq) {
                NEVER => None,
                s => Some(s),
            },
            batches: get(&self.batches),
            events_stored: get(&self.events_stored),
            events_removed: get(&self.events_removed),
            events_cleared: get(&self.events_cleared),
            decode_errors: get(&self.decode_errors),
            gaps: get(&self.gaps),
            restarts: get(&self.restarts),
            replays_ok: get(&self.replays_ok),
            replays_failed: get(&self.replays_failed),
            rebuilds: get(&self.rebuilds),
            stale: get(&self.stale),
            connects: get(&self.connects),
            orphan_stores: get(&self.orphan_stores),
            skipped_stores: get(&self.skipped_stores),
            evictions: get(&self.evictions),
            protocol_errors: get(&self.protocol_errors),
            disconnects: get(&self.disconnects),
        }
    }

    // ---- writer side (the subscriber) ----

    pub(crate) fn set_trusted(&self, trusted: bool) {
        self.trusted.store(trusted, Ordering::Release);
    }

    pub(crate) fn set_connected(&self, connected: bool) {
        self.connected.store(connected, Ordering::Relaxed);
    }

    /// A batch arrived: stops the staleness clock.
    pub(crate) fn batch_arrived(&self, seq: u64) {
        self.batches.fetch_add(1, Ordering::Relaxed);
        self.last_seq.store(seq, Ordering::Relaxed);
        self.last_batch_ms.store(self.now_ms(), Ordering::Relaxed);
        self.routed_waiting_since_ms.store(NEVER, Ordering::Release);
    }

    /// `n` replayed batches arrived, the last with sequence `last_seq`.
    pub(crate) fn batches_replayed(&self, n: u64, last_seq: u64) {
        if n == 0 {
            return;
        }
        self.batches.fetch_add(n, Ordering::Relaxed);
        self.last_seq.store(last_seq, Ordering::Relaxed);
        self.last_batch_ms.store(self.now_ms(), Ordering::Relaxed);
        self.routed_waiting_since_ms.store(NEVER, Ordering::Release);
    }

    /// Forget a pending staleness clock (after a reconnect, requests start it anew).
    pub(crate) fn reset_staleness(&self) {
        self.routed_waiting_since_ms.store(NEVER, Ordering::Release);
    }

    pub(crate) fn bump(counter: &AtomicU64, by: u64) {
        if by > 0 {
            counter.fetch_add(by, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silence_is_not_staleness() {
        let s = StreamState::new();
        assert!(!s.is_stale_at(1_000_000, 10), "idle and never routed to");
        s.note_routed();
        let start = s.now_ms();
        assert!(!s.is_stale_at(start + 5, 10));
        assert!(s.is_stale_at(start + 11, 10));
        s.note_routed(); // a second request does not restart the clock
        assert!(s.is_stale_at(start + 11, 10));
        s.batch_arrived(0);
        assert!(!s.is_stale_at(start + 1_000, 10), "a batch stops the clock");
        assert_eq!(s.snapshot().last_seq, Some(0));
    }
}
