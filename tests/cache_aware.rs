//! cache_aware through the real gateway: later turns of a conversation return to the
//! replica that served its earlier turns; unrelated conversations spread out.

mod common;

use common::*;

/// Turn `turns` of a chat: the system prompt, the earlier questions and answers, the next
/// question (each turn's prompt extends the previous one's, as a chat client sends it).
fn conversation(system: &str, conv: usize, turns: usize) -> String {
    let question = |t: usize| serde_json::json!({"role": "user", "content": format!("conversation {conv} question {t}")});
    let mut messages = vec![serde_json::json!({"role": "system", "content": system})];
    for t in 0..turns {
        messages.push(question(t));
        messages.push(
            serde_json::json!({"role": "assistant", "content": format!("answer {t} for {conv}")}),
        );
    }
    messages.push(question(turns));
    serde_json::json!({"model": "alias", "messages": messages}).to_string()
}

/// Stubs "a" and "b" behind a gateway routing `alias` by `strategy`.
async fn two_replicas(strategy: &str) -> ([Stub; 2], Gateway) {
    let stubs = [
        Stub::start("a").await.unwrap(),
        Stub::start("b").await.unwrap(),
    ];
    let urls: Vec<String> = stubs.iter().map(|s| s.url()).collect();
    let gw = Gateway::start(&routes_toml(&urls, strategy, "")).await;
    (stubs, gw)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversations_stick_to_their_replica_and_spread_across_the_fleet() {
    let stubs = [
        Stub::start("a").await.unwrap(),
        Stub::start("b").await.unwrap(),
        Stub::start("c").await.unwrap(),
    ];
    let urls: Vec<String> = stubs.iter().map(|s| s.url()).collect();
    let gw = Gateway::start(&routes_toml(&urls, "cache_aware", "")).await;
    // Distinct system prompts per conversation: nothing shared across conversations.
    let mut homes = Vec::new();
    for conv in 0..6 {
        let system = format!(
            "You are assistant number {conv}. {}",
            "Be helpful. ".repeat(50)
        );
        let (status, first, _) = post_chat(&gw, conversation(&system, conv, 0)).await;
        assert_eq!(status, 200);
        for turns in 1..4 {
            let (status, id, _) = post_chat(&gw, conversation(&system, conv, turns)).await;
            assert_eq!(status, 200);
            assert_eq!(id, first, "conversation {conv} turn {turns} moved");
        }
        homes.push(first.unwrap());
    }
    // Cold conversations go to the least-warmed replica, so all three get some.
    for s in ["a", "b", "c"] {
        assert!(
            homes.iter().any(|h| h == s),
            "{s} got no conversation: {homes:?}"
        );
    }
    let hits = gw
        .metric("rolter_routing_decisions_total{reason=\"cache_hit\",strategy=\"cache_aware\"}")
        .await;
    assert_eq!(hits, Some(18.0));
    let nodes: f64 = gw
        .metric("rolter_trie_nodes{target=\"p0/upstream-model-0\"}")
        .await
        .unwrap();
    assert!(nodes > 0.0);
}

/// Bodies from 32 KiB on are summarised as they are encoded instead of kept: a
/// conversation whose turns cross that length still returns to its replica (both paths
/// store and look up the same prompt key).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversations_crossing_into_summarised_lengths_stick_to_their_replica() {
    let (_stubs, gw) = two_replicas("cache_aware").await;
    for conv in 0..4 {
        // ~31 KiB of system prompt: the first turn is kept, later turns are summarised.
        let system = format!("You are assistant {conv}. {}", "Be helpful. ".repeat(2600));
        let body = |turns| {
            let mut b: serde_json::Value =
                serde_json::from_str(&conversation(&system, conv, turns)).unwrap();
            for m in b["messages"].as_array_mut().unwrap() {
                if m["role"] == "assistant" {
                    m["content"] = format!("{} {}", m["content"], "details ".repeat(150)).into();
                }
            }
            b.to_string()
        };
        assert!(body(0).len() < 32 << 10 && body(2).len() > 32 << 10);
        let (status, first, _) = post_chat(&gw, body(0)).await;
        assert_eq!(status, 200);
        for turns in 1..4 {
            let (status, id, _) = post_chat(&gw, body(turns)).await;
            assert_eq!(status, 200);
            assert_eq!(id, first, "conversation {conv} turn {turns} moved");
        }
    }
    // Every later turn was found in the trie, summarised or not.
    let hits = gw
        .metric("rolter_routing_decisions_total{reason=\"cache_hit\",strategy=\"cache_aware\"}")
        .await;
    assert_eq!(hits, Some(12.0));
}

/// A long conversation's later turns resume their parse where the previous turn's body
/// ended (`prompt::resume`): each still reaches its replica with the model rewritten for
/// that replica, whether the body names its model before or after its messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resumed_long_conversations_keep_their_replica_and_their_model() {
    let (_stubs, gw) = two_replicas("cache_aware").await;
    for conv in 0..4 {
        let system = format!("You are assistant {conv}. {}", "Be helpful. ".repeat(3000));
        let body = |turns| {
            let b: serde_json::Value =
                serde_json::from_str(&conversation(&system, conv, turns)).unwrap();
            let messages = b["messages"].to_string();
            if conv % 2 == 0 {
                format!(r#"{{"model": "alias", "messages": {messages}, "stream": false}}"#)
            } else {
                format!(r#"{{"messages": {messages}, "temperature": 0, "model": "alias"}}"#)
            }
        };
        assert!(body(0).len() > 32 << 10);
        let mut first = None;
        for turns in 0..4 {
            let (status, id, text) = post_chat(&gw, body(turns)).await;
            assert_eq!(status, 200, "{text}");
            let reply: serde_json::Value = serde_json::from_str(&text).unwrap();
            let expected = match id.as_deref() {
                Some("a") => "upstream-model-0",
                Some("b") => "upstream-model-1",
                other => panic!("no stub id: {other:?}"),
            };
            assert_eq!(reply["model"], expected, "conversation {conv} turn {turns}");
            first.get_or_insert(id.clone());
            assert_eq!(Some(id), first, "conversation {conv} turn {turns} moved");
        }
    }
    // Turns 1-3 of each conversation resumed.
    let resumed = gw.metric("rolter_prompts_resumed_total").await;
    assert_eq!(resumed, Some(12.0));
}

/// A route that reads no prompt (round_robin) resumes long conversations' walks too, and
/// each turn still reaches its replica with that replica's model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_reading_no_prompt_resumes_the_walk_and_keeps_the_model() {
    let (_stubs, gw) = two_replicas("round_robin").await;
    let system = format!("You are brief. {}", "Be helpful. ".repeat(3000));
    for turns in 0..4 {
        let (status, id, text) = post_chat(&gw, conversation(&system, 0, turns)).await;
        assert_eq!(status, 200, "{text}");
        let reply: serde_json::Value = serde_json::from_str(&text).unwrap();
        let expected = if id.as_deref() == Some("a") {
            "upstream-model-0"
        } else {
            "upstream-model-1"
        };
        assert_eq!(reply["model"], expected, "turn {turns}");
    }
    let resumed = gw.metric("rolter_prompts_resumed_total").await;
    assert_eq!(resumed, Some(3.0));
}

/// A long conversation whose bodies arrive in many small writes (more pieces than the
/// gateway holds as they come, so later ones are gathered) resumes like one sent at
/// once, and each replica receives the body byte for byte with only the model replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_trickled_in_small_writes_resumes_and_arrives_whole() {
    let (stubs, gw) = two_replicas("cache_aware").await;
    for s in &stubs {
        s.set_recording(true);
    }
    let system = format!("You are patient. {}", "Take your time. ".repeat(2500));
    let client = reqwest::Client::new();
    for turns in 0..4 {
        let body = conversation(&system, 7, turns);
        assert!(body.len() > 32 << 10);
        let chunks: Vec<Vec<u8>> = body.as_bytes().chunks(700).map(<[u8]>::to_vec).collect();
        let resp =
            post_chat_in_pieces(&client, &gw, chunks, std::time::Duration::from_millis(1)).await;
        assert_eq!(resp.status().as_u16(), 200, "turn {turns}");
        let id = resp.headers().get("x-stub-id").unwrap().to_str().unwrap();
        let (stub, model) = match id {
            "a" => (&stubs[0], "upstream-model-0"),
            _ => (&stubs[1], "upstream-model-1"),
        };
        let sent = body.replacen(r#""model":"alias""#, &format!(r#""model":"{model}""#), 1);
        let got = stub.recorded().pop().expect("recorded").body;
        assert!(
            got == sent.as_bytes(),
            "turn {turns}: the body changed on the way"
        );
    }
    // Turns 1-3 resumed.
    let resumed = gw.metric("rolter_prompts_resumed_total").await;
    assert_eq!(resumed, Some(3.0));
}
