//! Replica KV-cache sizes read from the replicas themselves: vLLM publishes its cache
//! configuration as the Prometheus info metric `vllm:cache_config_info` on `GET /metrics`,
//! so a provider without `kv_cache_tokens` still gets sized tries and a known cache size.
//!
//! Owns: reading the size out of a metrics body ([`parse_cache_tokens`]), one replica's
//! read loop ([`Reader`]) and the background service running them
//! ([`CacheSizePollService`]). A good read is published through
//! [`CacheSizeEndpoint::publish`] (`fleet::cache_size`, which the route table holds). Must
//! not: make routing decisions, or read anything for a provider whose `kv_cache_tokens` is
//! set (the table lists only the others).
//!
//! ## The size
//! One sample per engine the server fronts (`engine` label; several under data
//! parallelism), its labels the engine's `CacheConfig`, `str()`-ed: newer vLLM names
//! `kv_cache_size_tokens`, per engine; every release names `num_gpu_blocks` and
//! `block_size`, where `num_gpu_blocks` is the sum over the server's engines (its front end
//! adds up what each engine reports and writes the sum into every sample). The size is one
//! engine's cache, as a prompt lives in one engine's: the smallest `kv_cache_size_tokens`,
//! else `num_gpu_blocks` × `block_size` over the number of samples. A value not filled in
//! yet (`None`, `0`) counts as absent. Label values follow the text exposition format
//! (quoted, `\\`, `\"`, `\n` escapes); `prometheus-parse` 0.2 splits a label set on `,` and
//! `=` without honouring quotes, so this one metric is read here; a malformed sample is
//! skipped while another gives the size.
//!
//! ## When
//! At start and after every reload (the table's endpoints restart), then every
//! [`REFRESH`] after a good read: a replica restarted with another cache size is picked
//! up. A failed read keeps the last size (a replica being down does not change its cache)
//! and retries after [`RETRY_FIRST`], doubling up to [`REFRESH`]. Every read re-checks the
//! replica's address against the current egress policy; a denied one is not contacted.

use crate::egress::EgressPolicy;
pub use crate::fleet::cache_size::CacheSizeEndpoint;
use crate::http_get::{self, Get, PollResult};
use crate::metrics::METRICS;
use crate::runtime::generations::run_per_table;
use crate::runtime::Runtime;
use async_trait::async_trait;
use pingora::connectors::http::v1::Connector;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

/// The info metric vLLM exposes its `CacheConfig` as.
pub const CACHE_CONFIG_INFO: &str = "vllm:cache_config_info";
/// Time between two good reads.
pub const REFRESH: Duration = Duration::from_secs(60);
/// First retry after a failed read (then doubling, up to [`REFRESH`]).
pub const RETRY_FIRST: Duration = Duration::from_secs(1);
/// Connect, request and body of one read.
pub const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest metrics body read (vLLM's is a few hundred KiB with all its histograms).
pub const MAX_METRICS_BODY_BYTES: usize = 16 << 20;

/// Why a metrics body gave no cache size.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoCacheSize {
    /// No `vllm:cache_config_info` sample at all (not vLLM, or metrics off).
    #[error("no vllm:cache_config_info sample")]
    NoSample,
    /// Samples, but none with a size (the engine has not profiled its memory yet).
    #[error(
        "vllm:cache_config_info names no cache size (kv_cache_size_tokens, or num_gpu_blocks and block_size)"
    )]
    NotFilledIn,
    /// Every sample's label set is malformed.
    #[error("vllm:cache_config_info: malformed label set: {0}")]
    Malformed(&'static str),
}

/// The KV-cache size in tokens a metrics body reports (see the module docs).
pub fn parse_cache_tokens(text: &str) -> Result<u64, NoCacheSize> {
    let mut per_engine: Option<u64> = None;
    let mut summed_blocks: Option<u64> = None;
    let mut samples = 0u64;
    let mut malformed = None;
    for line in text.lines() {
        let Some(after) = line.trim_start().strip_prefix(CACHE_CONFIG_INFO) else {
            continue;
        };
        // The name ends at '{' or a space; anything else is a longer name.
        if !after.starts_with(|c: char| c == '{' || c.is_ascii_whitespace()) {
            continue;
        }
        let rest = after.trim_start();
        let labels = if rest.starts_with('{') {
            match parse_label_set(rest) {
                Ok(labels) => labels,
                Err(why) => {
                    malformed = Some(why);
                    continue;
                }
            }
        } else {
            Vec::new()
        };
        samples += 1;
        let get = |name: &str| {
            labels
                .iter()
                .find(|(k, _)| *k == name)
                .and_then(|(_, v)| v.trim().parse::<u64>().ok())
                .filter(|&n| n > 0)
        };
        if let Some(tokens) = get("kv_cache_size_tokens") {
            per_engine = Some(per_engine.map_or(tokens, |t| t.min(tokens)));
        }
        if let Some(tokens) = get("num_gpu_blocks").and_then(|b| b.checked_mul(get("block_size")?))
        {
            summed_blocks = Some(summed_blocks.map_or(tokens, |t| t.min(tokens)));
        }
    }
    match (per_engine, summed_blocks, samples, malformed) {
        (Some(tokens), _, _, _) => Ok(tokens),
        (None, Some(tokens), n, _) => Ok((tokens / n.max(1)).max(1)),
        (None, None, 0, Some(why)) => Err(NoCacheSize::Malformed(why)),
        (None, None, 0, None) => Err(NoCacheSize::NoSample),
        (None, None, _, _) => Err(NoCacheSize::NotFilledIn),
    }
}

/// The labels of `{name="value",...}` at the start of `s` (exposition-format quoting and
/// escapes; a trailing comma allowed), as (name, unescaped value) pairs.
fn parse_label_set(s: &str) -> Result<Vec<(&str, String)>, &'static str> {
    let mut rest = s.strip_prefix('{').unwrap_or(s);
    let mut labels = Vec::new();
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix('}') {
            if after.is_empty() || after.starts_with(|c: char| c.is_ascii_whitespace()) {
                return Ok(labels);
            }
            return Err("no space before the value");
        }
        let name_len = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        if name_len == 0 {
            return Err("expected a label name");
        }
        let (name, after) = rest.split_at(name_len);
        let Some(after) = after.trim_start().strip_prefix('=') else {
            return Err("expected '=' after a label name");
        };
        let Some(quoted) = after.trim_start().strip_prefix('"') else {
            return Err("expected a quoted label value");
        };
        let mut value = String::new();
        let mut chars = quoted.char_indices();
        let end = loop {
            match chars.next() {
                None => return Err("unterminated label value"),
                Some((i, '"')) => break i,
                Some((_, '\\')) => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, c @ ('\\' | '"'))) => value.push(c),
                    _ => return Err("unknown escape in a label value"),
                },
                Some((_, c)) => value.push(c),
            }
        };
        labels.push((name, value));
        rest = quoted[end + 1..].trim_start();
        if let Some(after) = rest.strip_prefix(',') {
            rest = after;
        } else if !rest.starts_with('}') {
            return Err("expected ',' or '}' after a label value");
        }
    }
}

/// What one read found: the size in tokens, or why there is none.
pub type ReadResult = PollResult<u64>;

/// Reads replicas' cache sizes over one HTTP connector.
pub struct Reader {
    connector: Connector,
}

impl Default for Reader {
    fn default() -> Self {
        Reader {
            connector: Connector::new(None),
        }
    }
}

impl Reader {
    /// One read of `ep` under `policy`; publishes nothing.
    pub async fn read_once(&self, ep: &CacheSizeEndpoint, policy: &EgressPolicy) -> ReadResult {
        if let Err(e) = policy.check_resolved(&ep.host_name, &[ep.addr.ip()]) {
            return ReadResult::Denied(e);
        }
        let req = Get {
            addr: ep.addr,
            authority: &ep.authority,
            path: &ep.path,
            accept: "text/plain",
            timeout: READ_TIMEOUT,
            max_body_bytes: MAX_METRICS_BODY_BYTES,
        };
        match http_get::get(&self.connector, &req).await {
            Ok(body) => match std::str::from_utf8(&body) {
                Ok(text) => match parse_cache_tokens(text) {
                    Ok(tokens) => ReadResult::Ok(tokens),
                    Err(why) => ReadResult::Invalid(why.to_string()),
                },
                Err(_) => ReadResult::Invalid("body is not UTF-8".into()),
            },
            Err(e) => e.into(),
        }
    }

    /// One read of `ep`, published when good, counted in metrics.
    pub async fn refresh(&self, ep: &CacheSizeEndpoint, policy: &EgressPolicy) -> ReadResult {
        let result = self.read_once(ep, policy).await;
        if let ReadResult::Ok(tokens) = result {
            ep.publish(tokens);
        }
        METRICS
            .cache_size_reads
            .with_label_values(&[&ep.provider, result.label()])
            .inc();
        result
    }

    /// Read `ep` on the schedule of the module docs until cancelled; logs when the
    /// outcome changes.
    pub async fn run(&self, ep: &CacheSizeEndpoint, policy: &EgressPolicy) {
        let mut retry = RETRY_FIRST;
        let mut last: Option<ReadResult> = None;
        loop {
            let result = self.refresh(ep, policy).await;
            let changed = last.as_ref().is_none_or(|l| match (l, &result) {
                (ReadResult::Ok(a), ReadResult::Ok(b)) => a != b,
                (a, b) => a.label() != b.label(),
            });
            let wait = if let ReadResult::Ok(tokens) = result {
                retry = RETRY_FIRST;
                if changed {
                    log::info!(
                        "cache size of {} read from {}{}: {tokens} tokens",
                        ep.provider,
                        ep.addr,
                        ep.path
                    );
                }
                REFRESH
            } else {
                if changed {
                    let known = ep.known_tokens();
                    if known > 0 {
                        log::warn!(
                            "cache size of {} ({}{}): {result}; keeping {known} tokens",
                            ep.provider,
                            ep.addr,
                            ep.path
                        );
                    } else {
                        log::warn!(
                            "cache size of {} ({}{}) unknown: {result}; until it is read, its \
                             prefix trie does not forget what the replica evicts (set \
                             kv_cache_tokens, or metrics_path = \"\" to stop reading)",
                            ep.provider,
                            ep.addr,
                            ep.path
                        );
                    }
                }
                let wait = retry;
                retry = (retry * 2).min(REFRESH);
                wait
            };
            last = Some(result);
            tokio::time::sleep(wait).await;
        }
    }
}

/// The background service running every replica's read loop; restarts them when a
/// reload swaps the route table (`runtime::generations`).
pub struct CacheSizePollService(pub Arc<Runtime>);

#[async_trait]
impl BackgroundService for CacheSizePollService {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let reader = Arc::new(Reader::default());
        let mut read_before: HashSet<String> = HashSet::new();
        run_per_table(&self.0, &mut shutdown, |table, tasks| {
            // The old table's reads are gone: a replica no longer read loses its gauge.
            let read_now: HashSet<String> = table
                .cache_size_endpoints()
                .iter()
                .map(|ep| ep.provider.clone())
                .collect();
            for gone in read_before.difference(&read_now) {
                crate::metrics::forget_reported_cache_size(gone);
            }
            read_before = read_now;
            for ep in table.cache_size_endpoints() {
                let (reader, ep, policy) = (reader.clone(), ep.clone(), table.egress().clone());
                tasks.spawn(async move { reader.run(&ep, &policy).await });
            }
        })
        .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_size_is_kv_cache_size_tokens_else_blocks_times_block_size() {
        let old = "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
                   # TYPE vllm:cache_config_info gauge\n\
                   vllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",\
                   gpu_memory_utilization=\"0.9\",num_cpu_blocks=\"None\",num_gpu_blocks=\"81767\",\
                   num_gpu_blocks_override=\"None\",sliding_window=\"None\"} 1.0\n\
                   vllm:num_requests_running{model_name=\"m\"} 0.0\n";
        assert_eq!(parse_cache_tokens(old), Ok(81767 * 16));
        let new = "vllm:cache_config_info{block_size=\"16\",engine=\"0\",kv_cache_size_tokens=\"123433\",\
                   num_gpu_blocks=\"14835\"} 1.0\n";
        assert_eq!(parse_cache_tokens(new), Ok(123433));
        // Not profiled yet: the label is there but says nothing; the older field is used.
        let unfilled = "vllm:cache_config_info{block_size=\"16\",kv_cache_size_tokens=\"None\",\
                        num_gpu_blocks=\"100\"} 1.0\n";
        assert_eq!(parse_cache_tokens(unfilled), Ok(1600));
    }

    #[test]
    fn under_data_parallelism_the_size_is_one_engines_cache() {
        // vLLM's front end writes the blocks summed over its engines into every sample, and
        // each engine's own kv_cache_size_tokens.
        let summed = "vllm:cache_config_info{engine=\"0\",block_size=\"16\",num_gpu_blocks=\"17000\"} 1.0\n\
                      vllm:cache_config_info{engine=\"1\",block_size=\"16\",num_gpu_blocks=\"17000\"} 1.0\n";
        assert_eq!(parse_cache_tokens(summed), Ok(8500 * 16));
        let per_engine = "vllm:cache_config_info{engine=\"0\",block_size=\"16\",kv_cache_size_tokens=\"144000\",num_gpu_blocks=\"17000\"} 1.0\n\
                          vllm:cache_config_info{engine=\"1\",block_size=\"16\",kv_cache_size_tokens=\"128000\",num_gpu_blocks=\"17000\"} 1.0\n";
        assert_eq!(parse_cache_tokens(per_engine), Ok(128000));
    }

    #[test]
    fn a_body_without_a_size_is_an_error_that_says_why() {
        assert_eq!(
            parse_cache_tokens("vllm:num_requests_running 0\n"),
            Err(NoCacheSize::NoSample)
        );
        assert_eq!(
            parse_cache_tokens(
                "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"None\"} 1.0\n\
                 vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"0\"} 1.0\n\
                 vllm:cache_config_info 1.0\n",
            ),
            Err(NoCacheSize::NotFilledIn)
        );
        // A longer metric name is another metric.
        assert_eq!(
            parse_cache_tokens(
                "vllm:cache_config_info_extra{block_size=\"16\",num_gpu_blocks=\"4\"} 1\n"
            ),
            Err(NoCacheSize::NoSample)
        );
        for broken in [
            "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"4} 1\n",
            "vllm:cache_config_info{block_size=16} 1\n",
            "vllm:cache_config_info{block_size=\"16\" num_gpu_blocks=\"4\"} 1\n",
            "vllm:cache_config_info{a=\"\\x\"} 1\n",
            "vllm:cache_config_info{=\"1\"} 1\n",
            "vllm:cache_config_info{block_size=\"16\"}1\n",
        ] {
            let e = parse_cache_tokens(broken).unwrap_err();
            assert!(matches!(e, NoCacheSize::Malformed(_)), "{broken}: {e}");
        }
        // A malformed sample beside a good one: the good one counts.
        assert_eq!(
            parse_cache_tokens(
                "vllm:cache_config_info{block_size=16} 1\n\
                 vllm:cache_config_info {block_size=\"16\",num_gpu_blocks=\"4\"} 1\n"
            ),
            Ok(64)
        );
    }

    #[test]
    fn quoted_commas_equals_and_escapes_do_not_split_labels() {
        let text =
            "vllm:cache_config_info{model_name=\"a,b=c \\\"d\\\" \\\\ }\",block_size=\"32\",\
                    num_gpu_blocks=\"10\",} 1.0\n";
        assert_eq!(parse_cache_tokens(text), Ok(320));
    }

    proptest::proptest! {
        /// Whatever a label value holds, the exposition the `prometheus` crate writes for
        /// it reads back to the same labels and size.
        #[test]
        fn labels_read_back_from_the_prometheus_encoder(
            model in "\\PC{0,24}",
            blocks in 1u64..10_000_000,
            block_size in proptest::sample::select(vec![1u64, 16, 32, 64]),
        ) {
            use prometheus::{Encoder, Opts, Registry, TextEncoder, GaugeVec};
            let registry = Registry::new();
            let info = GaugeVec::new(
                Opts::new("vllm:cache_config_info", "CacheConfig"),
                &["model_name", "block_size", "num_gpu_blocks"],
            ).unwrap();
            registry.register(Box::new(info.clone())).unwrap();
            info.with_label_values(&[&model, &block_size.to_string(), &blocks.to_string()]).set(1.0);
            let mut out = Vec::new();
            TextEncoder::new().encode(&registry.gather(), &mut out).unwrap();
            let text = String::from_utf8(out).unwrap();
            let line = text.lines().find(|l| l.starts_with(CACHE_CONFIG_INFO)).unwrap();
            let labels = parse_label_set(&line[CACHE_CONFIG_INFO.len()..]).unwrap();
            proptest::prop_assert!(labels.contains(&("model_name", model.clone())));
            proptest::prop_assert_eq!(parse_cache_tokens(&text), Ok(blocks * block_size));
        }
    }
}
