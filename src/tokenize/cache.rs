//! Bounded cache of token ids by rendered-prefix hash: what makes a conversation's next turn
//! cost roughly its new text.
//!
//! Owns: the key (length and 64-bit SipHash of the rendered text up to a cut point) and a
//! striped store bounded in bytes. Each of [`SHARDS`] stripes has its own lock and its own
//! share of the byte budget and evicts in insertion order (the oldest conversation state
//! goes first, like the prefix trie's LRU by insertion); a lookup locks one stripe for a hash
//! probe and an `Arc` clone, so there is no global lock on the request path. Must not: know
//! about tokenizers or requests.

use std::collections::{HashMap, VecDeque};
use std::hash::Hasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

/// Lock stripes (a power of two; a key picks one by its hash).
pub const SHARDS: usize = 16;
/// Bytes charged per entry on top of its ids (map slot, queue slot, `Arc` header).
const ENTRY_OVERHEAD: usize = 64;

/// Identifies a rendered text prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PrefixKey {
    /// Length in bytes.
    pub len: u64,
    /// SipHash-1-3 (std's `DefaultHasher`, fixed keys) of the bytes.
    pub hash: u64,
}

/// Keys of `text[..cut]` for every cut, in one pass over the text.
pub fn prefix_keys(text: &str, cuts: &[usize]) -> Vec<(usize, PrefixKey)> {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let mut prev = 0;
    cuts.iter()
        .map(|&at| {
            h.write(&text.as_bytes()[prev..at]);
            prev = at;
            (
                at,
                PrefixKey {
                    len: at as u64,
                    hash: h.clone().finish(),
                },
            )
        })
        .collect()
}

#[derive(Default)]
struct Shard {
    map: HashMap<PrefixKey, Arc<[u32]>>,
    order: VecDeque<PrefixKey>,
    bytes: usize,
}

/// The cache (see the module header).
pub struct PrefixIdsCache {
    shards: Box<[Mutex<Shard>]>,
    shard_budget: usize,
    hits: AtomicU64,
    misses: AtomicU64,
}

fn cost(ids: &[u32]) -> usize {
    std::mem::size_of_val(ids) + ENTRY_OVERHEAD
}

impl PrefixIdsCache {
    /// A cache holding at most `max_bytes` (split evenly over the stripes).
    pub fn new(max_bytes: usize) -> Self {
        PrefixIdsCache {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            shard_budget: max_bytes / SHARDS,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    fn shard(&self, key: PrefixKey) -> &Mutex<Shard> {
        &self.shards[(key.hash as usize) & (SHARDS - 1)]
    }

    /// The ids cached for `key`.
    pub fn get(&self, key: PrefixKey) -> Option<Arc<[u32]>> {
        let got = self.shard(key).lock().map.get(&key).cloned();
        let counter = if got.is_some() {
            &self.hits
        } else {
            &self.misses
        };
        counter.fetch_add(1, Ordering::Relaxed);
        got
    }

    /// Cache `ids` under `key`, evicting the oldest entries of its stripe past the budget
    /// (an entry larger than a stripe's budget is not kept).
    pub fn insert(&self, key: PrefixKey, ids: Arc<[u32]>) {
        let c = cost(&ids);
        if c > self.shard_budget {
            return;
        }
        let mut s = self.shard(key).lock();
        if s.map.contains_key(&key) {
            return;
        }
        while s.bytes + c > self.shard_budget {
            let Some(old) = s.order.pop_front() else {
                break;
            };
            if let Some(v) = s.map.remove(&old) {
                s.bytes -= cost(&v);
            }
        }
        s.map.insert(key, ids);
        s.order.push_back(key);
        s.bytes += c;
    }

    /// Bytes held (ids and per-entry overhead).
    pub fn bytes(&self) -> usize {
        self.shards.iter().map(|s| s.lock().bytes).sum()
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().map.len()).sum()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Lookups that found / did not find an entry.
    pub fn hit_counts(&self) -> (u64, u64) {
        (
            self.hits.load(Ordering::Relaxed),
            self.misses.load(Ordering::Relaxed),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn keys_are_prefix_hashes() {
        let a = prefix_keys("abcdef", &[2, 4]);
        let b = prefix_keys("abcdXY", &[4]);
        assert_eq!(
            a[1].1, b[0].1,
            "same prefix, same key whatever the cuts before"
        );
        let c = prefix_keys("abcXef", &[2, 4]);
        assert_eq!(a[0].1, c[0].1);
        assert_ne!(a[1].1, c[1].1);
    }

    #[test]
    fn get_returns_what_was_inserted() {
        let cache = PrefixIdsCache::new(1 << 20);
        let k = prefix_keys("hello", &[5])[0].1;
        assert!(cache.get(k).is_none());
        cache.insert(k, vec![1, 2, 3].into());
        assert_eq!(&*cache.get(k).unwrap(), &[1, 2, 3]);
        assert_eq!(cache.hit_counts(), (1, 1));
    }

    proptest! {
        /// The byte bound holds whatever is inserted, and the newest entry of a stripe
        /// survives its own insertion.
        #[test]
        fn bytes_never_exceed_the_budget(sizes in proptest::collection::vec(0usize..400, 1..200)) {
            let budget = SHARDS * 2048;
            let cache = PrefixIdsCache::new(budget);
            for (i, n) in sizes.iter().enumerate() {
                let key = PrefixKey { len: i as u64, hash: (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) };
                cache.insert(key, vec![7u32; *n].into());
                prop_assert!(cache.bytes() <= budget);
                if cost(&vec![0u32; *n]) <= budget / SHARDS {
                    prop_assert!(cache.get(key).is_some());
                }
            }
        }
    }
}
