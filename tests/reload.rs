//! SIGHUP reload through the real binary, under continuous load: every reload swaps the
//! routes atomically without failing a request, the prefix state of a target present in
//! every generation survives (its trie never shrinks, a known conversation still returns
//! to its replica), and an invalid file is rejected, logged and counted while the old
//! routes keep serving.

mod common;

use common::*;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Concurrent clients in the load loop.
const CLIENTS: usize = 4;
/// SIGHUPs sent, alternating the two configs.
const RELOADS: usize = 20;
/// Hard bound on the load loop, whatever happens to the test.
const LOAD_LIMIT: Duration = Duration::from_secs(25);
/// How long one reload may take to show up in the metrics.
const RELOAD_LIMIT: Duration = Duration::from_secs(5);

const OK: &str = "rolter_config_reloads_total{result=\"ok\"}";
const FAILED: &str = "rolter_config_reloads_total{result=\"failed\"}";
const CACHE_HITS: &str =
    "rolter_routing_decisions_total{reason=\"cache_hit\",strategy=\"cache_aware\"}";

fn provider(name: &str, url: &str) -> String {
    format!(
        "[[providers]]\nname = \"{name}\"\nkind = \"openai_compatible\"\napi_base = \"{url}\"\n\n"
    )
}

fn route(alias: &str, strategy: &str, providers: &[&str]) -> String {
    let mut s = format!("[[routes]]\nmodel = \"{alias}\"\nstrategy = \"{strategy}\"\n");
    for p in providers {
        s += &format!("[[routes.targets]]\nprovider = \"{p}\"\nmodel = \"m\"\n");
    }
    s
}

/// Generation A: `alias` is cache_aware over stubs a and b.
fn config_a(a: &Stub, b: &Stub) -> String {
    provider("pa", &a.url())
        + &provider("pb", &b.url())
        + &route("alias", "cache_aware", &["pa", "pb"])
}

/// Generation B: b is gone, c is new, `alias` is a pipeline, and a second route exists.
fn config_b(a: &Stub, c: &Stub) -> String {
    provider("pa", &a.url())
        + &provider("pc", &c.url())
        + &route("alias", "pipeline", &["pa", "pc"])
        + &route("extra", "round_robin", &["pc"])
}

/// Replace the routing file the way configuration tools do (write aside, rename).
fn rewrite(gw: &Gateway, text: &str) {
    let tmp = gw.routes.with_extension("toml.new");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, &gw.routes).unwrap();
}

async fn metric_or_zero(gw: &Gateway, series: &str) -> f64 {
    gw.metric(series).await.unwrap_or(0.0)
}

/// Wait until `series` reaches `value`.
async fn wait_for(gw: &Gateway, series: &str, value: f64, limit: Duration) -> bool {
    eventually(limit, || async {
        metric_or_zero(gw, series).await >= value
    })
    .await
}

/// The reload service starts listening shortly after the proxy answers (an earlier
/// SIGHUP is dropped, not fatal): signal until one reload is counted.
async fn arm_reload(gw: &Gateway) -> f64 {
    let ok = metric_or_zero(gw, OK).await;
    for _ in 0..25 {
        gw.signal("HUP");
        if wait_for(gw, OK, ok + 1.0, Duration::from_millis(400)).await {
            return metric_or_zero(gw, OK).await;
        }
    }
    panic!("no SIGHUP reload was ever counted");
}

/// A conversation with its own long system prompt, `turns` exchanges deep.
fn conversation(conv: usize, turns: usize) -> String {
    let system = format!(
        "You are the reload-test assistant {conv}. {}",
        "Stay on topic. ".repeat(40)
    );
    let mut messages = vec![serde_json::json!({"role": "system", "content": system})];
    for t in 0..turns {
        messages.push(serde_json::json!({"role": "user", "content": format!("question {t}")}));
        messages.push(serde_json::json!({"role": "assistant", "content": format!("answer {t}")}));
    }
    messages.push(serde_json::json!({"role": "user", "content": "and next?"}));
    serde_json::json!({"model": "alias", "messages": messages}).to_string()
}

/// What the load loop saw.
#[derive(Default)]
struct LoadReport {
    ok: AtomicU64,
    failures: Mutex<Vec<String>>,
}

/// `CLIENTS` tasks posting chat requests over keep-alive connections until `stop` (or
/// [`LOAD_LIMIT`]); every answer must be a 200 from one of `stubs`.
fn start_load(
    gw: &Gateway,
    stubs: &'static [&'static str],
    stop: Arc<AtomicBool>,
    report: Arc<LoadReport>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..CLIENTS)
        .map(|client| {
            let url = gw.url("/v1/chat/completions");
            let (stop, report) = (stop.clone(), report.clone());
            tokio::spawn(async move {
                let http = reqwest::Client::new();
                let deadline = Instant::now() + LOAD_LIMIT;
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                    n += 1;
                    // Past one 64-byte chunk, so each request stores a key in its target's trie.
                    let text = format!("client {client} request {n}: {}", "load ".repeat(16));
                    let body = chat_body("alias", &text, false);
                    let resp = http
                        .post(&url)
                        .header("content-type", "application/json")
                        .timeout(Duration::from_secs(10))
                        .body(body)
                        .send()
                        .await;
                    let outcome = match resp {
                        Err(e) => Err(format!("client {client} request {n}: {e}")),
                        Ok(r) => {
                            let status = r.status().as_u16();
                            let stub = r
                                .headers()
                                .get("x-stub-id")
                                .and_then(|v| v.to_str().ok())
                                .map(str::to_owned);
                            let body = r.text().await;
                            match (status, stub, body) {
                                (200, Some(s), Ok(_)) if stubs.contains(&s.as_str()) => Ok(()),
                                (status, stub, body) => Err(format!(
                                    "client {client} request {n}: {status} from {stub:?}: {body:?}"
                                )),
                            }
                        }
                    };
                    match outcome {
                        Ok(()) => {
                            report.ok.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => report.failures.lock().unwrap().push(e),
                    }
                }
            })
        })
        .collect()
}

async fn stop_load(
    stop: &AtomicBool,
    clients: Vec<tokio::task::JoinHandle<()>>,
    report: &LoadReport,
) -> u64 {
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
    }
    let failures = report.failures.lock().unwrap();
    assert!(
        failures.is_empty(),
        "{} failed requests, first: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    report.ok.load(Ordering::Relaxed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_reloads_under_load_fail_no_request_and_keep_the_surviving_trie() {
    let (a, b, c) = (
        Stub::start("a").await.unwrap(),
        Stub::start("b").await.unwrap(),
        Stub::start("c").await.unwrap(),
    );
    let gw = Gateway::start_logged(&config_a(&a, &b)).await;
    let mut ok = arm_reload(&gw).await;

    // A known conversation homed on a (the target both generations keep). A cold
    // conversation goes to the least-warmed target, so one of the first two lands on a.
    let mut home = None;
    for conv in 0..4 {
        let (status, stub, _) = post_chat(&gw, conversation(conv, 0)).await;
        assert_eq!(status, 200);
        if stub.as_deref() == Some("a") {
            home = Some(conv);
            break;
        }
    }
    let known = home.expect("no cold conversation landed on a");
    let (status, stub, _) = post_chat(&gw, conversation(known, 1)).await;
    assert_eq!(
        (status, stub.as_deref()),
        (200, Some("a")),
        "turn 1 stays on a"
    );

    let stop = Arc::new(AtomicBool::new(false));
    let report = Arc::new(LoadReport::default());
    let clients = start_load(&gw, &["a", "b", "c"], stop.clone(), report.clone());

    let trie_a = "rolter_trie_nodes{target=\"pa/m\"}";
    let mut nodes = gw.metric(trie_a).await.expect("a's trie is exported");
    assert!(nodes > 0.0);
    let started = Instant::now();
    for i in 1..=RELOADS {
        let generation_b = i % 2 == 1;
        rewrite(
            &gw,
            &if generation_b {
                config_b(&a, &c)
            } else {
                config_a(&a, &b)
            },
        );
        gw.signal("HUP");
        assert!(
            wait_for(&gw, OK, ok + 1.0, RELOAD_LIMIT).await,
            "reload {i} was not counted"
        );
        ok += 1.0;
        // The new generation is live: its route list, and no series for a removed target.
        let models = gw.get_text("/v1/models").await;
        assert_eq!(
            models.contains("\"extra\""),
            generation_b,
            "reload {i}: {models}"
        );
        if generation_b {
            // The added target serves its new route at once.
            let (status, stub, _) = post_chat(&gw, chat_body("extra", "to c", false)).await;
            assert_eq!((status, stub.as_deref()), (200, Some("c")), "reload {i}");
        }
        let gone = if generation_b { "pb/m" } else { "pc/m" };
        assert_eq!(
            gw.metric(&format!("rolter_trie_nodes{{target=\"{gone}\"}}"))
                .await,
            None,
            "reload {i}: {gone} was removed"
        );
        assert_eq!(
            gw.metric(&format!(
                "rolter_upstream_ttfb_seconds_count{{target=\"{gone}\"}}"
            ))
            .await,
            None,
            "reload {i}: {gone}'s histograms were dropped"
        );
        // a's trie only grows: its state survived the swap.
        let now = gw.metric(trie_a).await.expect("a's trie is exported");
        assert!(
            now >= nodes,
            "reload {i}: a's trie shrank from {nodes} to {now}"
        );
        nodes = now;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let reload_time = started.elapsed();
    let served = stop_load(&stop, clients, &report).await;
    assert_eq!(metric_or_zero(&gw, FAILED).await, 0.0);
    assert!(served >= 50, "only {served} requests in {reload_time:?}");
    assert!(a.served() > 0 && b.served() > 0, "the load reached a and b");
    assert!(
        c.served() >= (RELOADS / 2) as u64,
        "every generation B reached c"
    );
    eprintln!("{RELOADS} reloads in {reload_time:?} under {served} requests, none failed");

    // The last generation is A again (cache_aware): the known conversation still
    // matches a's trie and is pinned there as a cache hit.
    let hits = metric_or_zero(&gw, CACHE_HITS).await;
    let (status, stub, _) = post_chat(&gw, conversation(known, 2)).await;
    assert_eq!(
        (status, stub.as_deref()),
        (200, Some("a")),
        "the known conversation moved"
    );
    assert_eq!(metric_or_zero(&gw, CACHE_HITS).await, hits + 1.0);
    // No in-flight count leaked or went negative across removals and re-additions.
    for t in ["pa/m", "pb/m"] {
        let series = format!("rolter_inflight_requests{{target=\"{t}\"}}");
        assert_eq!(gw.metric(&series).await, Some(0.0), "{series}");
    }
    let log = gw.log();
    assert!(
        log.matches("reloaded routes from").count() > RELOADS,
        "every reload is logged:\n{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_file_is_rejected_logged_counted_and_the_old_routes_keep_serving() {
    let (a, b, c) = (
        Stub::start("a").await.unwrap(),
        Stub::start("b").await.unwrap(),
        Stub::start("c").await.unwrap(),
    );
    let gw = Gateway::start_logged(&config_a(&a, &b)).await;
    let ok = arm_reload(&gw).await;
    let stop = Arc::new(AtomicBool::new(false));
    let report = Arc::new(LoadReport::default());
    // Only the old targets may answer.
    let clients = start_load(&gw, &["a", "b"], stop.clone(), report.clone());

    // Each file would move all traffic to c, and each is wrong in its own way: a bad
    // strategy (schema), a cloud-metadata address (egress), a name that does not
    // resolve (found only when routes are built).
    let bad = [
        (
            config_b(&a, &c)
                .replace("\"pipeline\"", "\"fastest\"")
                .replace(&provider("pa", &a.url()), ""),
            "fastest",
        ),
        (
            provider("pc", "http://169.254.169.254:80") + &route("alias", "round_robin", &["pc"]),
            "169.254.169.254",
        ),
        (
            provider("pc", "http://no-such-host.invalid:8000")
                + &route("alias", "round_robin", &["pc"]),
            "no-such-host.invalid",
        ),
        (
            // A tokenizer directory that is not there (found when the table is built).
            provider("pc", &c.url())
                + &route("alias", "precise_cache_aware", &["pc"]).replace(
                    "\"precise_cache_aware\"\n",
                    "\"precise_cache_aware\"\ntokenizer = \"no-such-tokenizer\"\n",
                ),
            "routes[0].tokenizer",
        ),
    ];
    for (n, (text, reason)) in bad.iter().enumerate() {
        let failed = metric_or_zero(&gw, FAILED).await;
        rewrite(&gw, text);
        gw.signal("HUP");
        assert!(
            wait_for(&gw, FAILED, failed + 1.0, RELOAD_LIMIT).await,
            "bad file {n} was not counted as failed"
        );
        let log = gw.log();
        let line = log
            .lines()
            .rev()
            .find(|l| l.contains("rejected, keeping the previous routes"))
            .unwrap_or_else(|| panic!("bad file {n}: no error logged:\n{log}"));
        assert!(line.contains("ERROR"), "{line}");
        assert!(
            log.contains(reason),
            "bad file {n}: the log does not name {reason}:\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let served = stop_load(&stop, clients, &report).await;
    assert!(served > 0);
    assert_eq!(
        metric_or_zero(&gw, OK).await,
        ok,
        "no bad file was swapped in"
    );
    assert_eq!(
        c.served(),
        0,
        "no request reached the rejected files' target"
    );
    assert!(a.served() + b.served() >= served);
    // And after all that, the old routes still answer.
    for i in 0..10 {
        let (status, stub, _) =
            post_chat(&gw, chat_body("alias", &format!("after {i}"), false)).await;
        assert_eq!(status, 200);
        assert!(matches!(stub.as_deref(), Some("a" | "b")), "{stub:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_removed_while_its_probe_runs_leaves_no_health_gauge_behind() {
    // The removed provider's health endpoint accepts and never answers, so each probe runs
    // its full 1.5 s timeout; the reload lands right after one starts, well inside it.
    use tokio::io::AsyncReadExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let slow_url = format!("http://{}", listener.local_addr().unwrap());
    let (started_tx, mut started) = tokio::sync::mpsc::unbounded_channel();
    let server = tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let _ = started_tx.send(());
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                while matches!(sock.read(&mut buf).await, Ok(n) if n > 0) {}
            });
        }
    });
    let a = Stub::start("a").await.unwrap();
    let slow_health = "[providers.health]\ninterval_ms = 40\ntimeout_ms = 1500\nunhealthy_threshold = 1\nhealthy_threshold = 1\n\n";
    let no_health = "[providers.health]\nenabled = false\n\n";
    let with_slow = provider("pa", &a.url()).replace("\n\n", &format!("\n{no_health}"))
        + &provider("slow", &slow_url).replace("\n\n", &format!("\n{slow_health}"))
        + &route("alias", "round_robin", &["pa", "slow"]);
    let without_slow = provider("pa", &a.url()).replace("\n\n", &format!("\n{no_health}"))
        + &route("alias", "round_robin", &["pa"]);
    let gauge = "rolter_provider_healthy{provider=\"slow\"}";
    let gw = Gateway::start(&with_slow).await;
    assert!(
        eventually(RELOAD_LIMIT, || async {
            gw.metric(gauge).await == Some(0.0)
        })
        .await,
        "the never-answering provider was not marked down"
    );
    // A reload of the same file first, so the SIGHUP handler is known to be listening.
    let ok = arm_reload(&gw).await;

    rewrite(&gw, &without_slow);
    while started.try_recv().is_ok() {}
    tokio::time::timeout(RELOAD_LIMIT, started.recv())
        .await
        .expect("no probe started")
        .unwrap();
    gw.signal("HUP");
    assert!(wait_for(&gw, OK, ok + 1.0, RELOAD_LIMIT).await);
    // The probe that was running when the reload landed has ended by now (its timeout
    // is 1.5 s; the prober gives up on it after twice that at the latest).
    tokio::time::sleep(Duration::from_millis(3200)).await;
    let metrics = gw.get_text("/metrics").await;
    assert!(metrics.contains("rolter_config_reloads_total"), "{metrics}");
    assert!(
        !metrics.contains(gauge),
        "a dropped gauge came back: {metrics}"
    );
    let (status, _, body) = post_chat(&gw, chat_body("alias", "still serving", false)).await;
    assert_eq!(status, 200, "{body}");
    server.abort();
}
