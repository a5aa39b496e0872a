//! rolter: a cache-aware Pingora gateway for vLLM / OpenAI-compatible fleets.
//!
//! The library holds every module so integration tests and benches can use them;
//! `main.rs` only wires the CLI to [`server`].
//!
//! Data flows one way: bytes in → request → prompt → decision → upstream → bytes out,
//! and state flows back once: outcome → fleet state / prefix state.

pub mod allocator;
pub mod cache_size_poll;
pub mod config;
#[cfg(feature = "demo")]
pub mod demo;
pub mod egress;
pub mod fleet;
pub mod http_get;
pub mod kv_events;
pub mod lmcache_poll;
pub mod metrics;
pub mod peering;
pub mod pieces;
pub mod prefix;
pub mod prompt;
pub mod proxy;
pub mod routing;
pub mod runtime;
pub mod server;
pub mod tokenize;
