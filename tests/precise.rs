//! precise_cache_aware end to end: the simulated vLLM fleet publishes real KV events
//! over ZMQ, the gateway's subscribers build residency indices, and routing follows
//! the blocks each replica reports.

mod common;

use common::*;
use rolter_loadtest::kv_events::publisher::KvFault;
use rolter_loadtest::tokenizer::{chat_tokens, token_header_value, ChatMessage};
use rolter_loadtest::{spawn_fleet, FleetConfig, FleetHandle};
use std::time::Duration;

fn routes(fleet: &FleetHandle) -> String {
    precise_fleet_routes(fleet, "")
}

fn conversation(topic: usize, turns: usize) -> Vec<ChatMessage> {
    let mut m = vec![ChatMessage::new(
        "system",
        format!(
            "You are expert number {topic}. {}",
            "Answer carefully and cite sources. ".repeat(40)
        ),
    )];
    for t in 0..turns {
        m.push(ChatMessage::new(
            "user",
            format!("question {t} about topic {topic}"),
        ));
        m.push(ChatMessage::new("assistant", format!("answer {t}")));
    }
    m.push(ChatMessage::new(
        "user",
        format!("final question about topic {topic}"),
    ));
    m
}

fn body(messages: &[ChatMessage]) -> String {
    let msgs: Vec<serde_json::Value> = messages
        .iter()
        .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
        .collect();
    serde_json::json!({"model": "alias", "messages": msgs, "max_tokens": 4}).to_string()
}

async fn send(gw: &Gateway, messages: &[ChatMessage]) -> u16 {
    let ids = token_header_value(&chat_tokens(messages));
    post_chat_with(gw, body(messages), &[("x-rolter-vllm-token-ids", &ids)])
        .await
        .0
}

/// Send straight to one replica (bypassing the gateway) to warm its cache.
async fn warm(fleet: &FleetHandle, replica: usize, messages: &[ChatMessage]) {
    let resp = reqwest::Client::new()
        .post(format!(
            "{}/v1/chat/completions",
            fleet.replica(replica).base_url()
        ))
        .body(body(messages).replace("\"alias\"", "\"sim-model\""))
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success());
}

fn served(fleet: &FleetHandle) -> Vec<u64> {
    fleet.stats().iter().map(|s| s.requests).collect()
}

/// Both of the gateway's subscribers are connected; then a margin for ZMQ's
/// slow-joiner window (the SUBSCRIBE message must reach the PUB socket before
/// batches published afterwards are delivered).
async fn wait_subscribed(gw: &Gateway, n: usize) {
    for i in 0..n {
        let series = format!("rolter_kv_stream_connected{{provider=\"r{i}\"}}");
        assert!(
            metric_eventually(gw, &series, |v| v == 1.0).await,
            "r{i} never connected"
        );
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
}

async fn metric_eventually(gw: &Gateway, series: &str, want: impl Fn(f64) -> bool) -> bool {
    eventually(Duration::from_secs(10), || async {
        gw.metric(series).await.is_some_and(&want)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_follows_reported_blocks_and_survives_gaps_and_restarts() {
    let fleet = spawn_fleet(FleetConfig::default()).await.unwrap();
    let gw = Gateway::start(&routes(&fleet)).await;
    wait_subscribed(&gw, 2).await;

    // Blocks that live only on replica 1 pull the request to replica 1.
    let conv = conversation(7, 2);
    warm(&fleet, 1, &conv).await;
    let blocks = fleet.replica(1).cached_block_hashes().len() as f64;
    assert!(blocks > 10.0);
    assert!(
        metric_eventually(&gw, "rolter_kv_index_blocks{provider=\"r1\"}", |v| v
            == blocks)
        .await
    );
    for _ in 0..5 {
        let before = served(&fleet);
        assert_eq!(send(&gw, &conv).await, 200);
        let after = served(&fleet);
        assert_eq!(
            (after[0] - before[0], after[1] - before[1]),
            (0, 1),
            "request left replica 1"
        );
    }

    // A workload through the gateway: each index equals its replica's cache size.
    for topic in 0..6 {
        for turns in 0..3 {
            assert_eq!(send(&gw, &conversation(topic, turns)).await, 200);
        }
    }
    for (i, r) in fleet.replicas().iter().enumerate() {
        let want = r.cached_block_hashes().len() as f64;
        let series = format!("rolter_kv_index_blocks{{provider=\"r{i}\"}}");
        assert!(
            metric_eventually(&gw, &series, |v| v == want).await,
            "index {i} != cache ({want})"
        );
    }
    let hits = gw
        .metric(
            "rolter_routing_decisions_total{reason=\"cache_hit\",strategy=\"precise_cache_aware\"}",
        )
        .await
        .unwrap_or(0.0);
    assert!(hits >= 10.0, "only {hits} cache hits");

    // A dropped batch is a gap; replay repairs it and the stream is trusted again.
    fleet.replica(1).kv_fault(KvFault::DropNext);
    assert_eq!(send(&gw, &conversation(40, 1)).await, 200);
    assert_eq!(send(&gw, &conversation(41, 1)).await, 200);
    warm(&fleet, 1, &conversation(42, 1)).await;
    assert!(
        metric_eventually(
            &gw,
            "rolter_kv_stream_total{kind=\"gaps\",provider=\"r1\"}",
            |v| v >= 1.0
        )
        .await
    );
    assert!(
        metric_eventually(
            &gw,
            "rolter_kv_stream_total{kind=\"replays_ok\",provider=\"r1\"}",
            |v| v >= 1.0
        )
        .await
    );
    assert!(
        metric_eventually(&gw, "rolter_kv_stream_trusted{provider=\"r1\"}", |v| v
            == 1.0)
        .await
    );

    // Restart replica 0's publisher (sequence back to 0): the gateway recovers.
    fleet.replica(0).restart_kv_publisher().await.unwrap();
    // Recovery takes one of two paths: the SUB socket re-dials by itself and the
    // sequence restarting at 0 clears the index (`restarts`), or requests routed to
    // r0 with no events following make the stream stale (staleness_ms = 2000) and the
    // subscriber reconnects (`connects`). Keep traffic flowing until either happened.
    let restarts = "rolter_kv_stream_total{kind=\"restarts\",provider=\"r0\"}";
    let reconnects = "rolter_kv_stream_total{kind=\"connects\",provider=\"r0\"}";
    let mut topic = 200;
    let recovered = eventually(Duration::from_secs(20), || {
        topic += 1;
        let conv = conversation(topic, 0);
        let gw = &gw;
        async move {
            assert_eq!(
                send(gw, &conv).await,
                200,
                "requests keep flowing during recovery"
            );
            gw.metric(restarts).await.is_some_and(|v| v >= 1.0)
                || gw.metric(reconnects).await.is_some_and(|v| v >= 2.0)
        }
    })
    .await;
    assert!(recovered, "no reconnect after the publisher restarted");
    wait_subscribed(&gw, 2).await;
    let conv0 = conversation(99, 1);
    warm(&fleet, 0, &conv0).await;
    let want = fleet.replica(0).cached_block_hashes().len() as f64;
    assert!(
        metric_eventually(&gw, "rolter_kv_stream_trusted{provider=\"r0\"}", |v| v
            == 1.0)
        .await
    );
    let before = served(&fleet);
    assert_eq!(send(&gw, &conv0).await, 200);
    let after = served(&fleet);
    assert_eq!(
        after[0] - before[0],
        1,
        "after restart, blocks on replica 0 ({want}) did not attract the request"
    );
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_or_malformed_token_ids_fall_back_to_least_load() {
    let fleet = spawn_fleet(FleetConfig::default()).await.unwrap();
    let gw = Gateway::start(&routes(&fleet)).await;
    let conv = conversation(3, 1);
    for ids in [None, Some("1,2,banana"), Some("")] {
        let headers: Vec<(&str, &str)> = ids
            .iter()
            .map(|v| ("x-rolter-vllm-token-ids", *v))
            .collect();
        let (status, _, answer) = post_chat_with(&gw, body(&conv), &headers).await;
        assert_eq!(status, 200, "{answer}");
    }
    assert_eq!(
        gw.metric(
            "rolter_routing_decisions_total{reason=\"fallback\",strategy=\"precise_cache_aware\"}"
        )
        .await,
        Some(3.0)
    );
    fleet.shutdown().await;
}

/// In-process: a subscriber feeding a residency index from a simulated replica's real
/// KV-event stream ends up holding exactly the replica's cached block set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_index_equals_the_replicas_cache_block_for_block() {
    use rolter::kv_events::sequence::StreamState;
    use rolter::kv_events::subscriber::{KvEventSubscriber, SubscriberConfig};
    use rolter::prefix::ResidencyIndex;
    use std::sync::Arc;

    let fleet = spawn_fleet(FleetConfig {
        replicas: 1,
        ..FleetConfig::default()
    })
    .await
    .unwrap();
    let r = fleet.replica(0).clone();
    let mut cfg = SubscriberConfig::new(r.kv_events_endpoint().unwrap(), "");
    cfg.replay_endpoint = r.kv_replay_endpoint();
    let index = Arc::new(ResidencyIndex::new(1 << 20));
    let state = Arc::new(StreamState::new());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(
        KvEventSubscriber::new(cfg, index.clone(), state.clone()).run(async move {
            let _ = stopped.await;
        }),
    );
    assert!(eventually(Duration::from_secs(10), || async { state.is_connected() }).await);
    tokio::time::sleep(Duration::from_millis(300)).await; // ZMQ slow-joiner window
                                                          // A workload with shared prefixes and growing conversations, straight to the replica.
    for topic in 0..4 {
        for turns in 0..3 {
            warm(&fleet, 0, &conversation(topic, turns)).await;
        }
    }
    let want: Vec<u64> = {
        let mut v: Vec<u64> = r.cached_block_hashes().into_iter().collect();
        v.sort_unstable();
        v
    };
    assert!(want.len() > 50, "workload too small: {} blocks", want.len());
    let matched = eventually(Duration::from_secs(10), || async {
        index
            .gpu_block_hashes()
            .iter()
            .map(|h| h.0)
            .collect::<Vec<u64>>()
            == want
    })
    .await;
    let got: Vec<u64> = index.gpu_block_hashes().iter().map(|h| h.0).collect();
    assert!(
        matched,
        "index ({} blocks) != replica cache ({} blocks)",
        got.len(),
        want.len()
    );
    let _ = stop.send(());
    let _ = task.await;
    fleet.shutdown().await;
}

/// The staleness clock starts when a request is routed, not when its answer starts: a
/// replica whose HTTP side hangs (so it never answers, and never stores the blocks) makes
/// its stream stale within `staleness_ms`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_hangs_makes_its_stream_stale() {
    let fleet = spawn_fleet(FleetConfig::default()).await.unwrap();
    let gw = Gateway::start(&routes(&fleet)).await;
    wait_subscribed(&gw, 2).await;
    let conv = conversation(3, 2);
    warm(&fleet, 1, &conv).await;
    let blocks = fleet.replica(1).cached_block_hashes().len() as f64;
    assert!(
        metric_eventually(&gw, "rolter_kv_index_blocks{provider=\"r1\"}", |v| v
            == blocks)
        .await
    );
    fleet
        .replica(1)
        .set_http_fault(rolter_loadtest::replica::HttpFault::Hang);
    // A longer conversation: its blocks are on r1 as far as they go, the rest must be
    // stored there. The request never gets an answer; the client gives up.
    let longer = conversation(3, 4);
    let ids = token_header_value(&chat_tokens(&longer));
    let hung = tokio::time::timeout(
        Duration::from_millis(500),
        post_chat_with(&gw, body(&longer), &[("x-rolter-vllm-token-ids", &ids)]),
    )
    .await;
    assert!(hung.is_err(), "the hanging replica answered");
    assert_eq!(
        fleet.replica(1).stats().requests,
        2,
        "the request reached r1"
    );
    assert!(
        metric_eventually(
            &gw,
            "rolter_kv_stream_total{kind=\"stale\",provider=\"r1\"}",
            |v| v >= 1.0
        )
        .await,
        "r1's stream never went stale"
    );
    fleet
        .replica(1)
        .set_http_fault(rolter_loadtest::replica::HttpFault::None);
}

/// Without `kv_cache_tokens`, the gateway learns a replica's cache size from its events once
/// the replica evicts a block: the most blocks it held, which for the simulator (like vLLM,
/// it evicts only when no free block is left) is its whole cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replicas_cache_size_is_learned_from_its_first_eviction() {
    let mut cfg = FleetConfig::default();
    cfg.replica.cache_blocks = 64;
    let want = (cfg.replica.cache_blocks * cfg.replica.block_size) as f64;
    let fleet = spawn_fleet(cfg).await.unwrap();
    let gw = Gateway::start(&routes(&fleet)).await;
    wait_subscribed(&gw, 2).await;
    let learned = "rolter_kv_cache_learned_tokens{provider=\"r0\"}";
    // Filling, nothing evicted: the size is unknown (0).
    warm(&fleet, 0, &conversation(0, 0)).await;
    assert!(metric_eventually(&gw, "rolter_kv_index_blocks{provider=\"r0\"}", |v| v > 0.0).await);
    assert_eq!(fleet.replica(0).stats().evictions, 0);
    assert_eq!(gw.metric(learned).await, Some(0.0));
    // Other prompts until the replica evicts: then its whole cache.
    let mut topic = 1;
    while fleet.replica(0).stats().evictions == 0 {
        assert!(topic < 40, "64 blocks never filled");
        warm(&fleet, 0, &conversation(topic, 0)).await;
        topic += 1;
    }
    assert!(
        metric_eventually(&gw, learned, |v| v == want).await,
        "learned {:?}, cache {want}",
        gw.metric(learned).await
    );
    // The other replica, which evicted nothing, stays unknown.
    assert_eq!(
        gw.metric("rolter_kv_cache_learned_tokens{provider=\"r1\"}")
            .await,
        Some(0.0)
    );
}
