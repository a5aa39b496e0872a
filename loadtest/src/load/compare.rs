//! `rolter-load compare`: every strategy on the same workload, side by side.
//!
//! Owns the orchestration: per strategy, start a fresh in-process simulated fleet (ephemeral
//! ports, empty caches), write a routing TOML for it, start the gateway binary
//! (`rolter --routes FILE --listen 127.0.0.1:PORT [extra args]`, see `gateway`), run the
//! workload through it, read the replicas' counters, stop both; then write the markdown table
//! (plus a JSON copy) with the workload's theoretical upper bound.
//!
//! Strategies `direct_round_robin` and `direct_session_hash` bypass the gateway (the driver
//! picks the replica itself): baselines, and a way to check this harness without a gateway.
//! `smg_<policy>` and `vllm_router_<policy>` run a peer gateway in rolter's place (see `peer`)
//! with the fleet's worker URLs, the same workload and seed, the same counters read. The
//! routing file is `routes`' and the report's wording `document`'s.
//!
//! `cache_aware@2` (or `--gateways 2`, which adds that row beside each rolter strategy's) runs
//! two rolter processes with the same routing file in front of one fleet, each request sent to
//! either at random, as behind an L4 balancer.
//!
//! `--repeats N` runs N rounds, each strategy once per round on a fresh fleet in a rotated
//! order (see `repeats`), and reports per-strategy medians and the hit rate's spread.
//!
//! With `--trace-dir`, rolter gateways (not peers) run with `placement=debug` added to their
//! `RUST_LOG`, and after the run their decision lines are kept beside the trace as
//! `<trace>.placement.log` (`<trace>.gw<k>.placement.log` behind several gateways; see
//! `placement_log`). Without it the gateways' logging is left as it is.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;

use crate::fleet::{spawn_fleet, FleetHandle};
use crate::load::document::{describe_workload, render, render_repeats};
use crate::load::gateway::{self, free_port, Gateway, Launch};
use crate::load::peer::{default_venv, parse_peer, Readiness};
use crate::load::placement_log::{self, PlacementLogError};
use crate::load::repeats::{round_order, summarize_runs, StrategySummary};
use crate::load::report::{goodput, summarize, StrategyReport};
use crate::load::routes::routes_toml_with;
use crate::load::runner::{run, write_trace, Dispatch, Mode, RunOptions, RunOutcome};
use crate::load::scrape::scrape_all;
use crate::load::upper_bound::upper_bound;
use crate::load::workload::{generate, request_count, Session, WorkloadSpec};
use crate::sim_args::SimArgs;

/// Strategies that bypass the gateway.
pub const DIRECT_STRATEGIES: [&str; 2] = ["direct_round_robin", "direct_session_hash"];

/// Errors of a comparison run.
#[derive(Debug, Error)]
pub enum CompareError {
    #[error("starting the simulated fleet: {0}")]
    Fleet(std::io::Error),
    #[error("strategy {strategy}: {reason}")]
    Gateway { strategy: String, reason: String },
    #[error("reading replica metrics: {0}")]
    Metrics(String),
    #[error("writing {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("keeping the gateway's placement log: {0}")]
    PlacementLog(#[from] PlacementLogError),
}

/// How the driver sends load (shared by `run` and `compare`).
#[derive(Debug, Clone, clap::Args)]
pub struct DriverArgs {
    /// Closed-loop concurrent clients (ignored with --rate).
    #[arg(long, default_value_t = 16)]
    pub clients: usize,
    /// Open loop: Poisson arrivals at this many requests per second.
    #[arg(long)]
    pub rate: Option<f64>,
    /// `model` in each request (the gateway's route alias).
    #[arg(long, default_value = "sim")]
    pub request_model: String,
    /// Don't send `x-session-id`.
    #[arg(long)]
    pub no_session_header: bool,
    /// Don't send `x-rolter-vllm-token-ids`.
    #[arg(long)]
    pub no_token_header: bool,
    /// Per-request timeout, seconds.
    #[arg(long, default_value_t = 60.0)]
    pub request_timeout_secs: f64,
    /// Stop starting requests after this many seconds.
    #[arg(long, default_value_t = 240.0)]
    pub max_duration_secs: f64,
    /// Mean think time between a reply and the session's next turn, milliseconds
    /// (exponential; 0 = none).
    #[arg(long, default_value_t = 0.0)]
    pub think_time_ms: f64,
    /// Write a per-request trace (JSON lines: session, turn, replica, prompt and cached
    /// tokens, timings) to DIR/<strategy or label>.jsonl; `compare` also keeps each rolter
    /// gateway's placement decisions (RUST_LOG placement=debug) in DIR/<strategy>.placement.log
    /// (DIR/<strategy>.gw<k>.placement.log behind several gateways).
    #[arg(long)]
    pub trace_dir: Option<PathBuf>,
    /// TTFT objective of goodput (successful requests per second whose TTFT is at most this),
    /// milliseconds.
    #[arg(long, default_value_t = 500.0)]
    pub slo_ttft_ms: f64,
}

impl DriverArgs {
    /// The goodput TTFT objective.
    pub fn ttft_slo(&self) -> Duration {
        Duration::from_secs_f64(self.slo_ttft_ms.max(0.0) / 1e3)
    }

    pub fn run_options(&self, seed: u64) -> RunOptions {
        RunOptions {
            mode: match self.rate {
                Some(rate) => Mode::Open { rate },
                None => Mode::Closed {
                    clients: self.clients,
                },
            },
            model: self.request_model.clone(),
            send_session_id: !self.no_session_header,
            send_token_ids: !self.no_token_header,
            request_timeout: Duration::from_secs_f64(self.request_timeout_secs.max(0.001)),
            max_duration: Duration::from_secs_f64(self.max_duration_secs.max(0.001)),
            think_time: Duration::from_secs_f64(self.think_time_ms.max(0.0) / 1e3),
            seed,
            tokenizer: Default::default(),
        }
    }

    /// Write `run`'s per-request trace as `<trace_dir>/<name>.jsonl`, if a directory is set.
    pub fn write_trace(
        &self,
        name: &str,
        run: &RunOutcome,
        sessions: &[Session],
    ) -> Result<(), CompareError> {
        let Some(dir) = &self.trace_dir else {
            return Ok(());
        };
        let path = dir.join(format!("{name}.jsonl"));
        std::fs::create_dir_all(dir)
            .and_then(|()| write_trace(&path, run, sessions))
            .map_err(|source| CompareError::Write { path, source })
    }

    /// Environment for a rolter gateway: with a trace directory, `RUST_LOG` with the placement
    /// lines turned on (on top of the level the gateway would run with); none otherwise.
    pub fn gateway_env(&self) -> Vec<(String, String)> {
        if self.trace_dir.is_none() {
            return Vec::new();
        }
        let current = std::env::var("RUST_LOG").ok();
        vec![(
            "RUST_LOG".to_string(),
            placement_log::rust_log_with_placement(current.as_deref()),
        )]
    }

    /// Keep the placement lines of the rolter gateway logs `logs` (one per gateway, in order)
    /// as `<trace_dir>/<name>.placement.log` (`<name>.gw<k>.placement.log` for several), if a
    /// directory is set.
    pub fn write_placement_logs(&self, name: &str, logs: &[PathBuf]) -> Result<(), CompareError> {
        let Some(dir) = &self.trace_dir else {
            return Ok(());
        };
        std::fs::create_dir_all(dir).map_err(|source| CompareError::Write {
            path: dir.clone(),
            source,
        })?;
        for (k, log) in logs.iter().enumerate() {
            let to = dir.join(placement_log::file_name(name, k, logs.len()));
            placement_log::copy_placement_lines(log, &to)?;
        }
        Ok(())
    }

    pub fn describe(&self) -> String {
        let mode = match self.rate {
            Some(r) => format!("open loop, Poisson arrivals at {r} requests/s"),
            None => format!("closed loop, {} concurrent clients", self.clients),
        };
        if self.think_time_ms > 0.0 {
            format!(
                "{mode}, mean think time {} ms between a reply and the next turn",
                self.think_time_ms
            )
        } else {
            mode
        }
    }
}

/// Flags of `compare`.
#[derive(Debug, Clone, clap::Args)]
pub struct CompareArgs {
    /// The gateway binary.
    #[arg(long, default_value = "target/release/rolter")]
    pub gateway: PathBuf,
    /// Strategies to compare, comma-separated (gateway strategies or direct_round_robin,
    /// direct_session_hash).
    #[arg(long, value_delimiter = ',', default_value = "round_robin,least_load")]
    pub strategies: Vec<String>,
    /// Extra argument for the gateway (repeatable), e.g. --gateway-arg=-c --gateway-arg=conf/pingora.yaml.
    #[arg(long = "gateway-arg", allow_hyphen_values = true)]
    pub gateway_args: Vec<String>,
    /// Extra `key = value` line for the route's table in the routing file (repeatable), e.g.
    /// --route-option 'cache_threshold = 0.6'.
    #[arg(long = "route-option")]
    pub route_options: Vec<String>,
    /// Extra `key = value` line for each provider's table (repeatable), e.g.
    /// --provider-option 'metrics_path = ""'.
    #[arg(long = "provider-option")]
    pub provider_options: Vec<String>,
    /// Leave the providers' `kv_cache_tokens` out of the routing file (by default each gets
    /// its replica's cache size, as an operator copies it from vLLM's log).
    #[arg(long)]
    pub without_kv_cache_tokens: bool,
    /// Markdown output (default loadtest/reports/<workload>.md); a .json copy is written beside.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Seconds to wait for the gateway's /health.
    #[arg(long, default_value_t = 30.0)]
    pub ready_timeout_secs: f64,
    /// Upstream model name in the routing file (the replicas accept any).
    #[arg(long, default_value = "sim-model")]
    pub upstream_model: String,
    /// Also run each rolter strategy S behind this many independent gateways (row `S@N`, beside
    /// S's one-gateway row): the same routing file, each request sent to one of them at random
    /// as an L4 balancer would. `S@N` in --strategies does the same for one strategy.
    #[arg(long, default_value_t = 1)]
    pub gateways: usize,
    /// With --gateways N: also run each rolter strategy S behind N peered gateways (row
    /// `S@Np`: each gateway's routing file gets a `[peering]` table naming the others).
    #[arg(long)]
    pub peering: bool,
    /// Rounds: every strategy runs once per round (fresh fleet each time), in an order rotated
    /// by one each round; the report gives per-strategy medians and the hit rate's min–max.
    #[arg(long, default_value_t = 1)]
    pub repeats: usize,
    /// The venv holding peer gateways (`smg_*`, `vllm_router_*` strategies), as
    /// loadtest/peers.sh installs it [default: $ROLTER_PEERS_VENV, else
    /// ~/.cache/rolter-peers/venv].
    #[arg(long)]
    pub peer_venv: Option<PathBuf>,
    /// Extra argument for peer gateways (repeatable), e.g. --peer-arg=--cache-threshold
    /// --peer-arg=0.5.
    #[arg(long = "peer-arg", allow_hyphen_values = true)]
    pub peer_args: Vec<String>,
}

/// A rolter strategy name with an optional gateway count: `cache_aware@2` is cache_aware
/// behind two gateways (`cache_aware@2p`: two peered gateways, see [`peered`]); no suffix
/// (or an unreadable one) is one.
pub fn split_gateways(strategy: &str) -> (&str, usize) {
    match strategy.rsplit_once('@') {
        Some((base, n)) => match n.strip_suffix('p').unwrap_or(n).parse::<usize>() {
            Ok(n) if n >= 1 => (base, n),
            _ => (strategy, 1),
        },
        None => (strategy, 1),
    }
}

/// Whether `strategy` names several gateways that tell each other where they placed each
/// conversation (`S@Np`: each gateway's routing file gets a `[peering]` table naming the
/// others).
pub fn peered(strategy: &str) -> bool {
    strategy.ends_with('p') && split_gateways(strategy).1 > 1
}

/// Whether `strategy` (without its `@N`) runs on rolter gateways: not a direct dispatch, not
/// a peer.
fn is_rolter(strategy: &str) -> bool {
    !DIRECT_STRATEGIES.contains(&strategy) && parse_peer(strategy).is_none()
}

/// `strategies` with, when `gateways` > 1, each rolter strategy followed by its
/// `<strategy>@<gateways>` twin, and with `peering` its `<strategy>@<gateways>p` twin too
/// (direct, peer and already-suffixed names are left alone).
pub fn with_gateway_twins(strategies: &[String], gateways: usize, peering: bool) -> Vec<String> {
    let mut out = Vec::with_capacity(strategies.len() * 3);
    for s in strategies {
        out.push(s.clone());
        if gateways > 1 && is_rolter(s) && !s.contains('@') {
            out.push(format!("{s}@{gateways}"));
            if peering {
                out.push(format!("{s}@{gateways}p"));
            }
        }
    }
    out
}

/// Start `count` rolter processes for `strategy` in front of `fleet`, all with one routing file
/// (independent gateways: nothing shared but the replicas), or with `peering`, each with that
/// file and a `[peering]` table naming the others.
async fn start_rolter(
    fleet: &FleetHandle,
    compare: &CompareArgs,
    driver: &DriverArgs,
    strategy: &str,
    count: usize,
    peering: bool,
    workdir: &Path,
) -> Result<Vec<Gateway>, String> {
    let toml = routes_toml_with(
        fleet,
        strategy,
        &driver.request_model,
        &compare.upstream_model,
        &compare.route_options,
        &compare.provider_options,
        !compare.without_kv_cache_tokens,
    );
    let peer_ports = if peering {
        udp_ports(count).map_err(|e| format!("picking peering ports: {e}"))?
    } else {
        Vec::new()
    };
    let mut gateways: Vec<Gateway> = Vec::with_capacity(count);
    for k in 0..count {
        let (routes, toml) = if peering {
            let file = workdir.join(format!("routes-{strategy}-{k}.toml"));
            (file, format!("{toml}{}", peering_table(&peer_ports, k)))
        } else {
            (
                workdir.join(format!("routes-{strategy}.toml")),
                toml.clone(),
            )
        };
        std::fs::write(&routes, toml).map_err(|e| format!("writing {}: {e}", routes.display()))?;
        let taken: Vec<u16> = gateways.iter().map(|g| g.port).collect();
        let port = free_port(&taken).map_err(|e| format!("picking a port: {e}"))?;
        let mut args = vec![
            "--routes".to_string(),
            routes.display().to_string(),
            "--listen".into(),
            format!("127.0.0.1:{port}"),
        ];
        args.extend(compare.gateway_args.iter().cloned());
        let env = driver.gateway_env();
        let log = if count > 1 {
            workdir.join(format!("gateway-{strategy}-{k}.log"))
        } else {
            workdir.join(format!("gateway-{strategy}.log"))
        };
        // On an error the started ones are killed on drop.
        gateways.push(
            gateway::start(Launch {
                program: &compare.gateway,
                args,
                env,
                port,
                ready: Readiness::Health,
                log,
                ready_timeout: Duration::from_secs_f64(compare.ready_timeout_secs),
            })
            .await?,
        );
    }
    if strategy == "precise_cache_aware"
        && !fleet
            .wait_for_kv_subscribers(count, Duration::from_secs(10))
            .await
    {
        eprintln!(
            "warning: {strategy}: the gateways did not all subscribe to every replica's KV \
             events within 10 s"
        );
    }
    Ok(gateways)
}

/// `count` distinct free UDP ports on 127.0.0.1.
fn udp_ports(count: usize) -> std::io::Result<Vec<u16>> {
    // Held together while picking, so no two are the same.
    let sockets: Vec<std::net::UdpSocket> = (0..count)
        .map(|_| std::net::UdpSocket::bind("127.0.0.1:0"))
        .collect::<Result<_, _>>()?;
    sockets.iter().map(|s| Ok(s.local_addr()?.port())).collect()
}

/// The `[peering]` table of gateway `k` among gateways listening on `ports`.
fn peering_table(ports: &[u16], k: usize) -> String {
    let peers: Vec<String> = ports
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != k)
        .map(|(_, p)| format!("\"127.0.0.1:{p}\""))
        .collect();
    format!(
        "\n[peering]\nlisten = \"127.0.0.1:{}\"\npeers = [{}]\n",
        ports[k],
        peers.join(", ")
    )
}

/// Start the peer gateway `peer` in front of `workers`.
async fn start_peer(
    compare: &CompareArgs,
    strategy: &str,
    peer: &crate::load::peer::PeerSpec,
    workers: &[String],
    workdir: &Path,
) -> Result<Gateway, String> {
    let venv = compare.peer_venv.clone().unwrap_or_else(default_venv);
    let program = peer.program(&venv);
    if !program.exists() {
        return Err(format!(
            "{} not found (install it with loadtest/peers.sh, or give --peer-venv)",
            program.display()
        ));
    }
    let port = free_port(&[]).map_err(|e| format!("picking a port: {e}"))?;
    let aux = free_port(&[port]).map_err(|e| format!("picking a port: {e}"))?;
    let mut args = peer.args(port, aux, workers);
    args.extend(compare.peer_args.iter().cloned());
    gateway::start(Launch {
        program: &program,
        args,
        env: Vec::new(),
        port,
        ready: peer.readiness(workers.len()),
        log: workdir.join(format!("gateway-{strategy}.log")),
        ready_timeout: Duration::from_secs_f64(compare.ready_timeout_secs),
    })
    .await
}

/// Run one strategy on a fresh fleet.
pub async fn run_strategy(
    strategy: &str,
    sessions: Arc<Vec<Session>>,
    sim: &SimArgs,
    driver: &DriverArgs,
    compare: &CompareArgs,
    seed: u64,
    workdir: &Path,
) -> Result<StrategyReport, CompareError> {
    run_strategy_traced(
        strategy, None, sessions, sim, driver, compare, seed, workdir,
    )
    .await
}

/// [`run_strategy`], writing the trace (if `--trace-dir`) under `trace_name` instead of the
/// strategy's name.
#[allow(clippy::too_many_arguments)]
pub async fn run_strategy_traced(
    strategy: &str,
    trace_name: Option<&str>,
    sessions: Arc<Vec<Session>>,
    sim: &SimArgs,
    driver: &DriverArgs,
    compare: &CompareArgs,
    seed: u64,
    workdir: &Path,
) -> Result<StrategyReport, CompareError> {
    let mut fc = sim.fleet_config();
    let prompt_tokenizer = fc.replica.tokenizer.clone();
    fc.http_base_port = 0;
    fc.kv_base_port = 0;
    let fleet = spawn_fleet(fc).await.map_err(CompareError::Fleet)?;
    let urls = fleet.base_urls();
    let gw_err = |reason: String| CompareError::Gateway {
        strategy: strategy.to_string(),
        reason,
    };
    let mut opts = driver.run_options(seed);
    opts.tokenizer = prompt_tokenizer;
    let (base, count) = split_gateways(strategy);
    let peering = peered(strategy);
    let rolter = is_rolter(base);
    let started = match base {
        "direct_round_robin" => Ok((Dispatch::RoundRobin(urls.clone()), Vec::new())),
        "direct_session_hash" => Ok((Dispatch::SessionHash(urls.clone()), Vec::new())),
        _ => match parse_peer(base) {
            Some(peer) => {
                // Peers route on the served model name, not rolter's route alias.
                opts.model = sim.model.clone();
                start_peer(compare, strategy, &peer, &urls, workdir)
                    .await
                    .map(|gw| vec![gw])
            }
            None => start_rolter(&fleet, compare, driver, base, count, peering, workdir).await,
        }
        .map(|gws| {
            let bases: Vec<String> = gws.iter().map(|g| g.base_url.clone()).collect();
            let dispatch = if bases.len() == 1 {
                Dispatch::Single(bases[0].clone())
            } else {
                // As an L4 balancer in front of independent gateways.
                Dispatch::Spread(bases)
            };
            (dispatch, gws)
        }),
    };
    let (dispatch, gateways) = match started {
        Ok(x) => x,
        Err(e) => {
            fleet.shutdown().await;
            return Err(gw_err(e));
        }
    };
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("building the HTTP client");
    let result = async {
        let before = scrape_all(&client, &urls)
            .await
            .map_err(CompareError::Metrics)?;
        let outcome = run(sessions.clone(), dispatch, opts).await;
        let after = scrape_all(&client, &urls)
            .await
            .map_err(CompareError::Metrics)?;
        driver.write_trace(trace_name.unwrap_or(strategy), &outcome, &sessions)?;
        let mut report = summarize(strategy, &outcome, &before, &after);
        report.goodput = goodput(&outcome, driver.ttft_slo());
        Ok(report)
    }
    .await;
    let failed = result
        .as_ref()
        .map(|r: &StrategyReport| r.errors > 0)
        .unwrap_or(true);
    let logs: Vec<PathBuf> = gateways.iter().map(|g| g.log.clone()).collect();
    for (k, mut gw) in gateways.into_iter().enumerate() {
        if let Some(status) = gw.exited() {
            eprintln!("   the gateway exited during the run ({status})");
        }
        if failed {
            let kept = std::env::temp_dir().join(format!(
                "rolter-load-gateway-{strategy}-{k}-{}.log",
                std::process::id()
            ));
            let _ = std::fs::copy(&gw.log, &kept);
            eprintln!("   errors: gateway log kept at {}", kept.display());
        }
        gw.stop().await;
    }
    fleet.shutdown().await;
    // After the gateways stopped: their logs are complete.
    let kept = if rolter {
        driver.write_placement_logs(trace_name.unwrap_or(strategy), &logs)
    } else {
        Ok(())
    };
    result.and_then(|r| kept.map(|()| r))
}

/// Every run of a comparison, grouped by strategy in list order, and the strategies that could
/// not run (with why).
pub struct Rounds {
    pub runs: Vec<(String, Vec<StrategyReport>)>,
    pub skipped: Vec<(String, String)>,
}

/// Run `rounds` rounds of `strategies` (each round every strategy once, on a fresh fleet, in an
/// order rotated by one per round). A strategy whose gateway cannot start is skipped from then
/// on; any other error stops everything.
#[allow(clippy::too_many_arguments)]
pub async fn run_rounds(
    strategies: &[String],
    rounds: usize,
    sessions: &Arc<Vec<Session>>,
    sim: &SimArgs,
    driver: &DriverArgs,
    args: &CompareArgs,
    seed: u64,
    workdir: &Path,
) -> Result<Rounds, CompareError> {
    let n_requests = request_count(sessions);
    let mut runs: Vec<(String, Vec<StrategyReport>)> =
        strategies.iter().map(|s| (s.clone(), Vec::new())).collect();
    let mut skipped: Vec<(String, String)> = Vec::new();
    for round in 0..rounds {
        for strategy in round_order(strategies, round) {
            if skipped.iter().any(|(s, _)| *s == strategy) {
                continue;
            }
            let label = if rounds > 1 {
                format!("{strategy} (round {}/{rounds})", round + 1)
            } else {
                strategy.clone()
            };
            eprintln!("== {label}: {n_requests} requests");
            let trace_name = format!("{strategy}.r{}", round + 1);
            let r = match run_strategy_traced(
                &strategy,
                (rounds > 1).then_some(trace_name.as_str()),
                sessions.clone(),
                sim,
                driver,
                args,
                seed,
                workdir,
            )
            .await
            {
                Ok(r) => r,
                // A gateway that rejects a strategy (not implemented yet, peer not installed)
                // skips that row only.
                Err(CompareError::Gateway { strategy, reason }) => {
                    eprintln!("   skipped: {reason}");
                    skipped.push((strategy, reason));
                    continue;
                }
                Err(e) => return Err(e),
            };
            eprintln!(
                "   hit rate {:.1}%, TTFT p50 {:.0} ms, e2e p50 {:.0} ms, {:.1} req/s \
                 (goodput {:.1}), errors {}{}",
                r.hit_rate * 100.0,
                r.ttft_ms.p50,
                r.e2e_ms.p50,
                r.throughput,
                r.goodput,
                r.errors,
                r.error_samples
                    .first()
                    .map(|e| format!(" (e.g. {e})"))
                    .unwrap_or_default()
            );
            if let Some((_, v)) = runs.iter_mut().find(|(s, _)| *s == strategy) {
                v.push(r);
            }
        }
    }
    runs.retain(|(_, v)| !v.is_empty());
    Ok(Rounds { runs, skipped })
}

/// Every run of `runs` with its number appended to its strategy's name (`cache_aware #2`).
pub fn numbered_runs(runs: &[(String, Vec<StrategyReport>)]) -> Vec<StrategyReport> {
    runs.iter()
        .flat_map(|(_, v)| v.iter().enumerate())
        .map(|(i, r)| StrategyReport {
            strategy: format!("{} #{}", r.strategy, i + 1),
            ..r.clone()
        })
        .collect()
}

/// A scratch directory for routing files and gateway logs, unique to this process.
pub fn workdir() -> Result<PathBuf, CompareError> {
    let dir = std::env::temp_dir().join(format!("rolter-load-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|source| CompareError::Write {
        path: dir.clone(),
        source,
    })?;
    Ok(dir)
}

/// Write the markdown to `out` and the JSON beside it (`.json`).
pub fn write_report(out: &Path, md: &str, json: &serde_json::Value) -> Result<(), CompareError> {
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| CompareError::Write {
            path: dir.to_path_buf(),
            source,
        })?;
    }
    std::fs::write(out, md).map_err(|source| CompareError::Write {
        path: out.to_path_buf(),
        source,
    })?;
    let json_path = out.with_extension("json");
    std::fs::write(
        &json_path,
        serde_json::to_string_pretty(json).unwrap_or_default(),
    )
    .map_err(|source| CompareError::Write {
        path: json_path.clone(),
        source,
    })?;
    eprintln!("wrote {} and {}", out.display(), json_path.display());
    Ok(())
}

/// Run the whole comparison and write the report; returns the markdown.
pub async fn compare(
    workload: &WorkloadSpec,
    sim: &SimArgs,
    driver: &DriverArgs,
    args: &CompareArgs,
) -> Result<String, CompareError> {
    let sessions = Arc::new(generate(workload));
    let n_requests = request_count(&sessions);
    let bound = upper_bound(&sessions, sim.block_size);
    let workdir = workdir()?;
    let rounds = args.repeats.max(1);
    let strategies = with_gateway_twins(&args.strategies, args.gateways, args.peering);
    let Rounds { runs, skipped } = run_rounds(
        &strategies,
        rounds,
        &sessions,
        sim,
        driver,
        args,
        workload.seed,
        &workdir,
    )
    .await?;
    let (mut md, json_rows) = if rounds == 1 {
        let reports: Vec<StrategyReport> = runs.into_iter().flat_map(|(_, v)| v).collect();
        let md = render(workload, sim, driver, &reports, bound, n_requests);
        (md, serde_json::json!({ "strategies": reports }))
    } else {
        let summaries: Vec<StrategySummary> =
            runs.iter().map(|(s, v)| summarize_runs(s, v)).collect();
        let all = numbered_runs(&runs);
        let md = render_repeats(workload, sim, driver, &summaries, &all, bound, n_requests);
        (
            md,
            serde_json::json!({ "repeats": rounds, "strategies": summaries, "runs": all }),
        )
    };
    for (strategy, reason) in &skipped {
        let _ = writeln!(md, "\nNot run: `{strategy}` ({reason}).");
    }
    let out = args.out.clone().unwrap_or_else(|| {
        PathBuf::from(format!("loadtest/reports/{}.md", workload.workload.name()))
    });
    let mut json = serde_json::json!({
        "workload": describe_workload(workload, n_requests),
        "upper_bound_hit_rate": bound.rate(),
    });
    if let (Some(o), serde_json::Value::Object(rows)) = (json.as_object_mut(), json_rows) {
        o.extend(rows);
    }
    write_report(&out, &md, &json)?;
    let _ = std::fs::remove_dir_all(&workdir);
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The placement lines are turned on for rolter gateways only with a trace directory.
    #[test]
    fn placement_logging_only_with_a_trace_dir() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            driver: DriverArgs,
        }
        use clap::Parser as _;
        let plain = Cli::parse_from(["x"]).driver;
        assert!(plain.gateway_env().is_empty());
        let traced = Cli::parse_from(["x", "--trace-dir", "/nonexistent"]).driver;
        let env = traced.gateway_env();
        assert_eq!(env.len(), 1, "{env:?}");
        assert_eq!(env[0].0, "RUST_LOG");
        assert!(env[0].1.contains(",placement=debug"), "{env:?}");
    }

    #[test]
    fn gateway_counts_in_strategy_names() {
        assert_eq!(split_gateways("cache_aware@2"), ("cache_aware", 2));
        assert_eq!(split_gateways("cache_aware"), ("cache_aware", 1));
        assert_eq!(split_gateways("cache_aware@x"), ("cache_aware@x", 1));
        assert_eq!(split_gateways("cache_aware@0"), ("cache_aware@0", 1));
        assert_eq!(split_gateways("cache_aware@2p"), ("cache_aware", 2));
        assert!(peered("cache_aware@2p"));
        assert!(!peered("cache_aware@2"));
        assert!(!peered("cache_aware@1p"));
        assert!(!peered("smg_cache_aware"));
    }

    #[test]
    fn each_peered_gateway_names_the_others_and_listens_on_its_own_port() {
        let t = peering_table(&[7100, 7101, 7102], 1);
        let v: toml::Value = toml::from_str(&t).unwrap();
        assert_eq!(v["peering"]["listen"].as_str(), Some("127.0.0.1:7101"));
        let peers: Vec<&str> = v["peering"]["peers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_str().unwrap())
            .collect();
        assert_eq!(peers, ["127.0.0.1:7100", "127.0.0.1:7102"]);
        let ports = udp_ports(3).unwrap();
        assert_eq!(
            ports.iter().collect::<std::collections::HashSet<_>>().len(),
            3
        );
    }

    #[test]
    fn gateways_flag_adds_a_twin_after_each_rolter_strategy() {
        let s: Vec<String> = [
            "cache_aware",
            "smg_cache_aware",
            "direct_round_robin",
            "pipeline",
            "precise_cache_aware@3",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(with_gateway_twins(&s, 1, true), s);
        assert_eq!(
            with_gateway_twins(&s[..1], 2, true),
            ["cache_aware", "cache_aware@2", "cache_aware@2p"]
        );
        assert_eq!(
            with_gateway_twins(&s, 2, false),
            [
                "cache_aware",
                "cache_aware@2",
                "smg_cache_aware",
                "direct_round_robin",
                "pipeline",
                "pipeline@2",
                "precise_cache_aware@3",
            ]
        );
    }
}
