//! Prefix data structures the cache-aware strategies score against.
//!
//! Plain in-memory data structures only: no pingora, no tokio, no sockets, no I/O.

pub mod pending;
pub mod residency;
pub mod trie;

pub use pending::PendingBlocks;
pub use residency::ResidencyIndex;
pub use trie::{MatchHint, PrefixTrie};
