//! One try of a request on one target, and the one place its outcome flows back.
//!
//! An [`Attempt`] is made when a strategy's decision got a breaker ticket: it holds the
//! target's in-flight slot for exactly its life and counts the decision. What the
//! strategy learns from a decision is recorded here too, at decision time (the replica
//! starts the prefill as soon as it gets the request, so a burst sharing a new prefix
//! follows the first request instead of scattering). [`Attempt::settle`] is the only place
//! an exchange's result goes back to the fleet: the breaker, the target's latency
//! histograms and the route's answered-status series.
//! Must not: do I/O (the exchange is [`super::upstream`]'s) or decide anything.

use super::upstream::{ExchangeError, ExchangeOutcome};
use crate::config::BreakerConfig;
use crate::fleet::breaker::{Outcome, Ticket};
use crate::fleet::{ms_at, InflightGuard};
use crate::metrics::METRICS;
use crate::routing::{Decision, FleetView, RouteInput, Strategy};
use crate::runtime::{Route, RouteTarget};
use std::time::Instant;

/// One try in flight.
pub struct Attempt<'r> {
    /// The route tried.
    pub route: &'r Route,
    /// The strategy's decision.
    pub decision: Decision,
    /// The chosen target.
    pub target: &'r RouteTarget,
    ticket: Ticket<'r>,
    slot: InflightGuard,
    /// When the exchange started (TTFB and latency count from here).
    pub started: Instant,
}

impl<'r> Attempt<'r> {
    /// Start a try of `decision` (whose target granted `ticket`): take the in-flight slot,
    /// count the decision and let `strategy` (the one that decided) learn it.
    pub fn begin(
        route: &'r Route,
        strategy: &dyn Strategy,
        input: &RouteInput<'_>,
        view: &FleetView<'_>,
        decision: Decision,
        ticket: Ticket<'r>,
    ) -> Self {
        let target = &route.targets[decision.target];
        route
            .metrics
            .decision(decision.reason as usize, decision.reason.as_str());
        if let Some(score) = decision.score {
            route.metrics.prefix_score(score);
        }
        let slot = target.state.start_request();
        if decision.new_work {
            target.state.placed.note(input.now_ms);
        }
        let started = Instant::now();
        // An attempt that then fails to connect leaves its prompt in the target's trie
        // (bounded, LRU) or pending set (3 s).
        strategy.record(input, view, &decision);
        Attempt {
            route,
            decision,
            target,
            ticket,
            slot,
            started,
        }
    }

    /// The upstream has answered in full (its connection is released): the in-flight slot
    /// is given back now, before the client can see the answer end. A client that sends
    /// its next request as soon as it has the answer must find this target as loaded as
    /// it really is, not still busy with a request that is over ([`settle`](Self::settle)
    /// runs only after the last write to the client).
    pub fn upstream_done(&self) {
        self.slot.release();
    }

    /// The exchange ended with `result`: report it to the breaker, the target's latency
    /// state and the route's metrics, and free the slot. Returns the time it ended.
    pub fn settle(
        self,
        result: &Result<ExchangeOutcome, ExchangeError>,
        breaker: &BreakerConfig,
    ) -> Instant {
        let outcome = match result {
            Ok(o) if o.status >= 500 => Outcome::Failure,
            Ok(_) => Outcome::Success,
            Err(ExchangeError::Retryable(..)) => Outcome::Failure,
            Err(ExchangeError::Final(e)) if e.client_unreachable() => Outcome::Abandoned,
            Err(ExchangeError::Final(_)) => Outcome::Failure,
        };
        let ended = match result {
            Ok(o) => o.finished,
            Err(_) => Instant::now(),
        };
        let label = self.target.state.label();
        // A target removed while this attempt ran has had its series dropped: do not
        // re-create them (the state itself is dropped with the last request on it).
        let retired = self.target.state.is_retired();
        if let Some(t) = self.ticket.report(outcome, ms_at(ended), breaker) {
            log::warn!("target {label}: {}", t.as_str());
            if !retired {
                METRICS
                    .breaker_events
                    .with_label_values(&[label, t.as_str()])
                    .inc();
            }
        }
        if let Ok(o) = result {
            self.target
                .state
                .observe_upstream(o.ttfb, o.finished - self.started);
            if let (Ok(status), false) = (http::StatusCode::from_u16(o.status), retired) {
                self.route
                    .metrics
                    .answered(self.decision.target, label, status);
            }
        }
        ended
    }
}
