//! The simulator's deterministic tokenizer, chat template and reply generator.
//!
//! Owns how request text becomes token ids, so that the simulator, the load driver and the
//! gateway's tests all compute the same `x-rolter-vllm-token-ids` for a request. It must not
//! depend on any replica state: the same request always yields the same tokens on every replica.
//!
//! Tokenizer: split the text on Unicode whitespace into words (whitespace itself is dropped);
//! a word longer than [`MAX_PIECE_BYTES`] bytes is cut into pieces of at most that many bytes;
//! each piece maps to `FNV-1a-32(piece) mod VOCAB_SIZE`. So `"a b"` and `"a  b"` tokenize alike,
//! and appending text after a whitespace boundary only appends tokens (prefix-stable), which is
//! what a growing chat history needs.
//!
//! Chat template ([`render_chat`]): each message becomes `<|role|>\n{text}\n<|end|>\n`, then the
//! generation prompt `<|assistant|>\n`. Role markers are single words, hence single tokens. Because
//! the reply text that the simulator generates ([`reply_words`]) is exactly what a client puts
//! back into the next turn's assistant message, the next turn's prompt tokens start with the
//! previous prompt tokens followed by the previous output tokens, like a real chat template.

use std::path::Path;
use std::sync::Arc;

use serde_json::Value;

/// The gateway's Hugging Face tokenizer module (`src/tokenize/hf/`), compiled into the
/// simulator so `--tokenizer DIR` tokenizes exactly as the gateway (and vLLM) does. A module
/// include rather than a dependency: the gateway package depends on this one.
#[path = "../../src/tokenize/hf/mod.rs"]
#[allow(dead_code)]
pub mod hf;

/// Which tokenizer the simulator and the load driver use for prompts and replies.
#[derive(Debug, Clone, Default)]
pub enum PromptTokenizer {
    /// The built-in deterministic word tokenizer and template (this module).
    #[default]
    Builtin,
    /// A Hugging Face tokenizer directory (`--tokenizer DIR`).
    Hf(Arc<hf::ModelTokenizer>),
}

impl PromptTokenizer {
    /// The built-in tokenizer, or `dir`'s.
    pub fn load(dir: Option<&Path>) -> Result<Self, String> {
        match dir {
            None => Ok(PromptTokenizer::Builtin),
            Some(d) => hf::ModelTokenizer::load(d)
                .map(|t| PromptTokenizer::Hf(Arc::new(t)))
                .map_err(|e| e.to_string()),
        }
    }

    /// Prompt token ids of a request (`body` is `raw` parsed).
    pub fn request_prompt_tokens(&self, path: &str, raw: &[u8], body: &Value) -> Option<Vec<u32>> {
        match self {
            PromptTokenizer::Builtin => request_prompt_tokens(path, body),
            PromptTokenizer::Hf(t) if path.ends_with("/chat/completions") => t.chat_ids(raw).ok(),
            PromptTokenizer::Hf(t) => t.completion_ids(raw).ok(),
        }
    }

    /// Prompt token ids of a conversation as the driver sends it (`{"role", "content"}`).
    pub fn chat_tokens(&self, messages: &[ChatMessage]) -> Vec<u32> {
        match self {
            PromptTokenizer::Builtin => chat_tokens(messages),
            PromptTokenizer::Hf(t) => {
                let msgs: Vec<Value> = messages
                    .iter()
                    .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
                    .collect();
                let body = serde_json::json!({ "messages": msgs }).to_string();
                t.chat_ids(body.as_bytes()).unwrap_or_default()
            }
        }
    }

    /// Token ids of the reply words (joined by single spaces).
    pub fn reply_tokens(&self, words: &[&str]) -> Vec<u32> {
        match self {
            PromptTokenizer::Builtin => words.iter().map(|w| piece_id(w.as_bytes())).collect(),
            PromptTokenizer::Hf(t) => t.encode(&words.join(" "), false).unwrap_or_default(),
        }
    }
}

/// Vocabulary size, of the order of Llama 3's (128,256 tokens).
pub const VOCAB_SIZE: u32 = 128_000;
/// Longest word kept as one token; longer ones are split (real BPE vocabularies rarely hold
/// pieces much longer than this).
pub const MAX_PIECE_BYTES: usize = 8;
/// Marker closing every rendered chat message.
pub const END_MARKER: &str = "<|end|>";

const FNV32_OFFSET: u32 = 0x811c_9dc5;
const FNV32_PRIME: u32 = 0x0100_0193;

/// FNV-1a, 32 bits.
pub fn fnv1a32(bytes: &[u8]) -> u32 {
    let mut h = FNV32_OFFSET;
    for &b in bytes {
        h ^= u32::from(b);
        h = h.wrapping_mul(FNV32_PRIME);
    }
    h
}

/// Token id of one piece (a word, or a part of a long word).
pub fn piece_id(piece: &[u8]) -> u32 {
    fnv1a32(piece) % VOCAB_SIZE
}

/// Tokenize text: whitespace-separated words, long words split every [`MAX_PIECE_BYTES`] bytes.
pub fn tokenize(text: &str) -> Vec<u32> {
    let mut out = Vec::with_capacity(text.len() / 5 + 1);
    tokenize_into(text, &mut out);
    out
}

/// Like [`tokenize`], appending to `out`.
pub fn tokenize_into(text: &str, out: &mut Vec<u32>) {
    for word in text.split_whitespace() {
        for piece in word.as_bytes().chunks(MAX_PIECE_BYTES) {
            out.push(piece_id(piece));
        }
    }
}

/// One chat message as the template sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// Render chat messages with the simulator's template (see the module header).
pub fn render_chat(messages: &[ChatMessage]) -> String {
    let len: usize = messages
        .iter()
        .map(|m| m.role.len() + m.content.len() + 16)
        .sum();
    let mut s = String::with_capacity(len + 16);
    for m in messages {
        s.push_str("<|");
        s.push_str(&m.role);
        s.push_str("|>\n");
        s.push_str(&m.content);
        s.push('\n');
        s.push_str(END_MARKER);
        s.push('\n');
    }
    s.push_str("<|assistant|>\n");
    s
}

/// Prompt token ids of a chat conversation.
pub fn chat_tokens(messages: &[ChatMessage]) -> Vec<u32> {
    tokenize(&render_chat(messages))
}

/// Text of an OpenAI message `content`: a string, or an array of parts whose text parts are
/// joined by newlines (non-text parts contribute nothing).
pub fn content_text(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => {
            let texts: Vec<&str> = parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect();
            texts.join("\n")
        }
        _ => String::new(),
    }
}

/// Messages of an OpenAI chat request body (`None` if `messages` is missing or not an array).
pub fn chat_messages(body: &Value) -> Option<Vec<ChatMessage>> {
    let msgs = body.get("messages")?.as_array()?;
    Some(
        msgs.iter()
            .map(|m| ChatMessage {
                role: m
                    .get("role")
                    .and_then(Value::as_str)
                    .unwrap_or("user")
                    .to_string(),
                content: m.get("content").map(content_text).unwrap_or_default(),
            })
            .collect(),
    )
}

/// Prompt token ids of an OpenAI completions `prompt`: a string, an array of token ids, or an
/// array of strings (only the first is used: the simulator serves one prompt per request).
pub fn completion_prompt_tokens(prompt: &Value) -> Option<Vec<u32>> {
    match prompt {
        Value::String(s) => Some(tokenize(s)),
        Value::Array(items) if items.iter().all(Value::is_u64) => Some(
            items
                .iter()
                .filter_map(Value::as_u64)
                .map(|t| t.min(u64::from(u32::MAX)) as u32)
                .collect(),
        ),
        Value::Array(items) => items.first().and_then(completion_prompt_tokens),
        _ => None,
    }
}

/// Prompt token ids of a request body for `path` (`/v1/chat/completions` or `/v1/completions`).
pub fn request_prompt_tokens(path: &str, body: &Value) -> Option<Vec<u32>> {
    if path.ends_with("/chat/completions") {
        chat_messages(body).map(|m| chat_tokens(&m))
    } else {
        body.get("prompt").and_then(completion_prompt_tokens)
    }
}

/// The `x-rolter-vllm-token-ids` header value: comma-separated decimal ids.
pub fn token_header_value(tokens: &[u32]) -> String {
    let mut s = String::with_capacity(tokens.len() * 7);
    for (i, t) in tokens.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&t.to_string());
    }
    s
}

/// Short words the reply generator draws from; each is one token (≤ [`MAX_PIECE_BYTES`] bytes).
const REPLY_WORDS: [&str; 32] = [
    "the", "cache", "block", "prefix", "token", "router", "replica", "fleet", "model", "reply",
    "stream", "batch", "fast", "warm", "cold", "shared", "system", "prompt", "answer", "query",
    "load", "queue", "latency", "hit", "miss", "evict", "store", "route", "serve", "decode",
    "prefill", "chunk",
];

/// Deterministic reply of `n` words for a prompt: word `i` depends on the prompt tokens and `i`.
/// Every replica generates the same reply for the same prompt.
pub fn reply_words(prompt_tokens: &[u32], n: usize) -> Vec<&'static str> {
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    for &t in prompt_tokens {
        seed = splitmix64(seed ^ u64::from(t));
    }
    (0..n)
        .map(|i| {
            let h = splitmix64(seed.wrapping_add(i as u64));
            REPLY_WORDS[(h % REPLY_WORDS.len() as u64) as usize]
        })
        .collect()
}

/// Reply text (words joined by single spaces) and its tokens.
pub fn reply(prompt_tokens: &[u32], n: usize) -> (String, Vec<u32>) {
    let words = reply_words(prompt_tokens, n);
    let tokens = words.iter().map(|w| piece_id(w.as_bytes())).collect();
    (words.join(" "), tokens)
}

/// SplitMix64 finalizer (Steele, Lea, Flood 2014): a cheap, well-mixing 64-bit permutation.
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn whitespace_words_and_long_word_split() {
        let t = tokenize("hello   world\nabcdefghijkl");
        assert_eq!(t.len(), 4);
        assert_eq!(t[0], piece_id(b"hello"));
        assert_eq!(t[2], piece_id(b"abcdefgh"));
        assert_eq!(t[3], piece_id(b"ijkl"));
        assert_eq!(tokenize("a b"), tokenize(" a  b "));
        assert!(t.iter().all(|&id| id < VOCAB_SIZE));
    }

    #[test]
    fn chat_history_is_prefix_stable() {
        let sys = ChatMessage::new("system", "you are helpful");
        let u1 = ChatMessage::new("user", "what is a cache");
        let turn1 = chat_tokens(&[sys.clone(), u1.clone()]);
        let (text, out) = reply(&turn1, 5);
        let turn2 = chat_tokens(&[
            sys,
            u1,
            ChatMessage::new("assistant", text),
            ChatMessage::new("user", "and a block"),
        ]);
        let mut expected = turn1.clone();
        expected.extend_from_slice(&out);
        assert_eq!(&turn2[..expected.len()], &expected[..]);
    }

    #[test]
    fn request_bodies() {
        let chat = json!({"messages": [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]}
        ]});
        let t = request_prompt_tokens("/v1/chat/completions", &chat).unwrap();
        assert_eq!(
            t,
            chat_tokens(&[
                ChatMessage::new("system", "sys"),
                ChatMessage::new("user", "hi")
            ])
        );
        let c = json!({"prompt": [1, 2, 3]});
        assert_eq!(
            request_prompt_tokens("/v1/completions", &c).unwrap(),
            vec![1, 2, 3]
        );
        let c = json!({"prompt": "x y"});
        assert_eq!(
            request_prompt_tokens("/v1/completions", &c).unwrap(),
            tokenize("x y")
        );
        assert!(request_prompt_tokens("/v1/chat/completions", &json!({})).is_none());
        assert_eq!(token_header_value(&[1, 22, 333]), "1,22,333");
    }

    #[test]
    fn different_roles_differ() {
        let a = chat_tokens(&[ChatMessage::new("user", "x")]);
        let b = chat_tokens(&[ChatMessage::new("system", "x")]);
        assert_ne!(a, b);
    }

    #[test]
    fn reply_is_deterministic_and_one_token_per_word() {
        let (t1, k1) = reply(&[1, 2, 3], 7);
        let (t2, k2) = reply(&[1, 2, 3], 7);
        assert_eq!(t1, t2);
        assert_eq!(k1, k2);
        assert_eq!(tokenize(&t1), k1);
        assert_eq!(k1.len(), 7);
        assert_ne!(reply(&[1, 2, 4], 7).0, t1);
    }
}
