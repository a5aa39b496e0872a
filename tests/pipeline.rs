//! pipeline + session affinity through the real gateway.

mod common;

use common::*;
use std::hash::{Hash, Hasher};

/// A token that shares no prefix with other (session, i) pairs' tokens in practice.
fn unique(session: usize, i: usize) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (session, i).hash(&mut h);
    h.finish()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_sticks_to_one_replica_and_sessions_spread() {
    let (a, b) = (
        Stub::start("a").await.unwrap(),
        Stub::start("b").await.unwrap(),
    );
    let gw = Gateway::start(&routes_toml(&[a.url(), b.url()], "pipeline", "")).await;
    let mut homes = std::collections::HashSet::new();
    // 16 sessions, each placed by the random weight key: all on one replica has p = 2^-15.
    for session in 0..16 {
        let sid = format!("session-{session}");
        let mut first = None;
        for i in 0..20 {
            // Unrelated prompts each time: only the session id ties them together.
            let body = serde_json::json!({"model": "alias", "messages": [
                {"role": "user", "content": format!("{:016x} {}", unique(session, i), "q".repeat(200 + i * 7))}
            ]})
            .to_string();
            let (status, id, _) = post_chat_with(&gw, body, &[("x-session-id", &sid)]).await;
            assert_eq!(status, 200);
            let id = id.unwrap();
            match &first {
                None => first = Some(id),
                Some(f) => assert_eq!(&id, f, "{sid} request {i} moved"),
            }
        }
        homes.insert(first.unwrap());
    }
    assert_eq!(homes.len(), 2, "16 sessions all landed on one replica");
    assert_eq!(
        gw.metric("rolter_routing_decisions_total{reason=\"affinity\",strategy=\"pipeline\"}")
            .await,
        Some(16.0 * 19.0)
    );
    assert_eq!(
        gw.metric("rolter_sessions{route=\"alias\"}").await,
        Some(16.0)
    );
}
