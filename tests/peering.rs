//! Two gateways with `[peering]`: a conversation's turn that reaches the gateway which did
//! not serve the turn before goes where the other gateway put it; datagrams from anyone
//! but a configured peer are refused, and with a key, any not sealed with it.

mod common;

use common::*;
use std::time::Duration;

/// A system prompt long enough to count as cached on its own (over 256 tokens).
fn system(k: usize) -> String {
    format!(
        "You are assistant {k}. {}",
        "Answer with care and cite sources. ".repeat(40)
    )
}

/// Turn `turns` of conversation `conv` under `system`, for route `model`; each question is
/// long enough (about 40 tokens) to count as history beyond the system prompt.
fn turn(model: &str, system: &str, conv: usize, turns: usize) -> String {
    let question = |t: usize| {
        let text = format!(
            "conversation {conv} question {t}: {}",
            "please explain it in detail. ".repeat(5)
        );
        serde_json::json!({"role": "user", "content": text})
    };
    let mut messages = vec![serde_json::json!({"role": "system", "content": system})];
    for t in 0..turns {
        messages.push(question(t));
        messages.push(serde_json::json!({"role": "assistant", "content": format!("answer {t}")}));
    }
    messages.push(question(turns));
    serde_json::json!({"model": model, "messages": messages}).to_string()
}

/// A loopback UDP port nobody uses right now.
fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Providers p0..p2 for `urls`, cache_aware routes (`alias`, and `warm` when given) over
/// the given targets, and `[peering]`.
fn routes(urls: &[String], alias: &[usize], warm: &[usize], listen: u16, peer: u16) -> String {
    let mut s = providers_toml(urls);
    for (model, targets) in [("alias", alias), ("warm", warm)] {
        if targets.is_empty() {
            continue;
        }
        s += &format!("[[routes]]\nmodel = \"{model}\"\nstrategy = \"cache_aware\"\n");
        for i in targets {
            s += &format!(
                "[[routes.targets]]\nprovider = \"p{i}\"\nmodel = \"upstream-model-{i}\"\n"
            );
        }
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
    // Gateway A routes `alias` to "b" only. Gateway B routes it over all three, and `warm`
    // to "b" only: a request there puts the system prompt in B's view of "b" (a target's
    // prefix state is shared by the routes using it).
    let a = Gateway::start(&routes(&urls, &[1], &[], port_a, port_b)).await;
    let b = Gateway::start(&routes(&urls, &[0, 1, 2], &[1], port_b, port_a)).await;
    let mut heard = 0.0;
    let mut checked = 0;
    for k in 0..8 {
        let system = system(k);
        let (status, id, _) = post_chat(&b, turn("warm", &system, 99, 0)).await;
        assert_eq!((status, id.as_deref()), (200, Some("b")));
        for conv in 0..4 {
            // The first turn through B: its group's home there, once the group is known.
            let (status, first, _) = post_chat(&b, turn("alias", &system, conv, 0)).await;
            assert_eq!(status, 200);
            // The second through A, which can only place it on "b" and tells B so.
            let (status, id, _) = post_chat(&a, turn("alias", &system, conv, 1)).await;
            assert_eq!((status, id.as_deref()), (200, Some("b")));
            heard += 1.0;
            let told = eventually(Duration::from_secs(5), || async {
                b.metric(RECEIVED).await.unwrap_or(0.0) >= heard
            })
            .await;
            assert!(told, "B never heard of conversation {conv}'s second turn");
            // The third through B: without the note, B's view has the first turn's history
            // on the first turn's target and sends it back there.
            let (status, id, _) = post_chat(&b, turn("alias", &system, conv, 2)).await;
            assert_eq!(status, 200);
            assert_eq!(id.as_deref(), Some("b"), "system {k} conversation {conv}");
            checked += usize::from(first.as_deref() != Some("b"));
        }
        if checked >= 3 {
            break;
        }
    }
    assert!(checked >= 3, "too few first turns away from \"b\" to tell");
    assert!(a.metric(SENT).await.unwrap_or(0.0) >= heard);

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

/// The peering address still taken at start (the process a `-u` upgrade replaces has not
/// exited yet): the gateway serves meanwhile and binds the address once it is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taken_peering_address_is_bound_once_it_is_free() {
    let stub = Stub::start("a").await.unwrap();
    let taken = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let gw = Gateway::start(&routes(&[stub.url()], &[0], &[], port, free_udp_port())).await;
    const LISTENING: &str = "rolter_peering_listening";
    assert_eq!(gw.metric(LISTENING).await, Some(0.0));
    let (status, id, _) = post_chat(&gw, turn("alias", &system(0), 0, 0)).await;
    assert_eq!((status, id.as_deref()), (200, Some("a")));
    drop(taken);
    let bound = eventually(Duration::from_secs(5), || async {
        gw.metric(LISTENING).await == Some(1.0)
    })
    .await;
    assert!(bound, "the freed address was never bound");
}

const UNAUTHENTICATED: &str = "rolter_peer_notes_total{event=\"unauthenticated\"}";

/// With a `[peering]` key, notes pass only sealed with it: a listed peer's unsealed
/// datagram, one sealed with another key, one stamped before the receiver started, or a
/// sealed one sent again is counted and dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_key_only_notes_sealed_with_it_are_heard() {
    use rolter::peering::wire;
    let stub = Stub::start("a").await.unwrap();
    let dir = std::env::temp_dir().join(format!("rolter-peer-key-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let key_file = dir.join("peering.key");
    let secret = "9f".repeat(32);
    std::fs::write(&key_file, format!("{secret}\n")).unwrap();
    // A listed peer the test speaks for, beside gateway A.
    let listed = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let listed_port = listed.local_addr().unwrap().port();
    let (port_a, port_b) = (free_udp_port(), free_udp_port());
    let with_key = |routes: String, peers: &[u16]| {
        let peers: Vec<String> = peers.iter().map(|p| format!("\"127.0.0.1:{p}\"")).collect();
        let cut = routes.find("peers = ").unwrap();
        format!(
            "{}peers = [{}]\nkey_file = \"{}\"\n",
            &routes[..cut],
            peers.join(", "),
            key_file.display()
        )
    };
    let urls = [stub.url()];
    let a = Gateway::start(&with_key(
        routes(&urls, &[0], &[], port_a, port_b),
        &[port_b],
    ))
    .await;
    let b = Gateway::start(&with_key(
        routes(&urls, &[0], &[], port_b, port_a),
        &[port_a, listed_port],
    ))
    .await;

    // A's notes reach B, sealed.
    let (status, id, _) = post_chat(&a, turn("alias", &system(0), 0, 0)).await;
    assert_eq!((status, id.as_deref()), (200, Some("a")));
    let heard = eventually(Duration::from_secs(5), || async {
        b.metric(RECEIVED).await.unwrap_or(0.0) >= 1.0
    })
    .await;
    assert!(heard, "B never heard A's sealed note");

    let note = wire::Note {
        route: "alias",
        label: "p0/upstream-model-0",
        conversation: 7,
        new_work: true,
    };
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64;
    let from = listed.local_addr().unwrap();
    let sealed_at = |key: &wire::Key, stamp: u64| {
        let mut d = wire::MAGIC_SEALED.to_vec();
        d.resize(wire::SEALED_HEADER, 0);
        d.extend(wire::encode(&note).unwrap());
        wire::seal(&mut d, key, from, stamp);
        d
    };
    let key = wire::Key::new(secret.as_bytes()).unwrap();
    let other_key = wire::Key::new(&[1; wire::MIN_KEY_BYTES]).unwrap();
    let mut unsealed = wire::MAGIC.to_vec();
    unsealed.extend(wire::encode(&note).unwrap());
    // From a listed peer's address: unsealed, sealed with another key, and sealed with the
    // group's key but stamped before B started (as a datagram captured earlier would be):
    // all refused.
    let before_b = now_us - 20_000_000;
    let refused = [
        unsealed,
        sealed_at(&other_key, now_us),
        sealed_at(&key, before_b),
    ];
    for (i, datagram) in refused.iter().enumerate() {
        let received = b.metric(RECEIVED).await.unwrap_or(0.0);
        listed.send_to(datagram, ("127.0.0.1", port_b)).unwrap();
        let refused = eventually(Duration::from_secs(5), || async {
            b.metric(UNAUTHENTICATED).await.unwrap_or(0.0) >= (i + 1) as f64
        })
        .await;
        assert!(refused, "datagram {i} was not refused as unauthenticated");
        assert_eq!(b.metric(RECEIVED).await.unwrap_or(0.0), received);
    }
    // Sealed with the group's key: heard, once; the same datagram again is a replay.
    let received = b.metric(RECEIVED).await.unwrap_or(0.0);
    let good = sealed_at(&key, now_us);
    listed.send_to(&good, ("127.0.0.1", port_b)).unwrap();
    let heard = eventually(Duration::from_secs(5), || async {
        b.metric(RECEIVED).await.unwrap_or(0.0) > received
    })
    .await;
    assert!(heard, "a note sealed with the group's key was not heard");
    listed.send_to(&good, ("127.0.0.1", port_b)).unwrap();
    let refused = eventually(Duration::from_secs(5), || async {
        b.metric(UNAUTHENTICATED).await.unwrap_or(0.0) >= 4.0
    })
    .await;
    assert!(refused, "a replayed datagram was not refused");
    assert_eq!(b.metric(RECEIVED).await.unwrap_or(0.0), received + 1.0);
    let _ = std::fs::remove_dir_all(&dir);
}
