//! A model's Hugging Face tokenizer and chat template, loaded from a local directory, and the
//! request → token ids computation vLLM performs for `/tokenize`, chat and completions.
//!
//! Owns: reading a model directory in Hugging Face layout (`tokenizer.json`,
//! `tokenizer_config.json` with `chat_template`, optionally `chat_template.jinja` and
//! `special_tokens_map.json`), turning an OpenAI request body into the conversation vLLM
//! hands to the template ([`request`]), rendering it with transformers' Jinja semantics
//! ([`template`]) and encoding with Hugging Face's own `tokenizers`. Must not: download
//! anything, touch sockets, or depend on the rest of the gateway (the simulator in
//! `loadtest/` compiles this directory as its own module, so it can only use `super`/`self`
//! paths and the crates both packages depend on).
//!
//! vLLM's calls, reproduced (checked in vLLM's source: `entrypoints/chat_utils.py`,
//! `renderers/params.py`, the request models in `protocol.py`): a chat request is rendered
//! with `tokenizer.apply_chat_template(conversation, tools=..., add_generation_prompt=True,
//! tokenize=False)` and the text encoded with `add_special_tokens=False` (the template
//! writes its own BOS); a completion's string prompt is encoded with `add_special_tokens=True`
//! (the tokenizer's post-processor adds the BOS). Both flags can be overridden per request,
//! as vLLM allows (`add_generation_prompt`, `add_special_tokens`, `chat_template_kwargs`).
//!
//! Segment independence (what the prefix cache in `tokenize/` relies on): `tokenizers`
//! splits the text on added tokens first and encodes the pieces between them independently,
//! so the ids of `text` are the ids of `text[..b]` followed by those of `text[b..]` whenever
//! `b` ends an occurrence of a special token that strips no whitespace. [`ModelTokenizer::
//! cut_points`] lists such positions; it lists none when the tokenizer's pre-tokenizer treats
//! the start of the text specially (Metaspace `prepend_scheme: first`) or a token matches only
//! as a single word.

mod request;
mod template;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use minijinja::Value;
use thiserror::Error;

pub use request::{ChatRequest, CompletionPrompt};
use template::ChatTemplate;

/// Special-token attributes transformers passes to every chat template (its
/// `special_tokens_map`), in its order.
const SPECIAL_TOKEN_KEYS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// Why a tokenizer directory could not be loaded.
#[derive(Debug, Error)]
pub enum LoadError {
    #[error("{dir}: cannot read {file}: {source}")]
    Read {
        dir: String,
        file: &'static str,
        source: std::io::Error,
    },
    #[error("{dir}: tokenizer.json: {reason}")]
    Tokenizer { dir: String, reason: String },
    #[error("{dir}: {file}: {reason}")]
    Config {
        dir: String,
        file: &'static str,
        reason: String,
    },
    #[error("{dir}: chat template \"{name}\": {reason}")]
    Template {
        dir: String,
        name: String,
        reason: String,
    },
}

/// Why one request's token ids could not be computed (the caller routes without them).
#[derive(Debug, Error)]
pub enum TokenizeError {
    #[error("request body: {0}")]
    Request(String),
    #[error("the tokenizer directory has no chat template")]
    NoTemplate,
    #[error("chat template: {0}")]
    Template(String),
    #[error("encode: {0}")]
    Encode(String),
}

/// A loaded model tokenizer (immutable, shared by every request of a route).
pub struct ModelTokenizer {
    dir: PathBuf,
    tokenizer: tokenizers::Tokenizer,
    templates: Option<ChatTemplate>,
    /// `bos_token`, `eos_token`, ... as the template sees them.
    special: Vec<(&'static str, Value)>,
    /// Special tokens the templates emit that are safe to cut after (see the module header).
    cut_tokens: Vec<String>,
}

impl std::fmt::Debug for ModelTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelTokenizer")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

fn read_opt(dir: &Path, file: &'static str) -> Result<Option<String>, LoadError> {
    match std::fs::read_to_string(dir.join(file)) {
        Ok(s) => Ok(Some(s)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(LoadError::Read {
            dir: dir.display().to_string(),
            file,
            source,
        }),
    }
}

fn parse_json(
    dir: &Path,
    file: &'static str,
    text: &str,
) -> Result<serde_json::Map<String, serde_json::Value>, LoadError> {
    match serde_json::from_str(text) {
        Ok(serde_json::Value::Object(m)) => Ok(m),
        Ok(_) => Err(LoadError::Config {
            dir: dir.display().to_string(),
            file,
            reason: "not a JSON object".into(),
        }),
        Err(e) => Err(LoadError::Config {
            dir: dir.display().to_string(),
            file,
            reason: e.to_string(),
        }),
    }
}

/// A special token's text: a string, or an `AddedToken` object's `content`.
fn token_text(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(m) => m.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

impl ModelTokenizer {
    /// Load `dir` (nothing is downloaded; every failure names the directory and the file).
    pub fn load(dir: &Path) -> Result<Self, LoadError> {
        let d = || dir.display().to_string();
        let json = read_opt(dir, "tokenizer.json")?.ok_or_else(|| LoadError::Read {
            dir: d(),
            file: "tokenizer.json",
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
        })?;
        let mut tokenizer = tokenizers::Tokenizer::from_bytes(json.as_bytes()).map_err(|e| {
            LoadError::Tokenizer {
                dir: d(),
                reason: e.to_string(),
            }
        })?;
        // vLLM passes its own truncation/padding arguments; a tokenizer.json's defaults
        // would otherwise cut or pad the ids.
        tokenizer
            .with_truncation(None)
            .map_err(|e| LoadError::Tokenizer {
                dir: d(),
                reason: e.to_string(),
            })?;
        tokenizer.with_padding(None);
        let config = match read_opt(dir, "tokenizer_config.json")? {
            Some(t) => parse_json(dir, "tokenizer_config.json", &t)?,
            None => serde_json::Map::new(),
        };
        let map = match read_opt(dir, "special_tokens_map.json")? {
            Some(t) => parse_json(dir, "special_tokens_map.json", &t)?,
            None => serde_json::Map::new(),
        };
        let mut special = Vec::new();
        for key in SPECIAL_TOKEN_KEYS {
            let text = config
                .get(key)
                .and_then(token_text)
                .or_else(|| map.get(key).and_then(token_text));
            if let Some(t) = text {
                special.push((key, Value::from(t)));
            }
        }
        // transformers: `chat_template.jinja` wins over tokenizer_config.json's entry, which
        // is a string or a list of named templates.
        let mut sources: Vec<(String, String)> = Vec::new();
        if let Some(t) = read_opt(dir, "chat_template.jinja")? {
            sources.push(("default".into(), t));
        } else {
            match config.get("chat_template") {
                None | Some(serde_json::Value::Null) => {}
                Some(serde_json::Value::String(s)) => sources.push(("default".into(), s.clone())),
                Some(serde_json::Value::Array(list)) => {
                    for item in list {
                        let name = item.get("name").and_then(|v| v.as_str());
                        let tmpl = item.get("template").and_then(|v| v.as_str());
                        match (name, tmpl) {
                            (Some(n), Some(t)) => sources.push((n.to_owned(), t.to_owned())),
                            _ => {
                                return Err(LoadError::Config {
                                    dir: d(),
                                    file: "tokenizer_config.json",
                                    reason:
                                        "chat_template list entries need \"name\" and \"template\""
                                            .into(),
                                })
                            }
                        }
                    }
                }
                Some(_) => {
                    return Err(LoadError::Config {
                        dir: d(),
                        file: "tokenizer_config.json",
                        reason: "chat_template must be a string or a list".into(),
                    })
                }
            }
        }
        let templates = if sources.is_empty() {
            None
        } else {
            Some(
                ChatTemplate::new(&sources).map_err(|(name, reason)| LoadError::Template {
                    dir: d(),
                    name,
                    reason,
                })?,
            )
        };
        let safe = !json
            .replace(' ', "")
            .contains("\"prepend_scheme\":\"first\"");
        let added = tokenizer.get_added_tokens_decoder();
        let mut cut_tokens = Vec::new();
        if safe && !added.values().any(|t| t.single_word) {
            let mut seen: HashMap<&str, ()> = HashMap::new();
            for t in added.values() {
                let emitted = sources.iter().any(|(_, s)| s.contains(&t.content))
                    || special.iter().any(|(_, v)| v.as_str() == Some(&t.content));
                if t.special
                    && !t.rstrip
                    && !t.content.is_empty()
                    && emitted
                    && seen.insert(&t.content, ()).is_none()
                {
                    cut_tokens.push(t.content.clone());
                }
            }
        }
        cut_tokens.sort();
        Ok(ModelTokenizer {
            dir: dir.to_path_buf(),
            tokenizer,
            templates,
            special,
            cut_tokens,
        })
    }

    /// The directory this was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether a chat template was found.
    pub fn has_chat_template(&self) -> bool {
        self.templates.is_some()
    }

    /// Parse a chat request body into what the template needs.
    pub fn parse_chat(&self, body: &[u8]) -> Result<ChatRequest, TokenizeError> {
        let openai = self
            .templates
            .as_ref()
            .is_some_and(|t| t.iterates_content());
        request::parse_chat(body, openai)
    }

    /// Render a parsed chat request with the model's template.
    pub fn render(&self, req: &ChatRequest) -> Result<String, TokenizeError> {
        let templates = self.templates.as_ref().ok_or(TokenizeError::NoTemplate)?;
        templates.render(req, &self.special)
    }

    /// Encode text; `add_special_tokens` applies the tokenizer's post-processor (BOS).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        if text.is_empty() && !add_special_tokens {
            return Ok(Vec::new());
        }
        self.tokenizer
            .encode_fast(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizeError::Encode(e.to_string()))
    }

    /// Positions in `text` right after a special token, where encoding may be split
    /// (ascending; empty when this tokenizer does not allow it, see the module header).
    pub fn cut_points(&self, text: &str) -> Vec<usize> {
        let mut cuts = Vec::new();
        for tok in &self.cut_tokens {
            for at in memchr::memmem::find_iter(text.as_bytes(), tok.as_bytes()) {
                cuts.push(at + tok.len());
            }
        }
        cuts.sort_unstable();
        cuts.dedup();
        cuts
    }

    /// Token ids of a chat request, uncached: exactly vLLM's.
    pub fn chat_ids(&self, body: &[u8]) -> Result<Vec<u32>, TokenizeError> {
        let req = self.parse_chat(body)?;
        let text = self.render(&req)?;
        self.encode(&text, req.add_special_tokens)
    }

    /// Token ids of a completions request (its first prompt when it carries a batch).
    pub fn completion_ids(&self, body: &[u8]) -> Result<Vec<u32>, TokenizeError> {
        match request::parse_completion(body)? {
            CompletionPrompt::Ids(ids) => Ok(ids),
            CompletionPrompt::Text {
                text,
                add_special_tokens,
            } => self.encode(&text, add_special_tokens),
        }
    }
}
