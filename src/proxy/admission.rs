//! Admission control: the global cap on requests being proxied (`limits.max_inflight`)
//! and the per-connection client limits (keep-alive idle time, write timeout).
//!
//! Owns: one lock-free counter of admitted requests and the RAII guard that gives a slot
//! back however the request ends (success, error, client gone, panic). The cap is read
//! from the live route table per request, so a reload changes it for new requests while
//! admitted ones keep their slots.
//! Must not: queue or wait. Beyond the cap a request is refused at once (503 with
//! `Retry-After`, error kind `overloaded`); waiting would only hold its body in memory.
//!
//! Pingora 0.9.1 limits that are *not* configurable, and so are not config keys:
//! a request header of at most 1 MiB (`MAX_HEADER_SIZE` = 1,048,575 bytes) and 256
//! header fields (`MAX_HEADERS`); beyond either pingora answers 400 (not 431) and closes
//! the connection before rolter sees the request. A new connection has 60 s to send
//! its first request header, counted per read.

use crate::config::LimitsConfig;
use pingora::proxy::Session;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// Counter of requests admitted and not yet finished.
#[derive(Debug, Default)]
pub struct Admission {
    inflight: AtomicUsize,
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
}
