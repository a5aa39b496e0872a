//! Group homes: one home target per prefix group (prompts sharing a first message: a system
//! prompt, a tool list, a few-shot template), computed from the set of groups a gateway has
//! seen, so that independent gateways behind one L4 balancer, which see the same groups,
//! name the same home without talking to each other.
//!
//! Why: a new group is placed by the cost rule on the load this gateway sees. Two gateways
//! see different halves of the load, so in a burst they can place one group on two
//! replicas and never converge (each one's trie shows only its own home); under cache
//! pressure both replicas then alternate two system prompts. The home here is a function
//! of the group set and the targets' labels only: rendezvous hashing with bounded loads
//! (groups in key order, each to its highest-weight target that has fewer than
//! `ceil(groups / targets)` homes so far). The bound keeps homes even (as many groups as
//! targets get one target each); the rendezvous preference keeps them stable: a group
//! joining or leaving moves few others' homes, as a moved home costs the fleet a prefill
//! of that group's prefix on its new home. A group counts once it has been seen twice (a
//! one-off prompt is not a group) and is forgotten [`FORGET_AFTER_MS`] after its last
//! request. In the opening [`OPENING_MS`] after the first request (a start or a reload), a
//! group no target holds counts from its first request, up to as many groups as targets:
//! a cold start's burst brings the groups within milliseconds, and counted one by one at
//! their second request, a group counted later can take the home another has already sent
//! several conversations to (the set's key order decides, not arrival), leaving those
//! conversations on a replica that now hosts another group.
//!
//! A home whose groups stop opening conversations goes quiet ([`QUIET_AFTER_MISSED`]): the
//! clock is this route's count of new conversations, so a cold start's burst or a lull of
//! the whole route silences no one.
//!
//! Owns the seen-group table, the published assignment, the count of new conversations (one
//! atomic) and each target's pace on that count (kept with the assignment, carried over by
//! label when it is rebuilt). Must not decide placement (the rule in `placement` weighs the
//! home against cache and load) nor do I/O; time is passed in. No global lock on the
//! request path: the assignment is an `ArcSwap`, the seen groups are dashmap shards (a
//! known group's entry is read, and written at most once a second), and a first sighting
//! writes one slot of an array. A rebuild (when a group becomes known, the targets change,
//! or the sweep every [`SWEEP_EVERY_MS`] forgets a group) runs under a `try_lock`, so no
//! request waits for it.

use super::pace::Pace;
use super::placement::{fnv1a, rendezvous_hashed, GroupHome};
use arc_swap::ArcSwap;
use dashmap::DashMap;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// A group not seen for this long loses its home.
pub const FORGET_AFTER_MS: u64 = 60_000;
/// A home is quiet when its groups have opened none of the route's last new conversations
/// where their usual share would have brought this many (a tenant gone idle, a batch near
/// its end): `placement` then lets other groups' work in (its rule 9). Four: by chance a
/// home misses that many expected conversations about 2% of the time.
pub const QUIET_AFTER_MISSED: f64 = 4.0;
/// Most groups with a home; past it, new groups get none until a sweep makes room.
pub const MAX_GROUPS: usize = 4096;
/// Interval between sweeps of forgotten groups.
pub const SWEEP_EVERY_MS: u64 = 1_000;
/// Slots of the first-sighting filter (direct-mapped: a collision only forgets a sighting).
const FIRST_SIGHT_SLOTS: usize = 4096;
/// A known group's last-seen time is rewritten at most this often.
const SEEN_REFRESH_MS: u64 = 1_000;
/// How long after the first request a group counts from its first request (up to as many
/// groups as targets).
pub const OPENING_MS: u64 = 500;

/// A published assignment: the labels it was computed over, and group -> label index.
#[derive(Debug, Default)]
struct Homes {
    labels: Vec<String>,
    label_hashes: Vec<u64>,
    /// Homes per label.
    count: Vec<usize>,
    /// Groups with a home, and the XOR of their keys: the set this was computed for.
    groups: usize,
    groups_xor: u64,
    home: HashMap<u64, usize>,
    /// Per label, the pace of the new conversations of the groups living there, on this
    /// route's count of new conversations.
    paces: Vec<Arc<Pace>>,
}

impl Homes {
    fn computed_over(&self, labels: &[&str]) -> bool {
        self.labels.len() == labels.len() && self.labels.iter().zip(labels).all(|(a, b)| a == b)
    }

    /// Take over `before`'s pace for every label both have: a rebuild moves homes, not
    /// the record of what the groups on a target have been doing.
    fn keep_paces(&mut self, before: &Homes) {
        for (label, pace) in self.labels.iter().zip(self.paces.iter_mut()) {
            if let Some(j) = before.labels.iter().position(|l| l == label) {
                *pace = before.paces[j].clone();
            }
        }
    }

    /// Where a group seen for the first time goes, so its first conversation does not open
    /// a home the group then leaves: its rendezvous choice over all targets, when that has
    /// room for one more home (so the group would get it on joining the set last).
    /// Otherwise none: naming the next label with room would send every one-off prompt to
    /// the few targets with room for a home. Exact unless joining raises the per-target cap
    /// (the known groups are a multiple of the targets): then earlier groups may take the
    /// room it was named for.
    fn expected_home(&self, group: u64) -> Option<usize> {
        let top = self.best_home(group, usize::MAX)?;
        (self.count[top] < home_cap(self.groups + 1, self.labels.len())).then_some(top)
    }

    /// `group`'s highest-weight label with fewer than `cap` homes.
    fn best_home(&self, group: u64, cap: usize) -> Option<usize> {
        (0..self.labels.len())
            .filter(|&i| self.count[i] < cap)
            .max_by_key(|&i| rendezvous_hashed(group, self.label_hashes[i]))
    }
}

/// One route's group homes.
#[derive(Debug)]
pub struct GroupHomes {
    /// Groups seen at least twice, with the time of their last request (ms, refreshed at
    /// most once a second).
    seen: DashMap<u64, AtomicU64>,
    /// XOR of the keys in `seen`, kept with it: with its size, tells whether the set
    /// differs from the one the published assignment was computed for.
    seen_xor: AtomicU64,
    /// Groups seen once, by slot: a one-off prompt writes here and nowhere else.
    first_sight: Box<[AtomicU64]>,
    homes: ArcSwap<Homes>,
    /// Time of the last sweep (ms; 0 = never).
    swept_ms: AtomicU64,
    /// Held while rebuilding.
    rebuild: Mutex<()>,
    /// Time of the first request noted (ms; 0 = none yet): the opening runs from it.
    opened_ms: AtomicU64,
    /// New conversations of known groups placed so far: the clock the pace of each home's
    /// groups is kept in.
    conversations: AtomicU64,
}

impl Default for GroupHomes {
    fn default() -> Self {
        GroupHomes {
            seen: DashMap::new(),
            seen_xor: AtomicU64::new(0),
            first_sight: (0..FIRST_SIGHT_SLOTS).map(|_| AtomicU64::new(0)).collect(),
            homes: ArcSwap::from_pointee(Homes::default()),
            swept_ms: AtomicU64::new(0),
            rebuild: Mutex::new(()),
            opened_ms: AtomicU64::new(0),
            conversations: AtomicU64::new(0),
        }
    }
}

/// What a request's lookup found in the published assignment: its group's home, and the
/// assignment itself for how many groups live on each target.
pub struct HomeView {
    /// The group's home, if it has (or is expected to get) one.
    pub home: Option<GroupHome>,
    homes: arc_swap::Guard<Arc<Homes>>,
}

impl HomeView {
    /// How many known groups live on the target at `index` (into the labels looked up).
    pub fn homes_on(&self, index: usize) -> usize {
        self.homes.count.get(index).copied().unwrap_or(0)
    }
}

impl GroupHomes {
    /// Count one request of `group` and look up its home as an index into `labels` (the
    /// route's targets, eligible or not, in order): its assigned home once the group is
    /// known, before that the target it would get if it joined the set last. `held`: some
    /// target's view holds the group's prefix (a group new to the fleet has none). None
    /// until an assignment over exactly these labels is published.
    pub fn note_and_home(
        &self,
        group: u64,
        labels: &[&str],
        held: bool,
        now_ms: u64,
    ) -> Option<HomeView> {
        let became_known = self.note(group, labels.len(), held, now_ms);
        let swept = self.swept_ms.load(Relaxed);
        let due = swept == 0 || now_ms >= swept.saturating_add(SWEEP_EVERY_MS);
        let mut homes = self.homes.load();
        let mut current = homes.computed_over(labels);
        if became_known || due || !current {
            if let Some(_rebuilding) = self.rebuild.try_lock() {
                // What another request may have published while this one reached the lock.
                homes = self.homes.load();
                current = homes.computed_over(labels);
                if due {
                    self.sweep(now_ms);
                    self.swept_ms.store(now_ms.max(1), Relaxed);
                }
                // The same groups over the same targets keep the assignment as it is.
                if !current || self.groups_changed(&homes) {
                    let mut next = assign(&self.known(), labels);
                    next.keep_paces(&homes);
                    self.homes.store(Arc::new(next));
                    homes = self.homes.load();
                }
                current = true;
            }
        }
        if !current {
            return None;
        }
        let home = match homes.home.get(&group) {
            Some(&h) => Some(GroupHome::Known(h)),
            None => homes.expected_home(group).map(GroupHome::Expected),
        };
        Some(HomeView { home, homes })
    }

    /// Count a new conversation of a known group whose home is the target at `home` (an
    /// index into the labels looked up), labelled `label`, in that target's pace too.
    pub fn note_conversation(&self, home: usize, label: &str) {
        let n = self.conversations.fetch_add(1, Relaxed) + 1;
        let homes = self.homes.load();
        if homes.labels.get(home).is_some_and(|l| l == label) {
            homes.paces[home].note(n);
        }
    }

    /// Whether the groups living on the target at `index` (into the labels `view` was
    /// looked up with) have gone quiet: see [`QUIET_AFTER_MISSED`]. A target no group
    /// lives on is not.
    pub fn is_quiet(&self, view: &HomeView, index: usize) -> bool {
        view.homes_on(index) > 0
            && view.homes.paces.get(index).is_some_and(|pace| {
                pace.stopped(self.conversations.load(Relaxed), QUIET_AFTER_MISSED)
            })
    }

    /// Note a request of `group` on a route with `targets` targets; true when it made the
    /// group known (its second, or in the opening its first if no target holds it).
    fn note(&self, group: u64, targets: usize, held: bool, now_ms: u64) -> bool {
        let opened = self.opened_at(now_ms);
        if let Some(last) = self.seen.get(&group) {
            if last.load(Relaxed).saturating_add(SEEN_REFRESH_MS) <= now_ms {
                last.store(now_ms, Relaxed);
            }
            return false;
        }
        // Group keys are XXH3 hashes (`PlacementKeys`): their low bits pick the slot.
        let slot = &self.first_sight[group as usize % FIRST_SIGHT_SLOTS];
        let seen_before = slot.swap(group, Relaxed) == group;
        let opening =
            !held && now_ms < opened.saturating_add(OPENING_MS) && self.seen.len() < targets;
        if !(seen_before || opening) || self.seen.len() >= MAX_GROUPS {
            return false;
        }
        if self.seen.insert(group, AtomicU64::new(now_ms)).is_none() {
            self.seen_xor.fetch_xor(group, Relaxed);
        }
        true
    }

    /// When the opening began: the time of the first request noted (`now_ms` if this is
    /// it).
    fn opened_at(&self, now_ms: u64) -> u64 {
        let opened = self.opened_ms.load(Relaxed);
        if opened != 0 {
            return opened;
        }
        match self
            .opened_ms
            .compare_exchange(0, now_ms.max(1), Relaxed, Relaxed)
        {
            Ok(_) => now_ms.max(1),
            Err(opened) => opened,
        }
    }

    /// Forget groups silent for [`FORGET_AFTER_MS`].
    fn sweep(&self, now_ms: u64) {
        self.seen.retain(|&group, last| {
            let keep = last.load(Relaxed).saturating_add(FORGET_AFTER_MS) > now_ms;
            if !keep {
                self.seen_xor.fetch_xor(group, Relaxed);
            }
            keep
        });
    }

    /// Whether the known groups differ from those `homes` was computed for (a group became
    /// known or was forgotten since, including one that became known while another request
    /// held the rebuild lock).
    fn groups_changed(&self, homes: &Homes) -> bool {
        (self.seen.len(), self.seen_xor.load(Relaxed)) != (homes.groups, homes.groups_xor)
    }

    /// The known groups, in key order.
    fn known(&self) -> Vec<u64> {
        let mut known: Vec<u64> = self.seen.iter().map(|s| *s.key()).collect();
        known.sort_unstable();
        known
    }
}

/// Most homes one label takes when `groups` groups share `labels` labels.
fn home_cap(groups: usize, labels: usize) -> usize {
    groups.div_ceil(labels.max(1))
}

/// Homes for `groups` (in key order) over `labels`: each group to its highest-weight label
/// with fewer than `home_cap` homes so far.
fn assign(groups: &[u64], labels: &[&str]) -> Homes {
    let mut homes = Homes {
        labels: labels.iter().map(|l| l.to_string()).collect(),
        label_hashes: labels.iter().map(|l| fnv1a(l.as_bytes())).collect(),
        count: vec![0; labels.len()],
        groups: 0,
        groups_xor: 0,
        home: HashMap::with_capacity(groups.len()),
        paces: labels.iter().map(|_| Arc::default()).collect(),
    };
    let cap = home_cap(groups.len(), labels.len());
    for &g in groups {
        let Some(best) = homes.best_home(g, cap) else {
            break;
        };
        homes.count[best] += 1;
        homes.groups += 1;
        homes.groups_xor ^= g;
        homes.home.insert(g, best);
    }
    homes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::placement::rendezvous;
    use GroupHome::{Expected, Known};

    const LABELS: [&str; 4] = ["a/m", "b/m", "c/m", "d/m"];

    /// Note a request of group `g` and return its home.
    fn home(h: &GroupHomes, g: u64, labels: &[&str], now: u64) -> Option<GroupHome> {
        h.note_and_home(g, labels, true, now).and_then(|v| v.home)
    }

    /// `home` for a group no target holds yet.
    fn home_new(h: &GroupHomes, g: u64, now: u64) -> Option<GroupHome> {
        h.note_and_home(g, &LABELS, false, now).and_then(|v| v.home)
    }

    fn seen_twice(h: &GroupHomes, groups: impl IntoIterator<Item = u64>, now: u64) {
        for g in groups {
            home(h, g, &LABELS, now);
            home(h, g, &LABELS, now);
        }
    }

    #[test]
    fn a_home_goes_quiet_once_its_groups_miss_their_share_of_new_conversations() {
        let g = GroupHomes::default();
        seen_twice(&g, [1, 2], 10);
        let home_of = |group| match home(&g, group, &LABELS, 10) {
            Some(Known(i)) => i,
            other => panic!("{other:?}"),
        };
        let (a, b) = (home_of(1), home_of(2));
        let quiet =
            |g: &GroupHomes, i| g.is_quiet(&g.note_and_home(1, &LABELS, true, 10).unwrap(), i);
        // a's groups open every second conversation of the route.
        for _ in 0..20 {
            g.note_conversation(a, LABELS[a]);
            g.note_conversation(b, LABELS[b]);
        }
        assert!(!quiet(&g, a) && !quiet(&g, b));
        // The route goes on without a's groups: quiet once they have missed more than
        // QUIET_AFTER_MISSED (4) of the conversations their share (one in two) would bring.
        for _ in 0..7 {
            g.note_conversation(b, LABELS[b]);
        }
        assert!(!quiet(&g, a));
        g.note_conversation(b, LABELS[b]);
        assert!(quiet(&g, a));
        assert!(!quiet(&g, b));
        // A target no group lives on is never quiet.
        let empty = (0..4).find(|&i| i != a && i != b).unwrap();
        assert!(!quiet(&g, empty));
        // A group becoming known rebuilds the assignment; the paces stay with the targets.
        seen_twice(&g, [3], 10);
        assert!(quiet(&g, a));
        // Another route over the same targets keeps its own clock and paces.
        let other = GroupHomes::default();
        seen_twice(&other, [1, 2], 10);
        for _ in 0..40 {
            other.note_conversation(a, LABELS[a]);
        }
        assert!(quiet(&g, a));
        // One new conversation of theirs and they are back.
        g.note_conversation(a, LABELS[a]);
        assert!(!quiet(&g, a));
    }

    #[test]
    fn a_group_is_known_from_its_second_request_and_first_goes_where_it_would_join() {
        let h = GroupHomes::default();
        seen_twice(&h, [1, 2, 3], 10);
        let free = (0..4)
            .find(|&i| (1..=3).all(|g| home(&h, g, &LABELS, 10) != Some(Known(i))))
            .unwrap();
        let top = |g: u64| (0..4).max_by_key(|&i| rendezvous(g, LABELS[i])).unwrap();
        // A new group (a larger key than any known) whose rendezvous choice is the target
        // without a home first goes there, and keeps it once known.
        let g = (4..).find(|&g| top(g) == free).unwrap();
        assert_eq!(home(&h, g, &LABELS, 10), Some(Expected(free)));
        assert_eq!(h.known(), vec![1, 2, 3]);
        assert_eq!(home(&h, g, &LABELS, 10), Some(Known(free)));
        // New groups whose rendezvous choice has a home name none: one-off prompts must
        // not all pile onto the one target without a home.
        let h = GroupHomes::default();
        seen_twice(&h, [1, 2, 3], 10);
        for g in (1000..1100).filter(|&g| top(g) != free) {
            assert_eq!(home(&h, g, &LABELS, 10), None, "group {g}");
        }
    }

    /// In a cold start's burst the groups arrive within milliseconds: each counts from its
    /// first request, so the set is whole as soon as every group has been seen once. Up to
    /// as many groups as targets, within the opening, and only groups no target holds.
    #[test]
    fn in_the_opening_a_group_no_target_holds_is_known_from_its_first_request() {
        let h = GroupHomes::default();
        let t0 = 1_000;
        for g in 1..=4 {
            assert!(
                matches!(home_new(&h, g, t0 + g), Some(Known(_))),
                "group {g}"
            );
        }
        // A fifth group: more groups than targets, so one-off prompts can fill no more.
        assert!(!matches!(home_new(&h, 5, t0 + 5), Some(Known(_))));
        assert!(matches!(home_new(&h, 5, t0 + 6), Some(Known(_))));
        // A group some target holds counts from its second request, opening or not.
        let h = GroupHomes::default();
        assert!(!matches!(home(&h, 7, &LABELS, t0), Some(Known(_))));
        assert!(matches!(home(&h, 7, &LABELS, t0), Some(Known(_))));
        // After the opening, a new group counts from its second request.
        let after = t0 + OPENING_MS;
        assert!(!matches!(home_new(&h, 8, after), Some(Known(_))));
        assert!(matches!(home_new(&h, 8, after), Some(Known(_))));
    }

    #[test]
    fn as_many_groups_as_targets_get_one_target_each() {
        for seed in 0..50u64 {
            let h = GroupHomes::default();
            let groups: Vec<u64> = (0..4).map(|i| rendezvous(seed, &format!("g{i}"))).collect();
            seen_twice(&h, groups.iter().copied(), 10);
            let mut homes: Vec<usize> = groups
                .iter()
                .map(|&g| match home(&h, g, &LABELS, 10) {
                    Some(Known(i)) => i,
                    other => panic!("{other:?}"),
                })
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
                    home(&a, g, &LABELS, 20),
                    home(&b, g, &LABELS, 20),
                    "seed {seed}"
                );
            }
        }
    }

    /// A moved home costs the fleet a prefill of that group's prefix on its new home, so a
    /// group joining must leave the others' homes where they are, nearly all of them.
    #[test]
    fn a_group_joining_moves_few_other_homes() {
        let (mut moved, mut total) = (0usize, 0usize);
        for seed in 0..50u64 {
            let groups: Vec<u64> = (0..64)
                .map(|i| rendezvous(seed, &format!("g{i}")))
                .collect();
            let mut with_one_more = groups.clone();
            with_one_more.push(rendezvous(seed, "new"));
            with_one_more.sort_unstable();
            let mut sorted = groups.clone();
            sorted.sort_unstable();
            let (before, after) = (assign(&sorted, &LABELS), assign(&with_one_more, &LABELS));
            moved += groups
                .iter()
                .filter(|g| before.home[g] != after.home[g])
                .count();
            total += groups.len();
        }
        // Bounded-load rendezvous moves ~4% here; homes dealt round-robin in key order
        // (each group to the target with the fewest so far) moved ~23%.
        assert!(moved * 10 < total, "{moved} of {total} homes moved");
    }

    #[test]
    fn a_forgotten_group_loses_its_home_and_frees_its_target() {
        let h = GroupHomes::default();
        seen_twice(&h, [1, 2, 3, 4], 10);
        let home_of_1 = home(&h, 1, &LABELS, 10).unwrap();
        // 1 stays in use; 2, 3, 4 are not seen again.
        let later = 10 + FORGET_AFTER_MS / 2;
        home(&h, 1, &LABELS, later);
        let much_later = later + FORGET_AFTER_MS / 2 + SWEEP_EVERY_MS;
        assert_eq!(home(&h, 1, &LABELS, much_later), Some(home_of_1));
        assert_eq!(h.known(), vec![1]);
        assert!(matches!(
            home(&h, 5, &LABELS, much_later),
            Some(Expected(_))
        ));
    }

    #[test]
    fn a_sweep_that_forgets_nothing_keeps_the_assignment() {
        let h = GroupHomes::default();
        seen_twice(&h, [1, 2, 3], 10);
        let before = h.homes.load_full();
        home(&h, 1, &LABELS, 10 + 2 * SWEEP_EVERY_MS);
        assert!(
            Arc::ptr_eq(&before, &h.homes.load_full()),
            "rebuilt for nothing"
        );
        // A group forgotten by a sweep is a change.
        home(&h, 1, &LABELS, 10 + FORGET_AFTER_MS + SWEEP_EVERY_MS);
        assert!(!Arc::ptr_eq(&before, &h.homes.load_full()));
        assert_eq!(h.homes.load().groups, 1);
    }

    /// A group that becomes known while another request holds the rebuild lock gets its
    /// home at the next sweep, even when that sweep forgets another group and the count of
    /// known groups is what it was.
    #[test]
    fn a_group_known_while_the_rebuild_was_busy_gets_a_home_at_the_next_sweep() {
        let h = GroupHomes::default();
        seen_twice(&h, [1, 2], 10);
        let half = 10 + FORGET_AFTER_MS / 2;
        home(&h, 1, &LABELS, half);
        {
            let _busy = h.rebuild.lock();
            seen_twice(&h, [3], half);
        }
        assert!(!matches!(home(&h, 3, &LABELS, half), Some(Known(_))));
        // This sweep forgets 2: {1, 3} has as many groups as the published {1, 2}.
        let later = 10 + FORGET_AFTER_MS + SWEEP_EVERY_MS;
        home(&h, 1, &LABELS, later);
        assert_eq!(h.known(), vec![1, 3]);
        assert!(matches!(home(&h, 3, &LABELS, later), Some(Known(_))));
    }

    #[test]
    fn homes_follow_a_change_of_targets() {
        let h = GroupHomes::default();
        seen_twice(&h, [1, 2, 3], 10);
        let three = &LABELS[..3];
        let Some(Known(home)) = home(&h, 1, three, 11) else {
            panic!("group 1 is known");
        };
        assert!(home < 3);
    }

    #[test]
    fn the_table_is_bounded_and_one_off_prompts_stay_out_of_it() {
        let h = GroupHomes::default();
        for g in 1..=(3 * MAX_GROUPS as u64) {
            home(&h, g, &LABELS, 10);
        }
        assert_eq!(h.seen.len(), 0);
        seen_twice(&h, 1..=(MAX_GROUPS as u64 + 100), 10);
        assert_eq!(h.seen.len(), MAX_GROUPS);
    }
}
