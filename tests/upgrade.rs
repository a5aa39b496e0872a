//! pingora's zero-downtime binary upgrade with the real binary: a new process started
//! with `-u` takes the listening socket over from the old one (through `upgrade_sock`
//! from the pingora YAML) when the old one gets SIGQUIT, while a client loop runs.
//!
//! The sequence (pingora-core 0.9.1, `server/mod.rs` and `server/transfer_fd`):
//! 1. the new process, in `bootstrap()`, binds `upgrade_sock` and waits (up to ~5 s)
//!    for the old one to connect;
//! 2. SIGQUIT makes the old process send its listening sockets over that socket, keep
//!    accepting for 5 s (pingora's `CLOSE_TIMEOUT`) while the new one starts its
//!    services, then stop accepting, wait `grace_period_seconds` for in-flight
//!    requests and exit;
//! 3. both processes accept on the same socket meanwhile, so no client ever finds the
//!    port closed.
//!
//! The clients open a fresh connection per request: what the handover guarantees is
//! that *connecting* never fails. (An idle keep-alive connection to the old process is
//! closed when it shuts down, as any HTTP server may do; clients retry on a new one.)

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Concurrent clients in the loop.
const CLIENTS: usize = 3;
/// Hard bound on the client loop.
const LOAD_LIMIT: Duration = Duration::from_secs(25);
/// How long the old process may take to exit after SIGQUIT: pingora's 5 s close
/// timeout + the test YAML's 1 s grace period + 1 s runtime shutdown, with slack.
const EXIT_LIMIT: Duration = Duration::from_secs(15);

/// A gateway process killed on drop (if still running).
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(conf: &Path, routes: &Path, port: u16, log: &Path, upgrade: bool) -> Proc {
    let mut cmd = Command::new(rolter_bin());
    cmd.arg("-c")
        .arg(conf)
        .arg("--routes")
        .arg(routes)
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"));
    if upgrade {
        cmd.arg("-u");
    }
    let child = cmd
        .env("RUST_LOG", "info,access=warn")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .expect("spawn rolter");
    Proc(child)
}

fn signal(p: &Proc, sig: &str) {
    let ok = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(p.0.id().to_string())
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -{sig} failed");
}

/// What the client loop saw, with the time of each success (to show the new process
/// answered after the old one was gone).
#[derive(Default)]
struct Seen {
    ok: AtomicU64,
    last_ok: Mutex<Option<Instant>>,
    failures: Mutex<Vec<String>>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_process_takes_the_socket_over_and_no_client_is_refused() {
    let stub = Stub::start("a").await.unwrap();
    let dir = TempDir::new("upgrade");
    let routes = dir.path().join("routes.toml");
    std::fs::write(&routes, routes_toml(&[stub.url()], "round_robin", "")).unwrap();
    let conf = write_pingora_yaml(dir.path());
    let sock: PathBuf = dir.path().join("upgrade.sock");
    let (old_log, new_log) = (dir.path().join("old.log"), dir.path().join("new.log"));
    let port = free_port();

    let mut old = spawn(&conf, &routes, port, &old_log, false);
    assert!(
        wait_healthy_on(port, Duration::from_secs(20)).await,
        "old process did not come up"
    );

    let stop = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(Seen::default());
    let clients: Vec<_> = (0..CLIENTS)
        .map(|client| {
            let (stop, seen) = (stop.clone(), seen.clone());
            let url = format!("http://127.0.0.1:{port}/v1/chat/completions");
            tokio::spawn(async move {
                // No idle pool: every request connects anew.
                let http = reqwest::Client::builder()
                    .pool_max_idle_per_host(0)
                    .build()
                    .unwrap();
                let deadline = Instant::now() + LOAD_LIMIT;
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                    n += 1;
                    let result = http
                        .post(&url)
                        .header("content-type", "application/json")
                        .timeout(Duration::from_secs(10))
                        .body(chat_body(
                            "alias",
                            &format!("client {client} request {n}"),
                            false,
                        ))
                        .send()
                        .await;
                    let outcome = match result {
                        Ok(r) => {
                            let status = r.status();
                            match r.text().await {
                                Ok(_) if status == 200 => Ok(()),
                                Ok(body) => Err(format!("{status}: {body}")),
                                Err(e) => Err(format!("{status}, body: {e:?}")),
                            }
                        }
                        Err(e) => Err(format!("{e:?}")),
                    };
                    match outcome {
                        Ok(()) => {
                            seen.ok.fetch_add(1, Ordering::Relaxed);
                            *seen.last_ok.lock().unwrap() = Some(Instant::now());
                        }
                        Err(e) => seen
                            .failures
                            .lock()
                            .unwrap()
                            .push(format!("client {client} request {n}: {e}")),
                    }
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = seen.ok.load(Ordering::Relaxed);
    assert!(before > 0, "the old process serves the loop");

    // Step 1: the new process waits for the sockets on `upgrade_sock`.
    let mut new = spawn(&conf, &routes, port, &new_log, true);
    assert!(
        eventually(Duration::from_secs(10), || async { sock.exists() }).await,
        "the new process never opened {}",
        sock.display()
    );
    // Step 2: the old one hands them over and drains.
    let quit_at = Instant::now();
    signal(&old, "QUIT");
    let exited = eventually(EXIT_LIMIT, || {
        let done = old.0.try_wait().unwrap().is_some();
        async move { done }
    })
    .await;
    let handover = quit_at.elapsed();
    assert!(exited, "the old process did not exit within {EXIT_LIMIT:?}");
    let gone_at = Instant::now();
    assert!(old.0.wait().unwrap().success(), "the old process failed");
    assert!(
        new.0.try_wait().unwrap().is_none(),
        "the new process died:\n{}",
        std::fs::read_to_string(&new_log).unwrap_or_default()
    );
    // The loop keeps going against the new process alone for a moment.
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
    }

    let failures = seen.failures.lock().unwrap().clone();
    let total = seen.ok.load(Ordering::Relaxed);
    assert!(
        failures.is_empty(),
        "{} of {} requests failed during the upgrade, first: {:?}",
        failures.len(),
        total + failures.len() as u64,
        &failures[..failures.len().min(5)]
    );
    assert!(
        seen.last_ok.lock().unwrap().is_some_and(|t| t > gone_at),
        "no request was answered after the old process exited"
    );
    // The new process answers on the same port, and it got the socket by handover.
    let (status, stub_id, _) = {
        let gw_url = format!("http://127.0.0.1:{port}/v1/chat/completions");
        let r = reqwest::Client::new()
            .post(gw_url)
            .header("content-type", "application/json")
            .body(chat_body("alias", "after the upgrade", false))
            .timeout(Duration::from_secs(10))
            .send()
            .await
            .expect("the new process answers");
        let status = r.status().as_u16();
        let id = r
            .headers()
            .get("x-stub-id")
            .map(|v| v.to_str().unwrap().to_string());
        (status, id, r.text().await.unwrap())
    };
    assert_eq!((status, stub_id.as_deref()), (200, Some("a")));
    let old_text = std::fs::read_to_string(&old_log).unwrap();
    assert!(
        old_text.contains("listener sockets sent"),
        "the old process did not hand its sockets over:\n{old_text}"
    );
    eprintln!(
        "upgrade: {total} requests ({before} before the new process), none failed; \
         old process exited {handover:?} after SIGQUIT"
    );
    // Clean stop of the new process (SIGINT: pingora's fast shutdown).
    signal(&new, "INT");
    let _ = eventually(Duration::from_secs(5), || {
        let done = new.0.try_wait().unwrap().is_some();
        async move { done }
    })
    .await;
}
