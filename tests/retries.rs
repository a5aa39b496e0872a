//! Retries through the real binary on loopback (issue #25): a replica answering 503 to
//! everything is hidden by retries on the others, and when every replica fails, retries
//! stop at the retry budget instead of multiplying the load.

mod common;

use common::*;

/// Providers over `urls` without active health checks (a 503 replica stays "healthy":
/// only retries can hide it) and a breaker that never trips (so every request keeps
/// trying it), plus `extra`.
fn routes(urls: &[String], extra: &str) -> String {
    let mut s = String::new();
    for (i, u) in urls.iter().enumerate() {
        s += &format!(
            "[[providers]]\nname = \"p{i}\"\nkind = \"openai_compatible\"\napi_base = \"{u}\"\n[providers.health]\nenabled = false\n\n"
        );
    }
    s += "[[routes]]\nmodel = \"alias\"\nstrategy = \"round_robin\"\n";
    for i in 0..urls.len() {
        s += &format!("[[routes.targets]]\nprovider = \"p{i}\"\nmodel = \"m\"\n");
    }
    s += "[breaker]\nfailure_threshold = 100000\n";
    s + extra
}

fn failing(status: u16) -> Behaviour {
    Behaviour {
        status,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_hide_a_replica_that_answers_503_to_everything() {
    let bad = Stub::start("bad").await.unwrap();
    let good1 = Stub::start("good1").await.unwrap();
    let good2 = Stub::start("good2").await.unwrap();
    bad.set_behaviour(failing(503));
    // Without a breaker to take the bad replica out, round robin gives it every other
    // request (a retry moves the rotation on too): half the requests are retried, more
    // than the default budget (20%) allows, so this gateway's budget is raised. The
    // default set-up is the next test.
    let budget = "[retry]\nbudget_ratio = 1.0\n";
    let gw = Gateway::start_logged(&routes(&[bad.url(), good1.url(), good2.url()], budget)).await;

    const REQUESTS: usize = 60;
    for i in 0..REQUESTS {
        let (status, id, body) = post_chat(
            &gw,
            chat_body("alias", &format!("question {i}"), i % 2 == 0),
        )
        .await;
        assert_eq!(status, 200, "request {i}: {body}");
        assert_ne!(id.as_deref(), Some("bad"));
    }
    // Round robin sent a third of the first attempts to the bad replica; each was
    // retried once, on a good one.
    let tried_bad = bad.served();
    assert!(
        tried_bad >= (REQUESTS / 4) as u64,
        "bad replica tried {tried_bad} times"
    );
    assert_eq!(
        good1.served() + good2.served(),
        REQUESTS as u64,
        "each request answered once by a good replica"
    );
    let retried = gw
        .metric("rolter_retries_total{reason=\"503\",route=\"alias\"}")
        .await;
    assert_eq!(retried, Some(tried_bad as f64));
    let attempts = |result: &str| {
        format!("rolter_upstream_attempts_total{{result=\"{result}\",route=\"alias\"}}")
    };
    assert_eq!(gw.metric(&attempts("503")).await, Some(tried_bad as f64));
    assert!(
        eventually(std::time::Duration::from_secs(2), || async {
            gw.metric(&attempts("answered")).await == Some(REQUESTS as f64)
        })
        .await
    );
    // The access log counts the attempts of each request and says why it retried.
    let log = gw.log();
    let retried_lines = log
        .lines()
        .filter(|l| l.contains("attempts=2 retried=503 "))
        .count();
    assert_eq!(retried_lines as u64, tried_bad, "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_default_settings_a_503_replica_costs_no_client_an_error() {
    let bad = Stub::start("bad").await.unwrap();
    let good1 = Stub::start("good1").await.unwrap();
    let good2 = Stub::start("good2").await.unwrap();
    bad.set_behaviour(failing(503));
    // Default breaker, default retries and budget; no active health checks, so only the
    // passive side (retries, then the breaker's cooldown) deals with the bad replica.
    let mut text = String::new();
    for (name, stub) in [("bad", &bad), ("good1", &good1), ("good2", &good2)] {
        text += &format!(
            "[[providers]]\nname = \"{name}\"\nkind = \"openai_compatible\"\napi_base = \"{}\"\n[providers.health]\nenabled = false\n",
            stub.url()
        );
    }
    text += "[[routes]]\nmodel = \"alias\"\nstrategy = \"least_load\"\n";
    for name in ["bad", "good1", "good2"] {
        text += &format!("[[routes.targets]]\nprovider = \"{name}\"\nmodel = \"m\"\n");
    }
    let gw = Gateway::start(&text).await;
    let load = (0..4).map(|w| {
        let url = gw.url("/v1/chat/completions");
        tokio::spawn(async move {
            let client = reqwest::Client::new();
            let mut failed = 0;
            for i in 0..40 {
                let resp = client
                    .post(&url)
                    .body(chat_body("alias", &format!("w{w} q{i}"), false))
                    .send()
                    .await
                    .unwrap();
                failed += usize::from(resp.status() != 200);
            }
            failed
        })
    });
    let failed: usize = futures_util::future::join_all(load)
        .await
        .into_iter()
        .map(Result::unwrap)
        .sum();
    assert_eq!(failed, 0);
    assert!(bad.served() >= 1, "the bad replica was never tried");
    assert_eq!(good1.served() + good2.served(), 160);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_every_replica_fails_retries_stop_at_the_budget() {
    let stubs = [
        Stub::start("a").await.unwrap(),
        Stub::start("b").await.unwrap(),
        Stub::start("c").await.unwrap(),
    ];
    for s in &stubs {
        s.set_behaviour(failing(503));
    }
    let urls: Vec<String> = stubs.iter().map(Stub::url).collect();
    // 20% extra over 10 s, no free minimum; back-off short so the test stays fast.
    let retry = "[retry]\nretries = 2\nbackoff_ms = 1\nmax_backoff_ms = 2\nbudget_ratio = 0.2\nbudget_window_s = 10\nbudget_min_retries = 0\n";
    let gw = Gateway::start(&routes(&urls, retry)).await;

    const REQUESTS: u64 = 50;
    for i in 0..REQUESTS {
        let (status, _, body) = post_chat(&gw, chat_body("alias", &format!("q{i}"), false)).await;
        // The last upstream answer is relayed as it was.
        assert_eq!(status, 503, "{body}");
        assert!(body.contains("failing"), "{body}");
    }
    let hits: u64 = stubs.iter().map(Stub::served).sum();
    // Without a budget every request would make 3 attempts (150). With it, retries add
    // at most 20% of the window's requests.
    assert!(
        (REQUESTS + 5..=REQUESTS + REQUESTS / 5 + 1).contains(&hits),
        "{hits} upstream attempts for {REQUESTS} requests"
    );
    let refused = gw
        .metric("rolter_retries_refused_total{reason=\"budget\",route=\"alias\"}")
        .await
        .unwrap_or(0.0);
    assert!(refused > 0.0, "no retry was refused for the budget");
    let retries = gw
        .metric("rolter_retries_total{reason=\"503\",route=\"alias\"}")
        .await;
    assert_eq!(retries, Some((hits - REQUESTS) as f64));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_before_the_head_is_retried_on_another_target() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // Reads a request, then closes without answering (a replica dying mid-request).
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let reset_addr = listener.local_addr().unwrap();
    let resets = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = resets.clone();
    let server = tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let mut buf = [0u8; 65536];
            let _ = sock.read(&mut buf).await;
            let _ = sock.shutdown().await;
        }
    });
    let good = Stub::start("good").await.unwrap();
    let gw = Gateway::start(&routes(&[format!("http://{reset_addr}"), good.url()], "")).await;
    for i in 0..6 {
        let (status, id, body) = post_chat(&gw, chat_body("alias", &format!("r{i}"), false)).await;
        assert_eq!((status, id.as_deref()), (200, Some("good")), "{body}");
    }
    assert!(resets.load(std::sync::atomic::Ordering::SeqCst) >= 3);
    assert!(
        gw.metric("rolter_retries_total{reason=\"reset\",route=\"alias\"}")
            .await
            >= Some(3.0)
    );

    server.abort();
}
