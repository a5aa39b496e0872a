//! What routing needs of a prompt, computed as the prompt is encoded and without keeping
//! its bytes: its length, its key (`prefix::key`) and the XXH3-64 hashes of its first two
//! messages, each cut to a given length (what its placement keys are made of).
//!
//! Owns the [`Summarizer`] sink the encoders write into. Must not know what routing does
//! with the summary: it returns hashes and lengths, never routing types.

use super::{Sink, ESC, RS, TAG_CHAT};
use crate::prefix::key::KeyBuilder;
use std::hash::Hasher as _;
use twox_hash::xxhash3_64::{RawHasher, SecretBuffer};

/// Streaming XXH3-64 with the default seed and secret, allocating nothing.
type Xxh3 = RawHasher<&'static [u8; twox_hash::xxhash3_64::DEFAULT_SECRET_LENGTH]>;

fn xxh3() -> Xxh3 {
    RawHasher::new(SecretBuffer::default())
}

/// A prompt as routing sees it, without its bytes.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PromptSummary {
    /// Prompt bytes in all.
    pub len: usize,
    /// The prompt's key (empty unless asked for).
    pub key: Vec<u8>,
    /// XXH3-64 of the first message's bytes (from the prompt's start: its tag, the message
    /// and its end byte), at most `keep` of them; of the whole prompt's first `keep` bytes
    /// when the prompt has no message ends ([`super::first_two_message_ends`]).
    pub first_hash: u64,
    /// Where the first message ends (the whole length when it does not).
    pub first_len: usize,
    /// XXH3-64 of the second message's bytes (from the first's end), at most `keep` of them.
    pub second_hash: u64,
    /// The `keep` the hashes were cut to.
    pub keep: usize,
}

/// A sink summarising the prompt bytes written into it.
#[derive(Clone)]
pub(super) struct Summarizer {
    summary: PromptSummary,
    key: Option<KeyBuilder>,
    keep: usize,
    /// The first two messages' hashes so far, and how many bytes each took.
    hashes: [Xxh3; 2],
    hashed: [usize; 2],
    /// Chat prompt (known from the first byte): its messages end with unescaped RS.
    chat: bool,
    /// Message ends found (the scan stops at two).
    ends: usize,
    /// The last byte seen by the scan was an unescaped ESC: the next one is escaped.
    escaped: bool,
    /// Where the first message ended, once it has.
    first_end: Option<usize>,
}

impl Summarizer {
    /// A summariser hashing at most `keep` bytes of each of the first two messages, and
    /// building the key when `with_key`, for a prompt of about `len_hint` bytes.
    pub(super) fn new(keep: usize, with_key: bool, len_hint: usize) -> Self {
        Summarizer {
            summary: PromptSummary::default(),
            key: with_key.then(|| KeyBuilder::with_capacity(len_hint)),
            keep,
            hashes: [xxh3(), xxh3()],
            hashed: [0, 0],
            chat: false,
            ends: 0,
            escaped: false,
            first_end: None,
        }
    }

    /// Make room in the key for a prompt of about `len_hint` bytes in all.
    pub(super) fn reserve_key(&mut self, len_hint: usize) {
        if let Some(key) = &mut self.key {
            key.reserve_for(len_hint);
        }
    }

    /// Bytes the key holds so far (what keeping this summariser costs, beyond its size).
    pub(super) fn key_bytes(&self) -> usize {
        self.key.as_ref().map_or(0, KeyBuilder::held_bytes)
    }

    pub(super) fn finish(mut self) -> PromptSummary {
        self.summary.first_len = self.first_end.unwrap_or(self.summary.len);
        self.summary.first_hash = self.hashes[0].finish();
        self.summary.second_hash = self.hashes[1].finish();
        self.summary.keep = self.keep;
        self.summary.key = self.key.map(KeyBuilder::finish).unwrap_or_default();
        self.summary
    }

    /// Where, in `bytes`, the message being scanned ends (the index of its RS).
    fn find_end(&mut self, bytes: &[u8]) -> Option<usize> {
        let mut i = 0;
        if std::mem::take(&mut self.escaped) {
            i = 1;
        }
        while i < bytes.len() {
            let at = i + memchr::memchr2(ESC, RS, &bytes[i..])?;
            if bytes[at] == RS {
                return Some(at);
            }
            if at + 1 == bytes.len() {
                self.escaped = true;
                return None;
            }
            i = at + 2;
        }
        None
    }

    /// Hashes `bytes` (at prompt offset `at`) into the first or second message's hash.
    fn scan(&mut self, mut bytes: &[u8], mut at: usize) {
        if at == 0 && !bytes.is_empty() {
            self.chat = bytes[0] == TAG_CHAT;
        }
        while !bytes.is_empty() && self.ends < 2 {
            let end = if self.chat {
                self.find_end(bytes)
            } else {
                None
            };
            let (part, rest) = bytes.split_at(end.map_or(bytes.len(), |i| i + 1));
            let n = self.ends;
            let take = part.len().min(self.keep - self.hashed[n]);
            self.hashes[n].write(&part[..take]);
            self.hashed[n] += take;
            if end.is_some() {
                self.ends += 1;
                if self.ends == 1 {
                    self.first_end = Some(at + part.len());
                }
            } else if !self.chat && self.hashed[0] >= self.keep {
                // No message ends to find: the first `keep` bytes are all there is to keep.
                self.ends = 2;
            }
            at += part.len();
            bytes = rest;
        }
    }
}

impl Sink for Summarizer {
    fn push(&mut self, b: u8) {
        self.extend_from_slice(&[b]);
    }

    fn extend_from_slice(&mut self, bytes: &[u8]) {
        if let Some(key) = &mut self.key {
            key.update(bytes);
        }
        if self.ends < 2 {
            self.scan(bytes, self.summary.len);
        }
        self.summary.len += bytes.len();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prompt::{first_two_message_ends, Endpoint, RequestBody};
    use twox_hash::XxHash3_64;

    /// What the summary must equal: the same facts read off the encoded prompt.
    fn from_prompt(prompt: &[u8], keep: usize) -> PromptSummary {
        let (first, second) = first_two_message_ends(prompt);
        let first = first.unwrap_or(prompt.len());
        let second = second.unwrap_or(prompt.len());
        PromptSummary {
            len: prompt.len(),
            key: crate::prefix::prompt_key(prompt),
            first_hash: XxHash3_64::oneshot(&prompt[..first.min(keep)]),
            first_len: first,
            second_hash: XxHash3_64::oneshot(&prompt[first..second.min(first + keep)]),
            keep,
        }
    }

    fn check(endpoint: Endpoint, body: &str) {
        let parsed = RequestBody::parse(endpoint, body.as_bytes()).unwrap();
        let prompt = parsed.prompt();
        for keep in [0, 1, 5, 64, 4096] {
            assert_eq!(
                parsed.summary(keep, true),
                from_prompt(&prompt, keep),
                "{endpoint:?} keep {keep}: {body}"
            );
        }
        let unkeyed = parsed.summary(64, false);
        assert!(unkeyed.key.is_empty());
        assert_eq!(unkeyed.len, prompt.len());
    }

    #[test]
    fn a_summary_is_what_the_encoded_prompt_says() {
        let long = "word ".repeat(300);
        let sep = "a\u{1b}b\u{1e}c\u{1f}d\u{1d}e\u{1b}";
        let chat = |msgs: &[(&str, &str)]| {
            let m: Vec<_> = msgs
                .iter()
                .map(|(r, c)| serde_json::json!({"role": r, "content": c}))
                .collect();
            serde_json::json!({"model": "m", "messages": m}).to_string()
        };
        check(Endpoint::Chat, &chat(&[]));
        check(Endpoint::Chat, &chat(&[("system", &long)]));
        check(Endpoint::Chat, &chat(&[("system", &long), ("user", "hi")]));
        check(
            Endpoint::Chat,
            &chat(&[
                ("system", sep),
                ("user", &long),
                ("assistant", &long),
                ("user", sep),
            ]),
        );
        check(
            Endpoint::Chat,
            &chat(&[(sep, sep), (sep, &long), ("user", "x")]),
        );
        check(
            Endpoint::Chat,
            r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"http://x"}}]},{"role":"assistant","content":null,"tool_calls":[{"id":"1","type":"function","function":{"name":"f","arguments":"{}"}}]}]}"#,
        );
        check(
            Endpoint::Completions,
            &serde_json::json!({"model": "m", "prompt": long}).to_string(),
        );
        check(
            Endpoint::Completions,
            r#"{"model":"m","prompt":[[1,2,30],[4]]}"#,
        );
        check(
            Endpoint::Messages,
            &serde_json::json!({"model": "m", "max_tokens": 1, "system": long,
                "messages": [{"role": "user", "content": sep}]})
            .to_string(),
        );
        check(
            Endpoint::Responses,
            &serde_json::json!({"model": "m", "instructions": sep, "input": long}).to_string(),
        );
    }

    proptest::proptest! {
        /// Any chat conversation, separators and escapes in its text included.
        #[test]
        fn any_conversation_summarises_as_its_encoded_prompt(
            msgs in proptest::collection::vec(
                ("[a-z\u{1b}\u{1d}\u{1e}\u{1f}]{0,6}", "[a-z \u{1b}\u{1d}\u{1e}\u{1f}]{0,300}"),
                0..5,
            ),
            keep in 0usize..200,
        ) {
            let m: Vec<_> = msgs
                .iter()
                .map(|(r, c)| serde_json::json!({"role": r, "content": c}))
                .collect();
            let body = serde_json::json!({"model": "m", "messages": m}).to_string();
            let parsed = RequestBody::parse(Endpoint::Chat, body.as_bytes()).unwrap();
            proptest::prop_assert_eq!(
                parsed.summary(keep, true),
                from_prompt(&parsed.prompt(), keep)
            );
        }
    }

    proptest::proptest! {
        /// Any bytes (separators, escapes, either tag or none), cut into any pieces.
        #[test]
        fn any_bytes_in_any_pieces_summarise_as_the_whole(
            tag in proptest::sample::select(vec![TAG_CHAT, b'P', ESC, RS]),
            body in proptest::collection::vec(
                proptest::sample::select(vec![b'a', ESC, RS, 0x1F, 0x1D, 0]),
                0..400,
            ),
            cuts in proptest::collection::vec(0usize..401, 0..12),
            keep in 0usize..300,
            tagged in proptest::bool::ANY,
        ) {
            let mut prompt = if tagged { vec![tag] } else { vec![] };
            prompt.extend(&body);
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(prompt.len())).collect();
            cuts.sort();
            let mut s = Summarizer::new(keep, true, 0);
            let mut at = 0;
            for c in cuts {
                s.extend_from_slice(&prompt[at..c]);
                at = c;
            }
            s.extend_from_slice(&prompt[at..]);
            proptest::prop_assert_eq!(s.finish(), from_prompt(&prompt, keep));
        }
    }

    /// An escape whose escaped byte arrives in the next piece is still an escape.
    #[test]
    fn an_escape_split_across_pieces_hides_its_separator() {
        for cut in 0..=7 {
            let prompt = [TAG_CHAT, b'r', ESC, RS, b'x', RS, b'y', RS];
            let mut s = Summarizer::new(100, false, 0);
            s.extend_from_slice(&prompt[..cut]);
            s.extend_from_slice(&prompt[cut..]);
            assert_eq!(s.finish(), {
                let mut p = from_prompt(&prompt, 100);
                p.key.clear();
                p
            });
        }
    }
}
