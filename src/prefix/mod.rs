//! Data structures the routing strategies score against (pure: no sockets, no pingora).

pub mod residency;
