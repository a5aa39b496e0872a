//! Gateway-side tokenization end to end (issue #23): a route with `tokenizer = DIR` gives a
//! plain OpenAI-SDK-shaped request (no `x-rolter-vllm-token-ids`) precise routing, against
//! simulated replicas that tokenize with the same Hugging Face directory; a broken
//! directory fails `rolter -t`.

mod common;

use common::*;
use rolter_loadtest::tokenizer::PromptTokenizer;
use rolter_loadtest::{spawn_fleet, FleetConfig, FleetHandle};
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tokenizer")
        .join(name)
}

fn routes(fleet: &FleetHandle, tokenizer: &std::path::Path) -> String {
    precise_fleet_routes(fleet, &format!("tokenizer = \"{}\"\n", tokenizer.display()))
}

/// What the openai SDK sends: messages with content parts, sampling fields, no rolter header.
fn sdk_body(model: &str, turns: usize) -> String {
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": "You are a helpful assistant. ".repeat(30)}),
    ];
    for t in 0..turns {
        messages.push(serde_json::json!({"role": "user", "content": [{"type": "text", "text": format!("what is a prefix cache, part {t}?")}]}));
        messages.push(
            serde_json::json!({"role": "assistant", "content": format!("the prefix cache {t}")}),
        );
    }
    messages.push(serde_json::json!({"role": "user", "content": "and a block?"}));
    serde_json::json!({"model": model, "messages": messages, "temperature": 0.2, "max_tokens": 4, "stream": false}).to_string()
}

fn served(fleet: &FleetHandle) -> Vec<u64> {
    fleet.stats().iter().map(|s| s.requests).collect()
}

async fn metric_eventually(gw: &Gateway, series: &str, want: impl Fn(f64) -> bool) -> bool {
    eventually(Duration::from_secs(10), || async {
        gw.metric(series).await.is_some_and(&want)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_sdk_request_without_the_header_gets_precise_routing() {
    let dir = fixture("llama3");
    let mut config = FleetConfig::default();
    config.replica.tokenizer = PromptTokenizer::load(Some(&dir)).unwrap();
    let fleet = spawn_fleet(config).await.unwrap();
    let gw = Gateway::start(&routes(&fleet, &dir)).await;
    for i in 0..fleet.replicas().len() {
        let series = format!("rolter_kv_stream_connected{{provider=\"r{i}\"}}");
        assert!(
            metric_eventually(&gw, &series, |v| v == 1.0).await,
            "r{i} never connected"
        );
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    // Warm replica 1 only, straight to it; its blocks must then pull the SDK's requests.
    let resp = reqwest::Client::new()
        .post(format!(
            "{}/v1/chat/completions",
            fleet.replica(1).base_url()
        ))
        .header("content-type", "application/json")
        .body(sdk_body("sim-model", 2))
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success());
    let blocks = fleet.replica(1).cached_block_hashes().len() as f64;
    assert!(blocks > 10.0, "{blocks}");
    assert!(
        metric_eventually(&gw, "rolter_kv_index_blocks{provider=\"r1\"}", |v| v
            == blocks)
        .await
    );
    for _ in 0..4 {
        let before = served(&fleet);
        let (status, _, answer) = post_chat_with(&gw, sdk_body("alias", 2), &[]).await;
        assert_eq!(status, 200, "{answer}");
        let after = served(&fleet);
        assert_eq!(
            (after[0] - before[0], after[1] - before[1]),
            (0, 1),
            "request left replica 1"
        );
    }
    let hits = gw
        .metric(
            "rolter_routing_decisions_total{reason=\"cache_hit\",strategy=\"precise_cache_aware\"}",
        )
        .await
        .unwrap_or(0.0);
    assert!(hits >= 4.0, "cache hits {hits}");
    assert_eq!(
        gw.metric(
            "rolter_routing_decisions_total{reason=\"fallback\",strategy=\"precise_cache_aware\"}"
        )
        .await
        .unwrap_or(0.0),
        0.0
    );
    fleet.shutdown().await;
}

#[test]
fn a_broken_tokenizer_directory_fails_the_check() {
    let dir = TempDir::new("tok");
    let tok = dir.path().join("model");
    std::fs::create_dir_all(&tok).unwrap();
    std::fs::write(tok.join("tokenizer.json"), "{\"truncated").unwrap();
    let routes = "[[providers]]\nname = \"p\"\nkind = \"openai_compatible\"\napi_base = \"http://127.0.0.1:9\"\n\
                  [[routes]]\nmodel = \"m\"\nstrategy = \"precise_cache_aware\"\ntokenizer = \"model\"\n\
                  [[routes.targets]]\nprovider = \"p\"\nmodel = \"x\"\n";
    let path = dir.path().join("routes.toml");
    std::fs::write(&path, routes).unwrap();
    let check = || {
        Command::new(rolter_bin())
            .arg("-t")
            .arg("--routes")
            .arg(&path)
            .env("RUST_LOG", "error")
            .output()
            .unwrap()
    };
    let out = check();
    let text =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("routes[0].tokenizer") && text.contains("tokenizer.json"),
        "{text}"
    );
    // The relative directory resolves next to the routing file: a good one passes.
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture("llama3").join(f), tok.join(f)).unwrap();
    }
    let out = check();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
