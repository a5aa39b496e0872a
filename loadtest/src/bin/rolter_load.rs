//! `rolter-load`: the load driver.
//!
//! - `run`: send a workload to a gateway (`--target`) or straight to replicas (`--direct`),
//!   report hit rate (from `--replica-urls` metrics), latencies, throughput and load spread.
//! - `compare`: start a simulated fleet and the gateway once per strategy, write the table to
//!   loadtest/reports/.
//! - `sweep`: `compare` at each of `--rates` (open loop), goodput (requests/s within the TTFT
//!   objective) per strategy and rate.
//! - `upper-bound`: the workload's best possible hit rate (one replica, unbounded cache).
//! - `traces DIR`: per `--trace-dir` trace, how often conversations moved replica and how each
//!   system prompt was spread over the replicas; per kept placement log, which placement
//!   reasons opened a prompt group on more replicas than its first.

use std::sync::Arc;

use clap::{Parser, Subcommand, ValueEnum};
use rolter_loadtest::load::compare::{compare, CompareArgs, DriverArgs};
use rolter_loadtest::load::document::describe_workload;
use rolter_loadtest::load::placement_log::{self, PlacementLogError, PlacementSummary};
use rolter_loadtest::load::report::{goodput, markdown_table, summarize};
use rolter_loadtest::load::runner::{run, Dispatch};
use rolter_loadtest::load::scrape::scrape_all;
use rolter_loadtest::load::sweep::sweep;
use rolter_loadtest::load::trace_summary::{render_summary, summarize_trace, TraceRow};
use rolter_loadtest::load::upper_bound::upper_bound;
use rolter_loadtest::load::workload::{generate, request_count, WorkloadSpec};
use rolter_loadtest::sim_args::SimArgs;

#[derive(Debug, Parser)]
#[command(
    name = "rolter-load",
    about = "Load driver and strategy comparison for rolter",
    version
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum DirectPolicy {
    RoundRobin,
    SessionHash,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Send one workload and report.
    Run {
        #[command(flatten)]
        workload: WorkloadSpec,
        #[command(flatten)]
        driver: DriverArgs,
        /// Gateway base URL (e.g. http://127.0.0.1:8080).
        #[arg(long, conflicts_with = "direct")]
        target: Option<String>,
        /// Replica base URLs to send to directly, comma-separated (no gateway).
        #[arg(long, value_delimiter = ',')]
        direct: Vec<String>,
        /// How --direct picks a replica.
        #[arg(long, value_enum, default_value_t = DirectPolicy::RoundRobin)]
        direct_policy: DirectPolicy,
        /// Replica base URLs whose /metrics give the hit rate and load spread (default: --direct).
        #[arg(long, value_delimiter = ',')]
        replica_urls: Vec<String>,
        /// Label of the row in the report.
        #[arg(long, default_value = "run")]
        label: String,
        /// Block size for the upper bound.
        #[arg(long, default_value_t = 16)]
        block_size: usize,
    },
    /// Compare strategies through the gateway on a simulated fleet.
    Compare {
        #[command(flatten)]
        workload: WorkloadSpec,
        #[command(flatten)]
        driver: DriverArgs,
        #[command(flatten)]
        sim: Box<SimArgs>,
        #[command(flatten)]
        compare: CompareArgs,
    },
    /// Compare strategies at rising open-loop rates; report goodput.
    Sweep {
        #[command(flatten)]
        workload: WorkloadSpec,
        #[command(flatten)]
        driver: DriverArgs,
        #[command(flatten)]
        sim: Box<SimArgs>,
        #[command(flatten)]
        compare: CompareArgs,
        /// Open-loop rates, requests per second, comma-separated (e.g. 40,80,120).
        #[arg(long, value_delimiter = ',', required = true)]
        rates: Vec<f64>,
    },
    /// Summarize the traces in a --trace-dir directory (every *.jsonl, by name), then its
    /// placement logs (every *.placement.log, by name).
    Traces {
        dir: std::path::PathBuf,
        /// System prompts listed per trace (most requests first), and extra-home decisions
        /// listed per placement log (first ones first).
        #[arg(long, default_value_t = 8)]
        prompts: usize,
    },
    /// Print the workload's upper-bound hit rate.
    UpperBound {
        #[command(flatten)]
        workload: WorkloadSpec,
        #[arg(long, default_value_t = 16)]
        block_size: usize,
    },
}

/// Every `*.jsonl` trace in `dir`, by file name (without the extension), in name order.
fn read_traces(dir: &std::path::Path) -> Result<Vec<(String, Vec<TraceRow>)>, String> {
    let paths = rolter_loadtest::load::files_ending_with(dir, ".jsonl")
        .map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut out = Vec::with_capacity(paths.len());
    for p in paths {
        let text = std::fs::read_to_string(&p).map_err(|e| format!("{}: {e}", p.display()))?;
        let rows = text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .enumerate()
            .map(|(i, l)| {
                serde_json::from_str(l).map_err(|e| format!("{} line {}: {e}", p.display(), i + 1))
            })
            .collect::<Result<Vec<TraceRow>, String>>()?;
        let name = p
            .file_stem()
            .map_or_else(String::new, |s| s.to_string_lossy().into());
        out.push((name, rows));
    }
    Ok(out)
}

/// Every `*.placement.log` in `dir`, by file name, with its summary.
fn read_placement_logs(
    dir: &std::path::Path,
) -> Result<Vec<(String, PlacementSummary)>, PlacementLogError> {
    placement_log::find_logs(dir)?
        .into_iter()
        .map(|p| {
            let name = p
                .file_name()
                .map_or_else(String::new, |s| s.to_string_lossy().into());
            Ok((name, placement_log::summarize_file(&p)?))
        })
        .collect()
}

/// `fut`'s output, or `None` if SIGINT or SIGTERM comes first. Dropping `fut` then kills the
/// gateway processes it started (they are spawned with kill_on_drop), so an interrupted
/// comparison leaves no gateway behind.
async fn until_signal<T>(fut: impl std::future::Future<Output = T>) -> Option<T> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).ok();
    let terminated = async {
        match term.as_mut() {
            Some(t) => {
                t.recv().await;
            }
            None => std::future::pending::<()>().await,
        }
    };
    let out = tokio::select! {
        v = fut => Some(v),
        _ = tokio::signal::ctrl_c() => None,
        _ = terminated => None,
    };
    if out.is_none() {
        eprintln!("rolter-load: interrupted; gateways stopped");
    }
    out
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    match Cli::parse().cmd {
        Cmd::Run {
            workload,
            driver,
            target,
            direct,
            direct_policy,
            replica_urls,
            label,
            block_size,
        } => {
            let dispatch = match (target, direct.is_empty()) {
                (Some(t), _) => Dispatch::Single(t),
                (None, false) => match direct_policy {
                    DirectPolicy::RoundRobin => Dispatch::RoundRobin(direct.clone()),
                    DirectPolicy::SessionHash => Dispatch::SessionHash(direct.clone()),
                },
                (None, true) => {
                    eprintln!("rolter-load run: give --target URL or --direct URL,URL,...");
                    return std::process::ExitCode::FAILURE;
                }
            };
            let metrics_urls = if replica_urls.is_empty() {
                direct
            } else {
                replica_urls
            };
            let sessions = Arc::new(generate(&workload));
            let n = request_count(&sessions);
            let bound = upper_bound(&sessions, block_size);
            let client = reqwest::Client::builder()
                .no_proxy()
                .build()
                .expect("http client");
            let before = scrape_all(&client, &metrics_urls).await;
            let outcome = run(
                sessions.clone(),
                dispatch,
                driver.run_options(workload.seed),
            )
            .await;
            let after = scrape_all(&client, &metrics_urls).await;
            let (before, after) = match (before, after) {
                (Ok(b), Ok(a)) => (b, a),
                (Err(e), _) | (_, Err(e)) => {
                    eprintln!(
                        "warning: replica metrics unavailable ({e}); hit rate and spread omitted"
                    );
                    (Vec::new(), Vec::new())
                }
            };
            if let Err(e) = driver.write_trace(&label, &outcome, &sessions) {
                eprintln!("rolter-load run: {e}");
                return std::process::ExitCode::FAILURE;
            }
            let mut report = summarize(&label, &outcome, &before, &after);
            report.goodput = goodput(&outcome, driver.ttft_slo());
            println!("{}\n", describe_workload(&workload, n));
            println!("{}", markdown_table(&[report], Some(bound)));
            std::process::ExitCode::SUCCESS
        }
        Cmd::Compare {
            workload,
            driver,
            sim,
            compare: args,
        } => match until_signal(compare(&workload, &sim, &driver, &args)).await {
            None => std::process::ExitCode::FAILURE,
            Some(Ok(md)) => {
                println!("{md}");
                std::process::ExitCode::SUCCESS
            }
            Some(Err(e)) => {
                eprintln!("rolter-load compare: {e}");
                std::process::ExitCode::FAILURE
            }
        },
        Cmd::Sweep {
            workload,
            driver,
            sim,
            compare: args,
            rates,
        } => match until_signal(sweep(&workload, &sim, &driver, &args, &rates)).await {
            None => std::process::ExitCode::FAILURE,
            Some(Ok(md)) => {
                println!("{md}");
                std::process::ExitCode::SUCCESS
            }
            Some(Err(e)) => {
                eprintln!("rolter-load sweep: {e}");
                std::process::ExitCode::FAILURE
            }
        },
        Cmd::Traces { dir, prompts } => {
            let read = read_traces(&dir).and_then(|traces| {
                read_placement_logs(&dir)
                    .map(|logs| (traces, logs))
                    .map_err(|e| e.to_string())
            });
            match read {
                Ok((traces, logs)) => {
                    for (name, rows) in traces {
                        println!(
                            "{}",
                            render_summary(&name, &summarize_trace(&rows), prompts)
                        );
                    }
                    for (name, s) in logs {
                        println!("{}", placement_log::render_summary(&name, &s, prompts));
                    }
                    std::process::ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("rolter-load traces: {e}");
                    std::process::ExitCode::FAILURE
                }
            }
        }
        Cmd::UpperBound {
            workload,
            block_size,
        } => {
            let sessions = generate(&workload);
            let b = upper_bound(&sessions, block_size);
            println!(
                "{}\nupper bound hit rate: {:.2}% ({} of {} prompt tokens)",
                describe_workload(&workload, request_count(&sessions)),
                b.rate() * 100.0,
                b.hits,
                b.queries
            );
            std::process::ExitCode::SUCCESS
        }
    }
}
