//! Timers a client connection keeps across its requests, so that a wait costs one atomic
//! update instead of a timer's registration and removal.
//!
//! Owns: [`ConnectionTimer`] (one reusable deadline) and the connection's upstream-head
//! timer lent to the request being served ([`with_lent_head_timer`], [`head_deadline`]).
//! Must not: read or write anything, or decide what a deadline is (the callers pass it).
//!
//! ## Why
//! Each request on a kept-alive connection waits twice with a deadline: for its header
//! (`connection::read_head`) and for the upstream's response head (`upstream`). A timer
//! made for each wait joins the runtime's timer wheel when the wait pends and leaves it
//! when the wait ends first: two of those per request were ~2.5% of the gateway's CPU at
//! 4 KiB (perf). A tokio `Sleep` whose deadline is moved later while it has not fired is
//! re-armed by one compare-and-swap (`Sleep::reset`, which extends the registered entry
//! in place); it fires at its old deadline only to be re-queued. So each connection keeps
//! one timer per kind of wait, and each kind always moves its deadline later (a timer
//! moved earlier would be registered again, which is what this avoids). A timer that
//! fires while its wait is over wakes the connection's task once, for nothing.
//!
//! The head timer lives in the connection's loop (`connection.rs`) but the head is awaited
//! deep in the proxy app pingora runs per request; it is lent to that request through a
//! task-local ([`with_lent_head_timer`]), since both run in the connection's task. A
//! request that cannot borrow it (none lent, or a second wait of the same request while
//! the first holds it) uses a timer of its own, as before.

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;
use tokio::time::{Instant, Sleep};

/// One deadline, re-armed per wait.
pub struct ConnectionTimer(Pin<Box<Sleep>>);

impl Default for ConnectionTimer {
    fn default() -> Self {
        // Not registered until first polled: a connection that never waits costs nothing.
        ConnectionTimer(Box::pin(tokio::time::sleep(Duration::ZERO)))
    }
}

/// The wait ran past its deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Elapsed;

impl ConnectionTimer {
    /// Await `fut` for at most `limit` from now (`fut` is polled first, so a ready one
    /// never touches the timer).
    pub async fn timeout<F: Future>(
        &mut self,
        limit: Duration,
        fut: F,
    ) -> Result<F::Output, Elapsed> {
        self.0.as_mut().reset(Instant::now() + limit);
        tokio::select! {
            biased;
            out = fut => Ok(out),
            () = self.0.as_mut() => Err(Elapsed),
        }
    }
}

tokio::task_local! {
    static HEAD_TIMER: RefCell<Option<ConnectionTimer>>;
}

/// Run `serve` (one request's processing, in the connection's task) with the connection's
/// head timer lent to [`head_deadline`], and take it back after (none if the request
/// kept it, e.g. was dropped mid-wait: the next request lends a fresh one).
pub async fn with_lent_head_timer<F: Future>(
    timer: &mut Option<ConnectionTimer>,
    serve: F,
) -> F::Output {
    let lent = RefCell::new(Some(timer.take().unwrap_or_default()));
    let scoped = HEAD_TIMER.scope(lent, serve);
    tokio::pin!(scoped);
    let out = (&mut scoped).await;
    *timer = scoped.as_mut().take_value().and_then(RefCell::into_inner);
    out
}

/// Await `fut` for at most `limit`, on the connection's lent head timer when there is one.
pub async fn head_deadline<F: Future>(limit: Duration, fut: F) -> Result<F::Output, Elapsed> {
    let borrowed = HEAD_TIMER
        .try_with(|slot| slot.borrow_mut().take())
        .ok()
        .flatten();
    match borrowed {
        Some(timer) => {
            let mut guard = Returned(Some(timer));
            let timer = guard.0.as_mut().expect("just set");
            timer.timeout(limit, fut).await
        }
        None => tokio::time::timeout(limit, fut).await.map_err(|_| Elapsed),
    }
}

/// Puts the borrowed timer back into the task's slot when the wait ends or is dropped.
struct Returned(Option<ConnectionTimer>);

impl Drop for Returned {
    fn drop(&mut self) {
        if let Some(timer) = self.0.take() {
            let _ = HEAD_TIMER.try_with(|slot| *slot.borrow_mut() = Some(timer));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_timer_ends_waits_past_their_deadline_across_reuses() {
        let mut t = ConnectionTimer::default();
        // Ready at once, pending then ready, and (re-armed later each time) past the limit.
        assert_eq!(
            t.timeout(Duration::from_millis(50), async { 1 }).await,
            Ok(1)
        );
        let soon = tokio::time::sleep(Duration::from_millis(10));
        assert_eq!(t.timeout(Duration::from_millis(500), soon).await, Ok(()));
        let never = std::future::pending::<()>();
        let started = std::time::Instant::now();
        assert_eq!(
            t.timeout(Duration::from_millis(60), never).await,
            Err(Elapsed)
        );
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(60) && took < Duration::from_secs(2),
            "{took:?}"
        );
        // After it fired: armed again.
        let never = std::future::pending::<()>();
        assert_eq!(
            t.timeout(Duration::from_millis(30), never).await,
            Err(Elapsed)
        );
        assert_eq!(
            t.timeout(Duration::from_millis(30), async { 2 }).await,
            Ok(2)
        );
    }

    #[tokio::test]
    async fn the_head_timer_is_lent_to_the_request_and_comes_back() {
        let mut timer = Some(ConnectionTimer::default());
        let mark = timer.as_ref().map(|t| &*t.0 as *const Sleep);
        let out = with_lent_head_timer(&mut timer, async {
            // Lent: the slot holds it until a wait borrows it.
            let lent =
                HEAD_TIMER.with(|slot| slot.borrow().as_ref().map(|t| &*t.0 as *const Sleep));
            assert_eq!(lent, mark);
            let never = std::future::pending::<()>();
            let first = head_deadline(Duration::from_millis(20), never).await;
            // A wait dropped midway puts it back too.
            let dropped = tokio::time::timeout(
                Duration::from_millis(10),
                head_deadline(Duration::from_secs(60), std::future::pending::<()>()),
            )
            .await;
            let back = HEAD_TIMER.with(|slot| slot.borrow().is_some());
            (first, dropped.is_err(), back)
        })
        .await;
        assert_eq!(out, (Err(Elapsed), true, true));
        let back = timer.as_ref().map(|t| &*t.0 as *const Sleep);
        assert_eq!(back, mark, "the same timer came back");
        // Outside a connection's task there is nothing to borrow: a timer of its own.
        let own = head_deadline(Duration::from_millis(20), std::future::pending::<()>()).await;
        assert_eq!(own, Err(Elapsed));
    }
}
