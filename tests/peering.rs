//! Two gateways with `[peering]`: a conversation's turn that reaches the gateway which did
//! not serve the turn before goes where the other gateway put it; datagrams from anyone
//! but a configured peer are refused.

mod common;

use common::*;
use std::time::Duration;

/// Turn `turns` of conversation `conv` (its own system prompt: nothing shared).
fn turn(conv: usize, turns: usize) -> String {
    let system = format!(
        "You are assistant {conv}. {}",
        "Answer with care. ".repeat(40)
    );
    let question = |t: usize| serde_json::json!({"role": "user", "content": format!("conversation {conv} question {t}")});
    let mut messages = vec![serde_json::json!({"role": "system", "content": system})];
    for t in 0..turns {
        messages.push(question(t));
        messages.push(serde_json::json!({"role": "assistant", "content": format!("answer {t}")}));
    }
    messages.push(question(turns));
    serde_json::json!({"model": "alias", "messages": messages}).to_string()
}

/// A loopback UDP port nobody uses right now.
fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Providers p0..p2 for `urls`, a cache_aware route over `targets` of them, and `[peering]`.
fn routes(urls: &[String], targets: &[usize], listen: u16, peer: u16) -> String {
    let mut s = String::new();
    for (i, u) in urls.iter().enumerate() {
        s += &format!(
            "[[providers]]\nname = \"p{i}\"\nkind = \"openai_compatible\"\napi_base = \"{u}\"\n\n"
        );
    }
    s += "[[routes]]\nmodel = \"alias\"\nstrategy = \"cache_aware\"\n";
    for i in targets {
        s += &format!("[[routes.targets]]\nprovider = \"p{i}\"\nmodel = \"upstream-model-{i}\"\n");
    }
    s += &format!("\n[peering]\nlisten = \"127.0.0.1:{listen}\"\npeers = [\"127.0.0.1:{peer}\"]\n");
    s
}

const SENT: &str = "rolter_peer_notes_total{event=\"sent\"}";
const RECEIVED: &str = "rolter_peer_notes_total{event=\"received\"}";
const REFUSED: &str = "rolter_peer_notes_total{event=\"refused\"}";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_reaching_the_other_gateway_goes_where_its_peer_put_the_last_one() {
    let stubs = [
        Stub::start("a").await.unwrap(),
        Stub::start("b").await.unwrap(),
        Stub::start("c").await.unwrap(),
    ];
    let urls: Vec<String> = stubs.iter().map(|s| s.url()).collect();
    let (port_a, port_b) = (free_udp_port(), free_udp_port());
    // Gateway A routes to "b" only; B to all three. Without A's notes, B places each
    // conversation's second turn as new work over three targets (nothing of it in its
    // trie), so six conversations would not all land on "b".
    let a = Gateway::start(&routes(&urls, &[1], port_a, port_b)).await;
    let b = Gateway::start(&routes(&urls, &[0, 1, 2], port_b, port_a)).await;
    for conv in 0..6 {
        let (status, id, _) = post_chat(&a, turn(conv, 0)).await;
        assert_eq!((status, id.as_deref()), (200, Some("b")));
        let heard = eventually(Duration::from_secs(5), || async {
            b.metric(RECEIVED).await.unwrap_or(0.0) >= (conv + 1) as f64
        })
        .await;
        assert!(heard, "B never heard of conversation {conv}");
        for turns in 1..3 {
            let (status, id, _) = post_chat(&b, turn(conv, turns)).await;
            assert_eq!(status, 200);
            assert_eq!(id.as_deref(), Some("b"), "conversation {conv} turn {turns}");
        }
    }
    assert!(a.metric(SENT).await.unwrap_or(0.0) >= 6.0);
    // B's own turns went back to A: it heard them as its peer's.
    let heard = eventually(Duration::from_secs(5), || async {
        a.metric(RECEIVED).await.unwrap_or(0.0) >= 12.0
    })
    .await;
    assert!(heard, "A never heard of B's turns");

    // A datagram from a socket that is not B's peer address is refused, however well formed.
    let before = b.metric(REFUSED).await.unwrap_or(0.0);
    let stranger = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let label = b"p0/upstream-model-0";
    let mut note = b"RLP1".to_vec();
    note.extend([5, b'a', b'l', b'i', b'a', b's', label.len() as u8]);
    note.extend(label);
    note.extend(7u64.to_le_bytes());
    note.push(0);
    stranger.send_to(&note, ("127.0.0.1", port_b)).unwrap();
    let refused = eventually(Duration::from_secs(5), || async {
        b.metric(REFUSED).await.unwrap_or(0.0) > before
    })
    .await;
    assert!(refused, "a stranger's datagram was not refused");
}
