//! Client keys (`[auth]`): the keys a client must present, read from a file and/or an
//! environment variable when the routing file is loaded (and on every reload), and the
//! check the proxy makes per request.
//!
//! Owns: [`ClientAuth`] and reading secrets from outside the routing file
//! ([`read_env_secret`]). Must not: log, print or export a key — errors name the file,
//! line or variable, never the value, and `Debug` shows only how many keys there are.

use super::LoadError;
use crate::config::{check_api_key, AuthConfig, Secret};
use std::collections::HashSet;

/// The header Anthropic's API (and its SDK) carries the client's key in.
pub const X_API_KEY: &str = "x-api-key";

/// The accepted client keys and what they protect.
pub struct ClientAuth {
    /// Hashed with std's randomly keyed SipHash: a lookup's timing tells an attacker
    /// nothing usable about the keys (the final comparison runs only on a full hash
    /// match, i.e. on the right key).
    keys: HashSet<String>,
    /// Whether `GET /metrics` needs a key.
    pub protect_metrics: bool,
    /// Whether `GET /health` and `GET /ready` need a key.
    pub protect_health: bool,
}

impl std::fmt::Debug for ClientAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientAuth")
            .field("keys", &self.keys.len())
            .field("protect_metrics", &self.protect_metrics)
            .field("protect_health", &self.protect_health)
            .finish()
    }
}

impl ClientAuth {
    /// Read the keys `[auth]` points at. `origin` names the routing file in errors.
    pub fn load(cfg: &AuthConfig, origin: &str) -> Result<Self, LoadError> {
        let mut keys = HashSet::new();
        let fail = |key: String, reason: String| LoadError::Secret {
            path: origin.to_string(),
            key,
            reason,
        };
        if let Some(file) = &cfg.keys_file {
            let text = std::fs::read_to_string(file)
                .map_err(|e| fail("auth.keys_file".into(), format!("cannot read {file}: {e}")))?;
            for (n, line) in text.lines().enumerate() {
                let line = line.trim();
                if line.is_empty() || line.starts_with('#') {
                    continue;
                }
                check_api_key(line).map_err(|why| {
                    fail(
                        "auth.keys_file".into(),
                        format!("{file}, line {}: {why}", n + 1),
                    )
                })?;
                keys.insert(line.to_string());
            }
        }
        if let Some(var) = &cfg.keys_env {
            let value =
                read_env_secret(var).map_err(|reason| fail("auth.keys_env".into(), reason))?;
            for (n, key) in value
                .expose()
                .split(|c: char| c == ',' || c.is_whitespace())
                .filter(|k| !k.is_empty())
                .enumerate()
            {
                check_api_key(key).map_err(|why| {
                    fail(
                        "auth.keys_env".into(),
                        format!("${var}, key {}: {why}", n + 1),
                    )
                })?;
                keys.insert(key.to_string());
            }
        }
        if keys.is_empty() {
            return Err(fail(
                "auth".into(),
                "no keys found: every request would be refused".into(),
            ));
        }
        Ok(ClientAuth {
            keys,
            protect_metrics: cfg.protect_metrics,
            protect_health: cfg.protect_health,
        })
    }

    /// Whether a request's headers carry an accepted key: `Authorization: Bearer <key>`
    /// (OpenAI's SDKs) or `x-api-key: <key>` (Anthropic's).
    pub fn admits_request(&self, headers: &http::HeaderMap) -> bool {
        self.admits(headers.get(http::header::AUTHORIZATION))
            || headers
                .get(X_API_KEY)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|key| self.keys.contains(key.trim()))
    }

    /// Whether an `Authorization` header value carries an accepted key
    /// (`Bearer <key>`, the scheme in any case).
    pub fn admits(&self, authorization: Option<&http::HeaderValue>) -> bool {
        let Some(value) = authorization.and_then(|v| v.to_str().ok()) else {
            return false;
        };
        let value = value.trim();
        let Some((scheme, key)) = value.split_once(' ') else {
            return false;
        };
        scheme.eq_ignore_ascii_case("bearer") && self.keys.contains(key.trim())
    }

    /// How many keys are accepted.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether no key is accepted (never true of a loaded one).
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

/// The value of environment variable `var`, as a secret; the error says only that it
/// is unset or not Unicode.
pub fn read_env_secret(var: &str) -> Result<Secret, String> {
    match std::env::var(var) {
        Ok(v) => Ok(Secret::new(v)),
        Err(std::env::VarError::NotPresent) => {
            Err(format!("environment variable {var} is not set"))
        }
        Err(std::env::VarError::NotUnicode(_)) => {
            Err(format!("environment variable {var} is not valid Unicode"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(v: &str) -> http::HeaderValue {
        http::HeaderValue::from_str(v).unwrap()
    }

    #[test]
    fn keys_from_a_file_and_the_environment_are_accepted_as_bearer_tokens() {
        let dir = std::env::temp_dir().join(format!("rolter-auth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("keys");
        std::fs::write(&file, "# team a\nsk-file-1\n\n  sk-file-2  \n").unwrap();
        std::env::set_var("ROLTER_AUTH_TEST_KEYS", "sk-env-1, sk-env-2");
        let cfg = AuthConfig {
            keys_file: Some(file.display().to_string()),
            keys_env: Some("ROLTER_AUTH_TEST_KEYS".into()),
            ..Default::default()
        };
        let auth = ClientAuth::load(&cfg, "routes.toml").unwrap();
        assert_eq!(auth.len(), 4);
        for ok in ["Bearer sk-file-1", "bearer sk-file-2", "BEARER  sk-env-2 "] {
            assert!(auth.admits(Some(&header(ok))), "{ok}");
        }
        for bad in [
            "Bearer sk-nope",
            "sk-file-1",
            "Basic sk-file-1",
            "Bearer # team a",
            "",
        ] {
            assert!(!auth.admits(Some(&header(bad))), "{bad}");
        }
        assert!(!auth.admits(None));
        let mut headers = http::HeaderMap::new();
        headers.insert(X_API_KEY, header("sk-env-1"));
        assert!(auth.admits_request(&headers));
        headers.insert(X_API_KEY, header("Bearer sk-env-1"));
        assert!(!auth.admits_request(&headers));
        let shown = format!("{auth:?}");
        assert!(!shown.contains("sk-"), "{shown}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn errors_name_the_source_never_the_key() {
        let dir = std::env::temp_dir().join(format!("rolter-auth-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("keys");
        std::fs::write(&file, "sk-good\nsk bad secret\n").unwrap();
        let cfg = AuthConfig {
            keys_file: Some(file.display().to_string()),
            ..Default::default()
        };
        let e = ClientAuth::load(&cfg, "routes.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 2") && e.contains("auth.keys_file"), "{e}");
        assert!(!e.contains("secret") && !e.contains("sk-good"), "{e}");
        let unset = AuthConfig {
            keys_env: Some("ROLTER_AUTH_TEST_UNSET".into()),
            ..Default::default()
        };
        let e = ClientAuth::load(&unset, "routes.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("ROLTER_AUTH_TEST_UNSET is not set"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
