//! rolter-loadtest: an OpenAI-compatible upstream stub, a vLLM fleet simulator and a load driver.
//!
//! Simulator (library first; `rolter-sim` wraps it): [`fleet::spawn_fleet`] starts N replicas,
//! each with a vLLM-like block prefix cache ([`cache`]), a cost model ([`cost`]), vLLM-format
//! KV events over ZMQ ([`kv_events`]), an LMCache-style status endpoint and fault injection
//! ([`replica`], [`http`]). [`tokenizer`] is the deterministic tokenizer and chat template that
//! everyone (simulator, driver, gateway tests) uses to compute token ids.
//!
//! Load driver (`rolter-load`): [`load`] generates seeded workloads, runs them against a base
//! URL, and compares routing strategies through the gateway.

pub mod cache;
pub mod cost;
pub mod fleet;
pub mod http;
pub mod kv_events;
pub mod load;
pub mod replica;
pub mod sim_args;
pub mod stub;
pub mod tokenizer;

pub use fleet::{
    spawn_fleet, BackgroundFleet, FleetConfig, FleetHandle, KvEventsConfig, ReplicaHandle,
};
pub use replica::ReplicaConfig;
