//! Repeated runs: the interleaved order of rounds, and one strategy's runs folded into medians
//! and a spread.
//!
//! Owns only arithmetic and the summary table; running is `compare`'s job. Times on a shared
//! machine drift over minutes, so `compare --repeats N` runs every strategy once per round, in an
//! order rotated by one each round, and a strategy's row is the median of its N runs (the mean of
//! the two middle values when N is even), with the hit rate's min–max beside it.

use std::fmt::Write as _;

use serde::Serialize;

use crate::load::report::{Percentiles, StrategyReport};
use crate::load::upper_bound::HitCount;

/// The order of round `round`: `strategies` rotated left by `round` (mod their count).
pub fn round_order<T: Clone>(strategies: &[T], round: usize) -> Vec<T> {
    if strategies.is_empty() {
        return Vec::new();
    }
    let k = round % strategies.len();
    strategies[k..]
        .iter()
        .chain(&strategies[..k])
        .cloned()
        .collect()
}

/// Median of a sample (mean of the two middle values for an even count; 0 when empty).
pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// One strategy over its runs.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct StrategySummary {
    pub strategy: String,
    pub runs: usize,
    /// Median fleet hit rate.
    pub hit_rate: f64,
    pub hit_rate_min: f64,
    pub hit_rate_max: f64,
    /// Median of each percentile over the runs.
    pub ttft_ms: Percentiles,
    pub e2e_ms: Percentiles,
    pub throughput: f64,
    pub goodput: f64,
    pub max_over_mean: f64,
    /// Errors over all runs.
    pub errors: usize,
    /// Requests over all runs.
    pub requests: usize,
}

fn median_of(runs: &[StrategyReport], f: impl Fn(&StrategyReport) -> f64) -> f64 {
    median(runs.iter().map(f).collect())
}

/// Fold a strategy's runs (all with the same `strategy` name) into medians and a spread.
pub fn summarize_runs(strategy: &str, runs: &[StrategyReport]) -> StrategySummary {
    let hits: Vec<f64> = runs.iter().map(|r| r.hit_rate).collect();
    let pct = |g: fn(&StrategyReport) -> &Percentiles| Percentiles {
        p50: median_of(runs, |r| g(r).p50),
        p90: median_of(runs, |r| g(r).p90),
        p99: median_of(runs, |r| g(r).p99),
    };
    StrategySummary {
        strategy: strategy.to_string(),
        runs: runs.len(),
        hit_rate: median(hits.clone()),
        hit_rate_min: hits.iter().copied().reduce(f64::min).unwrap_or(0.0),
        hit_rate_max: hits.iter().copied().reduce(f64::max).unwrap_or(0.0),
        ttft_ms: pct(|r| &r.ttft_ms),
        e2e_ms: pct(|r| &r.e2e_ms),
        throughput: median_of(runs, |r| r.throughput),
        goodput: median_of(runs, |r| r.goodput),
        max_over_mean: median_of(runs, |r| r.max_over_mean),
        errors: runs.iter().map(|r| r.errors).sum(),
        requests: runs.iter().map(|r| r.requests).sum(),
    }
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

/// The summary table: one row per strategy (medians), then the upper bound.
pub fn summary_table(rows: &[StrategySummary], bound: Option<HitCount>) -> String {
    let mut s = String::from(
        "| strategy | runs | hit rate (median) | hit rate min–max | of bound \
         | TTFT p50 / p90 / p99 ms | E2E p50 / p90 / p99 ms | req/s | max/mean | errors |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    let b = bound.map_or(0.0, |b| b.rate());
    for r in rows {
        let of_bound = if b > 0.0 {
            pct(r.hit_rate / b)
        } else {
            "–".into()
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.1}–{:.1} | {} | {:.0} / {:.0} / {:.0} | {:.0} / {:.0} / {:.0} \
             | {:.1} | {:.2} | {} |",
            r.strategy,
            r.runs,
            pct(r.hit_rate),
            r.hit_rate_min * 100.0,
            r.hit_rate_max * 100.0,
            of_bound,
            r.ttft_ms.p50,
            r.ttft_ms.p90,
            r.ttft_ms.p99,
            r.e2e_ms.p50,
            r.e2e_ms.p90,
            r.e2e_ms.p99,
            r.throughput,
            r.max_over_mean,
            r.errors,
        );
    }
    if b > 0.0 {
        let _ = writeln!(
            s,
            "| *upper bound: one replica, unbounded cache* | | {} | | 100% | | | | | |",
            pct(b)
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(hit: f64, ttft50: f64, mm: f64, errors: usize) -> StrategyReport {
        StrategyReport {
            strategy: "x".into(),
            requests: 10,
            errors,
            hit_rate: hit,
            ttft_ms: Percentiles {
                p50: ttft50,
                p90: 2.0 * ttft50,
                p99: 3.0 * ttft50,
            },
            e2e_ms: Percentiles::default(),
            throughput: 1.0,
            goodput: 0.5,
            shares: vec![],
            max_over_mean: mm,
            wall_s: 1.0,
            error_samples: vec![],
        }
    }

    #[test]
    fn rounds_rotate_so_each_strategy_takes_each_slot_once() {
        let s = ["a", "b", "c"];
        assert_eq!(round_order(&s, 0), ["a", "b", "c"]);
        assert_eq!(round_order(&s, 1), ["b", "c", "a"]);
        assert_eq!(round_order(&s, 2), ["c", "a", "b"]);
        assert_eq!(round_order(&s, 3), ["a", "b", "c"]);
        for slot in 0..3 {
            let mut firsts: Vec<&str> = (0..3).map(|r| round_order(&s, r)[slot]).collect();
            firsts.sort();
            assert_eq!(firsts, ["a", "b", "c"]);
        }
        assert!(round_order::<&str>(&[], 4).is_empty());
    }

    #[test]
    fn medians() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(vec![7.0]), 7.0);
        assert_eq!(median(vec![]), 0.0);
    }

    #[test]
    fn runs_fold_into_medians_and_spread() {
        let runs = [
            run(0.80, 100.0, 1.10, 0),
            run(0.90, 300.0, 1.30, 2),
            run(0.85, 200.0, 1.20, 1),
        ];
        let s = summarize_runs("cache_aware", &runs);
        assert_eq!(s.strategy, "cache_aware");
        assert_eq!(s.runs, 3);
        assert_eq!(s.hit_rate, 0.85);
        assert_eq!((s.hit_rate_min, s.hit_rate_max), (0.80, 0.90));
        assert_eq!(s.ttft_ms.p50, 200.0);
        assert_eq!(s.ttft_ms.p90, 400.0);
        assert_eq!(s.ttft_ms.p99, 600.0);
        assert_eq!(s.max_over_mean, 1.20);
        assert_eq!((s.errors, s.requests), (3, 30));
        let t = summary_table(
            &[s],
            Some(HitCount {
                queries: 100,
                hits: 95,
            }),
        );
        assert!(
            t.contains("| cache_aware | 3 | 85.0% | 80.0–90.0 | 89.5% | 200 / 400 / 600 |"),
            "{t}"
        );
        assert!(t.contains("| 1.20 | 3 |"), "{t}");
    }
}
