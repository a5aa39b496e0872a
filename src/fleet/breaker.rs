//! Passive health of one target: consecutive failures → cooldown (growing on repeat) →
//! open circuit → one half-open probe request → closed again on success.
//!
//! Read on every request for every target, so the read side ([`Breaker::eligible`]) is
//! two atomic loads; transitions happen under a per-target mutex taken only when a
//! request fails or a non-closed breaker sees a success. Time is passed in (ms on any
//! monotonic clock), so the state machine is unit-tested without sleeping.

use crate::config::BreakerConfig;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};

const CLOSED: u8 = 0;
const OPEN: u8 = 1;
const HALF_OPEN: u8 = 2;

/// Circuit state, for metrics and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CircuitState {
    /// Normal (possibly cooling down after failures).
    Closed,
    /// Refusing traffic until the back-off ends.
    Open,
    /// One probe request is in flight.
    HalfOpen,
}

/// How a request on a target ended, as far as the target's health is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The upstream answered (any status below 500).
    Success,
    /// Connect failure, timeout, reset or 5xx.
    Failure,
    /// Neither: the client left, or the request never reached the upstream.
    Abandoned,
}

/// What [`Breaker::admit`] granted; handed back to [`Breaker::report`], so only the
/// request that took an open circuit's half-open slot can resolve it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// An ordinary request (the circuit was closed).
    Normal,
    /// The open circuit's single half-open probe, stamped with the number of the probe it
    /// is: a probe from an earlier open period (a long stream that outlived a close and a
    /// re-open) resolves nothing when it ends.
    Probe(u64),
}

/// An admission that is reported exactly once: by [`Ticket::report`], or, if it is
/// dropped unreported (a panic unwinding the request, a cancelled request), as
/// [`Outcome::Abandoned`], so a half-open circuit's single probe slot cannot be lost.
#[derive(Debug)]
pub struct Ticket<'a> {
    breaker: &'a Breaker,
    admission: Option<Admission>,
}

impl Ticket<'_> {
    /// What was granted.
    pub fn admission(&self) -> Admission {
        self.admission.expect("reported tickets are consumed")
    }

    /// [`Breaker::report`] this ticket's admission.
    pub fn report(
        mut self,
        outcome: Outcome,
        now_ms: u64,
        cfg: &BreakerConfig,
    ) -> Option<Transition> {
        let admission = self.admission.take().expect("reported once");
        self.breaker.report(admission, outcome, now_ms, cfg)
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        if let Some(admission) = self.admission.take() {
            // Abandoned reads neither the time nor the config.
            self.breaker
                .report(admission, Outcome::Abandoned, 0, &BreakerConfig::default());
        }
    }
}

/// A state change worth counting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// A cooldown started.
    Cooldown,
    /// The circuit opened (or re-opened after a failed probe).
    CircuitOpened,
    /// A success closed an open / half-open circuit.
    CircuitClosed,
}

impl Transition {
    /// Metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Transition::Cooldown => "cooldown",
            Transition::CircuitOpened => "circuit_open",
            Transition::CircuitClosed => "circuit_close",
        }
    }
}

#[derive(Debug, Default)]
struct Counters {
    failures: u32,
    cooldowns_in_row: u32,
}

/// One target's breaker.
#[derive(Debug, Default)]
pub struct Breaker {
    state: AtomicU8,
    /// No traffic before this time (cooldown end, or open circuit's probe time).
    blocked_until_ms: AtomicU64,
    /// Mirror of `Counters::failures != 0` so the success path needs no lock.
    dirty: AtomicU32,
    counters: Mutex<Counters>,
    /// Probes admitted so far; the live probe holds the latest number.
    probes: AtomicU64,
}

impl Breaker {
    /// The circuit's state.
    pub fn state(&self) -> CircuitState {
        match self.state.load(Ordering::Acquire) {
            OPEN => CircuitState::Open,
            HALF_OPEN => CircuitState::HalfOpen,
            _ => CircuitState::Closed,
        }
    }

    /// Whether a request may be routed here at `now_ms`.
    pub fn eligible(&self, now_ms: u64) -> bool {
        match self.state.load(Ordering::Acquire) {
            HALF_OPEN => false,
            _ => now_ms >= self.blocked_until_ms.load(Ordering::Acquire),
        }
    }

    /// Claim the right to send a request that was just routed here. Always granted on a
    /// closed circuit; on an open one past its back-off, granted to exactly one caller
    /// (the half-open [`Admission::Probe`]).
    pub fn admit(&self, now_ms: u64) -> Option<Admission> {
        match self.state.load(Ordering::Acquire) {
            CLOSED => Some(Admission::Normal),
            HALF_OPEN => None,
            _ => {
                let claimed = now_ms >= self.blocked_until_ms.load(Ordering::Acquire)
                    && self
                        .state
                        .compare_exchange(OPEN, HALF_OPEN, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok();
                // The OPEN just claimed may be newer than the back-off read above: another
                // probe was admitted, failed and re-opened the circuit in between (`open`
                // stores the back-off before the state, so this read sees it). Then the
                // back-off is not over: give the circuit back.
                if claimed && now_ms < self.blocked_until_ms.load(Ordering::Acquire) {
                    self.state.store(OPEN, Ordering::Release);
                    return None;
                }
                // Numbered after the claim: an earlier probe's ticket stops counting from
                // here (one ending in the few instructions between the claim and this
                // increment would still count).
                claimed.then(|| Admission::Probe(self.probes.fetch_add(1, Ordering::AcqRel) + 1))
            }
        }
    }

    /// [`Breaker::admit`] as a [`Ticket`], which reports itself abandoned if dropped.
    pub fn ticket(&self, now_ms: u64) -> Option<Ticket<'_>> {
        self.admit(now_ms).map(|admission| Ticket {
            breaker: self,
            admission: Some(admission),
        })
    }

    /// Record how a request admitted as `admission` ended; returns the transition it
    /// caused, if any. Any success closes the circuit (the target answered); only the
    /// probe's failure or abandonment resolves a half-open circuit.
    pub fn report(
        &self,
        admission: Admission,
        outcome: Outcome,
        now_ms: u64,
        cfg: &BreakerConfig,
    ) -> Option<Transition> {
        let probe =
            matches!(admission, Admission::Probe(n) if n == self.probes.load(Ordering::Acquire));
        match outcome {
            Outcome::Success => {
                if self.dirty.load(Ordering::Acquire) == 0
                    && self.state.load(Ordering::Acquire) == CLOSED
                {
                    return None;
                }
                let mut c = self.counters.lock();
                *c = Counters::default();
                self.dirty.store(0, Ordering::Release);
                self.blocked_until_ms.store(0, Ordering::Release);
                let was = self.state.swap(CLOSED, Ordering::AcqRel);
                (was != CLOSED).then_some(Transition::CircuitClosed)
            }
            Outcome::Abandoned => {
                // A probe that told us nothing frees the slot for the next probe. (An
                // older request must not: the probe would still run, beside a second.)
                if probe {
                    let _ = self.state.compare_exchange(
                        HALF_OPEN,
                        OPEN,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    );
                }
                None
            }
            Outcome::Failure => {
                let mut c = self.counters.lock();
                match self.state.load(Ordering::Acquire) {
                    HALF_OPEN if probe => {
                        self.open(now_ms, cfg);
                        return Some(Transition::CircuitOpened);
                    }
                    // An older request failing late while the probe runs: the probe decides.
                    HALF_OPEN => return None,
                    // A request admitted before the circuit opened, failing late: the
                    // circuit already knows. Counting it would start a cooldown whose
                    // shorter end overwrites the open back-off.
                    OPEN => return None,
                    _ => {}
                }
                c.failures += 1;
                self.dirty.store(1, Ordering::Release);
                if c.failures < cfg.failure_threshold {
                    return None;
                }
                c.failures = 0;
                c.cooldowns_in_row += 1;
                if c.cooldowns_in_row >= cfg.open_after_cooldowns {
                    c.cooldowns_in_row = 0;
                    self.open(now_ms, cfg);
                    Some(Transition::CircuitOpened)
                } else {
                    let factor = 1u64 << (c.cooldowns_in_row - 1).min(20);
                    let cooldown = cfg
                        .cooldown_ms
                        .saturating_mul(factor)
                        .min(cfg.max_cooldown_ms);
                    self.blocked_until_ms
                        .store(now_ms + cooldown, Ordering::Release);
                    Some(Transition::Cooldown)
                }
            }
        }
    }

    fn open(&self, now_ms: u64, cfg: &BreakerConfig) {
        self.blocked_until_ms
            .store(now_ms + cfg.open_ms, Ordering::Release);
        self.state.store(OPEN, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> BreakerConfig {
        BreakerConfig {
            failure_threshold: 2,
            cooldown_ms: 100,
            max_cooldown_ms: 150,
            open_after_cooldowns: 3,
            open_ms: 1_000,
        }
    }

    /// Open `b`'s circuit at time 0 under [`cfg`]: 2 failures x 3 cooldowns.
    fn open_at_0(b: &Breaker, c: &BreakerConfig) {
        for _ in 0..6 {
            b.report(Admission::Normal, Outcome::Failure, 0, c);
        }
        assert_eq!(b.state(), CircuitState::Open);
    }

    #[test]
    fn failures_below_threshold_keep_it_eligible_and_success_resets() {
        let b = Breaker::default();
        b.report(Admission::Normal, Outcome::Failure, 0, &cfg());
        assert!(b.eligible(0));
        b.report(Admission::Normal, Outcome::Success, 1, &cfg());
        b.report(Admission::Normal, Outcome::Failure, 2, &cfg());
        assert!(b.eligible(2), "the success must have reset the count");
    }

    #[test]
    fn cooldown_grows_then_caps_then_the_circuit_opens() {
        let (b, c) = (Breaker::default(), cfg());
        b.report(Admission::Normal, Outcome::Failure, 0, &c);
        b.report(Admission::Normal, Outcome::Failure, 0, &c);
        assert!(
            !b.eligible(99) && b.eligible(100),
            "first cooldown is 100 ms"
        );
        b.report(Admission::Normal, Outcome::Failure, 100, &c);
        b.report(Admission::Normal, Outcome::Failure, 100, &c);
        assert!(
            !b.eligible(249) && b.eligible(250),
            "second is min(200, 150)"
        );
        assert_eq!(b.state(), CircuitState::Closed);
        b.report(Admission::Normal, Outcome::Failure, 250, &c);
        b.report(Admission::Normal, Outcome::Failure, 250, &c);
        assert_eq!(b.state(), CircuitState::Open);
        assert!(!b.eligible(1_249) && b.admit(1_249).is_none());
    }

    #[test]
    fn half_open_admits_one_probe_and_closes_on_success() {
        let (b, c) = (Breaker::default(), cfg());
        open_at_0(&b, &c);
        assert_eq!(b.state(), CircuitState::Open);
        assert!(b.eligible(1_000));
        let probe = b.admit(1_000);
        assert!(
            matches!(probe, Some(Admission::Probe(_))),
            "first caller gets the probe"
        );
        assert_eq!(b.admit(1_000), None, "only one probe at a time");
        assert!(!b.eligible(1_000));
        assert_eq!(b.state(), CircuitState::HalfOpen);
        b.report(probe.unwrap(), Outcome::Success, 1_010, &c);
        assert_eq!(b.state(), CircuitState::Closed);
        assert!(b.eligible(1_010) && b.admit(1_010) == Some(Admission::Normal));
    }

    /// Regression: with requests in flight when a replica died, the failures after the
    /// one that opened the circuit started a cooldown whose end (cooldown_ms) overwrote
    /// the open back-off (open_ms): the circuit half-opened after 1 s instead of 10 s.
    #[test]
    fn late_failures_do_not_shorten_an_open_circuit() {
        let c = BreakerConfig::default();
        let b = Breaker::default();
        let opened_at = c.failure_threshold * c.open_after_cooldowns;
        let mut transitions = Vec::new();
        for _ in 0..opened_at + 3 {
            transitions.push(b.report(Admission::Normal, Outcome::Failure, 0, &c));
        }
        assert_eq!(b.state(), CircuitState::Open);
        assert_eq!(
            transitions[opened_at as usize - 1],
            Some(Transition::CircuitOpened)
        );
        assert!(
            transitions[opened_at as usize..]
                .iter()
                .all(Option::is_none),
            "{transitions:?}"
        );
        assert!(!b.eligible(c.open_ms - 1) && b.admit(c.open_ms - 1).is_none());
        assert!(b.eligible(c.open_ms) && b.admit(c.open_ms).is_some());
    }

    #[test]
    fn failed_probe_reopens_and_abandoned_probe_frees_the_slot() {
        let (b, c) = (Breaker::default(), cfg());
        open_at_0(&b, &c);
        let probe = b.admit(1_000).expect("probe");
        b.report(probe, Outcome::Failure, 1_000, &c);
        assert_eq!(b.state(), CircuitState::Open);
        assert!(!b.eligible(1_999) && b.eligible(2_000));
        let probe = b.admit(2_000).expect("probe");
        b.report(probe, Outcome::Abandoned, 2_001, &c);
        assert_eq!(b.state(), CircuitState::Open);
        assert!(
            b.admit(2_001).is_some(),
            "abandoned probe lets the next request probe"
        );
    }

    /// Regression: a request admitted before the circuit opened and ending while the
    /// probe ran resolved the half-open circuit in the probe's place: abandoned, it
    /// re-opened the slot so a second probe ran beside the first; failed, it re-opened
    /// the circuit for a new back-off although the probe was still out.
    #[test]
    fn only_the_probe_resolves_a_half_open_circuit() {
        let (b, c) = (Breaker::default(), cfg());
        let old = b.admit(0).expect("closed");
        open_at_0(&b, &c);
        let probe = b.admit(1_000).expect("probe");
        assert!(matches!(probe, Admission::Probe(_)));
        assert_eq!(b.report(old, Outcome::Abandoned, 1_001, &c), None);
        assert_eq!(b.state(), CircuitState::HalfOpen);
        assert_eq!(b.admit(1_001), None, "a second probe while the first runs");
        assert_eq!(b.report(old, Outcome::Failure, 1_002, &c), None);
        assert_eq!(b.state(), CircuitState::HalfOpen);
        assert_eq!(
            b.report(probe, Outcome::Failure, 1_003, &c),
            Some(Transition::CircuitOpened)
        );
        assert!(!b.eligible(2_002) && b.eligible(2_003));
    }

    /// Regression: a probe from an earlier open period (a long stream), ending after an
    /// older request's success closed the circuit and new failures re-opened it, resolved
    /// the new probe's half-open circuit: abandoned, it let a second probe run beside it.
    #[test]
    fn a_probe_from_an_earlier_open_period_resolves_nothing() {
        let (b, c) = (Breaker::default(), cfg());
        let older = b.admit(0).expect("closed");
        open_at_0(&b, &c);
        let first = b.admit(1_000).expect("first probe");
        // The older request succeeds: closed. New failures open it again; a new probe.
        b.report(older, Outcome::Success, 1_001, &c);
        open_at_0(&b, &c);
        let second = b.admit(1_000).expect("second probe");
        assert_eq!(b.state(), CircuitState::HalfOpen);
        assert_eq!(b.report(first, Outcome::Abandoned, 1_002, &c), None);
        assert_eq!(b.admit(1_002), None, "a second probe beside the live one");
        assert_eq!(b.report(first, Outcome::Failure, 1_003, &c), None);
        assert_eq!(b.state(), CircuitState::HalfOpen);
        assert_eq!(
            b.report(second, Outcome::Failure, 1_004, &c),
            Some(Transition::CircuitOpened)
        );
    }

    /// A probe whose request never reports (a panic unwinding it) frees its slot.
    #[test]
    fn a_dropped_probe_ticket_frees_the_half_open_slot() {
        let (b, c) = (Breaker::default(), cfg());
        open_at_0(&b, &c);
        let ticket = b.ticket(1_000).expect("probe");
        assert!(matches!(ticket.admission(), Admission::Probe(_)));
        assert_eq!(b.state(), CircuitState::HalfOpen);
        drop(ticket);
        assert_eq!(b.state(), CircuitState::Open);
        let ticket = b.ticket(1_000).expect("the slot is free again");
        assert_eq!(
            ticket.report(Outcome::Success, 1_001, &c),
            Some(Transition::CircuitClosed)
        );
        assert_eq!(b.state(), CircuitState::Closed);
    }
}
