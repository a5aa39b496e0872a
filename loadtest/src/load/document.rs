//! The text of a comparison report: the workload and fleet in words, the header, the notes
//! under the tables, and the documents of `compare` (one run per strategy, or repeats).
//!
//! Owns wording and layout only; the tables themselves are `report`'s and `repeats`'.

use std::fmt::Write as _;

use crate::load::compare::DriverArgs;
use crate::load::repeats::{summary_table, StrategySummary};
use crate::load::report::{markdown_table, StrategyReport};
use crate::load::upper_bound::HitCount;
use crate::load::workload::{WorkloadKind, WorkloadSpec};
use crate::sim_args::SimArgs;

/// Describe the workload in one sentence.
pub fn describe_workload(w: &WorkloadSpec, requests: usize) -> String {
    match w.workload {
        WorkloadKind::MultiTurn => format!(
            "multi-turn chat: {} sessions × {} turns, each session on one of {} shared system \
             prompts of ~{} tokens, {}-token questions, {} output tokens, seed {} → {} requests",
            w.sessions,
            w.turns,
            w.prefixes,
            w.prefix_tokens,
            w.user_tokens,
            w.max_tokens,
            w.seed,
            requests
        ),
        WorkloadKind::FewShot => format!(
            "few-shot: {} requests, each one of {} templates of ~{} tokens + a unique {}-token \
             question, {} output tokens, seed {}",
            requests, w.prefixes, w.prefix_tokens, w.user_tokens, w.max_tokens, w.seed
        ),
        WorkloadKind::Unique => format!(
            "unique prompts: {} requests of {} unrelated tokens, {} output tokens, seed {}",
            requests, w.user_tokens, w.max_tokens, w.seed
        ),
        WorkloadKind::Agentic => format!(
            "agentic: {} agents × {} steps, each agent on one of {} tool prompts of ~{} tokens; \
             each step a {}-token instruction fanned out into {}–{} parallel calls ({} more \
             tokens each), the next step after all answered, {} output tokens, seed {} → {} \
             requests",
            w.sessions,
            w.turns,
            w.prefixes,
            w.prefix_tokens,
            w.user_tokens,
            w.fanout_min,
            w.fanout_max,
            w.call_tokens,
            w.max_tokens,
            w.seed,
            requests
        ),
        WorkloadKind::Skewed => format!(
            "skewed multi-turn chat: {} sessions × {} turns; a session's ~{}-token system prompt \
             is the hot one with probability {}, else one of {} others; {}-token questions, {} \
             output tokens, seed {} → {} requests",
            w.sessions,
            w.turns,
            w.prefix_tokens,
            w.hot_share,
            w.prefixes.saturating_sub(1),
            w.user_tokens,
            w.max_tokens,
            w.seed,
            requests
        ),
    }
}

fn describe_fleet(sim: &SimArgs) -> String {
    format!(
        "{} simulated replicas, cache {} blocks × {} tokens each, at most {} running (others \
         wait), prefill {} µs per uncached token, decode {} µs per output token",
        sim.replicas,
        sim.cache_blocks,
        sim.block_size,
        sim.max_running,
        sim.prefill_us_per_token,
        sim.decode_us_per_token
    )
}

/// The report's title and bullet list (workload, fleet, load, how to regenerate).
pub fn render_header(
    workload: &WorkloadSpec,
    sim: &SimArgs,
    driver: &DriverArgs,
    n_requests: usize,
) -> String {
    let mut s = format!("# Routing comparison: {}\n\n", workload.workload.name());
    let _ = writeln!(
        s,
        "- Workload: {}.",
        describe_workload(workload, n_requests)
    );
    let _ = writeln!(s, "- Fleet: {}.", describe_fleet(sim));
    let _ = writeln!(s, "- Load: {}.", driver.describe());
    let args: Vec<String> = std::env::args().skip(1).collect();
    let _ = writeln!(
        s,
        "- Regenerate: `loadtest/run.sh` (peers and repeats: `loadtest/peers.sh`; this table: \
         `rolter-load {}`).\n",
        args.join(" ")
    );
    s
}

pub const TABLE_NOTES: &str = "\nHit rate: Σ `vllm:prefix_cache_hits_total` / Σ \
    `vllm:prefix_cache_queries_total` (prompt tokens) over the replicas during the run. *of \
    bound*: that rate divided by the upper bound, the hit rate of a single replica with an \
    unbounded cache serving the same trace. Latencies in milliseconds over successful requests; \
    TTFT is the first content chunk of the streamed response. *requests per replica*: percent of \
    requests each replica received; *max/mean*: busiest replica over the mean (1.00 = even). \
    `smg_*` / `vllm_router_*` rows: that peer gateway in rolter's place (loadtest/peers.sh).\n";

/// The report document.
pub fn render(
    workload: &WorkloadSpec,
    sim: &SimArgs,
    driver: &DriverArgs,
    reports: &[StrategyReport],
    bound: HitCount,
    n_requests: usize,
) -> String {
    let mut s = render_header(workload, sim, driver, n_requests);
    s.push_str(&markdown_table(reports, Some(bound)));
    s.push_str(TABLE_NOTES);
    s
}

/// The report document of a repeated comparison: medians, then every run.
pub fn render_repeats(
    workload: &WorkloadSpec,
    sim: &SimArgs,
    driver: &DriverArgs,
    summaries: &[StrategySummary],
    runs: &[StrategyReport],
    bound: HitCount,
    n_requests: usize,
) -> String {
    let mut s = render_header(workload, sim, driver, n_requests);
    let rounds = summaries.iter().map(|r| r.runs).max().unwrap_or(0);
    let _ = writeln!(
        s,
        "Median of {rounds} interleaved runs per strategy (each round runs every strategy once \
         on a fresh fleet, the order rotated by one each round); *hit rate min–max* is the \
         spread over the runs, in percent.\n"
    );
    s.push_str(&summary_table(summaries, Some(bound)));
    s.push_str("\n### Every run\n\n");
    s.push_str(&markdown_table(runs, Some(bound)));
    s.push_str(TABLE_NOTES);
    s
}
