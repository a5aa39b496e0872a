//! Reading a replica's counters from its Prometheus `/metrics`.
//!
//! Owns the parsing of the few vLLM series the report needs, summed over label sets, so it works
//! against the simulator and against a real vLLM (which lacks `rolter_sim_requests_total`: then
//! `vllm:request_success_total` counts requests).

/// Counters of one replica at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ReplicaCounters {
    /// `vllm:prefix_cache_queries_total`.
    pub queries: f64,
    /// `vllm:prefix_cache_hits_total`.
    pub hits: f64,
    /// `rolter_sim_requests_total`, else `vllm:request_success_total`.
    pub requests: f64,
}

impl ReplicaCounters {
    /// `self − before`, per counter.
    pub fn since(&self, before: &ReplicaCounters) -> ReplicaCounters {
        ReplicaCounters {
            queries: self.queries - before.queries,
            hits: self.hits - before.hits,
            requests: self.requests - before.requests,
        }
    }
}

/// Sum of every sample of `name` (any labels) in Prometheus text, if present.
pub fn sample_sum(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let rest = match rest.chars().next() {
            Some('{') => match rest.find('}') {
                Some(end) => &rest[end + 1..],
                None => continue,
            },
            Some(' ') => rest,
            _ => continue, // a longer metric name
        };
        if let Some(v) = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

/// Parse the counters out of Prometheus text.
pub fn parse(text: &str) -> ReplicaCounters {
    ReplicaCounters {
        queries: sample_sum(text, "vllm:prefix_cache_queries_total").unwrap_or(0.0),
        hits: sample_sum(text, "vllm:prefix_cache_hits_total").unwrap_or(0.0),
        requests: sample_sum(text, "rolter_sim_requests_total")
            .or_else(|| sample_sum(text, "vllm:request_success_total"))
            .unwrap_or(0.0),
    }
}

/// Fetch and parse `{base_url}/metrics`.
pub async fn scrape(client: &reqwest::Client, base_url: &str) -> Result<ReplicaCounters, String> {
    let url = format!("{}/metrics", base_url.trim_end_matches('/'));
    let resp = client
        .get(&url)
        .send()
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    if !resp.status().is_success() {
        return Err(format!("{url}: HTTP {}", resp.status().as_u16()));
    }
    let text = resp.text().await.map_err(|e| format!("{url}: {e}"))?;
    Ok(parse(&text))
}

/// Scrape every replica.
pub async fn scrape_all(
    client: &reqwest::Client,
    base_urls: &[String],
) -> Result<Vec<ReplicaCounters>, String> {
    let mut out = Vec::with_capacity(base_urls.len());
    for u in base_urls {
        out.push(scrape(client, u).await?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_label_sets_and_ignores_longer_names() {
        let text = "\
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"a\"} 10.0
vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"a\"} 5
vllm:prefix_cache_hits_total_created{engine=\"0\"} 1.7e9
vllm:prefix_cache_queries_total 40
vllm:request_success_total{finished_reason=\"stop\"} 3
vllm:request_success_total{finished_reason=\"length\"} 4
";
        let c = parse(text);
        assert_eq!(c.hits, 15.0);
        assert_eq!(c.queries, 40.0);
        assert_eq!(c.requests, 7.0);
        assert_eq!(sample_sum(text, "vllm:missing"), None);
    }
}
