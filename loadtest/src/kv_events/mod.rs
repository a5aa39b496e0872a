//! vLLM V1 KV events as the simulator publishes them: wire encoding and the ZMQ publisher.
//!
//! `encode` turns the cache's logical events into vLLM's msgpack bytes; `publisher` owns the
//! PUB/ROUTER sockets, sequence numbers, replay buffer and fault injection; `frame_bomb` is a
//! hostile raw-TCP ZMQ peer for hardening tests and the soak.

pub mod encode;
pub mod frame_bomb;
pub mod publisher;

pub use encode::{BatchLayout, EventFields, EventLayout, HashRepr, WireFormat};
pub use publisher::{KvFault, Publisher, PublisherConfig};
