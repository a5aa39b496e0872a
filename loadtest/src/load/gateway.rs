//! Gateway processes for `compare`: start one (rolter or a peer) on a free loopback port, wait
//! until it can route, stop it.
//!
//! Owns the child process, its log file, port picking and the readiness wait. The command line
//! and any environment variables set on top of ours come from the caller (`compare` for
//! rolter, `peer` for peers). A process is killed on drop, so an early return never leaves
//! one behind.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::process::{Child, Command};

use crate::load::peer::Readiness;

/// A running gateway process, killed on drop.
pub struct Gateway {
    child: Child,
    pub port: u16,
    pub base_url: String,
    pub log: PathBuf,
}

/// What to start.
pub struct Launch<'a> {
    pub program: &'a Path,
    pub args: Vec<String>,
    /// Environment variables set for the child (it inherits ours otherwise), e.g. `RUST_LOG`.
    pub env: Vec<(String, String)>,
    /// Where it will listen.
    pub port: u16,
    pub ready: Readiness,
    /// Log file (stdout and stderr).
    pub log: PathBuf,
    pub ready_timeout: Duration,
}

/// Ports tried for listeners: below Linux's ephemeral range (32768–60999), so the port cannot
/// be taken meanwhile as the local port of one of the many outgoing connections (the gateway
/// binds it only after we release it).
const GATEWAY_PORTS: std::ops::Range<u16> = 20_000..32_000;

/// A port free on 127.0.0.1 right now, picked at random from [`GATEWAY_PORTS`], other than
/// those in `taken`.
pub fn free_port(taken: &[u16]) -> std::io::Result<u16> {
    use rand::Rng;
    let mut rng = rand::thread_rng();
    for _ in 0..100 {
        let port = rng.gen_range(GATEWAY_PORTS);
        if !taken.contains(&port) && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The last non-empty line of a log, and its tail printed to stderr.
pub fn log_summary(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let tail = &lines[lines.len().saturating_sub(20)..];
    if !tail.is_empty() {
        eprintln!("   gateway log ({}):\n{}", path.display(), tail.join("\n"));
    }
    tail.last()
        .map_or_else(|| "empty log".into(), |l| l.trim().to_string())
}

/// Whether a started gateway answers as ready.
async fn is_ready(client: &reqwest::Client, base_url: &str, ready: &Readiness) -> bool {
    match ready {
        Readiness::Health => client
            .get(format!("{base_url}/health"))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success()),
        Readiness::HealthyWorkers(n) => {
            let Ok(r) = client.get(format!("{base_url}/readiness")).send().await else {
                return false;
            };
            let Ok(v) = r.json::<serde_json::Value>().await else {
                return false;
            };
            v.get("healthy_workers")
                .and_then(serde_json::Value::as_u64)
                .is_some_and(|h| h >= *n as u64)
        }
    }
}

/// Start the process and wait until it is ready; an error says why (with the log's last line).
pub async fn start(launch: Launch<'_>) -> Result<Gateway, String> {
    let Launch {
        program,
        args,
        env,
        port,
        ready,
        log,
        ready_timeout,
    } = launch;
    let file = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
    let err = file.try_clone().map_err(|e| e.to_string())?;
    let mut child = Command::new(program)
        .args(&args)
        .envs(env)
        .stdin(std::process::Stdio::null())
        .stdout(file)
        .stderr(err)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("starting {}: {e}", program.display()))?;
    let base_url = format!("http://127.0.0.1:{port}");
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(2))
        .build()
        .map_err(|e| e.to_string())?;
    let deadline = tokio::time::Instant::now() + ready_timeout;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!(
                "gateway exited with {status} before becoming ready: {}",
                log_summary(&log)
            ));
        }
        if is_ready(&client, &base_url, &ready).await {
            return Ok(Gateway {
                child,
                port,
                base_url,
                log,
            });
        }
        if tokio::time::Instant::now() >= deadline {
            let _ = child.start_kill();
            return Err(format!(
                "gateway not ready after {} s: {}",
                ready_timeout.as_secs_f64(),
                log_summary(&log)
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

impl Gateway {
    /// Whether the process has exited (and how).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Kill the process and wait (bounded) for it to go.
    pub async fn stop(mut self) {
        let _ = self.child.start_kill();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.child.wait()).await;
    }
}
