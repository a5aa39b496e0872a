//! Prefix data structures the cache-aware strategies score against.
//!
//! Plain in-memory data structures only: no pingora, no tokio, no sockets, no I/O.

pub mod event;
pub mod key;
pub mod pending;
pub mod residency;
pub mod stream_state;
pub mod trie;

pub use key::prompt_key;
pub use pending::PendingBlocks;
pub use residency::ResidencyIndex;
pub use stream_state::StreamState;
pub use trie::{MatchHint, PrefixTrie};
