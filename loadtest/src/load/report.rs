//! Turning a run into numbers and a markdown table.
//!
//! Owns the statistics (nearest-rank percentiles, shares, max/mean load, fleet hit rate from
//! counter deltas) and the report layout; it never talks to the network.

use std::fmt::Write as _;
use std::time::Duration;

use serde::Serialize;

use crate::load::runner::RunOutcome;
use crate::load::scrape::ReplicaCounters;
use crate::load::upper_bound::HitCount;

/// p50 / p90 / p99 of a sample, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

/// Nearest-rank percentile `q` (0..=1) of sorted `v`.
pub fn percentile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// p50/p90/p99 of a sample.
pub fn percentiles(mut v: Vec<Duration>) -> Percentiles {
    v.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    Percentiles {
        p50: ms(percentile(&v, 0.50)),
        p90: ms(percentile(&v, 0.90)),
        p99: ms(percentile(&v, 0.99)),
    }
}

/// The result of one strategy on one workload.
#[derive(Debug, Clone, Serialize)]
pub struct StrategyReport {
    pub strategy: String,
    pub requests: usize,
    pub errors: usize,
    /// Fleet prefix-cache hit rate: Σ hits / Σ queries over the replicas during the run.
    pub hit_rate: f64,
    pub ttft_ms: Percentiles,
    pub e2e_ms: Percentiles,
    /// Successful requests per second of wall time.
    pub throughput: f64,
    /// Successful requests with TTFT within the run's objective, per second of wall time (0
    /// unless the caller sets it: see [`goodput`]).
    pub goodput: f64,
    /// Each replica's fraction of the requests it received.
    pub shares: Vec<f64>,
    /// Busiest replica's requests over the mean (1.0 = perfectly even).
    pub max_over_mean: f64,
    pub wall_s: f64,
    /// First few distinct error messages.
    pub error_samples: Vec<String>,
}

/// Summarize a run given the replicas' counters before and after it.
pub fn summarize(
    strategy: &str,
    run: &RunOutcome,
    before: &[ReplicaCounters],
    after: &[ReplicaCounters],
) -> StrategyReport {
    let deltas: Vec<ReplicaCounters> = after.iter().zip(before).map(|(a, b)| a.since(b)).collect();
    let queries: f64 = deltas.iter().map(|d| d.queries).sum();
    let hits: f64 = deltas.iter().map(|d| d.hits).sum();
    let reqs: Vec<f64> = deltas.iter().map(|d| d.requests).collect();
    let total: f64 = reqs.iter().sum();
    let shares = reqs
        .iter()
        .map(|r| if total > 0.0 { r / total } else { 0.0 })
        .collect();
    let mean = if reqs.is_empty() {
        0.0
    } else {
        total / reqs.len() as f64
    };
    let max = reqs.iter().cloned().fold(0.0, f64::max);
    let ok: Vec<_> = run.requests.iter().filter(|r| r.ok).collect();
    let mut error_samples: Vec<String> = Vec::new();
    for e in run.requests.iter().filter_map(|r| r.error.as_ref()) {
        if error_samples.len() < 3 && !error_samples.contains(e) {
            error_samples.push(e.clone());
        }
    }
    let wall = run.wall.as_secs_f64();
    StrategyReport {
        strategy: strategy.to_string(),
        requests: run.requests.len(),
        errors: run.requests.len() - ok.len(),
        hit_rate: if queries > 0.0 { hits / queries } else { 0.0 },
        ttft_ms: percentiles(ok.iter().filter_map(|r| r.ttft).collect()),
        e2e_ms: percentiles(ok.iter().map(|r| r.e2e).collect()),
        throughput: if wall > 0.0 {
            ok.len() as f64 / wall
        } else {
            0.0
        },
        goodput: 0.0,
        shares,
        max_over_mean: if mean > 0.0 { max / mean } else { 0.0 },
        wall_s: wall,
        error_samples,
    }
}

/// Goodput: successful requests whose TTFT is at most `slo`, per second of the run's wall time.
pub fn goodput(run: &RunOutcome, slo: Duration) -> f64 {
    let wall = run.wall.as_secs_f64();
    let good = run
        .requests
        .iter()
        .filter(|r| r.ok && r.ttft.is_some_and(|t| t <= slo))
        .count();
    if wall > 0.0 {
        good as f64 / wall
    } else {
        0.0
    }
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

fn triple(p: &Percentiles) -> String {
    format!("{:.0} / {:.0} / {:.0}", p.p50, p.p90, p.p99)
}

/// The comparison table (one row per strategy, then the upper bound).
pub fn markdown_table(reports: &[StrategyReport], bound: Option<HitCount>) -> String {
    let mut s = String::new();
    s.push_str(
        "| strategy | hit rate | of bound | TTFT p50 / p90 / p99 ms | E2E p50 / p90 / p99 ms \
         | req/s | requests per replica | max/mean | errors |\n",
    );
    s.push_str("|---|---:|---:|---:|---:|---:|---|---:|---:|\n");
    for r in reports {
        let of_bound = match bound {
            Some(b) if b.rate() > 0.0 => pct(r.hit_rate / b.rate()),
            _ => "–".into(),
        };
        let shares: Vec<String> = r
            .shares
            .iter()
            .map(|x| format!("{:.0}", x * 100.0))
            .collect();
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {:.1} | {} % | {:.2} | {} |",
            r.strategy,
            pct(r.hit_rate),
            of_bound,
            triple(&r.ttft_ms),
            triple(&r.e2e_ms),
            r.throughput,
            shares.join(" / "),
            r.max_over_mean,
            r.errors,
        );
    }
    if let Some(b) = bound {
        let _ = writeln!(
            s,
            "| *upper bound: one replica, unbounded cache* | {} | {} | | | | | | |",
            pct(b.rate()),
            if b.rate() > 0.0 { "100%" } else { "–" }
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::runner::RequestOutcome;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn nearest_rank() {
        let v: Vec<Duration> = (1..=100).map(ms).collect();
        assert_eq!(percentile(&v, 0.5), ms(50));
        assert_eq!(percentile(&v, 0.99), ms(99));
        assert_eq!(percentile(&v, 1.0), ms(100));
        assert_eq!(percentile(&[ms(7)], 0.9), ms(7));
        assert_eq!(percentile(&[], 0.5), Duration::ZERO);
    }

    #[test]
    fn summary_and_table() {
        let req = |ok: bool, e2e: u64| RequestOutcome {
            session: 0,
            turn: 0,
            call: 0,
            ok,
            error: (!ok).then(|| "HTTP 503".to_string()),
            ttft: ok.then(|| ms(e2e / 2)),
            e2e: ms(e2e),
            prompt_tokens: 10,
            replica: Some(0),
            cached_tokens: Some(0),
            sent_at: Duration::ZERO,
        };
        let run = RunOutcome {
            requests: vec![req(true, 10), req(true, 20), req(false, 5)],
            wall: Duration::from_secs(1),
        };
        let c = |q: f64, h: f64, r: f64| ReplicaCounters {
            queries: q,
            hits: h,
            requests: r,
        };
        let before = [c(0.0, 0.0, 0.0), c(100.0, 50.0, 1.0)];
        let after = [c(100.0, 20.0, 1.0), c(200.0, 110.0, 3.0)];
        let r = summarize("x", &run, &before, &after);
        assert_eq!(r.errors, 1);
        assert!((r.hit_rate - 0.4).abs() < 1e-9);
        assert_eq!(r.shares, vec![1.0 / 3.0, 2.0 / 3.0]);
        assert!((r.max_over_mean - 2.0 / 1.5).abs() < 1e-9);
        assert_eq!(r.throughput, 2.0);
        // TTFTs are 5 and 10 ms; the failed request never counts.
        assert_eq!(goodput(&run, ms(5)), 1.0);
        assert_eq!(goodput(&run, ms(10)), 2.0);
        assert_eq!(goodput(&run, ms(4)), 0.0);
        assert_eq!(r.e2e_ms.p50, 10.0);
        assert_eq!(r.error_samples, vec!["HTTP 503".to_string()]);
        let t = markdown_table(
            &[r],
            Some(HitCount {
                queries: 10,
                hits: 8,
            }),
        );
        assert!(t.contains("| x | 40.0% | 50.0% |"), "{t}");
        assert!(t.contains("| 33 / 67 % |"), "{t}");
        assert!(t.contains("80.0%"));
    }
}
