//! Resuming a growing chat body where the body of the conversation's previous turn ended.
//!
//! A chat client sends each turn's whole history again: the next body repeats the previous
//! one's bytes up to the end of its last message, then adds the reply and the new question.
//! Parsing and encoding that history again costs most of a long request's CPU (the JSON
//! scan and its UTF-8 checks, the key's chunk hashes). So, for a summarised chat body, the
//! parse walks the body's top-level object member by member (each value parsed by
//! serde_json, which reports where it ended) and, at the end of the messages array, keeps
//! the summariser's state with the offset it stands for and a hash of the bytes before it.
//! A later body whose bytes up to that offset hash the same resumes there: only the new
//! messages and the members after the array are parsed. The cache reads a body in the
//! pieces it arrived in (`crate::pieces`): only its part from the resumed offset on need
//! be contiguous for the walk.
//!
//! The bytes before a saved offset are never parsed again, so the hash that vouches for
//! them is keyed (XXH3-128 under a per-process random secret): a client cannot write a
//! body that resumes from another conversation's state.
//!
//! Owns [`ResumeCache`] (bounded in entries and bytes, striped by a hash of a body's
//! first bytes) and the top-level walk. Must not change what the summary is: a resumed
//! body summarises exactly as the same body parsed whole (`tests`), and anything the walk
//! does not expect (a duplicate member, a missing model, a different layout, nesting near
//! serde_json's limit, which a value parsed on its own would count from its own start)
//! falls back to the whole parse, which also gives the error a client sees.

use super::summary::Summarizer;
use super::{encode_message, Message, PromptSummary, Sink, Text, TAG_CHAT};
use crate::pieces::Pieces;
use dashmap::DashMap;
use parking_lot::Mutex;
use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::value::RawValue;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::OnceLock;
use twox_hash::xxhash3_128::{RawHasher, SecretBuffer};
use twox_hash::XxHash3_64;

/// Bytes of a body's start hashed to find its bucket: the model and the start of the
/// system prompt; a group's conversations share a bucket, told apart by `TAIL_BYTES`. A
/// state is saved only at an offset past them (they are part of the prefix it stands for).
const BUCKET_KEY_BYTES: usize = 1024;
/// Bytes just before a saved offset compared before the prefix is hashed.
const TAIL_BYTES: usize = 16;
/// Most saved states in one bucket: the conversations of one system prompt in flight.
const BUCKET_ENTRIES: usize = 256;
/// Default bound on the bytes all saved states hold (mostly their keys: 1/16 of a prompt).
pub const DEFAULT_BUDGET_BYTES: usize = 64 << 20;
/// serde_json's nesting limit (its `remaining_depth` starts at 128 and fails at 0).
const JSON_MAX_DEPTH: usize = 127;
/// Nesting a message's own parse may reach: the whole parse counts the body's object and
/// the messages array above it, a message parsed on its own does not.
const MESSAGE_MAX_DEPTH: usize = JSON_MAX_DEPTH - 2;

/// The prefix hash: XXH3-128 under a per-process random secret, so a client cannot aim a
/// body at another conversation's saved state (XXH3's default secret is public, and with
/// it two bodies colliding can be written down without a search). twox-hash's, which
/// picks AVX2 at run time where the CPU has it: the prefix is most of a long body, and
/// hashing it is most of what a resumed parse costs.
type PrefixHasher = RawHasher<&'static [u8; SECRET_BYTES]>;
const SECRET_BYTES: usize = 192;

fn prefix_hasher() -> PrefixHasher {
    static SECRET: OnceLock<[u8; SECRET_BYTES]> = OnceLock::new();
    let secret = SECRET.get_or_init(|| std::array::from_fn(|_| rand::random::<u8>()));
    RawHasher::new(SecretBuffer::new(0, secret).expect("192 bytes are a long enough secret"))
}

/// `model` (its value and span) and `stream` as far as the walk has seen them.
#[derive(Clone, Default)]
struct Before {
    model: Option<(String, std::ops::Range<usize>)>,
    stream: Option<Option<bool>>,
}

/// The parse of a body's top level at the end of its messages array.
#[derive(Clone)]
pub(super) struct Saved {
    /// The summariser after the last message (its options: `keep`, key or not); none when
    /// saved by a route that reads no summary (the walk's position alone).
    sum: Option<Summarizer>,
    keep: usize,
    with_key: bool,
    /// `model` and `stream` when they came before the messages.
    before: Before,
}

impl Saved {
    /// What holding this state costs: its key, its own size and its entry's (a bucket's
    /// spare room is kept below its entries' by `shrink`; the map's own overhead is not
    /// counted).
    fn bytes(&self) -> usize {
        self.sum.as_ref().map_or(0, Summarizer::key_bytes)
            + std::mem::size_of::<Saved>()
            + std::mem::size_of::<Entry>()
    }
}

/// A saved state taken for a body that starts with the bytes it stands for: the walk
/// resumes at `from.at` (only `body[at..]` need be contiguous).
pub struct Taken {
    saved: Box<Saved>,
    from: Origin,
}

/// Where a resumed body's walk started, and what saving its next state needs of the bytes
/// before it.
struct Origin {
    at: usize,
    /// The body's bucket and the `TAIL_BYTES` before `at`.
    key: u64,
    tail: [u8; TAIL_BYTES],
    /// Has hashed the body up to `at`.
    hasher: PrefixHasher,
}

impl Taken {
    /// Where the body's walk resumes.
    pub fn at(&self) -> usize {
        self.from.at
    }
}

struct Entry {
    at: usize,
    tail: [u8; TAIL_BYTES],
    prefix_hash: u128,
    saved: Box<Saved>,
    /// Insertion order (a bucket's entries are kept in it).
    seq: u64,
}

/// Saved parse states of recent long chat bodies, bounded in entries per bucket and in
/// bytes (about: concurrent inserts may each pass the check before counting). When the
/// bytes run out, the oldest half of all states is dropped at once (one request does it,
/// the others skip saving meanwhile).
pub struct ResumeCache {
    buckets: DashMap<u64, Vec<Entry>>,
    bytes: AtomicUsize,
    entries: AtomicUsize,
    budget: usize,
    seq: AtomicU64,
    evicting: Mutex<()>,
}

impl Default for ResumeCache {
    fn default() -> Self {
        ResumeCache::new(DEFAULT_BUDGET_BYTES)
    }
}

impl ResumeCache {
    /// A cache holding at most about `budget` bytes of saved states.
    pub fn new(budget: usize) -> Self {
        ResumeCache {
            buckets: DashMap::new(),
            bytes: AtomicUsize::new(0),
            entries: AtomicUsize::new(0),
            budget,
            seq: AtomicU64::new(0),
            evicting: Mutex::new(()),
        }
    }

    /// Bytes the saved states hold.
    pub fn bytes(&self) -> usize {
        self.bytes.load(Relaxed)
    }

    /// Take the saved state of the longest prefix of `body` a previous body ended at, with
    /// the hash of `body` up to there (streaming, to be continued to the next offset). The
    /// prefixes are hashed outside the bucket's lock; the entry is then taken under it
    /// unless another request took it first.
    pub fn take(&self, body: Pieces<'_>) -> Option<Taken> {
        if body.len() <= BUCKET_KEY_BYTES {
            return None;
        }
        let key = bucket_key(body);
        let tail_at = |at: usize| {
            let mut tail = [0; TAIL_BYTES];
            body.copy_to(at - TAIL_BYTES, &mut tail);
            tail
        };
        // (offset, prefix hash, entry id) of the entries whose tail bytes match, shortest first.
        let mut candidates: Vec<(usize, u128, u64)> = self
            .buckets
            .get(&key)?
            .iter()
            .filter(|e| e.at < body.len() && tail_at(e.at) == e.tail)
            .map(|e| (e.at, e.prefix_hash, e.seq))
            .collect();
        candidates.sort_unstable();
        let mut hasher = prefix_hasher();
        let mut hashed = 0;
        let mut found = None;
        for &(at, prefix_hash, seq) in &candidates {
            for s in body.slices(hashed..at) {
                hasher.write(s);
            }
            hashed = at;
            if hasher.finish_128() == prefix_hash {
                found = Some((at, seq, hasher.clone()));
            }
        }
        let (at, seq, hasher) = found?;
        let mut bucket = self.buckets.get_mut(&key)?;
        let i = bucket.iter().position(|e| e.seq == seq)?;
        let e = bucket.remove(i);
        self.forget(&e);
        shrink(&mut bucket);
        if bucket.is_empty() {
            drop(bucket);
            self.buckets.remove_if(&key, |_, b| b.is_empty());
        }
        Some(Taken {
            saved: e.saved,
            from: Origin {
                at,
                key,
                tail: e.tail,
                hasher,
            },
        })
    }

    /// Keep `saved`, the state at `at` of a body in bucket `key` whose `TAIL_BYTES` before
    /// `at` are `tail` and whose prefix up to `at` hashes to `prefix_hash`.
    fn put(
        &self,
        key: u64,
        at: usize,
        tail: [u8; TAIL_BYTES],
        prefix_hash: u128,
        saved: Box<Saved>,
    ) {
        let size = saved.bytes();
        if at < BUCKET_KEY_BYTES || size > self.budget {
            return;
        }
        if self.bytes.load(Relaxed) + size > self.budget {
            self.evict_oldest_half();
            if self.bytes.load(Relaxed) + size > self.budget {
                return;
            }
        }
        let seq = self.seq.fetch_add(1, Relaxed);
        let mut bucket = self.buckets.entry(key).or_default();
        if bucket.len() >= BUCKET_ENTRIES {
            let oldest = bucket.remove(0);
            self.forget(&oldest);
        }
        self.bytes.fetch_add(size, Relaxed);
        self.entries.fetch_add(1, Relaxed);
        bucket.push(Entry {
            at,
            tail,
            prefix_hash,
            saved,
            seq,
        });
    }

    fn forget(&self, e: &Entry) {
        self.bytes.fetch_sub(e.saved.bytes(), Relaxed);
        self.entries.fetch_sub(1, Relaxed);
    }

    /// Drop the states older than about the median (by insertion order), and the buckets
    /// left empty. One request at a time; the others go on without saving meanwhile.
    fn evict_oldest_half(&self) {
        let Some(_evicting) = self.evicting.try_lock() else {
            return;
        };
        let live = self.entries.load(Relaxed) as u64;
        let floor = self.seq.load(Relaxed).saturating_sub(live / 2);
        self.buckets.retain(|_, bucket| {
            bucket.retain(|e| {
                let keep = e.seq >= floor;
                if !keep {
                    self.forget(e);
                }
                keep
            });
            shrink(bucket);
            !bucket.is_empty()
        });
    }
}

/// Give back a bucket's room once it holds under a quarter of it: the budget counts
/// entries, not the room emptied buckets would keep.
fn shrink(bucket: &mut Vec<Entry>) {
    if bucket.capacity() > 4 * bucket.len().max(4) {
        bucket.shrink_to(2 * bucket.len());
    }
}

fn bucket_key(body: Pieces<'_>) -> u64 {
    XxHash3_64::oneshot(&body.range(0..BUCKET_KEY_BYTES))
}

/// What the walk of a chat body found.
pub(super) struct Walked<'a> {
    pub model: String,
    pub model_span: std::ops::Range<usize>,
    pub stream: bool,
    /// The messages parsed (those after the resumed offset when resumed).
    pub messages: Vec<Message<'a>>,
    /// When resumed: the saved state the walk continued from (the walk read only the body
    /// from its offset on).
    resumed: Option<Taken>,
    /// Where the messages array's last message ends (0 when it has none), in the body.
    pub end: usize,
    /// `model` and `stream` seen before the messages, for the next body's saved state.
    before: Before,
}

/// Walk `body` (a chat completion request) from where a previous body of `cache` ended,
/// or from its start. `None` where the body is not a plain JSON object with one each of
/// `model` and `messages` (the whole parse then decides, and reports the error).
#[cfg(test)]
pub(super) fn walk<'a>(body: &'a [u8], cache: &ResumeCache) -> Option<Walked<'a>> {
    match cache.take(Pieces::one(body)) {
        Some(taken) => walk_resumed(&body[taken.at()..], taken),
        None => walk_whole(body),
    }
}

/// Walk a whole body from its start.
pub(super) fn walk_whole(body: &[u8]) -> Option<Walked<'_>> {
    Walker::start(body)?.run()
}

/// Walk a body from where `taken` was saved: `rest` is the body from `taken.at()` on.
pub(super) fn walk_resumed(rest: &[u8], taken: Taken) -> Option<Walked<'_>> {
    let before = taken.saved.before.clone();
    let mut walked = Walker::resume(rest, taken.at(), before).run()?;
    walked.resumed = Some(taken);
    Some(walked)
}

impl<'a> Walked<'a> {
    /// Whether the walk resumed where a previous body ended.
    pub fn is_resumed(&self) -> bool {
        self.resumed.is_some()
    }

    /// The summary of the whole body's prompt (at most `keep` bytes of each of the first
    /// two messages hashed; the key when `with_key`), saving the state at the end of the
    /// messages in `cache` for the conversation's next turn. `read` is what the walk read:
    /// the body from the resumed offset on, or the whole body. `None` when the resumed
    /// state was made with other options or without a summariser (the caller then parses
    /// the body whole).
    pub fn summary(
        self,
        read: &[u8],
        keep: usize,
        with_key: bool,
        cache: &ResumeCache,
    ) -> Option<PromptSummary> {
        let len = self.base() + read.len();
        let (mut sum, from) = match self.resumed {
            Some(Taken { saved, from }) => {
                let sum = saved
                    .sum
                    .filter(|_| (saved.keep, saved.with_key) == (keep, with_key));
                let mut sum = sum?;
                sum.reserve_key(len);
                (sum, Some(from))
            }
            None => {
                let mut sum = Summarizer::new(keep, with_key, len);
                sum.push(TAG_CHAT);
                (sum, None)
            }
        };
        for m in &self.messages {
            encode_message(&mut sum, m);
        }
        let saved = Saved {
            sum: Some(sum.clone()),
            keep,
            with_key,
            before: self.before,
        };
        save(read, from, self.end, saved, cache);
        Some(sum.finish())
    }

    /// Save the walk's position at the end of the messages in `cache`, for a route that
    /// reads no summary: the conversation's next body resumes its walk there (and a route
    /// that does want a summary then parses that body whole). `read` as for `summary`.
    pub fn remember(self, read: &[u8], cache: &ResumeCache) {
        let saved = Saved {
            sum: None,
            keep: 0,
            with_key: false,
            before: self.before,
        };
        save(read, self.resumed.map(|t| t.from), self.end, saved, cache);
    }

    /// Where the bytes the walk read start in the body.
    fn base(&self) -> usize {
        self.resumed.as_ref().map_or(0, Taken::at)
    }
}

/// Keep `saved`, the state at `end` (the messages' end) of a body of which `read` is the
/// part from `from`'s offset on (a resumed body) or the whole, in `cache`. Saved again
/// even when no message was added (a retried body), as `take` removed it.
fn save(read: &[u8], from: Option<Origin>, end: usize, saved: Saved, cache: &ResumeCache) {
    if end < BUCKET_KEY_BYTES {
        return;
    }
    let (base, key, before, mut hasher) = match from {
        Some(o) => (o.at, o.key, o.tail, o.hasher),
        None => (
            0,
            bucket_key(Pieces::one(read)),
            [0; TAIL_BYTES],
            prefix_hasher(),
        ),
    };
    hasher.write(&read[..end - base]);
    // The tail bytes before `end`; those before `read` starts are the resumed state's own.
    let mut tail = [0; TAIL_BYTES];
    for (i, t) in tail.iter_mut().enumerate() {
        let pos = end - TAIL_BYTES + i;
        *t = if pos < base {
            before[pos + TAIL_BYTES - base]
        } else {
            read[pos - base]
        };
    }
    cache.put(key, end, tail, hasher.finish_128(), Box::new(saved));
}

/// The walk's position in the body's top-level object.
struct Walker<'a> {
    /// The bytes walked: the body from `base` on (positions below are in them).
    body: &'a [u8],
    base: usize,
    pos: usize,
    /// `model` and `stream` seen so far.
    seen: Before,
    /// Present once the walk is inside (or past) the messages array.
    messages: Option<Vec<Message<'a>>>,
    end: usize,
    /// What `seen` was when the messages array began.
    before: Before,
}

impl<'a> Walker<'a> {
    fn start(body: &'a [u8]) -> Option<Self> {
        let pos = ws(body, 0);
        (body.get(pos) == Some(&b'{')).then_some(Walker {
            body,
            base: 0,
            pos: pos + 1,
            seen: Before::default(),
            messages: None,
            end: 0,
            before: Before::default(),
        })
    }

    /// The walk of a body from `at` on (`rest`), resumed after a message.
    fn resume(rest: &'a [u8], at: usize, before: Before) -> Self {
        Walker {
            body: rest,
            base: at,
            pos: 0,
            seen: before.clone(),
            messages: Some(Vec::new()),
            end: 0,
            before,
        }
    }

    fn run(mut self) -> Option<Walked<'a>> {
        if self.messages.is_some() {
            // Resumed inside the messages array, after a message.
            self.rest_of_messages()?;
            if !self.after_member()? {
                self.members()?;
            }
        } else {
            // An empty object has no model: the whole parse reports it.
            self.members()?;
        }
        let (model, model_span) = self.seen.model?;
        Some(Walked {
            model,
            model_span,
            stream: self.seen.stream.flatten().unwrap_or(false),
            messages: self.messages?,
            resumed: None,
            end: self.base + self.end,
            before: self.before,
        })
    }

    /// Members from the current one to the object's end, then nothing but whitespace.
    fn members(&mut self) -> Option<()> {
        loop {
            let (key, at) = value::<Text>(self.body, self.pos)?;
            self.pos = ws(self.body, at);
            if self.body.get(self.pos) != Some(&b':') {
                return None;
            }
            self.pos += 1;
            match key.0.as_ref() {
                "messages" => {
                    if self.messages.is_some() {
                        return None;
                    }
                    self.before = self.seen.clone();
                    self.pos = ws(self.body, self.pos);
                    if self.body.get(self.pos) != Some(&b'[') {
                        return None;
                    }
                    self.pos += 1;
                    self.messages = Some(Vec::new());
                    self.first_message()?;
                }
                "model" => {
                    if self.seen.model.is_some() {
                        return None;
                    }
                    let (raw, at) = value::<&RawValue>(self.body, self.pos)?;
                    let model: String = serde_json::from_str(raw.get()).ok()?;
                    let start =
                        self.base + raw.get().as_ptr() as usize - self.body.as_ptr() as usize;
                    self.seen.model = Some((model, start..start + raw.get().len()));
                    self.pos = at;
                }
                "stream" => {
                    if self.seen.stream.is_some() {
                        return None;
                    }
                    let (stream, at) = value::<Option<bool>>(self.body, self.pos)?;
                    self.seen.stream = Some(stream);
                    self.pos = at;
                }
                _ => self.pos = value::<IgnoredAny>(self.body, self.pos)?.1,
            }
            if self.after_member()? {
                return Some(());
            }
        }
    }

    /// After a member's value: `,` and the next member (false), or the object's end and
    /// then only whitespace (true).
    fn after_member(&mut self) -> Option<bool> {
        self.pos = ws(self.body, self.pos);
        match self.body.get(self.pos)? {
            b',' => {
                self.pos += 1;
                Some(false)
            }
            b'}' => {
                let end = ws(self.body, self.pos + 1);
                (end == self.body.len()).then_some(true)
            }
            _ => None,
        }
    }

    /// Just past the array's `[`: `]`, or the first message and the rest.
    fn first_message(&mut self) -> Option<()> {
        self.pos = ws(self.body, self.pos);
        if self.body.get(self.pos) == Some(&b']') {
            self.pos += 1;
            return Some(());
        }
        self.message()?;
        self.rest_of_messages()
    }

    /// Just past a message: `,` and another, until the array's `]`.
    fn rest_of_messages(&mut self) -> Option<()> {
        loop {
            self.pos = ws(self.body, self.pos);
            match self.body.get(self.pos)? {
                b']' => {
                    self.pos += 1;
                    return Some(());
                }
                b',' => {
                    self.pos += 1;
                    self.message()?;
                }
                _ => return None,
            }
        }
    }

    fn message(&mut self) -> Option<()> {
        let (m, at) = value::<Message>(self.body, self.pos)?;
        if nested_deeper_than(&self.body[self.pos..at], MESSAGE_MAX_DEPTH) {
            return None;
        }
        self.messages.as_mut()?.push(m);
        self.pos = at;
        self.end = at;
        Some(())
    }
}

/// One JSON value of `body` from `pos` (after any whitespace), and where it ends.
fn value<'a, T: Deserialize<'a>>(body: &'a [u8], pos: usize) -> Option<(T, usize)> {
    let mut values = serde_json::Deserializer::from_slice(body.get(pos..)?).into_iter::<T>();
    let v = values.next()?.ok()?;
    Some((v, pos + values.byte_offset()))
}

/// Whether the JSON value `bytes` nests arrays and objects more than `max` deep. Exact on
/// the brackets outside strings, so it also counts values the parse skips without a limit
/// (unknown members): a value it flags goes to the whole parse, which decides. Counts the
/// brackets first: a value with `max` of them or fewer cannot be that deep.
fn nested_deeper_than(bytes: &[u8], max: usize) -> bool {
    if memchr::memchr2_iter(b'[', b'{', bytes).count() <= max {
        return false;
    }
    let (mut depth, mut i, mut in_string) = (0usize, 0, false);
    while i < bytes.len() {
        if in_string {
            let Some(j) = memchr::memchr2(b'"', b'\\', &bytes[i..]) else {
                break;
            };
            if bytes[i + j] == b'\\' {
                // An escape: the byte after it is part of the string.
                i += j + 2;
            } else {
                i += j + 1;
                in_string = false;
            }
            continue;
        }
        match bytes[i] {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > max {
                    return true;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        i += 1;
    }
    false
}

/// `pos` past any JSON whitespace.
fn ws(body: &[u8], mut pos: usize) -> usize {
    while matches!(body.get(pos), Some(b' ' | b'\n' | b'\t' | b'\r')) {
        pos += 1;
    }
    pos
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prompt::{Endpoint, RequestBody};
    use serde_json::json;

    /// A body's members besides `messages`: (name, JSON value).
    type Members<'a> = Vec<(&'a str, String)>;

    /// A chat body with its members in the given order: `messages`, then the others as
    /// (name, JSON value) pairs placed before or after it.
    fn body(
        before: &[(&str, String)],
        msgs: &[serde_json::Value],
        after: &[(&str, String)],
    ) -> Vec<u8> {
        let member = |(k, v): &(&str, String)| format!("{}: {v}", json!(k));
        let mut members: Vec<String> = before.iter().map(member).collect();
        members.push(format!(
            "\"messages\": {}",
            serde_json::to_string(msgs).unwrap()
        ));
        members.extend(after.iter().map(member));
        format!("{{{}}}", members.join(", ")).into_bytes()
    }

    fn turn(i: usize, text: &str) -> [serde_json::Value; 2] {
        [
            json!({"role": "assistant", "content": format!("reply {i}: {text}")}),
            json!({"role": "user", "content": format!("question {i}: {text}")}),
        ]
    }

    /// The summary, model and stream of `body` through the walk, and whether it resumed.
    fn walked(
        body: &[u8],
        cache: &ResumeCache,
        keep: usize,
    ) -> (PromptSummary, String, std::ops::Range<usize>, bool, bool) {
        let w = walk(body, cache).expect("a plain chat body walks");
        let (model, span, stream, resumed) = (
            w.model.clone(),
            w.model_span.clone(),
            w.stream,
            w.resumed.is_some(),
        );
        let read = &body[w.base()..];
        let s = w.summary(read, keep, true, cache).expect("same options");
        (s, model, span, stream, resumed)
    }

    /// The summary through the gateway's path (walk or whole parse, whichever applies).
    fn resuming(body: &[u8], cache: &ResumeCache) -> PromptSummary {
        let mut p = RequestBody::parse_resuming(Endpoint::Chat, body, None, cache, 0).unwrap();
        p.summary_with(64, true, cache).expect("one set of options")
    }

    fn whole(body: &[u8], keep: usize) -> (PromptSummary, String, std::ops::Range<usize>, bool) {
        let p = RequestBody::parse(Endpoint::Chat, body).unwrap();
        (
            p.summary(keep, true),
            p.model.clone(),
            p.model_span.clone(),
            p.stream,
        )
    }

    #[test]
    fn a_growing_conversation_resumes_and_summarises_as_parsed_whole() {
        let layouts: [(Members, Members); 3] = [
            (
                vec![("model", json!("m").to_string())],
                vec![("stream", "true".into())],
            ),
            (
                vec![],
                vec![
                    ("model", json!("m\u{e9}").to_string()),
                    (
                        "tools",
                        json!([{"type": "function", "name": "f"}]).to_string(),
                    ),
                ],
            ),
            (
                vec![
                    ("stream", "false".into()),
                    ("model", json!("x/y").to_string()),
                ],
                vec![("max_tokens", "32".into())],
            ),
        ];
        for (before, after) in &layouts {
            let cache = ResumeCache::default();
            let system = "You are terse. \u{1e} \\ \"quoted\" ".repeat(50);
            let mut msgs = vec![
                json!({"role": "system", "content": system}),
                json!({"role": "user", "content": "hi"}),
            ];
            for i in 0..6 {
                let b = body(before, &msgs, after);
                let (s, model, span, stream, resumed) = walked(&b, &cache, 4096);
                let (ws, wmodel, wspan, wstream) = whole(&b, 4096);
                assert_eq!(
                    (&s, &model, &span, stream),
                    (&ws, &wmodel, &wspan, wstream),
                    "turn {i}"
                );
                assert_eq!(resumed, i > 0, "turn {i}");
                msgs.extend(turn(i, &"words \u{1d} ".repeat(i * 7)));
            }
        }
    }

    /// A route that reads no summary saves the walk's position alone: the next body's walk
    /// resumes from it, and a summary asked of such a body comes from the whole parse.
    #[test]
    fn a_position_saved_without_a_summariser_resumes_the_walk_only() {
        let cache = ResumeCache::default();
        let model = [("model", json!("m").to_string())];
        let mut msgs = vec![
            json!({"role": "system", "content": "s".repeat(1500)}),
            json!({"role": "user", "content": "q"}),
        ];
        let mut bodies = Vec::new();
        for t in 0..3 {
            bodies.push(body(&model, &msgs, &[("stream", "true".into())]));
            msgs.extend(turn(t, "x"));
        }
        let w = walk(&bodies[0], &cache).unwrap();
        assert!(!w.is_resumed());
        w.remember(&bodies[0], &cache);
        let w = walk(&bodies[1], &cache).unwrap();
        assert!(w.is_resumed());
        let whole1 = RequestBody::parse(Endpoint::Chat, &bodies[1]).unwrap();
        assert_eq!(
            (&w.model, &w.model_span, w.stream),
            (&whole1.model, &whole1.model_span, whole1.stream)
        );
        let at = w.base();
        w.remember(&bodies[1][at..], &cache);
        let mut p =
            RequestBody::parse_resuming(Endpoint::Chat, &bodies[2], None, &cache, 0).unwrap();
        assert!(p.resumed());
        // Resumed from a position saved without a summariser: the caller parses it whole.
        assert_eq!(p.summary_with(64, true, &cache), None);
    }

    #[test]
    fn a_body_whose_history_changed_starts_over() {
        let cache = ResumeCache::default();
        let mut msgs = vec![
            json!({"role": "system", "content": "s".repeat(1500)}),
            json!({"role": "user", "content": "q"}),
        ];
        let model = [("model", json!("m").to_string())];
        assert!(!walked(&body(&model, &msgs, &[]), &cache, 64).4);
        msgs[1] = json!({"role": "user", "content": "Q"});
        msgs.extend(turn(0, "x"));
        let b = body(&model, &msgs, &[]);
        let (s, .., resumed) = walked(&b, &cache, 64);
        assert!(!resumed);
        assert_eq!(s, whole(&b, 64).0);
    }

    #[test]
    fn a_retried_body_resumes_again_and_options_that_differ_fall_back() {
        let cache = ResumeCache::default();
        let msgs = vec![
            json!({"role": "system", "content": "s".repeat(1500)}),
            json!({"role": "user", "content": "q"}),
        ];
        let b = body(&[("model", json!("m").to_string())], &msgs, &[]);
        walked(&b, &cache, 64);
        assert!(
            walked(&b, &cache, 64).4,
            "the same body resumes at its own end"
        );
        assert!(walked(&b, &cache, 64).4, "and is saved again");
        // Saved with the key; asked without: no summary from the walk (the caller parses whole).
        let w = walk(&b, &cache).unwrap();
        assert!(w.resumed.is_some());
        let at = w.base();
        assert!(w.summary(&b[at..], 64, false, &cache).is_none());
        // Through `RequestBody` too: the caller parses the whole body.
        walked(&b, &cache, 64);
        let mut p = RequestBody::parse_resuming(Endpoint::Chat, &b, None, &cache, 0).unwrap();
        assert!(p.resumed());
        assert_eq!(p.summary_with(64, false, &cache), None);
    }

    #[test]
    fn bodies_the_walk_does_not_expect_are_left_to_the_whole_parse() {
        let cache = ResumeCache::default();
        let msgs = [json!({"role": "user", "content": "q"})];
        let dup_model = body(
            &[("model", json!("a").to_string())],
            &msgs,
            &[("model", json!("b").to_string())],
        );
        let dup_stream = body(
            &[("stream", "true".into())],
            &msgs,
            &[("model", json!("b").to_string()), ("stream", "true".into())],
        );
        let no_model = body(&[], &msgs, &[]);
        let model_number = body(&[("model", "7".into())], &msgs, &[]);
        let mut trailing = body(&[("model", json!("a").to_string())], &msgs, &[]);
        trailing.extend_from_slice(b" x");
        let messages_null = br#"{"model": "a", "messages": null}"#.to_vec();
        for b in [
            dup_model,
            dup_stream,
            no_model,
            model_number,
            trailing,
            messages_null,
        ] {
            assert!(
                walk(&b, &cache).is_none(),
                "{}",
                String::from_utf8_lossy(&b)
            );
            let err = |r: Result<RequestBody, _>| {
                r.err().map(|e: crate::prompt::PromptError| e.to_string())
            };
            assert_eq!(
                err(RequestBody::parse_resuming(
                    Endpoint::Chat,
                    &b,
                    None,
                    &cache,
                    0
                )),
                err(RequestBody::parse(Endpoint::Chat, &b)),
            );
            assert!(err(RequestBody::parse(Endpoint::Chat, &b)).is_some());
        }
        // A body resumed from a saved state must not accept a second model in its tail.
        let msgs = [json!({"role": "system", "content": "s".repeat(1500)})];
        let b1 = body(&[("model", json!("a").to_string())], &msgs, &[]);
        walked(&b1, &cache, 64);
        assert!(walked(&b1, &cache, 64).4);
        let mut longer = msgs.to_vec();
        longer.extend(turn(1, "x"));
        let b2 = body(
            &[("model", json!("a").to_string())],
            &longer,
            &[("model", json!("b").to_string())],
        );
        assert!(walk(&b2, &cache).is_none());
    }

    #[test]
    fn the_cache_stays_within_its_budget() {
        let cache = ResumeCache::new(64 << 10);
        for i in 0..200 {
            let msgs = vec![
                json!({"role": "system", "content": format!("{i} {}", "s".repeat(4000))}),
                json!({"role": "user", "content": "q"}),
            ];
            walked(
                &body(&[("model", json!("m").to_string())], &msgs, &[]),
                &cache,
                64,
            );
            assert!(cache.bytes() <= 64 << 10, "{}", cache.bytes());
        }
        assert!(cache.bytes() > 0);
    }

    /// Two 3,000-byte bodies that differ in two bytes yet hash alike under XXH3's public
    /// default secret (each changed word's high half equals the secret's there, so its
    /// product vanishes and the two changes cancel). The second is invalid JSON.
    fn colliding_under_the_default_secret(a0: u8, b0: u8) -> Vec<u8> {
        let mut b = br#"{"model":"m","messages":[{"role":"system","content":""#.to_vec();
        b.resize(3000, b'x');
        b[1472..1480].copy_from_slice(&[a0, b'a', b'a', 0xc2, 0x81, 0x3a, 0x26, 0x4c]);
        b[1920..1928].copy_from_slice(&[b0, b'b', b'b', b'b', 0xcd, 0xb4, 0x59, 0x31]);
        b.extend_from_slice(br#""},{"role":"user","content":"q"}"#);
        b
    }

    #[test]
    fn a_body_aimed_at_another_conversations_state_does_not_resume() {
        let (p, q) = (
            colliding_under_the_default_secret(b'!', b'#'),
            colliding_under_the_default_secret(b'"', b'"'),
        );
        assert_eq!(
            XxHash3_64::oneshot(&p),
            XxHash3_64::oneshot(&q),
            "the construction collides"
        );
        let cache = ResumeCache::default();
        let mut first = p.clone();
        first.extend_from_slice(b"]}");
        walked(&first, &cache, 64);
        let mut aimed = q;
        aimed.extend_from_slice(
            br#",{"role":"assistant","content":"a"},{"role":"user","content":"q2"}], "stream": true}"#,
        );
        assert!(walk(&aimed, &cache).is_none());
        assert!(RequestBody::parse_resuming(Endpoint::Chat, &aimed, None, &cache, 0).is_err());
    }

    /// A message parsed on its own is two levels shallower than in the whole body: a
    /// message nested to the whole parse's limit goes to the whole parse.
    #[test]
    fn nesting_is_limited_as_in_the_whole_parse() {
        let cache = ResumeCache::default();
        let system = json!({"role": "system", "content": "s".repeat(1500)});
        for d in 118..=130 {
            let deep = format!("{}{}", "[".repeat(d), "]".repeat(d));
            let user = format!(r#"{{"role":"user","content":[{{"type":"image","p":{deep}}}]}}"#);
            let b = format!(r#"{{"model":"m","messages":[{system},{user}]}}"#).into_bytes();
            let err =
                |r: Result<RequestBody, crate::prompt::PromptError>| r.err().map(|e| e.to_string());
            let resumed = RequestBody::parse_resuming(Endpoint::Chat, &b, None, &cache, 0);
            let whole = RequestBody::parse(Endpoint::Chat, &b);
            let (resumed_ok, whole_ok) = (resumed.is_ok(), whole.is_ok());
            assert_eq!(err(resumed), err(whole), "depth {d}");
            assert_eq!(resumed_ok, whole_ok, "depth {d}");
            if whole_ok {
                assert_eq!(walked(&b, &cache, 64).0, self::whole(&b, 64).0, "depth {d}");
            }
        }
        // Unknown members are skipped without a limit, in both parses.
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        let b = format!(
            r#"{{"model":"m","messages":[{system},{{"role":"user","content":"q","x":{deep}}}],"y":{deep}}}"#
        );
        assert!(RequestBody::parse(Endpoint::Chat, b.as_bytes()).is_ok());
        assert_eq!(
            resuming(b.as_bytes(), &cache),
            self::whole(b.as_bytes(), 64).0
        );
        assert!(nested_deeper_than(br#"[["]]]]]]", [[[]]]]"#, 4));
        assert!(!nested_deeper_than(br#"[["[[[[[[", "\"[[[[["]]"#, 2));
    }

    #[test]
    fn a_full_cache_makes_room_for_new_conversations_and_keeps_no_empty_buckets() {
        let cache = ResumeCache::new(200 << 10);
        let one_off = |i: usize| {
            let msgs = [json!({"role": "system", "content": format!("{i} {}", "s".repeat(8000))})];
            body(&[("model", json!("m").to_string())], &msgs, &[])
        };
        for i in 0..400 {
            walked(&one_off(i), &cache, 64);
            assert!(cache.bytes() <= 200 << 10);
        }
        assert!(cache.buckets.len() <= cache.entries.load(Relaxed));
        let mut msgs = vec![json!({"role": "system", "content": "c".repeat(8000)})];
        let mut resumed = 0;
        for t in 0..10 {
            msgs.extend(turn(t, "x"));
            resumed += usize::from(
                walked(
                    &body(&[("model", json!("m").to_string())], &msgs, &[]),
                    &cache,
                    64,
                )
                .4,
            );
        }
        assert_eq!(resumed, 9);
        // States taken and not saved again give back their bucket's room.
        let full = ResumeCache::default();
        let system = json!({"role": "system", "content": "p".repeat(2000)});
        let bodies: Vec<Vec<u8>> = (0..BUCKET_ENTRIES)
            .map(|i| {
                let user = json!({"role": "user", "content": i.to_string()});
                body(
                    &[("model", json!("m").to_string())],
                    &[system.clone(), user],
                    &[],
                )
            })
            .collect();
        for b in &bodies {
            walked(b, &full, 64);
        }
        assert_eq!(full.entries.load(Relaxed), BUCKET_ENTRIES);
        for b in &bodies {
            // Resumes at the end of `b`'s messages, then fails the walk: taken, not saved.
            let mut broken = b[..b.len() - 2].to_vec();
            broken.extend_from_slice(b",x]}");
            assert!(walk(&broken, &full).is_none());
        }
        assert_eq!((full.entries.load(Relaxed), full.bytes()), (0, 0));
        assert_eq!(full.buckets.len(), 0);
        for b in &bodies[..BUCKET_ENTRIES / 2] {
            walked(b, &full, 64);
        }
        for b in &bodies[..BUCKET_ENTRIES / 2 - 3] {
            let mut broken = b[..b.len() - 2].to_vec();
            broken.extend_from_slice(b",x]}");
            walk(&broken, &full);
        }
        let room: usize = full.buckets.iter().map(|b| b.capacity()).sum();
        assert!(room <= 4 * 4, "room for {room} entries kept for 3");
        // A budget too small for any state keeps nothing, and no bucket.
        let tiny = ResumeCache::new(1);
        for i in 0..50 {
            walked(&one_off(i), &tiny, 64);
        }
        assert_eq!((tiny.bytes(), tiny.buckets.len()), (0, 0));
    }

    proptest::proptest! {
        /// Any growing conversation, in any member order and layout, resumes each turn and
        /// summarises as its body parsed whole.
        #[test]
        fn any_growing_conversation_summarises_as_parsed_whole(
            turns in proptest::collection::vec(
                ("[a-z\u{1b}\u{1d}\u{1e}\u{1f}\"\\\\\u{e9}]{0,4}", "[a-z \u{1b}\u{1d}\u{1e}\u{1f}\"\\\\\u{e9}\u{1F600}]{0,120}"),
                1..6,
            ),
            model_first in proptest::bool::ANY,
            stream in proptest::option::of(proptest::bool::ANY),
            pretty in proptest::bool::ANY,
            keep in 0usize..100,
        ) {
            let cache = ResumeCache::default();
            let model = ("model", json!("m").to_string());
            let mut before = Vec::new();
            let mut after = vec![("temperature", "0.5".to_string())];
            if model_first { before.push(model) } else { after.push(model) }
            if let Some(s) = stream { before.push(("stream", s.to_string())) }
            let mut msgs = vec![json!({"role": "system", "content": "s \u{1e}".repeat(400)})];
            for (i, (role, text)) in turns.iter().enumerate() {
                msgs.push(json!({"role": role, "content": text}));
                let mut b = body(&before, &msgs, &after);
                if pretty {
                    let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
                    let pretty = serde_json::to_vec_pretty(&v).unwrap();
                    // Pretty printing sorts the members; keep it only where it still
                    // walks (every layout is a valid body either way).
                    b = pretty;
                }
                let (s, model, span, stream, resumed) = walked(&b, &cache, keep);
                let (ws, wmodel, wspan, wstream) = whole(&b, keep);
                proptest::prop_assert_eq!((s, model, span, stream), (ws, wmodel, wspan, wstream));
                proptest::prop_assert_eq!(resumed, i > 0, "turn {}", i);
            }
        }
    }
}
