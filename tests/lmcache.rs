//! `lmcache_aware` end to end and the LMCache status poller.
//!
//! The binary tests run the real gateway in front of recording stubs, each with a tiny
//! status server (below) the test steers: healthy answers, 500s, garbage, out-of-range
//! values and hangs. The re-pointed-name test runs the poller in-process with the
//! injectable [`StaticResolver`], so no `/etc/hosts` or DNS is involved. Everything is
//! on 127.0.0.1 and bounded in time.

mod common;

use common::*;
use parking_lot::Mutex;
use rolter::config::LmcacheConfig;
use rolter::egress::{EgressPolicy, StaticResolver};
use rolter::lmcache_poll::{LmcacheEndpoint, LmcacheStatus, LmcacheView, PollResult, Poller};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Poll timing used by the binary tests.
const INTERVAL_MS: u64 = 100;
const TIMEOUT_MS: u64 = 400;
const STALE_AFTER_MS: u64 = 1_500;
/// How long a hanging status server holds a connection before dropping it.
const HANG: Duration = Duration::from_secs(3);

/// What a status server answers.
#[derive(Debug, Clone, Copy)]
enum Mode {
    Status { occupancy: f64, available: bool },
    Fail500,
    Garbage,
    Hang,
}

fn status(occupancy: f64) -> Mode {
    Mode::Status {
        occupancy,
        available: true,
    }
}

/// An LMCache-style status endpoint on a loopback port (raw HTTP/1.1, one request per
/// connection), counting the requests it gets.
struct StatusServer {
    port: u16,
    mode: Arc<Mutex<Mode>>,
    hits: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl StatusServer {
    async fn start(mode: Mode) -> StatusServer {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let mode = Arc::new(Mutex::new(mode));
        let hits = Arc::new(AtomicUsize::new(0));
        let (m, h) = (mode.clone(), hits.clone());
        let task = tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let (m, h) = (m.clone(), h.clone());
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 1024];
                    let read_head = async {
                        while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 8192 {
                            match conn.read(&mut chunk).await {
                                Ok(0) | Err(_) => return false,
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                        }
                        true
                    };
                    if !tokio::time::timeout(Duration::from_secs(2), read_head)
                        .await
                        .unwrap_or(false)
                    {
                        return;
                    }
                    h.fetch_add(1, Ordering::SeqCst);
                    let mode = *m.lock();
                    let (code, body) = match mode {
                        Mode::Status {
                            occupancy,
                            available,
                        } => (
                            200,
                            format!(
                                "{{\"occupancy\": {occupancy}, \"cache_available\": {available}}}"
                            ),
                        ),
                        Mode::Fail500 => (500, "{\"error\": \"boom\"}".to_string()),
                        Mode::Garbage => (200, "<html>definitely not json".to_string()),
                        Mode::Hang => {
                            tokio::time::sleep(HANG).await;
                            return;
                        }
                    };
                    let resp = format!(
                        "HTTP/1.1 {code} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = conn.write_all(resp.as_bytes()).await;
                    let _ = conn.shutdown().await;
                });
            }
        });
        StatusServer {
            port,
            mode,
            hits,
            task,
        }
    }

    fn set(&self, mode: Mode) {
        *self.mode.lock() = mode;
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/cache/status", self.port)
    }
}

impl Drop for StatusServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A routing file: provider `p<i>` → `upstreams[i]` with `[providers.lmcache]` at
/// `statuses[i]`, one `lmcache_aware` route over all of them.
fn lmcache_routes(upstreams: &[String], statuses: &[String], extra: &str) -> String {
    let mut s = String::new();
    for (i, (u, st)) in upstreams.iter().zip(statuses).enumerate() {
        s += &format!(
            "[[providers]]\nname = \"p{i}\"\nkind = \"openai_compatible\"\napi_base = \"{u}\"\n\
             [providers.lmcache]\nendpoint = \"{st}\"\ninterval_ms = {INTERVAL_MS}\n\
             timeout_ms = {TIMEOUT_MS}\nstale_after_ms = {STALE_AFTER_MS}\n\n"
        );
    }
    s += "[[routes]]\nmodel = \"alias\"\nstrategy = \"lmcache_aware\"\n";
    for i in 0..upstreams.len() {
        s += &format!("[[routes.targets]]\nprovider = \"p{i}\"\nmodel = \"upstream-model-{i}\"\n");
    }
    s + extra
}

/// The value of the series `name{...}` whose labels include every `k="v"` in `labels`.
async fn metric_with(gw: &Gateway, name: &str, labels: &[(&str, &str)]) -> f64 {
    let text = gw.get_text("/metrics").await;
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Which stub served one small chat request (asserting it succeeded).
async fn served_by(gw: &Gateway, n: usize) -> String {
    let (status, stub, body) =
        post_chat(gw, chat_body("alias", &format!("question {n}"), false)).await;
    assert_eq!(status, 200, "{body}");
    stub.expect("x-stub-id")
}

/// Wait until every provider has had a good poll.
async fn wait_first_polls(gw: &Gateway, providers: usize) {
    for i in 0..providers {
        let p = format!("p{i}");
        assert!(
            eventually(Duration::from_secs(10), || async {
                metric_with(
                    gw,
                    "rolter_lmcache_polls_total",
                    &[("provider", &p), ("result", "ok")],
                )
                .await
                    >= 1.0
            })
            .await,
            "{p} was never polled successfully"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_endpoints_steer_traffic_toward_free_cache() {
    let (a, b) = (
        Stub::start("a").await.unwrap(),
        Stub::start("b").await.unwrap(),
    );
    let (sa, sb) = (
        StatusServer::start(status(0.9)).await,
        StatusServer::start(status(0.1)).await,
    );
    let gw = Gateway::start(&lmcache_routes(
        &[a.url(), b.url()],
        &[sa.url(), sb.url()],
        "",
    ))
    .await;
    wait_first_polls(&gw, 2).await;

    for n in 0..20 {
        assert_eq!(served_by(&gw, n).await, "b", "b has 90% free, a 10%");
    }
    let capacity = [("strategy", "lmcache_aware"), ("reason", "cache_capacity")];
    assert!(metric_with(&gw, "rolter_routing_decisions_total", &capacity).await >= 20.0);

    // The caches fill the other way round: traffic follows within a few polls.
    sa.set(status(0.05));
    sb.set(Mode::Status {
        occupancy: 0.0,
        available: false,
    });
    let mut n = 100;
    assert!(
        eventually(Duration::from_secs(5), || {
            n += 1;
            let gw = &gw;
            async move { served_by(gw, n).await == "a" }
        })
        .await,
        "traffic never moved to a"
    );
    for n in 200..210 {
        assert_eq!(
            served_by(&gw, n).await,
            "a",
            "b reports its cache unavailable"
        );
    }
    assert!(b.recorded().len() >= 20 && a.recorded().len() >= 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_controllers_turn_neutral_within_the_staleness_limit_and_routing_continues() {
    let stubs = [
        Stub::start("a").await.unwrap(),
        Stub::start("b").await.unwrap(),
        Stub::start("c").await.unwrap(),
    ];
    // Free capacity: a 1.0, b 0.5, c 0.0. With a neutral, a counts as the average of
    // the others (0.25), so b wins: that switch is how neutrality shows.
    let st = [
        StatusServer::start(status(0.0)).await,
        StatusServer::start(status(0.5)).await,
        StatusServer::start(status(1.0)).await,
    ];
    let urls: Vec<String> = stubs.iter().map(|s| s.url()).collect();
    let status_urls: Vec<String> = st.iter().map(|s| s.url()).collect();
    let gw = Gateway::start(&lmcache_routes(&urls, &status_urls, "")).await;
    wait_first_polls(&gw, 3).await;
    assert_eq!(served_by(&gw, 0).await, "a");

    let mut n = 1;
    for (mode, result) in [
        (Mode::Fail500, "error"),
        (Mode::Garbage, "invalid"),
        (status(1.7), "invalid"),
        (Mode::Hang, "timeout"),
    ] {
        st[0].set(mode);
        let switched = Instant::now();
        let mut neutral_after = None;
        while switched.elapsed() < Duration::from_millis(STALE_AFTER_MS + 1_000) {
            n += 1;
            if served_by(&gw, n).await == "b" {
                neutral_after = Some(switched.elapsed());
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let after = neutral_after.unwrap_or_else(|| panic!("{mode:?}: a never turned neutral"));
        assert!(
            after <= Duration::from_millis(STALE_AFTER_MS),
            "{mode:?}: neutral only after {after:?}"
        );
        // Neutral, not excluded: routing goes on (every request above got a 200) and a
        // keeps no preference.
        for _ in 0..5 {
            n += 1;
            assert_eq!(served_by(&gw, n).await, "b", "{mode:?}");
        }
        let p0 = [("provider", "p0"), ("result", result)];
        assert!(
            metric_with(&gw, "rolter_lmcache_polls_total", &p0).await >= 1.0,
            "{mode:?} not counted as {result}"
        );
        // Recover before the next failure mode.
        st[0].set(status(0.0));
        let gw = &gw;
        assert!(
            eventually(Duration::from_secs(5), || {
                n += 1;
                let k = n;
                async move { served_by(gw, k).await == "a" }
            })
            .await,
            "{mode:?}: a never recovered"
        );
    }
    assert!(
        stubs[2].recorded().is_empty(),
        "c (no free cache) never wins"
    );
}

fn poll_config(endpoint: String) -> LmcacheConfig {
    LmcacheConfig {
        endpoint,
        interval_ms: 50,
        timeout_ms: 300,
        stale_after_ms: 1_000,
    }
}

fn endpoint(provider: &str, url: String) -> LmcacheEndpoint {
    let cell = Arc::new(LmcacheStatus::new(Duration::from_millis(1_000)));
    LmcacheEndpoint::new(provider, &poll_config(url), cell).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_poll_outcome_is_classified() {
    let server = StatusServer::start(status(0.25)).await;
    let resolver = Arc::new(StaticResolver::default());
    resolver.set("status.test", &["127.0.0.1".parse().unwrap()]);
    let poller = Poller::new(resolver);
    let policy = Arc::new(EgressPolicy::default());
    let ep = endpoint("classify", format!("http://status.test:{}/s", server.port));
    assert_eq!(
        poller.poll_once(&ep, &policy).await,
        PollResult::Ok(LmcacheView {
            occupancy: 0.25,
            cache_available: true
        })
    );
    for (mode, label) in [
        (Mode::Fail500, "error"),
        (Mode::Garbage, "invalid"),
        (status(-0.5), "invalid"),
        (Mode::Hang, "timeout"),
    ] {
        server.set(mode);
        let started = Instant::now();
        let result = poller.poll_once(&ep, &policy).await;
        assert_eq!(result.label(), label, "{mode:?}: {result}");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "bounded by the timeout"
        );
    }
    let nowhere = endpoint("classify", "http://nowhere.test/s".into());
    assert_eq!(poller.poll_once(&nowhere, &policy).await.label(), "error");
    let refused = endpoint("classify", format!("http://127.0.0.1:{}/s", free_port()));
    assert_eq!(poller.poll_once(&refused, &policy).await.label(), "error");
    let metadata = endpoint("classify", "http://169.254.169.254/latest/meta-data".into());
    assert_eq!(poller.poll_once(&metadata, &policy).await.label(), "denied");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_repointed_to_a_denied_address_stops_being_polled() {
    let server = StatusServer::start(status(0.3)).await;
    let resolver = Arc::new(StaticResolver::default());
    resolver.set("status.test", &["127.0.0.1".parse().unwrap()]);
    let poller = Arc::new(Poller::new(resolver.clone()));
    let policy = Arc::new(EgressPolicy::default());
    let ep = Arc::new(endpoint(
        "repoint-test",
        format!("http://status.test:{}/s", server.port),
    ));
    let task = {
        let (poller, ep, policy) = (poller.clone(), ep.clone(), policy.clone());
        tokio::spawn(async move { poller.run(&ep, &policy).await })
    };
    let fresh = || ep.status.view(Instant::now()).is_some();
    assert!(
        eventually(Duration::from_secs(5), || async {
            fresh() && server.hits() >= 2
        })
        .await
    );

    // The name now resolves to the cloud metadata address: never contacted again.
    resolver.set("status.test", &["169.254.169.254".parse().unwrap()]);
    assert!(
        eventually(Duration::from_secs(5), || async { !fresh() }).await,
        "still fresh after the name moved to a denied address"
    );
    let hits = server.hits();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(server.hits(), hits, "a denied name was polled");
    let denied = rolter::metrics::METRICS
        .lmcache_polls
        .with_label_values(&["repoint-test", "denied"])
        .get();
    assert!(denied >= 5, "denied polls are counted: {denied}");

    // A name with one good and one denied address is still denied.
    resolver.set(
        "status.test",
        &["127.0.0.1".parse().unwrap(), "fe80::1".parse().unwrap()],
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(server.hits(), hits, "one denied address is enough");
    assert!(!fresh());

    // Pointed back, it is polled again.
    resolver.set("status.test", &["127.0.0.1".parse().unwrap()]);
    assert!(eventually(Duration::from_secs(5), || async { fresh() }).await);
    assert!(server.hits() > hits);
    task.abort();
}

/// Run `rolter` with `args` and the routing file `routes`; (success, stdout + stderr).
/// A gateway that unexpectedly starts is killed after a bound.
fn run_rolter(routes: &str, args: &[&str]) -> (bool, String) {
    let dir = TempDir::new("lmcache-cli");
    let path = dir.path().join("routes.toml");
    std::fs::write(&path, routes).unwrap();
    let mut child = Command::new(rolter_bin())
        .args(args)
        .arg("--routes")
        .arg(&path)
        .arg("--listen")
        .arg(format!("127.0.0.1:{}", free_port()))
        .env("RUST_LOG", "error")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("rolter {args:?} did not exit");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout),
    )
}

#[test]
fn denied_lmcache_endpoints_fail_startup_and_the_test_flag() {
    let upstream = ["http://127.0.0.1:9".to_string()];
    let literal = lmcache_routes(
        &upstream,
        &["http://169.254.169.254/latest/meta-data".into()],
        "",
    );
    for args in [&["-t"][..], &[]] {
        let (ok, out) = run_rolter(&literal, args);
        assert!(!ok, "{args:?}: {out}");
        assert!(
            out.contains(
                "routes.toml: providers[0].lmcache.endpoint: provider \"p0\": address 169.254.169.254 \
                 is denied by egress rule deny \"169.254.0.0/16\" (built-in: IPv4 link-local"
            ),
            "{args:?}: {out}"
        );
    }
    // A name that only resolves to a denied address: caught after resolution.
    let egress = "[egress]\ndeny = [\"127.0.0.0/8\", \"::1\"]\n";
    let resolved = lmcache_routes(
        &["http://192.0.2.1:9".to_string()],
        &["http://localhost:9/status".into()],
        egress,
    );
    let (ok, out) = run_rolter(&resolved, &["-t"]);
    assert!(!ok, "{out}");
    assert!(
        out.contains("providers[0].lmcache.endpoint: provider \"p0\": address ")
            && out.contains("of \"localhost\" is denied by egress rule deny")
            && out.contains("(egress.deny["),
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_with_a_denied_endpoint_is_rejected_and_the_old_routes_stay() {
    let a = Stub::start("a").await.unwrap();
    let sa = StatusServer::start(status(0.2)).await;
    let gw = Gateway::start(&lmcache_routes(&[a.url()], &[sa.url()], "")).await;
    wait_first_polls(&gw, 1).await;
    let denied = lmcache_routes(
        &[a.url()],
        &["http://metadata.google.internal/x".into()],
        "",
    );
    std::fs::write(&gw.routes, denied).unwrap();
    gw.signal("HUP");
    assert!(
        eventually(Duration::from_secs(10), || async {
            gw.metric("rolter_config_reloads_total{result=\"failed\"}")
                .await
                == Some(1.0)
        })
        .await,
        "reload was not rejected"
    );
    assert_eq!(served_by(&gw, 0).await, "a");
    // The old table's poller keeps running.
    let hits = sa.hits();
    assert!(eventually(Duration::from_secs(5), || async { sa.hits() > hits }).await);
}
