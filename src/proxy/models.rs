//! `GET /v1/models`: the route aliases, each with the `max_model_len` and `root` its
//! targets report in their own `/v1/models` (vLLM's answer carries both), when known.
//!
//! Fetched lazily: a listing asks each eligible target whose answer is unknown or older
//! than [`FRESH_FOR`] (all within [`FETCH_BUDGET`] in total, so a listing never waits
//! long), over the same pooled connections as proxied requests, and remembers the answer
//! per target label (a failure for [`RETRY_AFTER`]). An alias's `max_model_len` is the
//! smallest its targets report (a request that fits it fits every target); `root` is the
//! first known. A target that says nothing leaves the fields out.
//! Must not: decide routes, or hold anything the request path reads.

use super::upstream;
use super::Gateway;
use crate::runtime::{RouteTable, RouteTarget};
use bytes::Bytes;
use dashmap::DashMap;
use serde::Deserialize;
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How long a target's answer is used before it is asked again.
pub const FRESH_FOR: Duration = Duration::from_secs(60);
/// How long a target that did not answer is left alone.
const RETRY_AFTER: Duration = Duration::from_secs(10);
/// Most time one listing spends asking targets (one at a time).
const FETCH_BUDGET: Duration = Duration::from_secs(2);
/// Largest `/v1/models` answer read from a target.
const MAX_ANSWER_BYTES: usize = 1 << 20;

/// What a target says about the model it serves.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelInfo {
    /// The model's `root` (the base model's name or path).
    pub root: Option<String>,
    /// The served context length.
    pub max_model_len: Option<u64>,
}

#[derive(Deserialize)]
struct ModelList {
    data: Vec<ModelEntry>,
}

#[derive(Deserialize)]
struct ModelEntry {
    id: String,
    #[serde(default)]
    root: Option<String>,
    #[serde(default)]
    max_model_len: Option<u64>,
}

/// The entry for `model` in a `/v1/models` answer (else its only entry); `None` if the
/// body is not such a list.
pub fn parse_model_list(body: &[u8], model: &str) -> Option<ModelInfo> {
    let list: ModelList = serde_json::from_slice(body).ok()?;
    let entry = match list.data.iter().find(|e| e.id == model) {
        Some(e) => e,
        None if list.data.len() == 1 => &list.data[0],
        None => return None,
    };
    Some(ModelInfo {
        root: entry.root.clone(),
        max_model_len: entry.max_model_len,
    })
}

/// Target label → when it was asked, and what it said; entries of targets no longer in
/// the table are dropped at the next refresh (discovered addresses come and go).
#[derive(Default)]
pub struct ModelInfoCache {
    by_target: DashMap<String, (Instant, Option<ModelInfo>)>,
    /// Set while one listing refreshes; concurrent listings answer from the cache.
    refreshing: AtomicBool,
}

/// Clears [`ModelInfoCache::refreshing`] however the refresh ends (a client that goes
/// away drops the future).
struct Refreshing<'a>(&'a AtomicBool);

impl Drop for Refreshing<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl ModelInfoCache {
    fn due(&self, label: &str, now: Instant) -> bool {
        self.by_target.get(label).is_none_or(|e| {
            let age = now.saturating_duration_since(e.0);
            age >= if e.1.is_some() {
                FRESH_FOR
            } else {
                RETRY_AFTER
            }
        })
    }

    fn known(&self, label: &str) -> Option<ModelInfo> {
        self.by_target.get(label).and_then(|e| e.1.clone())
    }
}

/// The listing body: one entry per alias, in alias order.
pub fn listing(table: &RouteTable, cache: &ModelInfoCache) -> Bytes {
    let data: Vec<serde_json::Value> = table
        .routes_by_alias()
        .map(|route| {
            let mut entry = serde_json::json!({"id": route.alias, "object": "model", "created": 0, "owned_by": "rolter"});
            let infos: Vec<ModelInfo> = route
                .targets
                .iter()
                .filter_map(|t| cache.known(t.state.label()))
                .collect();
            if let Some(len) = infos.iter().filter_map(|i| i.max_model_len).min() {
                entry["max_model_len"] = len.into();
            }
            if let Some(root) = infos.iter().find_map(|i| i.root.clone()) {
                entry["root"] = root.into();
            }
            entry
        })
        .collect();
    Bytes::from(serde_json::json!({"object": "list", "data": data}).to_string())
}

impl Gateway {
    /// Ask every due, eligible target for its `/v1/models`, within [`FETCH_BUDGET`].
    pub(super) async fn refresh_model_info(&self, table: &RouteTable) {
        if self.models.refreshing.swap(true, Ordering::Acquire) {
            return;
        }
        let _refreshing = Refreshing(&self.models.refreshing);
        let live: HashSet<&str> = table
            .routes_by_alias()
            .flat_map(|r| r.targets.iter().map(|t| t.state.label()))
            .collect();
        self.models
            .by_target
            .retain(|label, _| live.contains(label.as_str()));
        let started = Instant::now();
        let now_ms = crate::fleet::ms_at(started);
        for route in table.routes_by_alias() {
            for target in &route.targets {
                let label = target.state.label();
                if !self.models.due(label, Instant::now()) || !target.state.eligible(now_ms) {
                    continue;
                }
                let Some(left) = FETCH_BUDGET.checked_sub(started.elapsed()) else {
                    return;
                };
                let info = tokio::time::timeout(left, self.fetch_model_info(table, target))
                    .await
                    .ok()
                    .flatten();
                if info.is_none() {
                    log::debug!("target {label}: no /v1/models answer");
                }
                self.models
                    .by_target
                    .insert(label.to_string(), (Instant::now(), info));
            }
        }
    }

    async fn fetch_model_info(
        &self,
        table: &RouteTable,
        target: &RouteTarget,
    ) -> Option<ModelInfo> {
        // The provider's own key, when it has one (a vLLM started with --api-key).
        let auth = target
            .authorization
            .as_ref()
            .map(|k| format!("authorization: {}\r\n", k.expose()))
            .unwrap_or_default();
        let request = format!(
            "GET {}/v1/models HTTP/1.1\r\nhost: {}\r\naccept: application/json\r\n{auth}content-length: 0\r\n\r\n",
            target.base_path, target.host
        );
        let up = self.upstream_for(table, target, false);
        let (status, body) =
            upstream::fetch_small(&self.pool, &up, request.as_bytes(), MAX_ANSWER_BYTES)
                .await
                .ok()?;
        if status != 200 {
            return None;
        }
        parse_model_list(&body, &target.upstream_model)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_model_lists_are_read_for_the_served_model() {
        let body = br#"{"object":"list","data":[
            {"id":"lora-a","object":"model","root":"/adapters/a","parent":"org/base","max_model_len":8192},
            {"id":"org/base","object":"model","created":1,"owned_by":"vllm","root":"org/base","parent":null,"max_model_len":32768,"permission":[{"id":"p"}]}]}"#;
        assert_eq!(
            parse_model_list(body, "org/base"),
            Some(ModelInfo {
                root: Some("org/base".into()),
                max_model_len: Some(32768)
            })
        );
        assert_eq!(
            parse_model_list(body, "lora-a").unwrap().max_model_len,
            Some(8192)
        );
        // Not served here and more than one entry: unknown, not a guess.
        assert_eq!(parse_model_list(body, "other"), None);
        let one = br#"{"data":[{"id":"served-name"}]}"#;
        assert_eq!(parse_model_list(one, "x"), Some(ModelInfo::default()));
        assert_eq!(parse_model_list(b"not json", "x"), None);
        assert_eq!(parse_model_list(br#"{"data":[{"id":5}]}"#, "x"), None);
    }
}
