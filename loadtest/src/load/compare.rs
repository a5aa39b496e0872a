//! `rolter-load compare`: every strategy on the same workload, side by side.
//!
//! Owns the orchestration: per strategy, start a fresh in-process simulated fleet (ephemeral
//! ports, empty caches), write a routing TOML for it, start the gateway binary
//! (`rolter --routes FILE --listen 127.0.0.1:PORT [extra args]`), wait for its `/health`,
//! run the workload through it, read the replicas' counters, stop both; then write the
//! markdown table (plus a JSON copy) with the workload's theoretical upper bound.
//!
//! Strategies `direct_round_robin` and `direct_session_hash` bypass the gateway (the driver
//! picks the replica itself): baselines, and a way to check this harness without a gateway.
//! `precise_cache_aware` gets `[providers.kv_events]`, `lmcache_aware` gets
//! `[providers.lmcache]` and `cache_aware` gets each provider's `kv_cache_tokens` (the
//! replica's cache size, which sizes its prefix trie) in the routing file; other strategies
//! get none of these.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use thiserror::Error;
use tokio::process::{Child, Command};

use crate::fleet::{spawn_fleet, FleetHandle};
use crate::load::report::{markdown_table, summarize, StrategyReport};
use crate::load::runner::{run, write_trace, Dispatch, Mode, RunOptions, RunOutcome};
use crate::load::scrape::scrape_all;
use crate::load::upper_bound::{upper_bound, HitCount};
use crate::load::workload::{generate, request_count, Session, WorkloadKind, WorkloadSpec};
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
    /// tokens, timings) to DIR/<strategy or label>.jsonl.
    #[arg(long)]
    pub trace_dir: Option<PathBuf>,
}

impl DriverArgs {
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

    fn describe(&self) -> String {
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
    /// Markdown output (default loadtest/reports/<workload>.md); a .json copy is written beside.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Seconds to wait for the gateway's /health.
    #[arg(long, default_value_t = 30.0)]
    pub ready_timeout_secs: f64,
    /// Upstream model name in the routing file (the replicas accept any).
    #[arg(long, default_value = "sim-model")]
    pub upstream_model: String,
}

/// The routing TOML for `strategy` over `fleet`, route alias `model`.
pub fn routes_toml(
    fleet: &FleetHandle,
    strategy: &str,
    model: &str,
    upstream_model: &str,
) -> String {
    routes_toml_with(fleet, strategy, model, upstream_model, &[])
}

/// [`routes_toml`] with extra `key = value` lines in the route's table (`--route-option`).
pub fn routes_toml_with(
    fleet: &FleetHandle,
    strategy: &str,
    model: &str,
    upstream_model: &str,
    route_options: &[String],
) -> String {
    let mut s = String::from("# Written by rolter-load compare.\n");
    for r in fleet.replicas() {
        let _ = write!(
            s,
            "\n[[providers]]\nname = \"sim-{}\"\nkind = \"openai_compatible\"\napi_base = \"{}\"\n",
            r.index,
            r.base_url()
        );
        if strategy == "cache_aware" {
            // What an operator copies from vLLM's "GPU KV cache size: N tokens" log line.
            let _ = writeln!(s, "kv_cache_tokens = {}", r.kv_cache_tokens());
        }
        if strategy == "precise_cache_aware" {
            if let Some(ep) = r.kv_events_endpoint() {
                let _ = write!(
                    s,
                    "[providers.kv_events]\nendpoint = \"{ep}\"\ntopic = \"{}\"\n",
                    r.kv_topic().unwrap_or("")
                );
                if let Some(rep) = r.kv_replay_endpoint() {
                    let _ = writeln!(s, "replay_endpoint = \"{rep}\"");
                }
            }
        }
        if strategy == "lmcache_aware" {
            if let Some(url) = r.lmcache_status_url() {
                let _ = write!(s, "[providers.lmcache]\nendpoint = \"{url}\"\n");
            }
        }
    }
    let _ = write!(
        s,
        "\n[[routes]]\nmodel = \"{model}\"\nstrategy = \"{strategy}\"\n"
    );
    for line in route_options {
        let _ = writeln!(s, "{line}");
    }
    for r in fleet.replicas() {
        let _ = write!(
            s,
            "[[routes.targets]]\nprovider = \"sim-{}\"\nmodel = \"{upstream_model}\"\nweight = 1\n",
            r.index
        );
    }
    s
}

/// A running gateway process, killed on drop.
struct Gateway {
    child: Child,
    base_url: String,
    log: PathBuf,
}

/// Ports tried for the gateway's listener: below Linux's ephemeral range (32768–60999), so the
/// port cannot be taken meanwhile as the local port of one of the many outgoing connections
/// (the gateway binds it only after we release it).
const GATEWAY_PORTS: std::ops::Range<u16> = 20_000..32_000;

/// A port free on 127.0.0.1 right now, picked at random from [`GATEWAY_PORTS`].
fn free_port() -> std::io::Result<u16> {
    use rand::Rng;
    let mut rng = rand::thread_rng();
    for _ in 0..100 {
        let port = rng.gen_range(GATEWAY_PORTS);
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The last non-empty line of the gateway's log, and the log's tail printed to stderr.
fn log_summary(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let tail = &lines[lines.len().saturating_sub(20)..];
    if !tail.is_empty() {
        eprintln!("   gateway log ({}):\n{}", path.display(), tail.join("\n"));
    }
    tail.last()
        .map_or_else(|| "empty log".into(), |l| l.trim().to_string())
}

async fn start_gateway(
    args: &CompareArgs,
    strategy: &str,
    routes: &Path,
    workdir: &Path,
) -> Result<Gateway, String> {
    let port = free_port().map_err(|e| format!("picking a port: {e}"))?;
    let listen = format!("127.0.0.1:{port}");
    let log = workdir.join(format!("gateway-{strategy}.log"));
    let file = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
    let err = file.try_clone().map_err(|e| e.to_string())?;
    let mut child = Command::new(&args.gateway)
        .arg("--routes")
        .arg(routes)
        .arg("--listen")
        .arg(&listen)
        .args(&args.gateway_args)
        .stdin(std::process::Stdio::null())
        .stdout(file)
        .stderr(err)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("starting {}: {e}", args.gateway.display()))?;
    let base_url = format!("http://{listen}");
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(2))
        .build()
        .map_err(|e| e.to_string())?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs_f64(args.ready_timeout_secs);
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!(
                "gateway exited with {status} before becoming ready: {}",
                log_summary(&log)
            ));
        }
        if let Ok(r) = client.get(format!("{base_url}/health")).send().await {
            if r.status().is_success() {
                return Ok(Gateway {
                    child,
                    base_url,
                    log,
                });
            }
        }
        if tokio::time::Instant::now() >= deadline {
            let _ = child.start_kill();
            return Err(format!(
                "gateway not ready after {} s: {}",
                args.ready_timeout_secs,
                log_summary(&log)
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

impl Gateway {
    async fn stop(mut self) {
        let _ = self.child.start_kill();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.child.wait()).await;
    }
}

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

/// Run one strategy on a fresh fleet.
pub async fn run_strategy(
    strategy: &str,
    sessions: Arc<Vec<crate::load::workload::Session>>,
    sim: &SimArgs,
    driver: &DriverArgs,
    compare: &CompareArgs,
    seed: u64,
    workdir: &Path,
) -> Result<StrategyReport, CompareError> {
    let mut fc = sim.fleet_config();
    fc.http_base_port = 0;
    fc.kv_base_port = 0;
    let fleet = spawn_fleet(fc).await.map_err(CompareError::Fleet)?;
    let urls = fleet.base_urls();
    let gw_err = |reason: String| CompareError::Gateway {
        strategy: strategy.to_string(),
        reason,
    };
    let (dispatch, gateway) = match strategy {
        "direct_round_robin" => (Dispatch::RoundRobin(urls.clone()), None),
        "direct_session_hash" => (Dispatch::SessionHash(urls.clone()), None),
        _ => {
            let routes = workdir.join(format!("routes-{strategy}.toml"));
            let toml = routes_toml_with(
                &fleet,
                strategy,
                &driver.request_model,
                &compare.upstream_model,
                &compare.route_options,
            );
            std::fs::write(&routes, toml).map_err(|source| CompareError::Write {
                path: routes.clone(),
                source,
            })?;
            let gw = match start_gateway(compare, strategy, &routes, workdir).await {
                Ok(gw) => gw,
                Err(e) => {
                    fleet.shutdown().await;
                    return Err(gw_err(e));
                }
            };
            if strategy == "precise_cache_aware"
                && !fleet
                    .wait_for_kv_subscribers(1, Duration::from_secs(10))
                    .await
            {
                eprintln!("warning: {strategy}: the gateway did not subscribe to every replica's KV events within 10 s");
            }
            (Dispatch::Single(gw.base_url.clone()), Some(gw))
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
        let outcome = run(sessions.clone(), dispatch, driver.run_options(seed)).await;
        let after = scrape_all(&client, &urls)
            .await
            .map_err(CompareError::Metrics)?;
        driver.write_trace(strategy, &outcome, &sessions)?;
        Ok(summarize(strategy, &outcome, &before, &after))
    }
    .await;
    if let Some(mut gw) = gateway {
        if let Ok(Some(status)) = gw.child.try_wait() {
            eprintln!("   the gateway exited during the run ({status})");
        }
        let failed = result
            .as_ref()
            .map(|r: &StrategyReport| r.errors > 0)
            .unwrap_or(true);
        if failed {
            let kept = std::env::temp_dir().join(format!(
                "rolter-load-gateway-{strategy}-{}.log",
                std::process::id()
            ));
            let _ = std::fs::copy(&gw.log, &kept);
            eprintln!("   errors: gateway log kept at {}", kept.display());
        }
        gw.stop().await;
    }
    fleet.shutdown().await;
    result
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
    let workdir = std::env::temp_dir().join(format!("rolter-load-{}", std::process::id()));
    std::fs::create_dir_all(&workdir).map_err(|source| CompareError::Write {
        path: workdir.clone(),
        source,
    })?;
    let mut reports = Vec::new();
    let mut skipped = Vec::new();
    for strategy in &args.strategies {
        eprintln!("== {strategy}: {n_requests} requests");
        let r = match run_strategy(
            strategy,
            sessions.clone(),
            sim,
            driver,
            args,
            workload.seed,
            &workdir,
        )
        .await
        {
            Ok(r) => r,
            // A gateway that rejects a strategy (not implemented yet) skips that row only.
            Err(CompareError::Gateway { strategy, reason }) => {
                eprintln!("   skipped: {reason}");
                skipped.push((strategy, reason));
                continue;
            }
            Err(e) => return Err(e),
        };
        eprintln!(
            "   hit rate {:.1}%, e2e p50 {:.0} ms, {:.1} req/s, errors {}{}",
            r.hit_rate * 100.0,
            r.e2e_ms.p50,
            r.throughput,
            r.errors,
            r.error_samples
                .first()
                .map(|e| format!(" (e.g. {e})"))
                .unwrap_or_default()
        );
        reports.push(r);
    }
    let mut md = render(workload, sim, driver, &reports, bound, n_requests);
    for (strategy, reason) in &skipped {
        let _ = writeln!(md, "\nNot run: `{strategy}` ({reason}).");
    }
    let out = args.out.clone().unwrap_or_else(|| {
        PathBuf::from(format!("loadtest/reports/{}.md", workload.workload.name()))
    });
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| CompareError::Write {
            path: dir.to_path_buf(),
            source,
        })?;
    }
    std::fs::write(&out, &md).map_err(|source| CompareError::Write {
        path: out.clone(),
        source,
    })?;
    let json = serde_json::json!({
        "workload": describe_workload(workload, n_requests),
        "upper_bound_hit_rate": bound.rate(),
        "strategies": reports,
    });
    let json_path = out.with_extension("json");
    std::fs::write(
        &json_path,
        serde_json::to_string_pretty(&json).unwrap_or_default(),
    )
    .map_err(|source| CompareError::Write {
        path: json_path.clone(),
        source,
    })?;
    eprintln!("wrote {} and {}", out.display(), json_path.display());
    let _ = std::fs::remove_dir_all(&workdir);
    Ok(md)
}

/// The report document.
pub fn render(
    workload: &WorkloadSpec,
    sim: &SimArgs,
    driver: &DriverArgs,
    reports: &[StrategyReport],
    bound: HitCount,
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
        "- Regenerate: `loadtest/run.sh` (this table: `rolter-load {}`).\n",
        args.join(" ")
    );
    s.push_str(&markdown_table(reports, Some(bound)));
    s.push_str(
        "\nHit rate: Σ `vllm:prefix_cache_hits_total` / Σ `vllm:prefix_cache_queries_total` \
         (prompt tokens) over the replicas during the run. *of bound*: that rate divided by the \
         upper bound, the hit rate of a single replica with an unbounded cache serving the same \
         trace. Latencies in milliseconds over successful requests; TTFT is the first content \
         chunk of the streamed response. *requests per replica*: percent of requests each \
         replica received; *max/mean*: busiest replica over the mean (1.00 = even).\n",
    );
    s
}
