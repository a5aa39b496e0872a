//! The idle upstream connections of one address, as a route target holds them.
//!
//! Owns the storage only: a LIFO stack behind its own short mutex. What goes in and out,
//! the reuse test and the sweep are `proxy::pool`'s. Must not: read or write sockets.

use parking_lot::Mutex;
use pingora::protocols::Stream;
use std::time::Instant;

/// The idle connections to one upstream address. Callers on the request path keep an
/// `Arc` of their target's stack (`proxy::pool::UpstreamPool::stack_for`) so a request looks nothing up.
#[derive(Default)]
pub struct IdleStack {
    pub(crate) conns: Mutex<Vec<Idle>>,
}

pub(crate) struct Idle {
    pub(crate) stream: Stream,
    pub(crate) since: Instant,
}
