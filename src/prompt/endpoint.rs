//! The client-facing API endpoints rolter forwards, by request path: which body shape
//! each one has (a prompt to route by, only a model to rewrite, or a multipart form) and
//! its metric label.
//!
//! Owns: the path → endpoint table. Must not: read bodies or touch sockets.

/// One forwarded API endpoint (several paths may name the same one, e.g. rerank).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`
    Chat,
    /// `POST /v1/completions`
    Completions,
    /// `POST /v1/responses` (OpenAI Responses API)
    Responses,
    /// `POST /v1/messages` (Anthropic Messages API)
    Messages,
    /// `POST /v1/messages/count_tokens`
    MessagesCountTokens,
    /// `POST /v1/embeddings`
    Embeddings,
    /// `POST /v1/rerank`, `/rerank`, `/v2/rerank`
    Rerank,
    /// `POST /v1/score`, `/score`
    Score,
    /// `POST /pooling`
    Pooling,
    /// `POST /classify`
    Classify,
    /// `POST /tokenize`
    Tokenize,
    /// `POST /detokenize`
    Detokenize,
    /// `POST /v1/chat/completions/render`
    ChatRender,
    /// `POST /v1/audio/transcriptions` (multipart/form-data)
    Transcriptions,
    /// `POST /v1/audio/translations` (multipart/form-data)
    Translations,
}

impl Endpoint {
    /// Every endpoint.
    pub const ALL: [Endpoint; 15] = [
        Endpoint::Chat,
        Endpoint::Completions,
        Endpoint::Responses,
        Endpoint::Messages,
        Endpoint::MessagesCountTokens,
        Endpoint::Embeddings,
        Endpoint::Rerank,
        Endpoint::Score,
        Endpoint::Pooling,
        Endpoint::Classify,
        Endpoint::Tokenize,
        Endpoint::Detokenize,
        Endpoint::ChatRender,
        Endpoint::Transcriptions,
        Endpoint::Translations,
    ];

    /// The endpoint a `POST` to `path` is for (`None`: not one rolter forwards by body).
    pub fn from_path(path: &str) -> Option<Endpoint> {
        Some(match path {
            "/v1/chat/completions" => Endpoint::Chat,
            "/v1/completions" => Endpoint::Completions,
            "/v1/responses" => Endpoint::Responses,
            "/v1/messages" => Endpoint::Messages,
            "/v1/messages/count_tokens" => Endpoint::MessagesCountTokens,
            "/v1/embeddings" => Endpoint::Embeddings,
            "/v1/rerank" | "/rerank" | "/v2/rerank" => Endpoint::Rerank,
            "/v1/score" | "/score" => Endpoint::Score,
            "/pooling" => Endpoint::Pooling,
            "/classify" => Endpoint::Classify,
            "/tokenize" => Endpoint::Tokenize,
            "/detokenize" => Endpoint::Detokenize,
            "/v1/chat/completions/render" => Endpoint::ChatRender,
            "/v1/audio/transcriptions" => Endpoint::Transcriptions,
            "/v1/audio/translations" => Endpoint::Translations,
            _ => return None,
        })
    }

    /// Stable label for metrics (`rolter_endpoint_requests_total{endpoint}`) and logs.
    pub fn label(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat_completions",
            Endpoint::Completions => "completions",
            Endpoint::Responses => "responses",
            Endpoint::Messages => "messages",
            Endpoint::MessagesCountTokens => "messages_count_tokens",
            Endpoint::Embeddings => "embeddings",
            Endpoint::Rerank => "rerank",
            Endpoint::Score => "score",
            Endpoint::Pooling => "pooling",
            Endpoint::Classify => "classify",
            Endpoint::Tokenize => "tokenize",
            Endpoint::Detokenize => "detokenize",
            Endpoint::ChatRender => "chat_render",
            Endpoint::Transcriptions => "audio_transcriptions",
            Endpoint::Translations => "audio_translations",
        }
    }

    /// Whether the body is multipart/form-data (the model is the form field `model`).
    pub fn is_form(self) -> bool {
        matches!(self, Endpoint::Transcriptions | Endpoint::Translations)
    }

    /// Whether the body carries a prompt the route's strategy routes by (else the request
    /// is a pass-through: least-load, or session affinity where the strategy keeps it).
    pub fn has_prompt(self) -> bool {
        matches!(
            self,
            Endpoint::Chat | Endpoint::Completions | Endpoint::Responses | Endpoint::Messages
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_map_to_endpoints_with_distinct_labels() {
        let labels: std::collections::HashSet<_> =
            Endpoint::ALL.iter().map(|e| e.label()).collect();
        assert_eq!(labels.len(), Endpoint::ALL.len());
        assert_eq!(Endpoint::from_path("/v2/rerank"), Some(Endpoint::Rerank));
        assert_eq!(Endpoint::from_path("/score"), Some(Endpoint::Score));
        assert_eq!(Endpoint::from_path("/v1/responses/x"), None);
        assert_eq!(Endpoint::from_path("/v1/chat/completions/"), None);
        assert!(Endpoint::Transcriptions.is_form() && !Endpoint::Embeddings.is_form());
    }
}
