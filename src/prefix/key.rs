//! Prompt keys: a hash per whole 64-byte chunk of a prompt, what the prefix tries store.
//!
//! A prompt's key is one 4-byte hash per whole 64-byte chunk of the prompt: a vLLM replica
//! caches whole blocks of 16 tokens, about 64 bytes of text, and a partial last block is
//! recomputed, so a prompt's last partial chunk is left out (a prompt under 64 bytes has an
//! empty key: nothing of it is worth routing for). Two prompts' keys share a prefix of `k`
//! hashes exactly when the prompts share their first `k` chunks (up to hash collisions: see
//! below), a conversation's next turn extends its previous turn's key as it extends its
//! prompt, and a trie of keys answers "how much of this prompt was stored" in whole chunks
//! while walking a 16th of the bytes. A key is computed in one pass over the prompt at about
//! the speed memory delivers it.
//!
//! Owns the key's layout, its hash and the conversion of a match back into prompt bytes.
//! Must not know about tries, targets or routing rules, and must not do I/O.
//!
//! The chunk hash is NH (Black et al., "UMAC: Fast and Secure Message Authentication",
//! 1999; the accumulate step of XXH3): the sum over the chunk's eight 64-bit words of
//! `lo32(w ^ k) × hi32(w ^ k) + w`, keyed by 64 random bytes drawn once per process, folded
//! to 32 bits. Keyed NH is almost-universal, so two different chunks get the same hash with
//! a chance of about 2^-32 whatever their text, and a client cannot aim a collision without
//! the key. A collision makes a prompt look more cached on one target than it is, through
//! the colliding chunk and any identical chunks after it (hashes are compared only under a
//! common prefix). Why not a hash crate: every
//! one hashes a slice per call, and a call per 64 bytes costs twice this loop (XXH3-64 per
//! chunk: 14-18 µs for 256 KiB, this loop 7 µs, XXH3 over the whole prompt 8.6 µs);
//! the numbers are in docs/performance.md. Keys are local to a process (tries are), so the
//! hash need not be frozen, and gateways need not agree on it.

use std::sync::OnceLock;

/// Prompt bytes per key hash.
pub const CHUNK_BYTES: usize = 64;

/// Key bytes per chunk.
pub const HASH_BYTES: usize = 4;

/// The per-process chunk-hash key, one word per word of a chunk.
fn secret() -> &'static [u64; 8] {
    static KEY: OnceLock<[u64; 8]> = OnceLock::new();
    KEY.get_or_init(|| std::array::from_fn(|_| rand::random::<u64>()))
}

/// The chunk's NH sum under `k`, folded to 32 bits.
#[inline(always)]
fn chunk_hash(chunk: &[u8; CHUNK_BYTES], k: &[u64; 8]) -> u32 {
    let mut s = 0u64;
    for (i, ki) in k.iter().enumerate() {
        let w = u64::from_le_bytes(chunk[8 * i..8 * i + 8].try_into().expect("8 bytes"));
        let x = w ^ ki;
        s = s
            .wrapping_add((x & 0xffff_ffff).wrapping_mul(x >> 32))
            .wrapping_add(w);
    }
    (s ^ (s >> 32)) as u32
}

/// The key of `prompt` (empty for a prompt under `CHUNK_BYTES`).
pub fn prompt_key(prompt: &[u8]) -> Vec<u8> {
    let mut key = KeyBuilder::with_capacity(prompt.len());
    key.update(prompt);
    key.finish()
}

/// A prompt's key computed from its bytes in pieces of any size as they are produced,
/// without keeping them: [`prompt_key`] of the pieces joined. Pieces that end inside a
/// chunk leave its bytes in a 64-byte carry until the chunk is whole.
#[derive(Clone)]
pub struct KeyBuilder {
    key: Vec<u8>,
    carry: [u8; CHUNK_BYTES],
    carried: usize,
}

impl KeyBuilder {
    /// A builder with room for the key of a prompt of `prompt_len` bytes.
    pub fn with_capacity(prompt_len: usize) -> Self {
        KeyBuilder {
            key: Vec::with_capacity(key_len(prompt_len)),
            carry: [0; CHUNK_BYTES],
            carried: 0,
        }
    }

    /// The next prompt bytes.
    pub fn update(&mut self, mut bytes: &[u8]) {
        let k = secret();
        if self.carried > 0 {
            let take = (CHUNK_BYTES - self.carried).min(bytes.len());
            self.carry[self.carried..self.carried + take].copy_from_slice(&bytes[..take]);
            self.carried += take;
            bytes = &bytes[take..];
            if self.carried < CHUNK_BYTES {
                return;
            }
            self.key
                .extend_from_slice(&chunk_hash(&self.carry, k).to_le_bytes());
            self.carried = 0;
        }
        let start = self.key.len();
        self.key.resize(start + key_len(bytes.len()), 0);
        for (h, c) in self.key[start..]
            .chunks_exact_mut(HASH_BYTES)
            .zip(bytes.chunks_exact(CHUNK_BYTES))
        {
            let c = c.try_into().expect("a whole chunk");
            h.copy_from_slice(&chunk_hash(c, k).to_le_bytes());
        }
        let rest = bytes.chunks_exact(CHUNK_BYTES).remainder();
        self.carry[..rest.len()].copy_from_slice(rest);
        self.carried = rest.len();
    }

    /// Make room for the key of a prompt of `prompt_len` bytes in all.
    pub fn reserve_for(&mut self, prompt_len: usize) {
        self.key
            .reserve(key_len(prompt_len).saturating_sub(self.key.len()));
    }

    /// Bytes the key holds (its allocation).
    pub fn held_bytes(&self) -> usize {
        self.key.capacity()
    }

    /// The key of the bytes given so far (a partial last chunk is not keyed).
    pub fn finish(self) -> Vec<u8> {
        self.key
    }
}

/// Bytes in the key of a prompt of `prompt_len` bytes.
pub fn key_len(prompt_len: usize) -> usize {
    prompt_len / CHUNK_BYTES * HASH_BYTES
}

/// Prompt bytes a match of `matched` key bytes stands for: the whole chunks matched (a
/// match that ends inside a hash counts that chunk as not matched).
pub fn matched_prompt_bytes(matched: usize) -> usize {
    matched / HASH_BYTES * CHUNK_BYTES
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// `n` pseudo-random lowercase letters from `seed` (xorshift).
    pub(crate) fn text(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                b'a' + (x % 26) as u8
            })
            .collect()
    }

    /// A key built from a prompt cut into pieces anywhere is the key of the whole prompt.
    #[test]
    fn a_key_built_piece_by_piece_is_the_key_of_the_whole() {
        let prompt = text(1000, 5);
        let whole = prompt_key(&prompt);
        for cuts in [
            vec![1, 2, 3],
            vec![63, 64, 65],
            vec![100, 500],
            vec![999],
            vec![0, 0, 1000],
        ] {
            let mut b = KeyBuilder::with_capacity(0);
            let mut at = 0;
            for &c in &cuts {
                b.update(&prompt[at..c.max(at)]);
                at = c.max(at);
            }
            b.update(&prompt[at..]);
            assert_eq!(b.finish(), whole, "{cuts:?}");
        }
        // Byte by byte too.
        let mut b = KeyBuilder::with_capacity(prompt.len());
        prompt.iter().for_each(|&x| b.update(&[x]));
        assert_eq!(b.finish(), whole);
    }

    #[test]
    fn a_key_has_one_hash_per_whole_chunk() {
        for (n, hashes) in [
            (0, 0),
            (1, 0),
            (63, 0),
            (64, 1),
            (127, 1),
            (128, 2),
            (1000, 15),
        ] {
            assert_eq!(
                prompt_key(&text(n, 3)).len(),
                hashes * HASH_BYTES,
                "{n} bytes"
            );
            assert_eq!(key_len(n), hashes * HASH_BYTES);
        }
    }

    #[test]
    fn prompts_sharing_whole_chunks_share_their_hashes_and_no_more() {
        let a = text(640, 1);
        for cut in [0, 1, 63, 64, 65, 200, 639] {
            let mut b = a.clone();
            b[cut] ^= 0x20;
            let (ka, kb) = (prompt_key(&a), prompt_key(&b));
            let same = ka.iter().zip(&kb).take_while(|(x, y)| x == y).count();
            let chunk = cut / CHUNK_BYTES;
            // Exactly the chunks before the changed one match: the changed chunk's hash
            // differs (but for a 2^-32 chance under the process's random key).
            assert_eq!(same / HASH_BYTES, chunk, "byte {cut} changed");
            assert_eq!(matched_prompt_bytes(same), chunk * CHUNK_BYTES);
        }
    }

    #[test]
    fn a_longer_prompt_extends_the_key_of_its_prefix() {
        let long = text(1000, 5);
        let full = prompt_key(&long);
        for n in [0, 63, 64, 100, 640, 999] {
            let short = prompt_key(&long[..n]);
            assert_eq!(short[..], full[..short.len()], "{n}-byte prefix");
        }
    }

    #[test]
    fn chunks_hash_by_content_not_position() {
        let c = text(64, 8);
        let twice: Vec<u8> = [c.clone(), c.clone()].concat();
        let k = prompt_key(&twice);
        assert_eq!(k[..HASH_BYTES], k[HASH_BYTES..]);
    }

    #[test]
    fn a_match_counts_whole_chunks() {
        assert_eq!(matched_prompt_bytes(0), 0);
        assert_eq!(matched_prompt_bytes(3), 0);
        assert_eq!(matched_prompt_bytes(4), 64);
        assert_eq!(matched_prompt_bytes(11), 128);
        assert_eq!(matched_prompt_bytes(12), 192);
    }
}
