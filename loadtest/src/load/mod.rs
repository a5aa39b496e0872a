//! The load driver: seeded workloads, the runner, counter scraping, reports, the comparison.
//!
//! `workload` says what to send, `runner` sends it, `scrape` reads the replicas' counters,
//! `report` turns a run into numbers and markdown, `upper_bound` computes the best possible hit
//! rate of a workload, and `compare` runs every strategy through the gateway (`gateway` starts
//! the processes, `peer` knows the other gateways, `repeats` folds repeated runs into medians,
//! `routes` writes the routing files, `document` the reports' text); `sweep` repeats the
//! comparison at rising open-loop rates (goodput); `trace_summary` reads `--trace-dir` traces and
//! `placement_log` the gateways' placement decisions kept beside them.

pub mod compare;
pub mod document;
pub mod gateway;
pub mod peer;
pub mod placement_log;
pub mod repeats;
pub mod report;
pub mod routes;
pub mod runner;
pub mod scrape;
pub mod sweep;
pub mod trace_summary;
pub mod upper_bound;
pub mod workload;

use std::path::{Path, PathBuf};

/// The files in `dir` whose names end with `suffix` (`.jsonl` traces, `.placement.log`
/// decision logs), sorted by path.
pub fn files_ending_with(dir: &Path, suffix: &str) -> std::io::Result<Vec<PathBuf>> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().ends_with(suffix))
        })
        .collect();
    paths.sort();
    Ok(paths)
}
