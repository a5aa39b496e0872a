//! `rolter-load sweep`: the comparison at rising open-loop rates, up to saturation.
//!
//! Owns the rate loop and the goodput table; each rate is a full comparison (`compare`'s rounds:
//! every strategy on a fresh fleet, interleaved, repeated) with Poisson arrivals at that rate.
//! Goodput is the successful requests per second whose TTFT is within `--slo-ttft-ms`: past
//! saturation queues grow, TTFT leaves the objective and goodput falls while throughput may
//! not, so the rate where each strategy's goodput peaks is its usable capacity.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;

use crate::load::compare::{
    numbered_runs, run_rounds, with_gateway_twins, workdir, write_report, CompareArgs,
    CompareError, DriverArgs, Rounds,
};
use crate::load::document::{describe_workload, render_header, TABLE_NOTES};
use crate::load::repeats::{summarize_runs, summary_table, StrategySummary};
use crate::load::report::markdown_table;
use crate::load::upper_bound::upper_bound;
use crate::load::workload::{generate, request_count, WorkloadSpec};
use crate::sim_args::SimArgs;

/// One rate's medians.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RatePoint {
    pub rate: f64,
    pub strategies: Vec<StrategySummary>,
}

/// The goodput table: one row per strategy, one column per rate, each cell the median goodput
/// and, in parentheses, the median TTFT p90.
pub fn goodput_table(points: &[RatePoint]) -> String {
    let mut names: Vec<&str> = Vec::new();
    for p in points {
        for s in &p.strategies {
            if !names.contains(&s.strategy.as_str()) {
                names.push(&s.strategy);
            }
        }
    }
    let mut t = String::from("| strategy |");
    for p in points {
        let _ = write!(t, " {} req/s |", p.rate);
    }
    t.push_str("\n|---|");
    t.push_str(&"---:|".repeat(points.len()));
    t.push('\n');
    for name in names {
        let _ = write!(t, "| {name} |");
        for p in points {
            match p.strategies.iter().find(|s| s.strategy == name) {
                Some(s) => {
                    let _ = write!(t, " {:.1} ({:.0}) |", s.goodput, s.ttft_ms.p90);
                }
                None => t.push_str(" – |"),
            }
        }
        t.push('\n');
    }
    t
}

/// Run the comparison at each of `rates` and write the sweep report; returns the markdown.
pub async fn sweep(
    workload: &WorkloadSpec,
    sim: &SimArgs,
    driver: &DriverArgs,
    args: &CompareArgs,
    rates: &[f64],
) -> Result<String, CompareError> {
    let sessions = Arc::new(generate(workload));
    let n_requests = request_count(&sessions);
    let bound = upper_bound(&sessions, sim.block_size);
    let dir = workdir()?;
    let rounds = args.repeats.max(1);
    let strategies = with_gateway_twins(&args.strategies, args.gateways, args.peering);
    let mut points = Vec::new();
    let mut detail = String::new();
    let mut all_runs = Vec::new();
    let mut skipped_all: Vec<(String, String)> = Vec::new();
    for &rate in rates {
        eprintln!("#### {rate} requests/s");
        let at_rate = DriverArgs {
            rate: Some(rate),
            ..driver.clone()
        };
        let Rounds { runs, skipped } = run_rounds(
            &strategies,
            rounds,
            &sessions,
            sim,
            &at_rate,
            args,
            workload.seed,
            &dir,
        )
        .await?;
        let summaries: Vec<StrategySummary> =
            runs.iter().map(|(s, v)| summarize_runs(s, v)).collect();
        let _ = writeln!(detail, "\n### {rate} requests/s\n");
        detail.push_str(&summary_table(&summaries, Some(bound)));
        let numbered = numbered_runs(&runs);
        if rounds > 1 {
            detail.push('\n');
            detail.push_str(&markdown_table(&numbered, Some(bound)));
        }
        all_runs.push(serde_json::json!({ "rate": rate, "runs": numbered }));
        for s in skipped {
            if !skipped_all.contains(&s) {
                skipped_all.push(s);
            }
        }
        points.push(RatePoint {
            rate,
            strategies: summaries,
        });
    }
    let think = if driver.think_time_ms > 0.0 {
        format!(
            ", mean think time {} ms between a reply and the next turn",
            driver.think_time_ms
        )
    } else {
        String::new()
    };
    let mut md = render_header(workload, sim, driver, n_requests)
        .replacen("# Routing comparison:", "# Rate sweep:", 1)
        .replacen(
            &format!("- Load: {}.", driver.describe()),
            &format!("- Load: open loop, Poisson arrivals at each rate below{think}."),
            1,
        );
    let _ = writeln!(
        md,
        "Open loop (Poisson arrivals) at each rate; goodput = successful requests per second \
         whose TTFT is at most **{} ms** (the objective), median of {rounds} interleaved \
         run(s) per strategy and rate; in parentheses the median TTFT p90 in ms.\n",
        driver.slo_ttft_ms
    );
    md.push_str(&goodput_table(&points));
    md.push_str(&detail);
    md.push_str(TABLE_NOTES);
    for (strategy, reason) in &skipped_all {
        let _ = writeln!(md, "\nNot run: `{strategy}` ({reason}).");
    }
    let out = args.out.clone().unwrap_or_else(|| {
        PathBuf::from(format!(
            "loadtest/reports/{}-sweep.md",
            workload.workload.name()
        ))
    });
    let json = serde_json::json!({
        "workload": describe_workload(workload, n_requests),
        "upper_bound_hit_rate": bound.rate(),
        "slo_ttft_ms": driver.slo_ttft_ms,
        "repeats": rounds,
        "rates": points,
        "runs": all_runs,
    });
    write_report(&out, &md, &json)?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::report::Percentiles;

    fn summary(name: &str, goodput: f64, p90: f64) -> StrategySummary {
        StrategySummary {
            strategy: name.into(),
            runs: 1,
            hit_rate: 0.5,
            hit_rate_min: 0.5,
            hit_rate_max: 0.5,
            ttft_ms: Percentiles {
                p50: 1.0,
                p90,
                p99: 1.0,
            },
            e2e_ms: Percentiles::default(),
            throughput: goodput,
            goodput,
            max_over_mean: 1.0,
            errors: 0,
            requests: 1,
        }
    }

    #[test]
    fn one_row_per_strategy_one_column_per_rate() {
        let points = [
            RatePoint {
                rate: 10.0,
                strategies: vec![summary("a", 9.5, 40.0), summary("b", 9.0, 80.0)],
            },
            RatePoint {
                rate: 40.0,
                strategies: vec![summary("a", 30.31, 400.0)],
            },
        ];
        let t = goodput_table(&points);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "| strategy | 10 req/s | 40 req/s |");
        assert_eq!(lines[2], "| a | 9.5 (40) | 30.3 (400) |");
        assert_eq!(lines[3], "| b | 9.0 (80) | – |");
        assert_eq!(lines.len(), 4);
    }
}
