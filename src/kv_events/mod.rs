//! vLLM V1 KV-event stream: the gateway's subscriber side (SPEC §4 precise_cache_aware).
//!
//! Owns the wire format ([`decode`]), sequence tracking ([`sequence`]), the libzmq
//! SUB/DEALER sockets ([`socket`]) and the client ([`subscriber`]) that feeds each target's
//! [`crate::prefix::residency::ResidencyIndex`]. It must not make routing decisions
//! (that is `routing/precise.rs`), register metrics itself (it exposes atomic
//! counters in [`sequence::StreamState`] for `metrics.rs` to read) or touch
//! config parsing: callers hand it a plain [`subscriber::SubscriberConfig`].
//! Everything network-facing lives in `socket` and `subscriber` (and `service`, which
//! keeps one subscriber per configured provider running as a pingora background
//! service); `decode` and `sequence` are pure and unit-tested without sockets.

pub mod decode;
pub mod sequence;
pub mod service;
pub mod socket;
pub mod subscriber;
