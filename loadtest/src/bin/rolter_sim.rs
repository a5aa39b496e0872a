//! `rolter-sim`: a fleet of simulated vLLM replicas on loopback.
//!
//! Prints one JSON line describing every replica's addresses (HTTP, KV-event PUB and replay
//! endpoints, LMCache status URL) on stdout once everything is bound, then serves until
//! SIGINT/SIGTERM or `--run-for-secs`.

use std::time::Duration;

use clap::Parser;
use rolter_loadtest::sim_args::{announcement, SimArgs};
use rolter_loadtest::spawn_fleet;

#[derive(Debug, Parser)]
#[command(
    name = "rolter-sim",
    about = "Simulated vLLM fleet for rolter",
    version
)]
struct Cli {
    #[command(flatten)]
    sim: SimArgs,
    /// Exit after this many seconds (default: run until a signal).
    #[arg(long)]
    run_for_secs: Option<f64>,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let fleet = match spawn_fleet(cli.sim.fleet_config()).await {
        Ok(f) => f,
        Err(e) => {
            eprintln!("rolter-sim: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    println!("{}", announcement(&fleet));
    for r in fleet.replicas() {
        eprintln!(
            "replica {}: {}  kv {}  replay {}",
            r.index,
            r.base_url(),
            r.kv_events_endpoint().unwrap_or_else(|| "-".into()),
            r.kv_replay_endpoint().unwrap_or_else(|| "-".into()),
        );
    }
    let run_for = async {
        match cli.run_for_secs {
            Some(s) => tokio::time::sleep(Duration::from_secs_f64(s.max(0.0))).await,
            None => std::future::pending().await,
        }
    };
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing a SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
        _ = run_for => {}
    }
    fleet.shutdown().await;
    std::process::ExitCode::SUCCESS
}
