//! Gateway-side tokenization: a route's model tokenizer and chat template, loaded from a
//! local Hugging Face directory (`[[routes]] tokenizer = "DIR"`), and a bounded cache of
//! earlier messages' ids, so `precise_cache_aware` gets vLLM's exact token ids for clients
//! that send no `x-rolter-vllm-token-ids` header (the openai SDK, LangChain, agents).
//!
//! Owns: [`hf`] (load, render, encode — vLLM's calls) and [`cache`] (rendered-prefix hash →
//! ids). Must not: touch sockets or routing state; `routing/` and `prefix/` never import it
//! (they receive plain ids). Heavy work leaves the request loop: a body above
//! [`OFFLOAD_BYTES`] is tokenized on tokio's blocking pool.
//!
//! Cost model: a conversation's turn n renders to turn n−1's rendered text (up to the last
//! special token before the generation prompt) plus the new messages. The ids of the text up
//! to the last cut point ([`hf::ModelTokenizer::cut_points`]) are cached under a hash of that
//! text; the next turn hashes its own text at its cut points, finds the longest cached
//! prefix and encodes only the rest. Parsing, rendering and hashing stay linear in the
//! body (tens of microseconds for 32 KiB); BPE, the expensive part, runs on the new text only.

pub mod board;
pub mod cache;
pub mod hf;

use std::path::Path;
use std::sync::Arc;

pub use cache::PrefixIdsCache;
pub use hf::{LoadError, ModelTokenizer, TokenizeError};

use crate::prompt::Endpoint;

/// Bodies larger than this are tokenized on the blocking pool, not the request loop
/// (at ~1-2 µs per uncached byte of BPE, 16 KiB is the order of a millisecond).
pub const OFFLOAD_BYTES: usize = 16 * 1024;
/// Default memory bound of a route's prefix-ids cache.
pub const DEFAULT_CACHE_BYTES: usize = 64 << 20;

/// A route's tokenizer with its prefix cache.
pub struct RouteTokenizer {
    model: Arc<ModelTokenizer>,
    cache: PrefixIdsCache,
}

impl std::fmt::Debug for RouteTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouteTokenizer")
            .field("dir", &self.model.dir())
            .finish_non_exhaustive()
    }
}

impl RouteTokenizer {
    /// Load `dir` with a cache bounded to `cache_bytes`.
    pub fn load(dir: &Path, cache_bytes: usize) -> Result<Self, LoadError> {
        Ok(Self::with_model(
            Arc::new(ModelTokenizer::load(dir)?),
            cache_bytes,
        ))
    }

    /// A loaded model with a new, empty cache.
    pub fn with_model(model: Arc<ModelTokenizer>, cache_bytes: usize) -> Self {
        RouteTokenizer {
            model,
            cache: PrefixIdsCache::new(cache_bytes),
        }
    }

    /// The loaded model tokenizer, shareable.
    pub fn model_arc(&self) -> Arc<ModelTokenizer> {
        self.model.clone()
    }

    /// The loaded model tokenizer.
    pub fn model(&self) -> &ModelTokenizer {
        &self.model
    }

    /// The prefix cache.
    pub fn cache(&self) -> &PrefixIdsCache {
        &self.cache
    }

    /// Token ids of a request body, on the calling thread (cached for chat).
    pub fn ids_blocking(&self, endpoint: Endpoint, body: &[u8]) -> Result<Vec<u32>, TokenizeError> {
        match endpoint {
            Endpoint::Completions => self.model.completion_ids(body),
            Endpoint::Chat => {
                let req = self.model.parse_chat(body)?;
                let text = self.model.render(&req)?;
                if req.add_special_tokens {
                    return self.model.encode(&text, true);
                }
                self.cached_encode(&text)
            }
            other => Err(TokenizeError::Request(format!(
                "no gateway-side tokenization for {}",
                other.label()
            ))),
        }
    }

    /// Encode rendered chat text, reusing the longest cached prefix and caching the text up
    /// to its last cut point for the next turn.
    pub fn cached_encode(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        let cuts = self.model.cut_points(text);
        let Some(&last) = cuts.last() else {
            return self.model.encode(text, false);
        };
        let keys = cache::prefix_keys(text, &cuts);
        let hit = keys
            .iter()
            .rev()
            .find_map(|&(at, key)| self.cache.get(key).map(|ids| (at, ids)));
        let (start, mut ids) = match hit {
            Some((at, ids)) => (at, ids.to_vec()),
            None => (0, Vec::new()),
        };
        if start < last {
            ids.extend(self.model.encode(&text[start..last], false)?);
            let key = keys[keys.len() - 1].1;
            self.cache.insert(key, ids.as_slice().into());
        }
        ids.extend(self.model.encode(&text[last.max(start)..], false)?);
        Ok(ids)
    }

    /// Token ids of a request body; bodies above [`OFFLOAD_BYTES`] go to the blocking pool.
    pub async fn ids(
        self: &Arc<Self>,
        endpoint: Endpoint,
        body: &[u8],
    ) -> Result<Vec<u32>, TokenizeError> {
        if body.len() <= OFFLOAD_BYTES {
            return self.ids_blocking(endpoint, body);
        }
        let me = self.clone();
        let owned = body.to_vec();
        tokio::task::spawn_blocking(move || me.ids_blocking(endpoint, &owned))
            .await
            .map_err(|e| TokenizeError::Encode(format!("tokenizer task: {e}")))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn fixtures() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer")
    }

    fn cases() -> Vec<serde_json::Value> {
        let text = std::fs::read_to_string(fixtures().join("cases.json")).unwrap();
        serde_json::from_str(&text).unwrap()
    }

    /// Case `i`'s body with its keys in the file's order (`serde_json::Value` sorts them).
    fn body_bytes(i: usize) -> Vec<u8> {
        let text = std::fs::read_to_string(fixtures().join("cases.json")).unwrap();
        let all: minijinja::Value = serde_json::from_str(&text).unwrap();
        let case = all.get_item(&minijinja::Value::from(i)).unwrap();
        serde_json::to_vec(&case.get_attr("body").unwrap()).unwrap()
    }

    fn load(name: &str) -> RouteTokenizer {
        RouteTokenizer::load(&fixtures().join(name), 1 << 20).unwrap()
    }

    /// Every fixture: the same rendered text and ids as the Python generator (vLLM's calls
    /// through transformers), uncached, then cached cold and warm.
    #[test]
    fn ids_equal_the_fixture_generators() {
        let all = cases();
        assert!(all.len() >= 20);
        for name in ["llama3", "qwen"] {
            let tok = load(name);
            for (i, case) in all
                .iter()
                .enumerate()
                .filter(|(_, c)| c["tokenizer"] == name)
            {
                let label = format!("{name}/{}", case["name"]);
                let body = body_bytes(i);
                let endpoint = match case["endpoint"].as_str().unwrap() {
                    "chat" => Endpoint::Chat,
                    _ => Endpoint::Completions,
                };
                if let Some(err) = case.get("error") {
                    let got = tok.ids_blocking(endpoint, &body).unwrap_err();
                    let want = err.as_str().unwrap();
                    assert!(got.to_string().contains(want), "{label}: {got} vs {want}");
                    continue;
                }
                if let Some(text) = case.get("text") {
                    let req = tok.model().parse_chat(&body).unwrap();
                    let rendered = tok.model().render(&req).unwrap();
                    assert_eq!(rendered, text.as_str().unwrap(), "{label}: rendered text");
                }
                let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
                let uncached = match endpoint {
                    Endpoint::Chat => tok.model().chat_ids(&body).unwrap(),
                    Endpoint::Completions => tok.model().completion_ids(&body).unwrap(),
                    other => unreachable!("fixtures are chat or completions, not {other:?}"),
                };
                assert_eq!(uncached, want, "{label}: uncached ids");
                assert_eq!(
                    tok.ids_blocking(endpoint, &body).unwrap(),
                    want,
                    "{label}: cold"
                );
                assert_eq!(
                    tok.ids_blocking(endpoint, &body).unwrap(),
                    want,
                    "{label}: warm"
                );
            }
        }
    }

    #[test]
    fn completion_id_arrays_are_used_as_they_are() {
        let tok = load("llama3");
        let body = br#"{"model": "m", "prompt": [5, 6, 7]}"#;
        assert_eq!(
            tok.ids_blocking(Endpoint::Completions, body).unwrap(),
            vec![5, 6, 7]
        );
        let body = br#"{"model": "m", "prompt": [[8, 9], [1]]}"#;
        assert_eq!(
            tok.ids_blocking(Endpoint::Completions, body).unwrap(),
            vec![8, 9]
        );
    }

    /// A growing conversation: every turn's cached ids equal the uncached ones, and from the
    /// second turn on the lookup hits (only the new text is encoded).
    #[test]
    fn a_conversation_reuses_its_previous_turn() {
        for name in ["llama3", "qwen"] {
            let tok = load(name);
            let mut messages = vec![
                serde_json::json!({"role": "system", "content": "You are helpful. ".repeat(50)}),
            ];
            for turn in 0..6 {
                messages.push(serde_json::json!({"role": "user", "content": format!("question {turn}: what is a cache block?")}));
                let body =
                    serde_json::to_vec(&serde_json::json!({"model": "m", "messages": messages}))
                        .unwrap();
                let (hits_before, _) = tok.cache().hit_counts();
                let got = tok.ids_blocking(Endpoint::Chat, &body).unwrap();
                assert_eq!(
                    got,
                    tok.model().chat_ids(&body).unwrap(),
                    "{name} turn {turn}"
                );
                let (hits_after, _) = tok.cache().hit_counts();
                if turn > 0 {
                    assert_eq!(
                        hits_after,
                        hits_before + 1,
                        "{name} turn {turn} reused the previous turn"
                    );
                }
                messages.push(serde_json::json!({"role": "assistant", "content": format!("answer {turn}: the prefix cache")}));
            }
        }
    }

    #[test]
    fn broken_directories_fail_with_the_file_named() {
        let dir = std::env::temp_dir().join(format!("rolter-tok-broken-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let err = ModelTokenizer::load(&dir).unwrap_err().to_string();
        assert!(err.contains("tokenizer.json"), "{err}");
        std::fs::write(dir.join("tokenizer.json"), "{not json").unwrap();
        let err = ModelTokenizer::load(&dir).unwrap_err().to_string();
        assert!(err.contains("tokenizer.json"), "{err}");
        std::fs::copy(
            fixtures().join("qwen/tokenizer.json"),
            dir.join("tokenizer.json"),
        )
        .unwrap();
        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"chat_template": "{% for %}"}"#,
        )
        .unwrap();
        let err = ModelTokenizer::load(&dir).unwrap_err().to_string();
        assert!(err.contains("chat template"), "{err}");
        std::fs::write(dir.join("tokenizer_config.json"), "{}").unwrap();
        let ok = ModelTokenizer::load(&dir).unwrap();
        assert!(!ok.has_chat_template());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
