//! The routing file (TOML): schema, strict parsing and semantic validation.
//!
//! Owns: turning the text of a routing file into a validated [`Config`] or a
//! [`ConfigError`] that names the file, the key and the reason — one line per problem,
//! all problems at once (unknown keys are collected with `serde_ignored` instead of
//! failing on the first one, so an operator fixes a file in one pass).
//!
//! Egress rules (`[egress]`) are applied here to literal addresses and host names of
//! every endpoint; the addresses names resolve to are checked by `runtime`.
//!
//! Must not: resolve DNS, open sockets or touch runtime state. Turning a `Config` into
//! live routes (address resolution, peers, strategies) is `runtime`'s job.

mod schema;
mod validate;

pub use schema::*;
pub use validate::{check_api_key, check_zmq_endpoint, endpoint_egress_problem, is_bind_endpoint};

use std::path::Path;
use thiserror::Error;

/// Environment variable that overrides the default routing file path.
pub const ROUTES_ENV: &str = "ROLTER_ROUTES";
/// Default routing file path, relative to the working directory.
pub const DEFAULT_ROUTES_PATH: &str = "conf/rolter.toml";

/// Why a routing file was rejected.
#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("{path}: cannot read: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// One or more problems; each entry is one self-contained line.
    #[error("{}", .problems.iter().map(|p| format!("{}: {p}", .path)).collect::<Vec<_>>().join("\n"))]
    Invalid { path: String, problems: Vec<String> },
}

impl ConfigError {
    /// The individual problems (one per line of the message).
    pub fn problems(&self) -> Vec<String> {
        match self {
            ConfigError::Read { source, .. } => vec![format!("cannot read: {source}")],
            ConfigError::Invalid { problems, .. } => problems.clone(),
        }
    }
}

/// Read and validate a routing file.
pub fn load_file(path: &Path) -> Result<Config, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.display().to_string(),
        source,
    })?;
    parse(&text, &path.display().to_string())
}

/// Parse and validate routing TOML; `origin` names the file in error messages.
pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
    let invalid = |problems| ConfigError::Invalid {
        path: origin.to_string(),
        problems,
    };
    let mut unknown = Vec::new();
    let de = toml::Deserializer::new(text);
    // serde_ignored writes an `Option`'s `Some` as a `?` segment: drop it from the path.
    let config: Config =
        serde_ignored::deserialize(de, |key| unknown.push(key.to_string().replace(".?", "")))
            .map_err(|e: toml::de::Error| invalid(vec![single_line(one_line(text, &e))]))?;
    let mut problems: Vec<String> = unknown
        .into_iter()
        .map(|key| format!("{key}: unknown key"))
        .collect();
    problems.extend(validate::problems(&config));
    let problems: Vec<String> = problems.into_iter().map(single_line).collect();
    if problems.is_empty() {
        Ok(config)
    } else {
        Err(invalid(problems))
    }
}

/// A problem quotes keys and values from the file, which may hold control characters
/// (`"a\nb" = 1` is a valid key): escape them so each problem stays one line (found by
/// `fuzz/fuzz_targets/config_parse.rs`).
fn single_line(problem: String) -> String {
    if !problem.chars().any(char::is_control) {
        return problem;
    }
    problem
        .chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// Fold toml's multi-line diagnostic into one line: "line L, column C: message".
fn one_line(text: &str, e: &toml::de::Error) -> String {
    let msg = e.message().trim().replace('\n', " ");
    match e.span() {
        Some(span) => {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
            format!("line {line}, column {column}: {msg}")
        }
        None => msg,
    }
}

#[cfg(test)]
mod tests;
