//! Session affinity table: `x-session-id` (or a conversation's key) → the target that
//! last served it, with a TTL and a size cap. Concurrent (dashmap shards), bounded, and keyed by the target's
//! stable label (`provider/model`) so entries survive config reloads.
//!
//! A session id is kept as a 64-bit keyed hash, never as the client's bytes: every entry
//! has the same size (the hash, the expiry and a reference to the target label, which the
//! config bounds), so the entry cap bounds the table's bytes however long the ids are
//! (stored whole, 4,000 distinct 60 KB ids held 250 MiB). The hash key is random per table
//! (SipHash, std's `RandomState`), so a client cannot craft ids that collide with another
//! client's session; an accidental collision (about 2^-64 per pair) only moves a
//! conversation's affinity, never its answer.
//!
//! Time is passed in (ms on the process's monotonic clock); no I/O.

use dashmap::DashMap;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Default session lifetime after its last request (SPEC §2 `session_ttl_s`).
pub const DEFAULT_SESSION_TTL_S: u64 = 300;
/// Default most sessions remembered per route.
pub const DEFAULT_SESSION_CAP: usize = 100_000;
/// Longest `session_ttl_s` the config accepts: 30 days (affinity is a cache hint; no
/// replica's KV cache holds a prefix that long), far from any overflow in milliseconds.
pub const MAX_SESSION_TTL_S: u64 = 30 * 24 * 3600;

#[derive(Debug, Clone)]
struct Entry {
    target: Arc<str>,
    expires_ms: u64,
    /// Written from another gateway's note (`peering`), not by a decision of this one.
    from_peer: bool,
}

/// One route's sessions.
#[derive(Debug)]
pub struct SessionTable {
    /// Keyed by [`SessionTable::key`] of the session id.
    map: DashMap<u64, Entry>,
    ids: RandomState,
    ttl_ms: AtomicU64,
    cap: AtomicU64,
    evictions: AtomicU64,
}

impl SessionTable {
    /// A table with the given TTL and cap.
    pub fn new(ttl_s: u64, cap: usize) -> Self {
        SessionTable {
            map: DashMap::new(),
            ids: RandomState::new(),
            ttl_ms: AtomicU64::new(ttl_s.saturating_mul(1000)),
            cap: AtomicU64::new(cap as u64),
            evictions: AtomicU64::new(0),
        }
    }

    /// Apply new settings (config reload) without losing entries.
    pub fn configure(&self, ttl_s: u64, cap: usize) {
        self.ttl_ms
            .store(ttl_s.saturating_mul(1000), Ordering::Relaxed);
        self.cap.store(cap as u64, Ordering::Relaxed);
    }

    /// The table's key for a session id.
    fn key(&self, session: &str) -> u64 {
        self.ids.hash_one(session)
    }

    /// The target label a live session is pinned to.
    pub fn get(&self, session: &str, now_ms: u64) -> Option<Arc<str>> {
        self.get_by_key(self.key(session), now_ms).map(|(t, _)| t)
    }

    /// Pin (or re-pin) a session to `target` from `now_ms` for one TTL.
    pub fn put(&self, session: &str, target: &str, now_ms: u64) {
        self.put_by_key(self.key(session), target, now_ms, false)
    }

    /// [`get`](Self::get) for a conversation known by a 64-bit key (e.g. a hash of its
    /// first messages), keyed through this table's own hash like a session id.
    pub fn get_conversation(&self, conversation: u64, now_ms: u64) -> Option<Arc<str>> {
        self.conversation_entry(conversation, now_ms)
            .map(|(t, _)| t)
    }

    /// [`get_conversation`](Self::get_conversation) and whether the entry came from a
    /// peer's note ([`put_conversation_from_peer`](Self::put_conversation_from_peer)).
    pub fn conversation_entry(&self, conversation: u64, now_ms: u64) -> Option<(Arc<str>, bool)> {
        self.get_by_key(self.ids.hash_one(conversation), now_ms)
    }

    /// [`put`](Self::put) for a conversation known by a 64-bit key.
    pub fn put_conversation(&self, conversation: u64, target: &str, now_ms: u64) {
        self.put_by_key(self.ids.hash_one(conversation), target, now_ms, false)
    }

    /// [`put_conversation`](Self::put_conversation) of what another gateway placed: the
    /// entry says so until this gateway places the conversation itself.
    pub fn put_conversation_from_peer(&self, conversation: u64, target: &str, now_ms: u64) {
        self.put_by_key(self.ids.hash_one(conversation), target, now_ms, true)
    }

    fn get_by_key(&self, key: u64, now_ms: u64) -> Option<(Arc<str>, bool)> {
        let e = self.map.get(&key)?;
        (now_ms < e.expires_ms).then(|| (e.target.clone(), e.from_peer))
    }

    fn put_by_key(&self, key: u64, target: &str, now_ms: u64, from_peer: bool) {
        let expires_ms = now_ms.saturating_add(self.ttl_ms.load(Ordering::Relaxed));
        match self.map.get_mut(&key) {
            Some(mut e) => {
                if &*e.target != target {
                    e.target = Arc::from(target);
                }
                e.expires_ms = expires_ms;
                e.from_peer = from_peer;
            }
            None => {
                let cap = self.cap.load(Ordering::Relaxed) as usize;
                if self.map.len() >= cap {
                    self.make_room(now_ms, cap);
                }
                self.map.insert(
                    key,
                    Entry {
                        target: Arc::from(target),
                        expires_ms,
                        from_peer,
                    },
                );
            }
        }
    }

    /// Drop expired entries; if still at the cap, drop the entries closest to expiry
    /// (the least recently used, since every use extends an entry by one TTL).
    ///
    /// Other threads insert and sweep at the same time, so every size here comes from this
    /// pass's own snapshot or count, never from a second read of the live table.
    fn make_room(&self, now_ms: u64, cap: usize) {
        self.map.retain(|_, e| e.expires_ms > now_ms);
        let mut expiries: Vec<u64> = self.map.iter().map(|e| e.expires_ms).collect();
        let over = (expiries.len() + 1).saturating_sub(cap);
        // Evict a batch (1/8 of the cap) at once so this O(n) pass stays rare.
        let batch = over.max(cap / 8).min(expiries.len());
        if over == 0 || batch == 0 {
            return;
        }
        let (_, &mut cutoff, _) = expiries.select_nth_unstable(batch - 1);
        let mut evicted = 0u64;
        self.map.retain(|_, e| {
            let keep = e.expires_ms > cutoff;
            evicted += u64::from(!keep);
            keep
        });
        self.evictions.fetch_add(evicted, Ordering::Relaxed);
    }

    /// Sessions remembered (including expired ones not yet swept).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether no session is remembered.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Sessions evicted by the cap so far.
    pub fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peers_note_is_marked_until_this_gateway_places_the_conversation() {
        let t = SessionTable::new(10, 10);
        t.put_conversation(7, "a", 0);
        assert_eq!(t.conversation_entry(7, 1), Some((Arc::from("a"), false)));
        t.put_conversation_from_peer(7, "b", 2);
        assert_eq!(t.conversation_entry(7, 3), Some((Arc::from("b"), true)));
        assert_eq!(t.get_conversation(7, 3).as_deref(), Some("b"));
        t.put_conversation(7, "b", 4);
        assert_eq!(t.conversation_entry(7, 5), Some((Arc::from("b"), false)));
    }

    #[test]
    fn ttl_expires_and_use_extends() {
        let t = SessionTable::new(1, 10);
        t.put("s", "a", 0);
        assert_eq!(t.get("s", 999).as_deref(), Some("a"));
        t.put("s", "a", 900);
        assert_eq!(
            t.get("s", 1_800).as_deref(),
            Some("a"),
            "use extended the TTL"
        );
        assert_eq!(t.get("s", 1_900), None);
        t.put("s", "b", 2_000);
        assert_eq!(t.get("s", 2_001).as_deref(), Some("b"));
    }

    /// Regression: `ttl_s * 1000` overflowed for a huge TTL (a panic in debug builds, a
    /// TTL of 384 ms in release).
    #[test]
    fn a_huge_ttl_saturates_instead_of_overflowing() {
        let t = SessionTable::new(18_446_744_073_709_552, 10);
        t.put("s", "a", 5_000);
        assert_eq!(t.get("s", 5_000 + 3_600_000).as_deref(), Some("a"));
        t.configure(u64::MAX, 10);
        t.put("s", "a", u64::MAX - 1);
        assert_eq!(t.get("s", u64::MAX - 1).as_deref(), Some("a"));
    }

    #[test]
    fn cap_evicts_the_least_recently_used_first() {
        let t = SessionTable::new(100, 16);
        for i in 0..16 {
            t.put(&format!("s{i}"), "a", i);
        }
        t.put("s0", "a", 100); // s0 is now the most recently used
        t.put("new", "b", 101);
        assert!(t.len() <= 16);
        assert!(t.evictions() >= 1);
        assert!(t.get("s0", 102).is_some(), "recently used session evicted");
        assert!(t.get("s1", 102).is_none(), "oldest session kept");
        assert_eq!(t.get("new", 102).as_deref(), Some("b"));
    }

    /// Threads pinning new sessions at once into a full table, with request clocks a little
    /// apart (each request reads the clock when it starts): no panic, the cap holds once
    /// they are done, and evictions are counted. (Sizing the eviction batch from one read of
    /// the table's length and indexing a later snapshot by it panicked when another thread's
    /// sweep had emptied the table in between.)
    #[test]
    fn concurrent_puts_into_a_full_table_neither_panic_nor_overflow_the_cap() {
        use std::time::{Duration, Instant};
        let cap = 4;
        let t = SessionTable::new(1, cap);
        let deadline = Instant::now() + Duration::from_secs(2);
        let latest = std::thread::scope(|s| {
            let workers: Vec<_> = (0..4u64)
                .map(|w| {
                    let t = &t;
                    s.spawn(move || {
                        let (mut i, mut now) = (0u64, 0u64);
                        while i < 200_000 && Instant::now() < deadline {
                            i += 1;
                            // Clocks interleave across threads, so one thread's sweep can
                            // expire every entry another thread is about to rank.
                            now = i * 700 + w * 350;
                            t.put(&format!("w{w}-s{i}"), "a", now);
                        }
                        now
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|h| h.join().unwrap())
                .max()
                .unwrap()
        });
        // Racing inserts may overshoot the cap for a moment; the next one restores it.
        t.put("last", "a", latest);
        assert!(t.len() <= cap, "{} sessions over a cap of {cap}", t.len());
        assert!(t.evictions() > 0);
    }
}
