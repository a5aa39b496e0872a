//! Group homes: one home target per prefix group (prompts sharing a first message: a system
//! prompt, a tool list, a few-shot template), computed from the set of groups a gateway has
//! seen, so that independent gateways behind one L4 balancer, which see the same groups,
//! name the same home without talking to each other.
//!
//! Why: a new group is placed by the cost rule on the load this gateway sees. Two gateways
//! see different halves of the load, so in a burst they can place one group on two
//! replicas and never converge (each one's trie shows only its own home); under cache
//! pressure both replicas then alternate two system prompts. The home here is a function
//! of the group set and the targets' labels only: groups in key order, each to the target
//! with the fewest homes so far, ties by rendezvous weight. A group counts once it has
//! been seen [`KNOWN_AFTER`] times (a one-off prompt is not a group) and is forgotten
//! [`FORGET_AFTER_MS`] after its last request.
//!
//! Owns the seen-group table and the published assignment. Must not decide placement (the
//! rule in `placement` weighs the home against cache and load) nor do I/O; time is passed
//! in. Readers take no lock: the assignment is an `ArcSwap`, the counters are dashmap
//! shards; a rebuild (when a group becomes known, the targets change, or once per
//! [`SWEEP_EVERY_MS`]) runs under a `try_lock`, so no request waits for it.

use super::placement::{fnv1a, rendezvous_hashed};
use arc_swap::ArcSwap;
use dashmap::DashMap;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// Requests of a group before it gets a home.
pub const KNOWN_AFTER: u32 = 2;
/// A group not seen for this long loses its home.
pub const FORGET_AFTER_MS: u64 = 60_000;
/// Most groups tracked; past it, new groups are not counted until a sweep makes room.
pub const MAX_GROUPS: usize = 4096;
/// Interval between sweeps of forgotten groups.
pub const SWEEP_EVERY_MS: u64 = 1_000;

#[derive(Debug)]
struct Seen {
    count: AtomicU32,
    last_ms: AtomicU64,
}

/// A published assignment: the labels it was computed over, and group -> label index.
#[derive(Debug, Default)]
struct Homes {
    labels: Vec<String>,
    home: HashMap<u64, usize>,
}

impl Homes {
    fn computed_over(&self, labels: &[&str]) -> bool {
        self.labels.len() == labels.len() && self.labels.iter().zip(labels).all(|(a, b)| a == b)
    }
}

/// One route's group homes.
#[derive(Debug)]
pub struct GroupHomes {
    seen: DashMap<u64, Seen>,
    homes: ArcSwap<Homes>,
    /// Time of the last sweep (ms; 0 = never).
    swept_ms: AtomicU64,
    /// Held while rebuilding.
    rebuild: Mutex<()>,
}

impl Default for GroupHomes {
    fn default() -> Self {
        GroupHomes {
            seen: DashMap::new(),
            homes: ArcSwap::from_pointee(Homes::default()),
            swept_ms: AtomicU64::new(0),
            rebuild: Mutex::new(()),
        }
    }
}

impl GroupHomes {
    /// Count one request of `group` and return its home as an index into `labels` (the
    /// route's targets, eligible or not, in order), if it has one.
    pub fn note_and_home(&self, group: u64, labels: &[&str], now_ms: u64) -> Option<usize> {
        let became_known = self.note(group, now_ms);
        let swept = self.swept_ms.load(Relaxed);
        let due = swept == 0 || now_ms >= swept.saturating_add(SWEEP_EVERY_MS);
        let mut homes = self.homes.load();
        if became_known || due || !homes.computed_over(labels) {
            if let Some(_rebuilding) = self.rebuild.try_lock() {
                if due {
                    self.sweep(now_ms);
                    self.swept_ms.store(now_ms.max(1), Relaxed);
                }
                self.homes.store(Arc::new(assign(&self.known(), labels)));
                homes = self.homes.load();
            }
        }
        if !homes.computed_over(labels) {
            return None;
        }
        homes.home.get(&group).copied()
    }

    /// Count `group`; true when this request made it known. A known group's entry is only
    /// read, and its last-seen time written at most once a second.
    fn note(&self, group: u64, now_ms: u64) -> bool {
        if let Some(s) = self.seen.get(&group) {
            if s.last_ms.load(Relaxed).saturating_add(1_000) <= now_ms {
                s.last_ms.store(now_ms, Relaxed);
            }
            if s.count.load(Relaxed) >= KNOWN_AFTER {
                return false;
            }
            return s.count.fetch_add(1, Relaxed).saturating_add(1) == KNOWN_AFTER;
        }
        if self.seen.len() >= MAX_GROUPS {
            return false;
        }
        let s = self.seen.entry(group).or_insert(Seen {
            count: AtomicU32::new(0),
            last_ms: AtomicU64::new(now_ms),
        });
        s.count.fetch_add(1, Relaxed).saturating_add(1) == KNOWN_AFTER
    }

    fn sweep(&self, now_ms: u64) {
        self.seen
            .retain(|_, s| s.last_ms.load(Relaxed).saturating_add(FORGET_AFTER_MS) > now_ms);
    }

    /// The known groups, in key order.
    fn known(&self) -> Vec<u64> {
        let mut known: Vec<u64> = self
            .seen
            .iter()
            .filter(|s| s.count.load(Relaxed) >= KNOWN_AFTER)
            .map(|s| *s.key())
            .collect();
        known.sort_unstable();
        known
    }
}

/// Homes for `groups` (in key order) over `labels`: each group to the label with the fewest
/// homes so far, ties by the group's rendezvous weight on the label.
fn assign(groups: &[u64], labels: &[&str]) -> Homes {
    let mut count = vec![0usize; labels.len()];
    let mut home = HashMap::with_capacity(groups.len());
    let label_hashes: Vec<u64> = labels.iter().map(|l| fnv1a(l.as_bytes())).collect();
    if !labels.is_empty() {
        for &g in groups {
            let best = (0..labels.len())
                .max_by_key(|&i| {
                    (
                        std::cmp::Reverse(count[i]),
                        rendezvous_hashed(g, label_hashes[i]),
                    )
                })
                .expect("labels is not empty");
            count[best] += 1;
            home.insert(g, best);
        }
    }
    Homes {
        labels: labels.iter().map(|l| l.to_string()).collect(),
        home,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::placement::rendezvous;

    const LABELS: [&str; 4] = ["a/m", "b/m", "c/m", "d/m"];

    fn seen_twice(h: &GroupHomes, groups: impl IntoIterator<Item = u64>, now: u64) {
        for g in groups {
            h.note_and_home(g, &LABELS, now);
            h.note_and_home(g, &LABELS, now);
        }
    }

    #[test]
    fn a_group_gets_a_home_on_its_second_request() {
        let h = GroupHomes::default();
        assert_eq!(h.note_and_home(7, &LABELS, 10), None);
        assert!(h.note_and_home(7, &LABELS, 10).is_some());
    }

    #[test]
    fn as_many_groups_as_targets_get_one_target_each() {
        for seed in 0..50u64 {
            let h = GroupHomes::default();
            let groups: Vec<u64> = (0..4).map(|i| rendezvous(seed, &format!("g{i}"))).collect();
            seen_twice(&h, groups.iter().copied(), 10);
            let mut homes: Vec<usize> = groups
                .iter()
                .map(|&g| h.note_and_home(g, &LABELS, 10).unwrap())
                .collect();
            homes.sort_unstable();
            assert_eq!(homes, vec![0, 1, 2, 3], "seed {seed}");
        }
    }

    #[test]
    fn two_gateways_seeing_the_groups_in_different_orders_agree() {
        for seed in 0..50u64 {
            let groups: Vec<u64> = (0..6).map(|i| rendezvous(seed, &format!("g{i}"))).collect();
            let (a, b) = (GroupHomes::default(), GroupHomes::default());
            seen_twice(&a, groups.iter().copied(), 10);
            seen_twice(&b, groups.iter().rev().copied(), 10);
            for &g in &groups {
                assert_eq!(
                    a.note_and_home(g, &LABELS, 20),
                    b.note_and_home(g, &LABELS, 20),
                    "seed {seed}"
                );
            }
        }
    }

    #[test]
    fn a_forgotten_group_loses_its_home_and_frees_its_target() {
        let h = GroupHomes::default();
        seen_twice(&h, [1, 2, 3, 4], 10);
        let home_of_1 = h.note_and_home(1, &LABELS, 10).unwrap();
        // 1 stays in use; 2, 3, 4 are not seen again.
        let later = 10 + FORGET_AFTER_MS / 2;
        h.note_and_home(1, &LABELS, later);
        let much_later = later + FORGET_AFTER_MS / 2 + SWEEP_EVERY_MS;
        assert_eq!(h.note_and_home(1, &LABELS, much_later), Some(home_of_1));
        assert_eq!(h.known(), vec![1]);
        assert_eq!(h.note_and_home(2, &LABELS, much_later), None);
    }

    #[test]
    fn homes_follow_a_change_of_targets() {
        let h = GroupHomes::default();
        seen_twice(&h, [1, 2, 3], 10);
        let three = &LABELS[..3];
        let home = h.note_and_home(1, three, 11).unwrap();
        assert!(home < 3);
    }

    #[test]
    fn the_table_is_bounded() {
        let h = GroupHomes::default();
        for g in 0..(MAX_GROUPS as u64 + 100) {
            h.note_and_home(g, &LABELS, 10);
        }
        assert_eq!(h.seen.len(), MAX_GROUPS);
    }
}
