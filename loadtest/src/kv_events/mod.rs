//! vLLM V1 KV events as the simulator publishes them: wire encoding and the ZMQ publisher.
//!
//! `encode` turns the cache's logical events into vLLM's msgpack bytes; `publisher` owns the
//! PUB/ROUTER sockets, sequence numbers, replay buffer and fault injection.

pub mod encode;
pub mod publisher;

pub use encode::{BatchLayout, EventFields, EventLayout, HashRepr, WireFormat};
pub use publisher::{KvFault, Publisher, PublisherConfig};
