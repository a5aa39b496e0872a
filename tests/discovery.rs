//! DNS discovery under load (issue #25): the gateway runs in this process with an
//! injected resolver, in front of stubs on 127.0.0.1-4 (all of 127/8 is loopback). The
//! name grows from 2 to 4 addresses, shrinks to 1, then stops resolving; continuous load
//! sees no failed request, and the per-target metric series follow the address set.

mod common;

use async_trait::async_trait;
use common::*;
use pingora::server::{RunArgs, ShutdownSignal, ShutdownSignalWatch};
use rolter::egress::StaticResolver;
use rolter::runtime::LoadContext;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Shuts the in-process server down when the sender is dropped or fires.
struct StopSignal(tokio::sync::Mutex<Option<tokio::sync::oneshot::Receiver<()>>>);

#[async_trait]
impl ShutdownSignalWatch for StopSignal {
    async fn recv(&self) -> ShutdownSignal {
        if let Some(rx) = self.0.lock().await.take() {
            let _ = rx.await;
        } else {
            std::future::pending::<()>().await;
        }
        ShutdownSignal::FastShutdown
    }
}

/// The gateway on its own thread in this process; stopped on drop.
struct InProcess {
    port: u16,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<(), String>>>,
    _dir: TempDir,
}

impl InProcess {
    fn start(routes: &str, resolver: Arc<StaticResolver>) -> InProcess {
        let dir = TempDir::new("discovery");
        let routes_path = dir.path().join("routes.toml");
        std::fs::write(&routes_path, routes).unwrap();
        let port = free_port();
        let cli = <rolter::server::Cli as clap::Parser>::parse_from([
            "rolter".to_string(),
            "--routes".to_string(),
            routes_path.display().to_string(),
            "--listen".to_string(),
            format!("127.0.0.1:{port}"),
        ]);
        let ctx = LoadContext {
            resolver,
            ..Default::default()
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        let thread = std::thread::spawn(move || {
            let args = RunArgs {
                shutdown_signal: Box::new(StopSignal(tokio::sync::Mutex::new(Some(rx)))),
            };
            rolter::server::serve(cli, ctx, args)
        });
        InProcess {
            port,
            stop: Some(tx),
            thread: Some(thread),
            _dir: dir,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    async fn metrics(&self) -> String {
        reqwest::get(self.url("/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Four stubs on 127.0.0.1-4, one port.
async fn four_stubs() -> (u16, Vec<Stub>) {
    for _ in 0..20 {
        let port = free_port();
        let mut stubs = Vec::new();
        for i in 1..=4u8 {
            let addr = SocketAddr::new(IpAddr::from([127, 0, 0, i]), port);
            match Stub::start_on(&format!("r{i}"), addr).await {
                Ok(s) => stubs.push(s),
                Err(_) => break,
            }
        }
        if stubs.len() == 4 {
            return (port, stubs);
        }
    }
    panic!("no port free on 127.0.0.1-4");
}

fn addrs(last_octets: &[u8]) -> Vec<IpAddr> {
    last_octets
        .iter()
        .map(|&i| IpAddr::from([127, 0, 0, i]))
        .collect()
}

fn inflight_series(octet: u8) -> String {
    format!("rolter_inflight_requests{{target=\"fleet@127.0.0.{octet}/m\"}}")
}

/// The targets (last octets) that have an in-flight series, and the discovered gauge.
async fn exported(gw: &InProcess) -> (Vec<u8>, Option<f64>) {
    let text = gw.metrics().await;
    let targets = (1..=4u8)
        .filter(|&o| text.lines().any(|l| l.starts_with(&inflight_series(o))))
        .collect();
    let gauge = text
        .lines()
        .find(|l| l.starts_with("rolter_discovered_addresses{provider=\"fleet\"} "))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok());
    (targets, gauge)
}

async fn wait_for_set(gw: &InProcess, want: &[u8]) {
    let ok = eventually(Duration::from_secs(10), || async {
        exported(gw).await == (want.to_vec(), Some(want.len() as f64))
    })
    .await;
    assert!(ok, "series never became {want:?}: {:?}", exported(gw).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_growing_and_shrinking_under_load_fails_no_request() {
    let (port, stubs) = four_stubs().await;
    let resolver = Arc::new(StaticResolver::default());
    resolver.set("fleet.test", &addrs(&[1, 2]));
    let routes = format!(
        r#"[[providers]]
name = "fleet"
kind = "openai_compatible"
api_base = "http://fleet.test:{port}"
discovery = "dns"
refresh_s = 1
[providers.health]
interval_ms = 200

[[routes]]
model = "alias"
strategy = "round_robin"
[[routes.targets]]
provider = "fleet"
model = "m"
"#
    );
    let gw = InProcess::start(&routes, resolver.clone());
    assert!(wait_healthy_on(gw.port, Duration::from_secs(20)).await);
    wait_for_set(&gw, &[1, 2]).await;

    // Continuous load: 4 clients, each request checked.
    let running = Arc::new(AtomicBool::new(true));
    let (sent, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let load: Vec<_> = (0..4)
        .map(|w| {
            let (running, sent, failed) = (running.clone(), sent.clone(), failed.clone());
            let url = gw.url("/v1/chat/completions");
            tokio::spawn(async move {
                let client = reqwest::Client::new();
                let mut i = 0;
                while running.load(Ordering::SeqCst) {
                    i += 1;
                    let resp = client
                        .post(&url)
                        .timeout(Duration::from_secs(10))
                        .body(chat_body("alias", &format!("w{w} q{i}"), w % 2 == 0))
                        .send()
                        .await;
                    let ok = match resp {
                        Ok(r) if r.status() == 200 => r.text().await.is_ok(),
                        Ok(r) => {
                            eprintln!("failed: {} {:?}", r.status(), r.text().await);
                            false
                        }
                        Err(e) => {
                            eprintln!("failed: {e}");
                            false
                        }
                    };
                    sent.fetch_add(1, Ordering::SeqCst);
                    failed.fetch_add(usize::from(!ok), Ordering::SeqCst);
                }
            })
        })
        .collect();
    let served = |i: usize| stubs[i].served();
    assert!(
        eventually(Duration::from_secs(5), || async {
            served(0) > 0 && served(1) > 0
        })
        .await
    );

    // 2 -> 4: the new addresses become targets and get traffic.
    resolver.set("fleet.test", &addrs(&[1, 2, 3, 4]));
    wait_for_set(&gw, &[1, 2, 3, 4]).await;
    assert!(
        eventually(Duration::from_secs(5), || async {
            served(2) > 0 && served(3) > 0
        })
        .await,
        "new targets got no traffic"
    );

    // 4 -> 1 with streams in flight on the addresses that go: they drain (finish on the
    // old table) and the targets' series go; only then do their replicas stop.
    let slow = Behaviour {
        stream_chunks: 10,
        chunk_interval: Duration::from_millis(20),
        ..Behaviour::default()
    };
    for s in &stubs {
        s.set_behaviour(slow.clone());
    }
    let leaving = [0, 2, 3];
    assert!(
        eventually(Duration::from_secs(5), || async {
            leaving.iter().any(|&i| stubs[i].active() > 0)
        })
        .await,
        "no stream in flight on a leaving target"
    );
    resolver.set("fleet.test", &addrs(&[2]));
    wait_for_set(&gw, &[2]).await;
    assert!(
        eventually(Duration::from_secs(5), || async {
            leaving.iter().all(|&i| stubs[i].active() == 0)
        })
        .await,
        "in-flight requests on removed targets did not finish"
    );
    for i in leaving {
        stubs[i].stop();
    }
    let before = served(1);
    assert!(eventually(Duration::from_secs(5), || async { served(1) > before + 20 }).await);

    // The name stops resolving: the last good set stays, and the failure is counted.
    resolver.set("fleet.test", &[]);
    let failed_series = "rolter_discovery_resolutions_total{provider=\"fleet\",result=\"failed\"} ";
    assert!(
        eventually(Duration::from_secs(5), || async {
            gw.metrics()
                .await
                .lines()
                .any(|l| l.starts_with(failed_series))
        })
        .await
    );
    let before = served(1);
    assert!(eventually(Duration::from_secs(5), || async { served(1) > before + 20 }).await);
    assert_eq!(exported(&gw).await, (vec![2], Some(1.0)));

    running.store(false, Ordering::SeqCst);
    for task in load {
        task.await.unwrap();
    }
    let (sent, failed) = (sent.load(Ordering::SeqCst), failed.load(Ordering::SeqCst));
    assert!(sent > 100, "only {sent} requests sent");
    assert_eq!(failed, 0, "{failed} of {sent} requests failed");
    let text = gw.metrics().await;
    for gone in [1, 3, 4] {
        let label = format!("fleet@127.0.0.{gone}");
        assert!(
            !text.lines().any(|l| l.contains(&label)),
            "a series of removed target {label} is left: {:?}",
            text.lines()
                .filter(|l| l.contains(&label))
                .collect::<Vec<_>>()
        );
    }
    assert!(text.contains("rolter_provider_healthy{provider=\"fleet@127.0.0.2\"} 1"));
}
