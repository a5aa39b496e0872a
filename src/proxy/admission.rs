//! Admission control: the global cap on requests being proxied (`limits.max_inflight`),
//! the global budget of buffered request-body bytes (`limits.max_buffered_body_bytes`),
//! and the per-connection client limits (keep-alive idle time, write timeout).
//!
//! Owns: two lock-free counters and their RAII guards, which give a slot or bytes back
//! however the request ends (success, error, client gone, panic). The caps are read from
//! the live route table per request, so a reload changes them for new requests while
//! admitted ones keep what they hold.
//! Must not: queue or wait. Beyond a cap a request is refused at once (503 with
//! `Retry-After`, error kind `overloaded`); waiting would only hold its body in memory.
//!
//! Why two limits: a slot is taken once the body is in, so clients that send their bodies
//! slowly (a slowloris, or a slow link) cannot fill `max_inflight` and lock everyone out
//! of proxying; the memory of bodies still arriving is bounded by the byte budget
//! instead, charged as the body grows (each piece as it is taken; `body::read_body`), so
//! a dribbling client holds little. A body is let go once the upstream's answer starts.
//!
//! A pingora 0.9.1 limit that is *not* configurable, and so is not a config key: 256
//! header fields (`MAX_HEADERS`); beyond it pingora answers 400 and closes the connection
//! before rolter sees the request. The header's size and time are bounded before pingora
//! reads it (`super::connection`).

use crate::config::LimitsConfig;
use pingora::proxy::Session;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// Counters of requests admitted and not yet finished, and of body bytes held.
#[derive(Debug, Default)]
pub struct Admission {
    inflight: AtomicUsize,
    buffered: AtomicUsize,
}

/// Body bytes charged to one request; dropping it gives them back.
#[derive(Debug)]
pub struct BodyBytes<'a> {
    counter: &'a AtomicUsize,
    held: usize,
}

impl BodyBytes<'_> {
    /// Charge `n` more bytes if the total stays within `cap`. Exact under contention.
    pub fn grow(&mut self, n: usize, cap: usize) -> bool {
        let ok = self
            .counter
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |total| {
                total.checked_add(n).filter(|t| *t <= cap)
            })
            .is_ok();
        if ok {
            self.held += n;
        }
        ok
    }

    /// Bytes charged right now.
    pub fn held(&self) -> usize {
        self.held
    }

    /// Give back everything charged so far (the body's buffer was freed).
    pub fn release(&mut self) {
        self.counter.fetch_sub(self.held, Ordering::AcqRel);
        self.held = 0;
    }
}

impl Drop for BodyBytes<'_> {
    fn drop(&mut self) {
        self.release();
    }
}

/// A slot held by one admitted request; dropping it frees the slot.
#[derive(Debug)]
pub struct Admitted<'a>(&'a AtomicUsize);

impl Drop for Admitted<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Admission {
    /// A new, empty counter.
    pub fn new() -> Self {
        Self::default()
    }

    /// Take a slot if fewer than `cap` are taken. Exact under contention (a CAS loop,
    /// never a transient over-count that would refuse a request below the cap).
    pub fn try_admit(&self, cap: usize) -> Option<Admitted<'_>> {
        self.inflight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < cap).then_some(n + 1)
            })
            .ok()
            .map(|_| Admitted(&self.inflight))
    }

    /// Requests admitted right now.
    pub fn inflight(&self) -> usize {
        self.inflight.load(Ordering::Acquire)
    }

    /// An empty charge of body bytes, grown as a body arrives ([`BodyBytes::grow`]).
    pub fn body_bytes(&self) -> BodyBytes<'_> {
        BodyBytes {
            counter: &self.buffered,
            held: 0,
        }
    }

    /// Body bytes held right now.
    pub fn buffered(&self) -> usize {
        self.buffered.load(Ordering::Acquire)
    }
}

/// Apply the client connection limits to a freshly read request.
///
/// Pingora keeps a reused HTTP/1.1 connection idle *forever* between requests
/// (`KeepaliveStatus::Infinite`, set when the request carries no `Keep-Alive: timeout`),
/// so every request caps it here. A connection that is not kept alive (HTTP/1.0 without
/// `Connection: keep-alive`, `Connection: close`) stays that way.
pub fn apply_client_limits(session: &mut Session, limits: &LimitsConfig) {
    if session.get_keepalive().is_some() {
        let idle = limits.client_keepalive_timeout_s;
        session.set_keepalive((idle > 0).then_some(idle));
    }
    session.set_write_timeout(Some(Duration::from_millis(limits.client_write_timeout_ms)));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn cap_is_exact_and_slots_come_back() {
        let a = Admission::new();
        let s1 = a.try_admit(2).expect("first");
        let s2 = a.try_admit(2).expect("second");
        assert!(a.try_admit(2).is_none());
        assert_eq!(a.inflight(), 2);
        drop(s1);
        let s3 = a.try_admit(2).expect("freed slot");
        assert!(a.try_admit(2).is_none());
        drop((s2, s3));
        assert_eq!(a.inflight(), 0);
        // A lower cap after a reload refuses until enough slots drain.
        let held: Vec<_> = (0..3).map(|_| a.try_admit(3).unwrap()).collect();
        assert!(a.try_admit(1).is_none());
        drop(held);
        assert!(a.try_admit(1).is_some());
    }

    #[test]
    fn never_over_admits_under_contention() {
        const CAP: usize = 8;
        let a = Arc::new(Admission::new());
        let max_seen = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let a = a.clone();
                let max_seen = max_seen.clone();
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        if let Some(_slot) = a.try_admit(CAP) {
                            max_seen.fetch_max(a.inflight(), Ordering::Relaxed);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert!(max_seen.load(Ordering::Relaxed) <= CAP);
        assert_eq!(a.inflight(), 0);
    }

    #[test]
    fn body_bytes_are_charged_within_the_budget_and_given_back() {
        let a = Admission::new();
        let mut one = a.body_bytes();
        let mut two = a.body_bytes();
        assert!(one.grow(60, 100));
        assert!(!two.grow(50, 100), "over the budget");
        assert_eq!(a.buffered(), 60, "a refused charge takes nothing");
        assert!(two.grow(40, 100));
        assert!(!one.grow(1, 100));
        drop(one);
        assert_eq!(a.buffered(), 40);
        assert!(two.grow(60, 100));
        assert!(!two.grow(usize::MAX, usize::MAX), "no overflow");
        drop(two);
        assert_eq!(a.buffered(), 0);
    }
}
