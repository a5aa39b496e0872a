//! The OpenAI Responses API (`POST /v1/responses`): the body's prompt, and the response id
//! an answer carries (for `previous_response_id` affinity).
//!
//! Prompt encoding: as chat (same tag, same separators), so a Responses conversation and
//! the same conversation sent to chat share their cached prefix: `instructions` first as a
//! `system` message, then `input` (a string is one `user` message; a list holds items: a
//! message is `role US text RS` with `input_text` / `output_text` / `text` parts as text and
//! other parts opaque; a `function_call` is `assistant US GS name GS arguments RS`, as a
//! chat tool call; a `function_call_output` is `tool US output RS`; any other item type is
//! `type US content RS`). Items are encoded in order, so a conversation that extends
//! another is a byte-extension of it.
//!
//! [`ResponseIdSniffer`] finds the response id in an answer as it streams past: the JSON
//! body's top-level `id`, or in an SSE stream the first event's `response.id`. It scans
//! bytes incrementally and holds at most [`MAX_ID_BYTES`] of them.
//! Must not: touch sockets or routing state.

use super::{
    collect_rest, encode_content, push_text, Content, JsonShape, ShapeVisitor, Sink, Text, GS, RS,
    US,
};
use serde::Deserialize;
use serde_json::value::RawValue;
use std::borrow::Cow;

/// Longest response id remembered (vLLM's are `resp_` + 32 hex digits).
pub const MAX_ID_BYTES: usize = 512;
/// Most answer bytes scanned for an id before giving up (vLLM sends it first).
const MAX_SCANNED_BYTES: usize = 8 << 20;

/// The fields of a Responses request that routing reads.
#[derive(Deserialize)]
pub(super) struct ResponsesBody<'a> {
    #[serde(borrow)]
    pub model: &'a RawValue,
    #[serde(borrow, default)]
    pub instructions: Option<Text<'a>>,
    #[serde(borrow, default)]
    pub input: Option<Input<'a>>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(borrow, default)]
    pub previous_response_id: Option<Text<'a>>,
}

/// `input`: a string, or a list of items.
pub(super) enum Input<'a> {
    Text(Cow<'a, str>),
    Items(Vec<Item<'a>>),
}

impl<'a> JsonShape<'a> for Input<'a> {
    const EXPECTING: &'static str = "'input' as a string or an array of input items";
    fn text(t: Cow<'a, str>) -> Self {
        Input::Text(t)
    }
    fn seq<'de: 'a, A: serde::de::SeqAccess<'de>>(seq: A) -> Result<Self, A::Error> {
        collect_rest(seq, None).map(Input::Items)
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Input<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ShapeVisitor(std::marker::PhantomData))
    }
}

/// One input item (message, function call, function call output, ...); fields not read
/// here (ids, status, ...) are skipped.
#[derive(Deserialize)]
pub(super) struct Item<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<Text<'a>>,
    #[serde(borrow, default)]
    role: Option<Text<'a>>,
    #[serde(borrow, default)]
    content: Option<Content<'a>>,
    #[serde(borrow, default)]
    name: Option<Text<'a>>,
    #[serde(borrow, default)]
    arguments: Option<Text<'a>>,
    #[serde(borrow, default)]
    output: Option<Content<'a>>,
}

/// A Responses request's conversation, borrowed from its body.
pub(super) struct Conversation<'a> {
    instructions: Option<Text<'a>>,
    input: Option<Input<'a>>,
}

fn is_text(kind: &str) -> bool {
    matches!(kind, "input_text" | "output_text" | "text")
}

impl<'a> Conversation<'a> {
    pub(super) fn new(instructions: Option<Text<'a>>, input: Option<Input<'a>>) -> Self {
        Conversation {
            instructions,
            input,
        }
    }

    /// Append the prompt bytes (module docs), without the leading tag.
    pub(super) fn encode(&self, out: &mut impl Sink) {
        if let Some(Text(i)) = &self.instructions {
            out.extend_from_slice(b"system");
            out.push(US);
            push_text(out, i);
            out.push(RS);
        }
        let items = match &self.input {
            None => return,
            Some(Input::Text(t)) => {
                out.extend_from_slice(b"user");
                out.push(US);
                push_text(out, t);
                out.push(RS);
                return;
            }
            Some(Input::Items(items)) => items,
        };
        let text = |t: &Option<Text<'a>>| t.as_ref().map_or(Cow::Borrowed(""), |t| t.0.clone());
        for item in items {
            match item.kind.as_ref().map(|k| k.0.as_ref()) {
                None | Some("message") => {
                    let role = item
                        .role
                        .as_ref()
                        .map_or(Cow::Borrowed("user"), |r| r.0.clone());
                    push_text(out, &role);
                    out.push(US);
                    encode_content(out, item.content.as_ref(), is_text);
                }
                Some("function_call") => {
                    out.extend_from_slice(b"assistant");
                    out.push(US);
                    out.push(GS);
                    push_text(out, &text(&item.name));
                    out.push(GS);
                    push_text(out, &text(&item.arguments));
                }
                Some("function_call_output") => {
                    out.extend_from_slice(b"tool");
                    out.push(US);
                    encode_content(out, item.output.as_ref(), is_text);
                }
                Some(_) => {
                    push_text(out, &text(&item.kind));
                    out.push(US);
                    encode_content(out, item.content.as_ref(), is_text);
                }
            }
            out.push(RS);
        }
    }
}

/// Finds the response id in an answer's body as its chunks pass ([`feed`](Self::feed)).
pub struct ResponseIdSniffer {
    mode: Mode,
    scanned: usize,
    done: bool,
}

enum Mode {
    /// A JSON body: its top-level `id`.
    Json(JsonScan),
    /// An SSE stream: `response.id` in a `data:` line's JSON.
    Sse {
        /// The current line's first bytes, until it is known whether it is `data:`.
        head: Vec<u8>,
        /// The current `data:` line's scan.
        scan: Option<JsonScan>,
        /// The current line is not one to scan: skip to its end.
        skip: bool,
    },
}

impl ResponseIdSniffer {
    /// A sniffer for an SSE stream (`stream`) or a JSON body.
    pub fn new(stream: bool) -> Self {
        let mode = if stream {
            Mode::Sse {
                head: Vec::new(),
                scan: None,
                skip: false,
            }
        } else {
            Mode::Json(JsonScan::new(&["id"]))
        };
        ResponseIdSniffer {
            mode,
            scanned: 0,
            done: false,
        }
    }

    /// Scan the next chunk of the body; the id the first time it is complete.
    pub fn feed(&mut self, chunk: &[u8]) -> Option<String> {
        if self.done {
            return None;
        }
        self.scanned += chunk.len();
        if self.scanned > MAX_SCANNED_BYTES {
            self.done = true;
            return None;
        }
        let found = match &mut self.mode {
            Mode::Json(scan) => {
                let found = scan.feed(chunk);
                self.done |= scan.failed;
                found
            }
            Mode::Sse { head, scan, skip } => sse_feed(head, scan, skip, chunk),
        };
        self.done |= found.is_some();
        found
    }
}

fn sse_feed(
    head: &mut Vec<u8>,
    scan: &mut Option<JsonScan>,
    skip: &mut bool,
    mut chunk: &[u8],
) -> Option<String> {
    const DATA: &[u8] = b"data:";
    while !chunk.is_empty() {
        let line_end = memchr::memchr(b'\n', chunk);
        let (part, rest) = match line_end {
            Some(i) => (&chunk[..i], &chunk[i + 1..]),
            None => (chunk, &chunk[..0]),
        };
        chunk = rest;
        let mut part = part;
        if !*skip && scan.is_none() {
            let want = DATA.len() - head.len();
            let take = want.min(part.len());
            head.extend_from_slice(&part[..take]);
            part = &part[take..];
            if head.len() == DATA.len() {
                if head == DATA {
                    *scan = Some(JsonScan::new(&["response", "id"]));
                } else {
                    *skip = true;
                }
            } else if line_end.is_some() && !DATA.starts_with(head) {
                *skip = true;
            }
        }
        if let Some(s) = scan.as_mut() {
            if let Some(id) = s.feed(part) {
                return Some(id);
            }
        }
        if line_end.is_some() {
            head.clear();
            *scan = None;
            *skip = false;
        }
    }
    None
}

/// What the string being read is, at the level of the path being followed.
#[derive(Clone, Copy, PartialEq)]
enum Str {
    Key,
    Value,
    Other,
}

/// An incremental scan of one JSON text for the string at a path of object keys (e.g.
/// `response.id`), without building the document: it tracks nesting depth and how much
/// of the path the current object is on, and captures only the strings it must compare.
struct JsonScan {
    path: &'static [&'static str],
    depth: usize,
    /// Path keys matched by the enclosing objects (the object at depth `matched + 1` is
    /// the one whose keys are compared).
    matched: usize,
    in_string: bool,
    escaped: bool,
    /// The next string at the path level is a key.
    expect_key: bool,
    /// The last key at the path level was the next path step: its value follows.
    pending: bool,
    kind: Str,
    buf: Vec<u8>,
    too_long: bool,
    failed: bool,
}

impl JsonScan {
    fn new(path: &'static [&'static str]) -> Self {
        JsonScan {
            path,
            depth: 0,
            matched: 0,
            in_string: false,
            escaped: false,
            expect_key: false,
            pending: false,
            kind: Str::Other,
            buf: Vec::new(),
            too_long: false,
            failed: false,
        }
    }

    fn feed(&mut self, bytes: &[u8]) -> Option<String> {
        for &b in bytes {
            if self.failed {
                return None;
            }
            if let Some(found) = self.step(b) {
                self.failed = true;
                return Some(found);
            }
        }
        None
    }

    fn capture(&mut self, b: u8) {
        if self.kind == Str::Other {
            return;
        }
        if self.buf.len() >= MAX_ID_BYTES {
            self.too_long = true;
        } else {
            self.buf.push(b);
        }
    }

    fn step(&mut self, b: u8) -> Option<String> {
        if self.in_string {
            if self.escaped {
                self.escaped = false;
                self.capture(b);
            } else if b == b'\\' {
                self.escaped = true;
                self.capture(b);
            } else if b == b'"' {
                self.in_string = false;
                return self.string_end();
            } else {
                self.capture(b);
            }
            return None;
        }
        let at_level = self.depth == self.matched + 1;
        match b {
            b'"' => {
                self.in_string = true;
                self.buf.clear();
                self.too_long = false;
                self.kind = if !at_level {
                    Str::Other
                } else if self.expect_key {
                    Str::Key
                } else if self.pending && self.matched + 1 == self.path.len() {
                    Str::Value
                } else {
                    self.pending = false;
                    Str::Other
                };
            }
            b'{' | b'[' => {
                if self.depth == 0 {
                    self.failed = b == b'[';
                    self.expect_key = true;
                } else if at_level {
                    if b == b'{' && self.pending && self.matched + 1 < self.path.len() {
                        self.matched += 1;
                        self.expect_key = true;
                    }
                    self.pending = false;
                }
                self.depth += 1;
            }
            b'}' | b']' => {
                if self.depth <= 1 {
                    // The text ended (or was never an object) without the path.
                    self.failed = true;
                    return None;
                }
                self.depth -= 1;
                if self.depth == self.matched && self.matched > 0 {
                    // Left the object the path led into: the path is not below here.
                    self.failed = true;
                }
            }
            b',' if at_level => {
                self.expect_key = true;
                self.pending = false;
            }
            b':' | b' ' | b'\t' | b'\r' | b'\n' | b',' => {}
            _ if at_level => self.pending = false,
            _ => {}
        }
        None
    }

    fn string_end(&mut self) -> Option<String> {
        match self.kind {
            Str::Other => None,
            Str::Key => {
                self.expect_key = false;
                self.pending = !self.too_long && self.buf == self.path[self.matched].as_bytes();
                None
            }
            Str::Value => {
                self.pending = false;
                if self.too_long {
                    self.failed = true;
                    return None;
                }
                let mut quoted = Vec::with_capacity(self.buf.len() + 2);
                quoted.push(b'"');
                quoted.extend_from_slice(&self.buf);
                quoted.push(b'"');
                let id: Option<String> = serde_json::from_slice(&quoted).ok();
                self.failed = id.is_none();
                id.filter(|id| !id.is_empty())
            }
        }
    }
}

#[cfg(test)]
mod tests;
