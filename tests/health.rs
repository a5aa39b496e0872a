//! Fleet health end to end: active checks, cooldown, circuit breaking, retries and
//! timeouts, through the real binary on loopback.

mod common;

use common::*;
use std::time::{Duration, Instant};

const FAST_HEALTH: &str = "[providers.health]\ninterval_ms = 100\ntimeout_ms = 200\nunhealthy_threshold = 1\nhealthy_threshold = 1\n";
const NO_HEALTH: &str = "[providers.health]\nenabled = false\n";

/// A routing file like `routes_toml` but with a `[providers.health]` block per provider.
fn routes_with_health(urls: &[String], strategy: &str, health: &str, extra: &str) -> String {
    let mut s = String::new();
    for (i, u) in urls.iter().enumerate() {
        s += &format!("[[providers]]\nname = \"p{i}\"\nkind = \"openai_compatible\"\napi_base = \"{u}\"\n{health}\n");
    }
    s += &format!("[[routes]]\nmodel = \"alias\"\nstrategy = \"{strategy}\"\n");
    for i in 0..urls.len() {
        s += &format!("[[routes.targets]]\nprovider = \"p{i}\"\nmodel = \"m\"\n");
    }
    s + extra
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replica_loses_its_traffic_and_gets_it_back_after_recovering() {
    let a = Stub::start("a").await.unwrap();
    let b = Stub::start("b").await.unwrap();
    let a_addr = a.addr();
    let gw = Gateway::start(&routes_with_health(
        &[a.url(), b.url()],
        "round_robin",
        FAST_HEALTH,
        "",
    ))
    .await;

    let mut seen_a = 0;
    for i in 0..10 {
        let (status, id, _) =
            post_chat(&gw, chat_body("alias", &format!("before {i}"), false)).await;
        assert_eq!(status, 200);
        seen_a += usize::from(id.as_deref() == Some("a"));
    }
    assert!(seen_a > 0);

    a.stop();
    // Sequential requests never fail: a refused connect is retried on b, and once the
    // health check notices, a is not even tried.
    for i in 0..30 {
        let (status, id, body) =
            post_chat(&gw, chat_body("alias", &format!("during {i}"), false)).await;
        assert_eq!(status, 200, "request {i} failed: {body}");
        assert_eq!(id.as_deref(), Some("b"));
    }
    let down = "rolter_provider_healthy{provider=\"p0\"}";
    assert!(
        eventually(Duration::from_secs(5), || async {
            gw.metric(down).await == Some(0.0)
        })
        .await
    );

    let a2 = Stub::start_on("a-again", a_addr).await.unwrap();
    assert!(
        eventually(Duration::from_secs(5), || async {
            gw.metric(down).await == Some(1.0)
        })
        .await
    );
    let mut back = false;
    for i in 0..20 {
        let (status, id, _) =
            post_chat(&gw, chat_body("alias", &format!("after {i}"), false)).await;
        assert_eq!(status, 200);
        back |= id.as_deref() == Some("a-again");
        if back {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(back, "recovered replica never got traffic again");
    assert!(a2.served() > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_500s_cool_down_then_open_the_circuit_and_a_probe_closes_it() {
    let a = Stub::start("a").await.unwrap();
    let breaker = "[breaker]\nfailure_threshold = 2\ncooldown_ms = 300\nopen_after_cooldowns = 2\nopen_ms = 800\n";
    let gw = Gateway::start(&routes_with_health(
        &[a.url()],
        "least_load",
        NO_HEALTH,
        breaker,
    ))
    .await;
    a.set_behaviour(Behaviour {
        status: 500,
        ..Default::default()
    });
    let event = |e: &str| format!("rolter_breaker_events_total{{event=\"{e}\",target=\"p0/m\"}}");

    for _ in 0..2 {
        assert_eq!(post_chat(&gw, chat_body("alias", "x", false)).await.0, 500);
    }
    // The breaker hears of an answer just after its last byte left: wait for it.
    assert!(
        eventually(Duration::from_secs(2), || async {
            gw.metric(&event("cooldown")).await == Some(1.0)
        })
        .await
    );
    // Cooling down: 503 with Retry-After, and the upstream is not contacted.
    let served = a.served();
    let resp = reqwest::Client::new()
        .post(gw.url("/v1/chat/completions"))
        .body(chat_body("alias", "x", false))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 503);
    assert_eq!(resp.headers()["retry-after"], "1");
    let v: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["code"], "no_eligible_target");
    assert_eq!(a.served(), served);

    tokio::time::sleep(Duration::from_millis(350)).await;
    for _ in 0..2 {
        assert_eq!(post_chat(&gw, chat_body("alias", "x", false)).await.0, 500);
    }
    // The breaker hears of an answer just after its last byte left: wait for it.
    assert!(
        eventually(Duration::from_secs(2), || async {
            gw.metric(&event("circuit_open")).await == Some(1.0)
        })
        .await
    );
    assert_eq!(post_chat(&gw, chat_body("alias", "x", false)).await.0, 503);

    a.set_behaviour(Behaviour::default());
    tokio::time::sleep(Duration::from_millis(850)).await;
    let (status, id, _) = post_chat(&gw, chat_body("alias", "probe", false)).await;
    assert_eq!((status, id.as_deref()), (200, Some("a")), "half-open probe");
    assert_eq!(gw.metric(&event("circuit_close")).await, Some(1.0));
    for _ in 0..3 {
        assert_eq!(post_chat(&gw, chat_body("alias", "x", false)).await.0, 200);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_accepts_but_never_answers_gives_504_in_time() {
    // Accepts connections and holds them, never reading or writing.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((sock, _)) = listener.accept().await {
            held.push(sock);
        }
    });
    let route_timeouts = "[routes.timeouts]\ntotal_timeout_ms = 600\n";
    let gw = Gateway::start(&routes_with_health(
        &[format!("http://{addr}")],
        "least_load",
        NO_HEALTH,
        route_timeouts,
    ))
    .await;
    let started = Instant::now();
    let (status, _, body) = post_chat(&gw, chat_body("alias", "hello?", false)).await;
    let took = started.elapsed();
    assert_eq!(status, 504, "{body}");
    assert!(
        took >= Duration::from_millis(550) && took < Duration::from_secs(3),
        "{took:?}"
    );
    assert_eq!(
        gw.metric("rolter_inflight_requests{target=\"p0/m\"}").await,
        Some(0.0)
    );
    assert_eq!(
        gw.metric("rolter_request_errors_total{kind=\"upstream_timeout\"}")
            .await,
        Some(1.0)
    );
    hold.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_is_retried_on_the_other_target_transparently() {
    let dead = format!("http://127.0.0.1:{}", free_port());
    let live = Stub::start("live").await.unwrap();
    let gw = Gateway::start(&routes_with_health(
        &[dead, live.url()],
        "round_robin",
        NO_HEALTH,
        "",
    ))
    .await;
    let content = "z".repeat(200_000);
    for i in 0..4 {
        let body = chat_body("alias", &format!("{content}{i}"), false);
        let (status, id, answer) = post_chat(&gw, body.clone()).await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(id.as_deref(), Some("live"));
        let got = live.recorded().last().unwrap().body.clone();
        assert_eq!(
            got,
            body.replacen("\"model\":\"alias\"", "\"model\":\"m\"", 1)
                .as_bytes()
        );
    }
    assert!(
        gw.metric("rolter_breaker_events_total{event=\"cooldown\",target=\"p0/m\"}")
            .await
            >= Some(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_slower_than_the_interval_is_not_overlapped_by_the_next() {
    // A health endpoint that accepts and never answers: every probe lasts its full
    // timeout (400 ms), ten intervals (40 ms; the prober looks for due probes every 100 ms).
    // Count the probe connections open at once.
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use tokio::io::AsyncReadExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (open, max_open, total) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
    );
    let counts = (open.clone(), max_open.clone(), total.clone());
    let server = tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let (open, max_open, total) = (counts.0.clone(), counts.1.clone(), counts.2.clone());
            total.fetch_add(1, Ordering::SeqCst);
            let now = open.fetch_add(1, Ordering::SeqCst) + 1;
            max_open.fetch_max(now, Ordering::SeqCst);
            tokio::spawn(async move {
                // Read (and ignore) the probe until the prober gives up and closes.
                let mut buf = [0u8; 1024];
                while matches!(sock.read(&mut buf).await, Ok(n) if n > 0) {}
                open.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
    let slow = "[providers.health]\ninterval_ms = 40\ntimeout_ms = 400\nunhealthy_threshold = 3\nhealthy_threshold = 1\n";
    let gw = Gateway::start(&routes_with_health(
        &[format!("http://{addr}")],
        "round_robin",
        slow,
        "",
    ))
    .await;
    assert!(
        eventually(Duration::from_secs(10), || async {
            total.load(Ordering::SeqCst) >= 4
        })
        .await,
        "the provider was probed {} times",
        total.load(Ordering::SeqCst)
    );
    // Overlapping probes would keep about four open at once. Back to back, a new one can
    // connect just before the server notices the last one's close: at most two.
    let most = max_open.load(Ordering::SeqCst);
    assert!(most <= 2, "{most} probes were in flight at once");
    // Three failures in a row, one result at a time: the provider is marked down.
    assert!(
        eventually(Duration::from_secs(5), || async {
            gw.metric("rolter_provider_healthy{provider=\"p0\"}").await == Some(0.0)
        })
        .await
    );
    drop(gw);
    server.abort();
}
