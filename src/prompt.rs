//! Request JSON → what routing needs: the alias asked for, where the `model` value sits
//! in the body (so it can be rewritten without re-serialising), and the *prompt bytes*.
//!
//! Owns: the one JSON parse of a request body and the prompt byte encoding. Must not:
//! touch sockets, routing state or config.
//!
//! Prompt encoding (stable; tries store it): for chat, every message in order as
//! `role US text RS`, where `text` is the message's text (string content, or the text
//! parts of an array joined by GS; a non-text part contributes its type and a hash of
//! its payload, so two different images never look alike). Any of the separator bytes
//! (and ESC) inside a role or text is escaped with ESC, so the encoding is unambiguous
//! and a conversation that extends another one encodes to a byte-extension of it. For
//! completions, a string prompt is its escaped text; a token array is each id as four
//! big-endian bytes (prefix-preserving); a batch is its members each followed by RS.
//! Chat and completion prompts start with different tag bytes so they never collide.
//!
//! The other API shapes live beside this file, pure as it is: [`endpoint`] (which path is
//! which endpoint), [`responses`] (Responses API prompt, encoded as chat, and the response
//! id scanner), [`messages`] (Anthropic Messages, encoded as chat) and [`form`] (the
//! `model` field of a multipart/form-data body), and `summary` (what routing reads of a
//! long prompt, taken as it is encoded instead of keeping its bytes). Pass-through
//! endpoints only find the model ([`RequestBody::has_prompt`] is false).

use serde::Deserialize;
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::hash::{Hash, Hasher};
use thiserror::Error;

/// Header carrying the request's token ids for `precise_cache_aware`.
pub const TOKEN_IDS_HEADER: &str = "x-rolter-vllm-token-ids";
/// Most token ids accepted from the header; more is treated as malformed (fall back).
/// 1 M ids is far above any served context length.
pub const MAX_TOKEN_IDS: usize = 1 << 20;

const ESC: u8 = 0x1B;
const GS: u8 = 0x1D;
const RS: u8 = 0x1E;
const US: u8 = 0x1F;
const TAG_CHAT: u8 = b'C';
const TAG_COMPLETION: u8 = b'P';

pub mod form;
pub mod messages;
pub mod responses;
pub mod resume;
mod summary;

pub use summary::PromptSummary;

pub use endpoint::Endpoint;
mod endpoint;

/// A parsed request body: everything later stages need, with the body untouched.
#[derive(Debug)]
pub struct ParsedRequest {
    /// The `model` the client asked for.
    pub model: String,
    /// Byte range of the `model` value (including quotes) in the body.
    pub model_span: std::ops::Range<usize>,
    /// The prompt bytes (see module docs).
    pub prompt: Vec<u8>,
    /// Whether the client asked for a streamed (SSE) response.
    pub stream: bool,
}

/// Why a body could not be turned into a request.
#[derive(Debug, Error)]
pub enum PromptError {
    #[error("invalid JSON body: {0}")]
    Json(#[from] serde_json::Error),
    #[error("'model' must be a string")]
    ModelNotString,
    #[error("{0}")]
    Form(#[from] form::FormError),
}

#[derive(Deserialize)]
struct ChatBody<'a> {
    #[serde(borrow)]
    model: &'a RawValue,
    #[serde(borrow)]
    messages: Vec<Message<'a>>,
    #[serde(default)]
    stream: Option<bool>,
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow)]
    role: Cow<'a, str>,
    #[serde(borrow, default)]
    content: Option<Content<'a>>,
    #[serde(borrow, default)]
    tool_calls: Option<Vec<ToolCall<'a>>>,
}

enum Content<'a> {
    Text(Cow<'a, str>),
    Parts(Vec<Part<'a>>),
}

/// One content part. Deserialised by hand: `#[serde(flatten)]` into a map of
/// `serde_json::Value`s buffered the whole payload twice (serde's `Content` tree, then the
/// `Value` tree, ~30x the payload's size in memory) and serialised it again to hash it.
struct Part<'a> {
    kind: Cow<'a, str>,
    text: Option<Cow<'a, str>>,
    /// Canonical hash of the other members (the payload of `image_url`, `input_audio`,
    /// ...), computed while parsing ([`CanonicalHash`]).
    payload: u64,
}

impl<'de: 'a, 'a> Deserialize<'de> for Part<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct PartVisitor<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for PartVisitor<'a> {
            type Value = Part<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a content part object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Part<'a>, A::Error> {
                use serde::de::Error;
                let (mut kind, mut text, mut payload) = (None, None, 0u64);
                while let Some(Text(key)) = map.next_key::<Text>()? {
                    match key.as_ref() {
                        "type" if kind.is_some() => return Err(A::Error::duplicate_field("type")),
                        "type" => kind = Some(map.next_value::<Text>()?.0),
                        "text" if text.is_some() => return Err(A::Error::duplicate_field("text")),
                        "text" => text = Some(map.next_value::<Option<Text>>()?.map(|t| t.0)),
                        _ => {
                            let value = map.next_value_seed(CanonicalHash)?;
                            payload = payload.wrapping_add(member_hash(&key, value));
                        }
                    }
                }
                Ok(Part {
                    kind: kind.ok_or_else(|| A::Error::missing_field("type"))?,
                    text: text.flatten(),
                    payload,
                })
            }
        }
        d.deserialize_map(PartVisitor(std::marker::PhantomData))
    }
}

/// Hashes one JSON value as it is parsed, in one pass and without buffering it: object
/// members are combined by a wrapping sum of `hash(key, value)`, so the result does not
/// depend on the client's key order (nor on whitespace); array elements in order.
struct CanonicalHash;

fn member_hash(key: &str, value: u64) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    key.hash(&mut h);
    value.hash(&mut h);
    h.finish()
}

impl<'de> serde::de::DeserializeSeed<'de> for CanonicalHash {
    type Value = u64;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<u64, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for CanonicalHash {
    type Value = u64;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_unit<E>(self) -> Result<u64, E> {
        Ok(tagged(b'n', |_| {}))
    }
    fn visit_bool<E>(self, v: bool) -> Result<u64, E> {
        Ok(tagged(b'b', |h| v.hash(h)))
    }
    fn visit_i64<E>(self, v: i64) -> Result<u64, E> {
        Ok(tagged(b'i', |h| v.hash(h)))
    }
    fn visit_u64<E>(self, v: u64) -> Result<u64, E> {
        Ok(tagged(b'u', |h| v.hash(h)))
    }
    fn visit_f64<E>(self, v: f64) -> Result<u64, E> {
        Ok(tagged(b'f', |h| v.to_bits().hash(h)))
    }
    fn visit_str<E>(self, v: &str) -> Result<u64, E> {
        Ok(tagged(b's', |h| v.hash(h)))
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<u64, A::Error> {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        h.write_u8(b'[');
        while let Some(v) = seq.next_element_seed(CanonicalHash)? {
            h.write_u64(v);
        }
        Ok(h.finish())
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<u64, A::Error> {
        let mut sum = 0u64;
        while let Some(Text(key)) = map.next_key::<Text>()? {
            let value = map.next_value_seed(CanonicalHash)?;
            sum = sum.wrapping_add(member_hash(&key, value));
        }
        Ok(tagged(b'{', |h| sum.hash(h)))
    }
}

fn tagged(tag: u8, f: impl FnOnce(&mut std::collections::hash_map::DefaultHasher)) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    h.write_u8(tag);
    f(&mut h);
    h.finish()
}

#[derive(Deserialize)]
struct ToolCall<'a> {
    #[serde(borrow, default)]
    function: Option<ToolFunction<'a>>,
}

#[derive(Deserialize)]
struct ToolFunction<'a> {
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    arguments: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct CompletionBody<'a> {
    #[serde(borrow)]
    model: &'a RawValue,
    #[serde(borrow)]
    prompt: PromptField<'a>,
    #[serde(default)]
    stream: Option<bool>,
}

enum PromptField<'a> {
    Text(Cow<'a, str>),
    Tokens(Vec<u32>),
    TextBatch(Vec<Cow<'a, str>>),
    TokenBatch(Vec<Vec<u32>>),
}

/// A member of a completion `prompt` array; the first one decides the array's kind.
enum Member<'a> {
    Id(u32),
    Text(Cow<'a, str>),
    Ids(Vec<u32>),
}

/// One JSON string, borrowed from the body when it has no escape sequence.
struct Text<'a>(Cow<'a, str>);

/// The request values that are "a string or ..." (`content`, `prompt` and its members),
/// deserialised by hand rather than with `#[serde(untagged)]`: an untagged enum first
/// buffers the value into serde's private `Content` tree (copying every string) and then
/// tries each variant; this looks at the JSON type once and borrows the text from the body
/// (message text was the largest item under callgrind, loadtest/profile.sh).
trait JsonShape<'a>: Sized {
    /// What the value may be, for error messages.
    const EXPECTING: &'static str;
    /// From a string.
    fn text(t: Cow<'a, str>) -> Self;
    /// From an unsigned integer (default: not accepted).
    fn id<E: serde::de::Error>(v: u64) -> Result<Self, E> {
        Err(E::invalid_type(
            serde::de::Unexpected::Unsigned(v),
            &Self::EXPECTING,
        ))
    }
    /// From an array (default: not accepted).
    fn seq<'de: 'a, A: serde::de::SeqAccess<'de>>(_seq: A) -> Result<Self, A::Error> {
        Err(serde::de::Error::invalid_type(
            serde::de::Unexpected::Seq,
            &Self::EXPECTING,
        ))
    }
}

struct ShapeVisitor<'a, T>(std::marker::PhantomData<(&'a (), T)>);

impl<'de: 'a, 'a, T: JsonShape<'a>> serde::de::Visitor<'de> for ShapeVisitor<'a, T> {
    type Value = T;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(T::EXPECTING)
    }
    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<T, E> {
        Ok(T::text(Cow::Borrowed(v)))
    }
    fn visit_str<E>(self, v: &str) -> Result<T, E> {
        Ok(T::text(Cow::Owned(v.to_owned())))
    }
    fn visit_string<E>(self, v: String) -> Result<T, E> {
        Ok(T::text(Cow::Owned(v)))
    }
    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<T, E> {
        T::id(v)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, seq: A) -> Result<T, A::Error> {
        T::seq(seq)
    }
}

/// `Deserialize` for `JsonShape` types.
macro_rules! deserialize_shape {
    ($($ty:ident),*) => {$(
        impl<'de: 'a, 'a> Deserialize<'de> for $ty<'a> {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                d.deserialize_any(ShapeVisitor(std::marker::PhantomData))
            }
        }
    )*};
}
deserialize_shape!(Content, PromptField, Member, Text);

/// All elements of an array, given its first.
fn collect_rest<'de, A: serde::de::SeqAccess<'de>, T: Deserialize<'de>>(
    mut seq: A,
    first: Option<T>,
) -> Result<Vec<T>, A::Error> {
    let mut all = Vec::with_capacity(seq.size_hint().unwrap_or(1).min(1 << 16) + 1);
    all.extend(first);
    while let Some(x) = seq.next_element()? {
        all.push(x);
    }
    Ok(all)
}

impl<'a> JsonShape<'a> for Text<'a> {
    const EXPECTING: &'static str = "a string";
    fn text(t: Cow<'a, str>) -> Self {
        Text(t)
    }
}

impl<'a> JsonShape<'a> for Content<'a> {
    const EXPECTING: &'static str = "'content' as a string or an array of content parts";
    fn text(t: Cow<'a, str>) -> Self {
        Content::Text(t)
    }
    fn seq<'de: 'a, A: serde::de::SeqAccess<'de>>(seq: A) -> Result<Self, A::Error> {
        collect_rest(seq, None).map(Content::Parts)
    }
}

impl<'a> JsonShape<'a> for Member<'a> {
    const EXPECTING: &'static str = "a token id, a string or an array of token ids";
    fn text(t: Cow<'a, str>) -> Self {
        Member::Text(t)
    }
    fn id<E: serde::de::Error>(v: u64) -> Result<Self, E> {
        u32::try_from(v)
            .map(Member::Id)
            .map_err(|_| E::custom(format!("token id {v} out of range")))
    }
    fn seq<'de: 'a, A: serde::de::SeqAccess<'de>>(seq: A) -> Result<Self, A::Error> {
        collect_rest(seq, None).map(Member::Ids)
    }
}

/// A string, or an array whose first member fixes its kind (ids, strings or id arrays);
/// `[]` is an empty id list.
impl<'a> JsonShape<'a> for PromptField<'a> {
    const EXPECTING: &'static str = "'prompt' as a string, an array of strings, or token ids";
    fn text(t: Cow<'a, str>) -> Self {
        PromptField::Text(t)
    }
    fn seq<'de: 'a, A: serde::de::SeqAccess<'de>>(mut seq: A) -> Result<Self, A::Error> {
        Ok(match seq.next_element::<Member>()? {
            None => PromptField::Tokens(Vec::new()),
            Some(Member::Id(id)) => PromptField::Tokens(collect_rest(seq, Some(id))?),
            Some(Member::Text(t)) => PromptField::TextBatch(
                collect_rest(seq, Some(Text(t)))?
                    .into_iter()
                    .map(|t| t.0)
                    .collect(),
            ),
            Some(Member::Ids(ids)) => PromptField::TokenBatch(collect_rest(seq, Some(ids))?),
        })
    }
}

/// A request body parsed once: the fields every request needs, and its messages or prompt
/// borrowed from the body, encoded into prompt bytes only when a route's strategy reads
/// them ([`RequestBody::prompt`]): round_robin, least_load, precise_cache_aware and
/// lmcache_aware never do, and at 32 KiB the encoding is a 32 KiB copy.
pub struct RequestBody<'a> {
    /// The `model` the client asked for.
    pub model: String,
    /// Byte range of the `model` value (including quotes) in the body.
    pub model_span: std::ops::Range<usize>,
    /// Whether the client asked for a streamed (SSE) response.
    pub stream: bool,
    /// Whether `model_span` holds a JSON string literal (else a form field's raw value).
    pub model_is_json: bool,
    /// The Responses API's `previous_response_id`, if the body has one.
    pub previous_response_id: Option<String>,
    content: BodyContent<'a>,
    body: &'a [u8],
}

enum BodyContent<'a> {
    Chat(Vec<Message<'a>>),
    Completion(PromptField<'a>),
    Responses(responses::Conversation<'a>),
    Messages(messages::Conversation<'a>),
    /// A long chat body walked member by member, maybe resumed where the conversation's
    /// previous body ended ([`resume`]): only [`RequestBody::summary_with`] reads it
    /// as it is; every other reader parses the body whole again, which a resumed body
    /// (holding only its part from the resumed offset on) cannot give: the gateway asks a
    /// walked body for nothing but its summary.
    Walked(Option<Box<resume::Walked<'a>>>),
    /// A pass-through endpoint: only the model is read.
    None,
}

/// A pass-through JSON body: only `model` (and `stream`) are read; the rest is checked to
/// be JSON and skipped.
#[derive(Deserialize)]
struct ModelOnly<'a> {
    #[serde(borrow)]
    model: &'a RawValue,
    #[serde(default)]
    stream: Option<bool>,
}

impl<'a> RequestBody<'a> {
    /// Parse a JSON `body` (one JSON parse; strings without escapes stay borrowed from it).
    /// A multipart endpoint needs its `Content-Type`: [`RequestBody::parse_with`].
    pub fn parse(endpoint: Endpoint, body: &'a [u8]) -> Result<Self, PromptError> {
        Self::parse_with(endpoint, body, None)
    }

    /// Parse `body` for `endpoint`; `content_type` is the request's `Content-Type` (read
    /// only by the multipart/form-data endpoints, for the boundary).
    pub fn parse_with(
        endpoint: Endpoint,
        body: &'a [u8],
        content_type: Option<&[u8]>,
    ) -> Result<Self, PromptError> {
        if endpoint.is_form() {
            let ct = content_type.ok_or(form::FormError::NotMultipart)?;
            let field = form::model_field(body, ct)?;
            let model = std::str::from_utf8(&body[field.clone()])
                .map_err(|_| PromptError::ModelNotString)?
                .to_owned();
            return Ok(RequestBody {
                model,
                model_span: field,
                stream: false,
                model_is_json: false,
                previous_response_id: None,
                content: BodyContent::None,
                body,
            });
        }
        let mut previous_response_id = None;
        let (raw_model, stream, content) = match endpoint {
            Endpoint::Chat => {
                let req: ChatBody = serde_json::from_slice(body)?;
                (req.model, req.stream, BodyContent::Chat(req.messages))
            }
            Endpoint::Completions => {
                let req: CompletionBody = serde_json::from_slice(body)?;
                (req.model, req.stream, BodyContent::Completion(req.prompt))
            }
            Endpoint::Responses => {
                let req: responses::ResponsesBody = serde_json::from_slice(body)?;
                previous_response_id = req.previous_response_id.map(|t| t.0.into_owned());
                let conversation = responses::Conversation::new(req.instructions, req.input);
                (req.model, req.stream, BodyContent::Responses(conversation))
            }
            Endpoint::Messages => {
                let req: messages::MessagesBody = serde_json::from_slice(body)?;
                let conversation = messages::Conversation::new(req.system, req.messages);
                (req.model, req.stream, BodyContent::Messages(conversation))
            }
            _ => {
                let req: ModelOnly = serde_json::from_slice(body)?;
                (req.model, req.stream, BodyContent::None)
            }
        };
        let model: String =
            serde_json::from_str(raw_model.get()).map_err(|_| PromptError::ModelNotString)?;
        let start = raw_model.get().as_ptr() as usize - body.as_ptr() as usize;
        Ok(RequestBody {
            model,
            model_span: start..start + raw_model.get().len(),
            stream: stream.unwrap_or(false),
            model_is_json: true,
            previous_response_id,
            content,
            body,
        })
    }

    /// [`RequestBody::parse_with`], but a chat body of at least `walk_from` bytes is walked
    /// member by member, resuming where a previous body in `cache` ended when it starts
    /// with that body's bytes, for [`RequestBody::summary_with`]: the gateway's sequence
    /// (`proxy::Gateway::handle`, whose body is in pieces and made contiguous only from the
    /// resumed offset) for a body in one slice, for tests.
    #[cfg(test)]
    pub fn parse_resuming(
        endpoint: Endpoint,
        body: &'a [u8],
        content_type: Option<&[u8]>,
        cache: &resume::ResumeCache,
        walk_from: usize,
    ) -> Result<Self, PromptError> {
        if endpoint == Endpoint::Chat && body.len() >= walk_from {
            if let Some(taken) = cache.take(crate::pieces::Pieces::one(body)) {
                let at = taken.at();
                if let Some(resumed) = Self::parse_resumed(&body[at..], taken) {
                    return Ok(resumed);
                }
                return Self::parse_with(endpoint, body, content_type);
            }
        }
        Self::parse_walking(endpoint, body, content_type, walk_from)
    }

    /// A chat body walked from where `taken` (from [`resume::ResumeCache::take`]) was
    /// saved: `rest` is the body from `taken.at()` on. `None` when the walk meets anything
    /// it does not expect: the caller then parses the whole body, which decides.
    pub fn parse_resumed(rest: &'a [u8], taken: resume::Taken) -> Option<Self> {
        resume::walk_resumed(rest, taken).map(|w| Self::walked(w, rest))
    }

    /// [`RequestBody::parse_with`], but a chat body of at least `walk_from` bytes is walked
    /// member by member from its start, for [`RequestBody::summary_with`] (which saves its
    /// state for the conversation's next body).
    pub fn parse_walking(
        endpoint: Endpoint,
        body: &'a [u8],
        content_type: Option<&[u8]>,
        walk_from: usize,
    ) -> Result<Self, PromptError> {
        if endpoint != Endpoint::Chat || body.len() < walk_from {
            return Self::parse_with(endpoint, body, content_type);
        }
        match resume::walk_whole(body) {
            Some(w) => Ok(Self::walked(w, body)),
            None => Self::parse_with(endpoint, body, content_type),
        }
    }

    /// A walked body; `read` is what the walk read (the whole body, or its part from the
    /// resumed offset on).
    fn walked(w: resume::Walked<'a>, read: &'a [u8]) -> Self {
        RequestBody {
            model: w.model.clone(),
            model_span: w.model_span.clone(),
            stream: w.stream,
            model_is_json: true,
            previous_response_id: None,
            content: BodyContent::Walked(Some(Box::new(w))),
            body: read,
        }
    }

    /// [`RequestBody::summary`], for a walked body from where its conversation's previous
    /// body ended, keeping the state at the end of its messages in `cache` for the next.
    /// `None` only for a body resumed from a state saved with other options (or by a
    /// route that reads no summary): the caller then parses the whole body.
    pub fn summary_with(
        &mut self,
        keep: usize,
        with_key: bool,
        cache: &resume::ResumeCache,
    ) -> Option<PromptSummary> {
        if let BodyContent::Walked(walked) = &mut self.content {
            if let Some(w) = walked.take() {
                let resumed = w.is_resumed();
                match w.summary(self.body, keep, with_key, cache) {
                    Some(s) => return Some(s),
                    None if resumed => return None,
                    None => {}
                }
            }
        }
        Some(self.summary(keep, with_key))
    }

    /// For a walked body whose route reads no summary: keep where its messages end in
    /// `cache`, so the conversation's next body resumes its walk there.
    pub fn remember_walk(&mut self, cache: &resume::ResumeCache) {
        if let BodyContent::Walked(walked) = &mut self.content {
            if let Some(w) = walked.take() {
                w.remember(self.body, cache);
            }
        }
    }

    /// Whether this body's parse resumed where its conversation's previous body ended.
    pub fn resumed(&self) -> bool {
        matches!(&self.content, BodyContent::Walked(Some(w)) if w.is_resumed())
    }

    /// The body parsed whole (for a walked body's readers other than `summary_with`; not
    /// for a resumed one, which holds only the body's part from its resumed offset on).
    fn whole(&self) -> Option<RequestBody<'a>> {
        debug_assert!(!self.resumed(), "a resumed body's readers use summary_with");
        let whole = RequestBody::parse(Endpoint::Chat, self.body);
        debug_assert!(whole.is_ok(), "a walked body parses whole");
        whole.ok()
    }

    /// Whether the endpoint's body carries a prompt ([`RequestBody::prompt`] is empty
    /// for pass-through endpoints).
    pub fn has_prompt(&self) -> bool {
        !matches!(self.content, BodyContent::None)
    }

    /// The prompt bytes (see module docs).
    pub fn prompt(&self) -> Vec<u8> {
        let mut prompt = Vec::with_capacity(self.body.len());
        self.encode(&mut prompt);
        prompt
    }

    /// What routing needs of the prompt bytes, without keeping them: their length, their
    /// key (when `with_key`) and at most `keep` bytes of each of the first two messages.
    pub fn summary(&self, keep: usize, with_key: bool) -> PromptSummary {
        let mut s = summary::Summarizer::new(keep, with_key, self.body.len());
        self.encode(&mut s);
        s.finish()
    }

    fn encode(&self, out: &mut impl Sink) {
        match &self.content {
            BodyContent::Walked(_) => {
                if let Some(whole) = self.whole() {
                    whole.encode(out);
                }
            }
            BodyContent::Chat(messages) => {
                out.push(TAG_CHAT);
                for m in messages {
                    encode_message(out, m);
                }
            }
            BodyContent::Completion(p) => {
                out.push(TAG_COMPLETION);
                encode_completion(out, p);
            }
            BodyContent::Responses(c) => {
                out.push(TAG_CHAT);
                c.encode(out);
            }
            BodyContent::Messages(c) => {
                out.push(TAG_CHAT);
                c.encode(out);
            }
            BodyContent::None => {}
        }
    }
}

/// Where the encoders write prompt bytes: a `Vec` keeps them, a [`summary::Summarizer`]
/// keeps only what routing needs of them.
trait Sink {
    fn push(&mut self, b: u8);
    fn extend_from_slice(&mut self, bytes: &[u8]);
}

impl Sink for Vec<u8> {
    fn push(&mut self, b: u8) {
        Vec::push(self, b);
    }

    fn extend_from_slice(&mut self, bytes: &[u8]) {
        Vec::extend_from_slice(self, bytes);
    }
}

/// Parse a request body and encode its prompt: [`RequestBody::parse`] then
/// [`RequestBody::prompt`].
pub fn parse_request(endpoint: Endpoint, body: &[u8]) -> Result<ParsedRequest, PromptError> {
    let parsed = RequestBody::parse(endpoint, body)?;
    let prompt = parsed.prompt();
    Ok(ParsedRequest {
        model: parsed.model,
        model_span: parsed.model_span,
        prompt,
        stream: parsed.stream,
    })
}

/// The body with its `model` value replaced by `upstream_model`; every other byte kept.
pub fn rewrite_model(body: &[u8], span: std::ops::Range<usize>, upstream_model: &str) -> Vec<u8> {
    let quoted = quote_model(upstream_model);
    let mut out = Vec::with_capacity(body.len() - span.len() + quoted.len());
    rewrite_model_into(&mut out, body, span, quoted.as_bytes());
    out
}

/// `upstream_model` as the JSON string literal that replaces a body's `model` value
/// (computed once per target when the routing file loads).
pub fn quote_model(upstream_model: &str) -> String {
    serde_json::to_string(upstream_model).expect("a string always serialises")
}

/// Append `body` with its `model` value replaced by `quoted_model` (from [`quote_model`]) to
/// `out` (the copying form of `proxy::framing::BodyBuf::gather`).
pub fn rewrite_model_into(
    out: &mut Vec<u8>,
    body: &[u8],
    span: std::ops::Range<usize>,
    quoted_model: &[u8],
) {
    out.extend_from_slice(&body[..span.start]);
    out.extend_from_slice(quoted_model);
    out.extend_from_slice(&body[span.end..]);
}

/// Where the first two messages of encoded prompt bytes end (the index just past each
/// unescaped RS), for placement keys; `None` where the prompt has fewer messages (a
/// completion prompt has none: its token ids are raw bytes, not escaped text). Scans only
/// as far as the second boundary.
pub fn first_two_message_ends(prompt: &[u8]) -> (Option<usize>, Option<usize>) {
    if prompt.first() != Some(&TAG_CHAT) {
        return (None, None);
    }
    let mut ends = [None, None];
    let mut found = 0;
    let mut i = 0;
    while found < 2 {
        let Some(k) = memchr::memchr2(ESC, RS, &prompt[i..]) else {
            break;
        };
        let at = i + k;
        if prompt[at] == ESC {
            i = at + 2;
            if i >= prompt.len() {
                break;
            }
            continue;
        }
        ends[found] = Some(at + 1);
        found += 1;
        i = at + 1;
    }
    (ends[0], ends[1])
}

/// Parse `x-rolter-vllm-token-ids` (comma-separated u32). `None` if absent-equivalent
/// (empty) or malformed: the caller falls back to load-based routing.
pub fn parse_token_ids(header: &[u8]) -> Option<Vec<u32>> {
    let text = std::str::from_utf8(header).ok()?.trim();
    if text.is_empty() {
        return None;
    }
    let mut ids = Vec::with_capacity(text.len() / 4 + 1);
    for part in text.split(',') {
        if ids.len() >= MAX_TOKEN_IDS {
            return None;
        }
        ids.push(part.trim().parse::<u32>().ok()?);
    }
    Some(ids)
}

fn encode_message(out: &mut impl Sink, m: &Message) {
    push_text(out, &m.role);
    out.push(US);
    encode_content(out, m.content.as_ref(), |kind| kind == "text");
    for call in m.tool_calls.iter().flatten() {
        if let Some(f) = &call.function {
            out.push(GS);
            escape_into(out, f.name.as_deref().unwrap_or("").as_bytes());
            out.push(GS);
            escape_into(out, f.arguments.as_deref().unwrap_or("").as_bytes());
        }
    }
    out.push(RS);
}

/// A message's content: its text, or its parts joined by GS, where a part whose type
/// `is_text` accepts contributes its text and any other part is opaque
/// ([`encode_opaque_part`]).
fn encode_content(out: &mut impl Sink, content: Option<&Content>, is_text: fn(&str) -> bool) {
    match content {
        None => {}
        Some(Content::Text(t)) => push_text(out, t),
        Some(Content::Parts(parts)) => {
            for (i, part) in parts.iter().enumerate() {
                if i > 0 {
                    out.push(GS);
                }
                match &part.text {
                    Some(t) if is_text(&part.kind) => escape_into(out, t.as_bytes()),
                    _ => encode_opaque_part(out, part),
                }
            }
        }
    }
}

/// A non-text part: its type, then a stable hash of its payload's canonical JSON.
fn encode_opaque_part(out: &mut impl Sink, part: &Part) {
    escape_into(out, part.kind.as_bytes());
    out.push(b':');
    let mut h = std::collections::hash_map::DefaultHasher::new();
    // The payload's hash is canonical whatever the client's key order ([`CanonicalHash`]).
    part.payload.hash(&mut h);
    if let Some(t) = &part.text {
        t.hash(&mut h);
    }
    out.extend_from_slice(format!("{:016x}", h.finish()).as_bytes());
}

fn encode_completion(out: &mut impl Sink, p: &PromptField) {
    fn tokens(out: &mut impl Sink, ids: &[u32]) {
        for id in ids {
            out.extend_from_slice(&id.to_be_bytes());
        }
    }
    match p {
        PromptField::Text(t) => push_text(out, t),
        PromptField::Tokens(ids) => tokens(out, ids),
        PromptField::TextBatch(texts) => {
            for t in texts {
                push_text(out, t);
                out.push(RS);
            }
        }
        PromptField::TokenBatch(batch) => {
            for ids in batch {
                tokens(out, ids);
                out.push(RS);
            }
        }
    }
}

/// Append a JSON string's text, escaped. A string borrowed from the body had no escape
/// sequence in it, and JSON forbids raw control characters in strings (serde_json rejects
/// them), so it cannot hold a separator byte: it is copied without scanning.
#[allow(clippy::ptr_arg)] // the variant is the point: borrowed means "had no escapes"
fn push_text(out: &mut impl Sink, text: &Cow<'_, str>) {
    match text {
        Cow::Borrowed(t) => {
            debug_assert!(!t.bytes().any(|b| (ESC..=US).contains(&b)));
            out.extend_from_slice(t.as_bytes());
        }
        Cow::Owned(t) => escape_into(out, t.as_bytes()),
    }
}

/// Append `text`, escaping separator bytes with ESC. Separators are rare in real text,
/// so find them with SIMD searches and copy the runs between them in bulk (this was the
/// largest part of prompt extraction under callgrind; see loadtest/profile.sh).
fn escape_into(out: &mut impl Sink, text: &[u8]) {
    let mut rest = text;
    loop {
        let next = match (memchr::memchr3(ESC, GS, RS, rest), memchr::memchr(US, rest)) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let Some(i) = next else { break };
        out.extend_from_slice(&rest[..i]);
        out.push(ESC);
        out.push(rest[i]);
        rest = &rest[i + 1..];
    }
    out.extend_from_slice(rest);
}

#[cfg(test)]
mod tests;
