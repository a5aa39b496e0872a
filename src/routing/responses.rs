//! Responses API affinity: response id → the target (by its stable `provider/model`
//! label) whose replica stored that response, so a request that continues it
//! (`previous_response_id`) or reads, deletes or cancels it reaches the one replica that
//! has it (vLLM keeps responses in that process's memory).
//!
//! The table is a [`SessionTable`] (dashmap shards, ids kept as a keyed 64-bit hash, a
//! TTL and an entry cap: its memory is bounded whatever the ids' length). It lives in
//! the runtime, not in a route table, so it survives reloads; an entry whose target a
//! reload removed is reported as such (the caller answers an error, never another
//! replica). Time is passed in; no I/O.

use super::{Decision, FleetView, Reason, RouteInput, SessionTable, Strategy};
use std::sync::Arc;

/// Default lifetime of a remembered response id after it was learnt (6 hours: long
/// enough for a working session's conversation; vLLM's own store has no expiry).
pub const DEFAULT_RESPONSE_TTL_S: u64 = 6 * 3600;
/// Default most response ids remembered (about 100 bytes each: 20 MiB).
pub const DEFAULT_RESPONSE_CAP: usize = 200_000;

/// Where each known response lives.
#[derive(Debug)]
pub struct ResponseAffinity {
    table: SessionTable,
}

impl Default for ResponseAffinity {
    fn default() -> Self {
        Self::new(DEFAULT_RESPONSE_TTL_S, DEFAULT_RESPONSE_CAP)
    }
}

impl ResponseAffinity {
    /// A table with the given TTL and cap.
    pub fn new(ttl_s: u64, cap: usize) -> Self {
        ResponseAffinity {
            table: SessionTable::new(ttl_s, cap),
        }
    }

    /// Apply new settings (config reload) without losing entries.
    pub fn configure(&self, ttl_s: u64, cap: usize) {
        self.table.configure(ttl_s, cap);
    }

    /// Remember that `target` holds response `id` (learnt at `now_ms`).
    pub fn learn(&self, id: &str, target: &str, now_ms: u64) {
        self.table.put(id, target, now_ms);
    }

    /// The label of the target holding response `id`, if known and not expired.
    pub fn home(&self, id: &str, now_ms: u64) -> Option<Arc<str>> {
        self.table.get(id, now_ms)
    }

    /// Ids remembered (expired ones not yet swept included).
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Whether no id is remembered.
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// Ids evicted by the cap so far.
    pub fn evictions(&self) -> u64 {
        self.table.evictions()
    }
}

/// The strategy of a request bound to one target (the one holding the response it
/// continues): that target if it may be chosen, else none (never another replica).
#[derive(Debug, Clone, Copy)]
pub struct Pinned {
    /// Index of the target in the route.
    pub target: usize,
}

impl Strategy for Pinned {
    fn name(&self) -> &'static str {
        "response_affinity"
    }

    fn uses_prompt(&self) -> bool {
        false
    }

    fn fails_over(&self) -> bool {
        false
    }

    fn select(&self, _input: &RouteInput, fleet: &FleetView) -> Option<Decision> {
        fleet
            .eligible()
            .find(|&i| i == self.target)
            .map(|target| Decision {
                target,
                reason: Reason::Affinity,
                score: None,
                hint: None,
                conversation: None,
                new_work: false,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::Candidate;

    #[test]
    fn pinned_picks_its_target_even_if_busiest_and_nothing_else() {
        let mut c = [Candidate::default(), Candidate::default()];
        c[0].eligible = true;
        c[0].inflight = 50;
        c[1].eligible = true;
        let view = FleetView::new(&c);
        let p = Pinned { target: 0 };
        assert_eq!(p.select(&RouteInput::default(), &view).unwrap().target, 0);
        c[0].eligible = false;
        let view = FleetView::new(&c);
        assert_eq!(p.select(&RouteInput::default(), &view), None);
        let excluded = FleetView {
            candidates: &[Candidate {
                eligible: true,
                ..Default::default()
            }],
            excluded: &[0],
        };
        assert_eq!(p.select(&RouteInput::default(), &excluded), None);
    }

    #[test]
    fn learns_expires_and_moves() {
        let t = ResponseAffinity::new(10, 100);
        assert_eq!(t.home("resp_1", 0), None);
        t.learn("resp_1", "p0/m", 0);
        assert_eq!(t.home("resp_1", 9_999).as_deref(), Some("p0/m"));
        assert_eq!(t.home("resp_1", 10_000), None, "expired");
        t.learn("resp_1", "p1/m", 10_001);
        assert_eq!(t.home("resp_1", 10_002).as_deref(), Some("p1/m"));
    }

    /// 200,000 distinct 1 KiB ids into a table capped at 1,000: after every insert the
    /// table holds at most the cap, the newest id is kept and the oldest evicted, and
    /// evictions are counted. (Ids are kept as 64-bit hashes, so entries are fixed-size:
    /// see `SessionTable`.)
    #[test]
    fn memory_stays_bounded_by_the_cap() {
        let cap = 1_000;
        let t = ResponseAffinity::new(3600, cap);
        let pad = "x".repeat(1024);
        for i in 0..200_000u64 {
            t.learn(&format!("resp_{i}_{pad}"), "p0/m", i);
            assert!(t.len() <= cap, "{} ids over the cap at {i}", t.len());
        }
        assert!(t.evictions() >= 199_000);
        let last = format!("resp_{}_{pad}", 199_999);
        assert_eq!(t.home(&last, 200_000).as_deref(), Some("p0/m"));
        assert_eq!(t.home(&format!("resp_0_{pad}"), 200_000), None);
    }
}
