//! The README's demo command: `rolter --demo` starts a simulated fleet in-process and
//! routes to it with no configuration.

mod common;

use common::*;
use std::process::{Command, Stdio};
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_serves_and_routes_cache_aware() {
    let port = free_port();
    let dir = TempDir::new("demo");
    let yaml = dir.path().join("pingora.yaml");
    std::fs::write(
        &yaml,
        format!(
            "---\nversion: 1\nthreads: 1\npid_file: {0}/p.pid\nupgrade_sock: {0}/u.sock\n",
            dir.path().display()
        ),
    )
    .unwrap();
    let child = Command::new(rolter_bin())
        .args(["--demo", "--listen", &format!("127.0.0.1:{port}"), "-c"])
        .arg(&yaml)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let gw = Gateway {
        child,
        port,
        routes: dir.path().join("unused"),
        dir,
    };
    let client = reqwest::Client::new();
    assert!(
        eventually(Duration::from_secs(20), || async {
            client
                .get(gw.url("/health"))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
        })
        .await
    );
    let models: serde_json::Value = client
        .get(gw.url("/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["demo", "demo-pipeline", "demo-precise", "demo-rr"]);
    let system = "You are a helpful assistant. ".repeat(30);
    for turn in 0..3 {
        let mut messages = vec![serde_json::json!({"role": "system", "content": system})];
        for t in 0..turn {
            messages.push(serde_json::json!({"role": "user", "content": format!("question {t}")}));
            messages
                .push(serde_json::json!({"role": "assistant", "content": format!("answer {t}")}));
        }
        messages.push(serde_json::json!({"role": "user", "content": "and now?"}));
        let body =
            serde_json::json!({"model": "demo", "messages": messages, "max_tokens": 4}).to_string();
        let (status, _, answer) = post_chat(&gw, body).await;
        assert_eq!(status, 200, "{answer}");
        let v: serde_json::Value = serde_json::from_str(&answer).unwrap();
        assert!(
            v["choices"][0]["message"]["content"].is_string(),
            "{answer}"
        );
    }
    assert_eq!(
        gw.metric("rolter_routing_decisions_total{reason=\"cache_hit\",strategy=\"cache_aware\"}")
            .await,
        Some(2.0)
    );
    // No cache size in the demo's routing file: each replica's is read from its /metrics.
    for i in 0..3 {
        let series = format!("rolter_kv_cache_reported_tokens{{provider=\"replica-{i}\"}}");
        assert!(
            eventually(Duration::from_secs(10), || async {
                gw.metric(&series).await.is_some_and(|t| t > 0.0)
            })
            .await,
            "{series}: {:?}",
            gw.metric(&series).await
        );
    }
}
