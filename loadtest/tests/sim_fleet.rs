//! End-to-end tests of the simulated fleet on loopback: HTTP shapes, metrics, KV events over
//! real ZMQ sockets (live, replay, faults) and the LMCache-style status endpoint.
//! Every test binds 127.0.0.1 port 0 and is bounded by `LIMIT`.

use std::time::Duration;

use bytes::Bytes;
use rmpv::Value;
use rolter_loadtest::cache::CacheEvent;
use rolter_loadtest::cost::CostModel;
use rolter_loadtest::kv_events::{EventLayout, KvFault, WireFormat};
use rolter_loadtest::replica::{HttpFault, LmcacheFault};
use rolter_loadtest::tokenizer::{self, ChatMessage};
use rolter_loadtest::{spawn_fleet, FleetConfig, FleetHandle, KvEventsConfig, ReplicaConfig};
use serde_json::{json, Value as Json};

const LIMIT: Duration = Duration::from_secs(10);

async fn fleet(n: usize, replica: ReplicaConfig, kv: KvEventsConfig) -> FleetHandle {
    spawn_fleet(FleetConfig {
        replicas: n,
        replica,
        kv_events: Some(kv),
        ..FleetConfig::default()
    })
    .await
    .expect("fleet starts")
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(LIMIT).build().unwrap()
}

fn chat_body(system: &str, user: &str, max_tokens: u64, stream: bool) -> Json {
    json!({
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "stream": stream,
    })
}

fn words(n: usize, tag: &str) -> String {
    (0..n)
        .map(|i| format!("{tag}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The tests' libzmq context.
static ZMQ: std::sync::LazyLock<zmq::Context> = std::sync::LazyLock::new(zmq::Context::new);

async fn subscribe(endpoint: &str, topic: &str) -> zmq::Socket {
    let sub = ZMQ.socket(zmq::SUB).unwrap();
    sub.set_linger(0).unwrap();
    sub.connect(endpoint).unwrap();
    sub.set_subscribe(topic.as_bytes()).unwrap();
    sub
}

/// Whether a message arrives within `limit` (blocking: the publisher runs on its own thread).
fn readable(sock: &zmq::Socket, limit: Duration) -> bool {
    sock.poll(zmq::POLLIN, limit.as_millis() as i64).unwrap() > 0
}

async fn recv(sub: &mut zmq::Socket) -> Vec<Bytes> {
    assert!(readable(sub, LIMIT), "a KV-event message in time");
    sub.recv_multipart(0)
        .unwrap()
        .into_iter()
        .map(Bytes::from)
        .collect()
}

/// Minimal independent decoder of the array/u64 layout, for these tests.
fn decode(payload: &[u8]) -> Vec<CacheEvent> {
    let v = rmpv::decode::read_value(&mut &payload[..]).expect("valid msgpack");
    let batch = v.as_array().expect("batch is an array");
    assert!(batch[0].is_f64());
    assert_eq!(batch[2].as_u64(), Some(0), "data_parallel_rank");
    let hashes = |v: &Value| -> Vec<u64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_u64().unwrap())
            .collect()
    };
    batch[1]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let a = e.as_array().unwrap();
            match a[0].as_str().unwrap() {
                "BlockStored" => CacheEvent::Stored {
                    block_hashes: hashes(&a[1]),
                    parent_block_hash: a[2].as_u64(),
                    token_ids: a[3]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|t| t.as_u64().unwrap() as u32)
                        .collect(),
                    block_size: a[4].as_u64().unwrap() as usize,
                },
                "BlockRemoved" => CacheEvent::Removed {
                    block_hashes: hashes(&a[1]),
                },
                "AllBlocksCleared" => CacheEvent::AllCleared,
                other => panic!("unknown tag {other}"),
            }
        })
        .collect()
}

fn seq_of(frames: &[Bytes]) -> u64 {
    u64::from_be_bytes(frames[1][..].try_into().unwrap())
}

/// POST `body` as JSON to `url` and read the answer as JSON.
async fn post_json(
    c: &reqwest::Client,
    url: impl reqwest::IntoUrl,
    body: &impl serde::Serialize,
) -> Json {
    c.post(url)
        .json(body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// GET `url` and read the answer as JSON.
async fn get_json(c: &reqwest::Client, url: impl reqwest::IntoUrl) -> Json {
    c.get(url).send().await.unwrap().json().await.unwrap()
}

#[tokio::test]
async fn chat_json_and_stream_metrics_and_cache_hits() {
    let f = fleet(2, ReplicaConfig::default(), KvEventsConfig::default()).await;
    let r0 = f.replica(0);
    let url = format!("{}/v1/chat/completions", r0.base_url());
    let sys = words(200, "sys");
    let c = client();

    let body: Json = post_json(&c, &url, &chat_body(&sys, "first question", 5, false)).await;
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "m");
    let prompt = tokenizer::chat_tokens(&[
        ChatMessage::new("system", sys.clone()),
        ChatMessage::new("user", "first question"),
    ]);
    assert_eq!(body["usage"]["prompt_tokens"], prompt.len());
    assert_eq!(body["usage"]["completion_tokens"], 5);
    assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let (text, _) = tokenizer::reply(&prompt, 5);
    assert_eq!(body["choices"][0]["message"]["content"], text.as_str());

    // Same system prompt, another question: the system prompt's full blocks hit.
    let resp = c
        .post(&url)
        .json(&chat_body(&sys, "second question", 3, true))
        .send()
        .await
        .unwrap();
    assert_eq!(
        resp.headers()["content-type"].to_str().unwrap(),
        "text/event-stream"
    );
    let sse = resp.text().await.unwrap();
    let lines: Vec<&str> = sse.split("\n\n").filter(|l| !l.is_empty()).collect();
    assert_eq!(lines.last(), Some(&"data: [DONE]"));
    assert_eq!(lines.len(), 3 + 1 + 1, "3 tokens, finish chunk, DONE");
    let first: Json = serde_json::from_str(lines[0].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");

    let stats = r0.stats();
    assert_eq!(stats.requests, 2);
    assert_eq!(stats.requests_ok, 2);
    let q2 = tokenizer::chat_tokens(&[
        ChatMessage::new("system", sys.clone()),
        ChatMessage::new("user", "second question"),
    ]);
    assert_eq!(stats.prefix_cache_queries, (prompt.len() + q2.len()) as u64);
    // Blocks shared by both prompts: the system prompt's common full blocks.
    let common = prompt.iter().zip(&q2).take_while(|(a, b)| a == b).count();
    assert_eq!(stats.prefix_cache_hits, (common / 16 * 16) as u64);
    assert!(stats.prefix_cache_hits > 0);
    assert_eq!(f.replica(1).stats().requests, 0);

    let metrics = c
        .get(format!("{}/metrics", r0.base_url()))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for name in [
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
    ] {
        assert!(metrics.contains(&format!("# TYPE {name} ")), "{name}");
    }
    assert!(metrics.contains(&format!(
        "vllm:prefix_cache_hits_total{{engine=\"0\",model_name=\"sim-model\"}} {}.0",
        stats.prefix_cache_hits
    )));
    // The cache's size, as vLLM publishes it (what a gateway reads when not told).
    assert!(
        metrics.contains(&format!(
            "block_size=\"16\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",\
             gpu_memory_utilization=\"0.9\",num_cpu_blocks=\"None\",num_gpu_blocks=\"{}\"}} 1.0",
            stats.cache_capacity
        )),
        "{metrics}"
    );

    let completion: Json = post_json(
        &c,
        format!("{}/v1/completions", r0.base_url()),
        &json!({"model": "m", "prompt": [1, 2, 3], "max_tokens": 2}),
    )
    .await;
    assert_eq!(completion["object"], "text_completion");
    assert_eq!(completion["usage"]["prompt_tokens"], 3);

    let bad = c.post(&url).body("{not json").send().await.unwrap();
    assert_eq!(bad.status(), 400);
    let health = c
        .get(format!("{}/health", r0.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);

    // What gateways probe to recognise a vLLM worker (smg: `owned_by`, then `/version`).
    let models: Json = get_json(&c, format!("{}/v1/models", r0.base_url())).await;
    assert_eq!(models["data"][0]["owned_by"], "vllm");
    assert_eq!(models["data"][0]["id"], ReplicaConfig::default().model);
    let version: Json = get_json(&c, format!("{}/version", r0.base_url())).await;
    assert!(version["version"].as_str().is_some(), "{version}");

    // vLLM's render API: the prompt's token ids, no generation, not counted as a request.
    let requests_before = r0.stats().requests;
    let chat = chat_body("be brief", "render me", 5, false);
    let rendered: Json = post_json(
        &c,
        format!("{}/v1/chat/completions/render", r0.base_url()),
        &chat,
    )
    .await;
    let expected =
        rolter_loadtest::tokenizer::request_prompt_tokens("/v1/chat/completions", &chat).unwrap();
    let ids: Vec<u32> = serde_json::from_value(rendered["token_ids"].clone()).unwrap();
    assert_eq!(ids, expected);
    assert_eq!(rendered["sampling_params"]["max_tokens"], 5);
    let listed: Json = post_json(
        &c,
        format!("{}/v1/completions/render", r0.base_url()),
        &json!({"model": "m", "prompt": [7, 8, 9]}),
    )
    .await;
    assert_eq!(listed[0]["token_ids"], json!([7, 8, 9]));
    let bad = c
        .post(format!("{}/v1/chat/completions/render", r0.base_url()))
        .json(&json!({"model": "m"}))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    assert_eq!(r0.stats().requests, requests_before);
    f.shutdown().await;
}

#[tokio::test]
async fn kv_events_live_match_cache_and_replay() {
    let kv = KvEventsConfig {
        topic: "kv@sim-{replica}".into(),
        ..KvEventsConfig::default()
    };
    let replica = ReplicaConfig {
        cache_blocks: 8,
        ..ReplicaConfig::default()
    };
    let f = fleet(1, replica, kv).await;
    let r = f.replica(0);
    assert_eq!(r.kv_topic(), Some("kv@sim-0"));
    let mut sub = subscribe(&r.kv_events_endpoint().unwrap(), "kv@sim-0").await;
    assert!(f.wait_for_kv_subscribers(1, LIMIT).await);
    let c = client();
    let url = format!("{}/v1/completions", r.base_url());

    // 40 prompt tokens + 8 output: 2 full prompt blocks at admission, then the output fills
    // block 3 (tokens 32..48) at completion.
    let prompt: Vec<u32> = (1..=40).collect();
    let resp = c
        .post(&url)
        .json(&json!({"prompt": prompt, "max_tokens": 8}))
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success());
    let m0 = recv(&mut sub).await;
    assert_eq!(m0.len(), 3);
    assert_eq!(&m0[0][..], b"kv@sim-0");
    assert_eq!(seq_of(&m0), 0);
    let hashes = r.replica().chain_hashes(&prompt);
    assert_eq!(
        decode(&m0[2]),
        vec![CacheEvent::Stored {
            block_hashes: hashes.clone(),
            parent_block_hash: None,
            token_ids: (1..=32).collect(),
            block_size: 16,
        }]
    );
    let m1 = recv(&mut sub).await;
    assert_eq!(seq_of(&m1), 1);
    let ev = decode(&m1[2]);
    let CacheEvent::Stored {
        block_hashes,
        parent_block_hash,
        token_ids,
        ..
    } = &ev[0]
    else {
        panic!("expected a store, got {ev:?}")
    };
    assert_eq!(block_hashes.len(), 1);
    assert_eq!(*parent_block_hash, Some(hashes[1]));
    assert_eq!(&token_ids[..8], &(33..=40).collect::<Vec<u32>>()[..]);
    let mut cached: Vec<u64> = r.cached_block_hashes().into_iter().collect();
    cached.sort();
    let mut seen = vec![hashes[0], hashes[1], block_hashes[0]];
    seen.sort();
    assert_eq!(cached, seen);

    // Cache pressure: 8 blocks capacity, a 100-token unrelated prompt needs 6 more.
    let other: Vec<u32> = (1000..1100).collect();
    c.post(&url)
        .json(&json!({"prompt": other, "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    let m2 = decode(&recv(&mut sub).await[2]);
    assert!(matches!(m2[0], CacheEvent::Removed { .. }), "{m2:?}");

    // Reset → AllBlocksCleared.
    let reset = c
        .post(format!("{}/reset_prefix_cache", r.base_url()))
        .send()
        .await
        .unwrap();
    assert!(reset.status().is_success());
    let mut last = recv(&mut sub).await;
    while decode(&last[2]) != vec![CacheEvent::AllCleared] {
        last = recv(&mut sub).await;
    }
    let last_seq = seq_of(&last);
    assert!(r.cached_block_hashes().is_empty());

    // Replay from seq 1: every buffered batch from 1 on, then the end marker.
    let dealer = ZMQ.socket(zmq::DEALER).unwrap();
    dealer.set_linger(0).unwrap();
    dealer.connect(&r.kv_replay_endpoint().unwrap()).unwrap();
    dealer
        .send_multipart([&b""[..], &1u64.to_be_bytes()], 0)
        .unwrap();
    let mut got = Vec::new();
    loop {
        assert!(readable(&dealer, LIMIT), "a replay reply in time");
        let m = dealer.recv_multipart(0).unwrap();
        assert_eq!(m.len(), 3, "empty delimiter, seq, payload");
        assert!(m[0].is_empty());
        if m[1][..] == [0xff; 8] {
            assert!(m[2].is_empty());
            break;
        }
        got.push(u64::from_be_bytes(m[1][..].try_into().unwrap()));
    }
    assert_eq!(got, (1..=last_seq).collect::<Vec<_>>());
    assert_eq!(r.stats().kv_replays, 1);
    f.shutdown().await;
}

#[tokio::test]
async fn kv_faults_gap_corrupt_stall_restart() {
    let f = fleet(1, ReplicaConfig::default(), KvEventsConfig::default()).await;
    let r = f.replica(0);
    let mut sub = subscribe(&r.kv_events_endpoint().unwrap(), "").await;
    assert!(f.wait_for_kv_subscribers(1, LIMIT).await);
    let c = client();
    let url = format!("{}/v1/completions", r.base_url());
    let mut n = 0u32;
    // Each request: a fresh 20-token prompt, 1 output token → exactly one BlockStored batch.
    let mut send = || {
        n += 1;
        let prompt: Vec<u32> = (n * 100..n * 100 + 20).collect();
        let c = c.clone();
        let url = url.clone();
        async move {
            let r = c
                .post(&url)
                .json(&json!({"prompt": prompt, "max_tokens": 1}))
                .send()
                .await
                .unwrap();
            assert!(r.status().is_success());
        }
    };

    send().await;
    assert_eq!(seq_of(&recv(&mut sub).await), 0);

    r.kv_fault(KvFault::DropNext);
    send().await; // seq 1 dropped
    send().await;
    assert_eq!(seq_of(&recv(&mut sub).await), 2, "gap: seq 1 never arrives");

    r.kv_fault(KvFault::CorruptNext);
    send().await;
    let bad = recv(&mut sub).await;
    assert_eq!(seq_of(&bad), 3);
    assert!(rmpv::decode::read_value(&mut &bad[2][..]).is_err());

    r.kv_fault(KvFault::Stall);
    send().await;
    assert!(
        !readable(&sub, Duration::from_millis(100)),
        "nothing arrives while stalled"
    );
    r.kv_fault(KvFault::Resume);
    assert_eq!(seq_of(&recv(&mut sub).await), 4);

    r.kv_fault(KvFault::Restart);
    assert!(
        r.cached_block_hashes().is_empty(),
        "a restart empties the cache"
    );
    send().await;
    let m = recv(&mut sub).await;
    assert_eq!(seq_of(&m), 0, "sequence restarts at 0");
    assert!(matches!(decode(&m[2])[0], CacheEvent::Stored { .. }));

    // A real socket restart: same endpoints, a new subscriber sees a fresh sequence.
    send().await; // seq 1 on the old sockets
    let _ = recv(&mut sub).await;
    let before = (r.kv_events_endpoint(), r.kv_replay_endpoint());
    r.restart_kv_publisher().await.unwrap();
    assert_eq!((r.kv_events_endpoint(), r.kv_replay_endpoint()), before);
    assert!(r.cached_block_hashes().is_empty());
    let mut sub2 = subscribe(&r.kv_events_endpoint().unwrap(), "").await;
    assert!(f.wait_for_kv_subscribers(1, LIMIT).await);
    send().await;
    assert_eq!(seq_of(&recv(&mut sub2).await), 0);
    f.shutdown().await;
}

#[tokio::test]
async fn map_layout_over_the_wire() {
    let kv = KvEventsConfig {
        wire: WireFormat {
            layout: EventLayout::Map,
            ..WireFormat::default()
        },
        replay: false,
        ..KvEventsConfig::default()
    };
    let f = fleet(1, ReplicaConfig::default(), kv).await;
    let r = f.replica(0);
    assert!(r.kv_replay_endpoint().is_none());
    let mut sub = subscribe(&r.kv_events_endpoint().unwrap(), "").await;
    assert!(f.wait_for_kv_subscribers(1, LIMIT).await);
    r.reset_prefix_cache();
    let m = recv(&mut sub).await;
    let v = rmpv::decode::read_value(&mut &m[2][..]).unwrap();
    let ev = &v.as_array().unwrap()[1].as_array().unwrap()[0];
    let map = ev.as_map().unwrap();
    assert_eq!(map[0].0.as_str(), Some("type"));
    assert_eq!(map[0].1.as_str(), Some("AllBlocksCleared"));
    f.shutdown().await;
}

#[tokio::test]
async fn lmcache_status_and_faults() {
    let f = fleet(1, ReplicaConfig::default(), KvEventsConfig::default()).await;
    let r = f.replica(0);
    let url = r.lmcache_status_url().unwrap();
    let c = client();
    let v: Json = c.get(&url).send().await.unwrap().json().await.unwrap();
    assert_eq!(v, json!({"occupancy": 0.0, "cache_available": true}));

    c.post(format!("{}/v1/completions", r.base_url()))
        .json(&json!({"prompt": (0..33).collect::<Vec<u32>>(), "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    let v: Json = c.get(&url).send().await.unwrap().json().await.unwrap();
    assert_eq!(v["occupancy"], json!(2.0 / 1024.0));

    r.set_lmcache_fault(LmcacheFault::Error);
    assert_eq!(c.get(&url).send().await.unwrap().status(), 500);
    r.set_lmcache_fault(LmcacheFault::Garbage);
    let body = c.get(&url).send().await.unwrap().text().await.unwrap();
    assert!(serde_json::from_str::<Json>(&body).is_err());
    // Faults can also be set over HTTP.
    let set = c
        .post(format!("{}/sim/fault/lmcache/hang", r.base_url()))
        .send()
        .await
        .unwrap();
    assert!(set.status().is_success());
    let hung = c.get(&url).timeout(Duration::from_millis(200)).send().await;
    assert!(hung.is_err(), "status endpoint hangs");

    r.set_http_fault(HttpFault::Error);
    let e = c
        .post(format!("{}/v1/completions", r.base_url()))
        .json(&json!({"prompt": "x", "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(e.status(), 500);
    r.set_http_fault(HttpFault::Unhealthy);
    let h = c
        .get(format!("{}/health", r.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(h.status(), 503);
    // Shutdown ends the hanging handler promptly.
    tokio::time::timeout(LIMIT, f.shutdown()).await.unwrap();
}

#[tokio::test]
async fn bounded_concurrency_queues_requests() {
    let replica = ReplicaConfig {
        max_running: 1,
        cost: CostModel {
            prefill_per_token: Duration::ZERO,
            decode_per_token: Duration::from_millis(40),
            base_latency: Duration::ZERO,
        },
        ..ReplicaConfig::default()
    };
    let f = fleet(1, replica, KvEventsConfig::default()).await;
    let r = f.replica(0).clone();
    let url = format!("{}/v1/completions", r.base_url());
    let c = client();
    let t0 = std::time::Instant::now();
    let send = |p: &str| {
        c.post(&url)
            .json(&json!({"prompt": p, "max_tokens": 3}))
            .send()
    };
    let (a, b) = tokio::join!(send("a"), async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let s = r.stats();
        assert_eq!((s.running, s.waiting), (1, 0));
        let fut = send("b");
        let probe = async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let s = r.stats();
            assert_eq!((s.running, s.waiting), (1, 1), "second request waits");
        };
        let (resp, ()) = tokio::join!(fut, probe);
        resp
    });
    assert!(a.unwrap().status().is_success());
    assert!(b.unwrap().status().is_success());
    // Each request decodes 2 tokens after the first: 80 ms; serialized: ≥ 160 ms.
    assert!(
        t0.elapsed() >= Duration::from_millis(160),
        "{:?}",
        t0.elapsed()
    );
    f.shutdown().await;
}
