//! Hostile ZMQ peers against the KV-event path (issue #20 item 1): after a normal ZMTP
//! handshake, one frame header declaring 2^50 bytes. On the zeromq 0.7 crate this aborted
//! the process (the codec reserved the declared length); each test here then died with the
//! whole test binary. Now the peer is disconnected, counted, and a well-behaved publisher on
//! the same endpoint is subscribed to again. Loopback only; every wait is bounded.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use rolter::kv_events::sequence::StreamState;
use rolter::kv_events::subscriber::{KvEventSubscriber, SubscriberConfig};
use rolter::prefix::ResidencyIndex;
use rolter_loadtest::cache::CacheEvent;
use rolter_loadtest::kv_events::encode::encode_batch;
use rolter_loadtest::kv_events::frame_bomb::{self, BOMB_LEN};
use rolter_loadtest::kv_events::{Publisher, PublisherConfig, WireFormat};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Bound on every wait.
const WAIT: Duration = Duration::from_secs(10);

/// One stored block (block size 16) whose hash is `hash`.
fn one_block(hash: u64) -> Vec<CacheEvent> {
    vec![CacheEvent::Stored {
        block_hashes: vec![hash],
        parent_block_hash: None,
        token_ids: (0..16).collect(),
        block_size: 16,
    }]
}

struct Running {
    index: Arc<ResidencyIndex>,
    state: Arc<StreamState>,
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl Running {
    async fn stop(self) {
        let _ = self.stop.send(());
        tokio::time::timeout(WAIT, self.task)
            .await
            .expect("subscriber stops")
            .unwrap();
    }
}

fn start(mut cfg: SubscriberConfig) -> Running {
    cfg.connect_timeout = Duration::from_secs(2);
    cfg.replay_timeout = Duration::from_secs(2);
    cfg.backoff_initial = Duration::from_millis(50);
    cfg.backoff_max = Duration::from_millis(300);
    cfg.probe_interval = None;
    let index = Arc::new(ResidencyIndex::new(1_000));
    let state = Arc::new(StreamState::new());
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(
        KvEventSubscriber::new(cfg, index.clone(), state.clone()).run(async move {
            let _ = stopped.await;
        }),
    );
    Running {
        index,
        state,
        stop,
        task,
    }
}

async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A well-behaved simulated vLLM publisher bound on `endpoint` publishes one block once
/// the subscription reached it; the subscriber's index must then hold it.
async fn good_publisher_is_applied(endpoint: &str, run: &Running) {
    let p = Publisher::start(PublisherConfig {
        endpoint: endpoint.to_string(),
        replay_endpoint: None,
        ..PublisherConfig::default()
    })
    .await
    .expect("the endpoint is free again");
    wait_until("the subscriber subscribed", || {
        p.stats()
            .subscribers
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1
    })
    .await;
    p.publish(one_block(7));
    wait_until("the good batch applied", || run.index.block_count() == 1).await;
    p.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_sending_a_frame_bomb_is_dropped_counted_and_replaced() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    let run = start(SubscriberConfig::new(endpoint.clone(), ""));
    let outcome = frame_bomb::serve(&listener, "PUB", BOMB_LEN, 1, WAIT)
        .await
        .unwrap();
    assert!(outcome[0].handshake, "the bomb reached the frame decoder");
    assert!(
        outcome[0].peer_closed,
        "the subscriber closed the connection"
    );
    drop(listener);
    wait_until("the violation counted", || {
        run.state.snapshot().protocol_errors == 1
    })
    .await;
    good_publisher_is_applied(&endpoint, &run).await;
    assert_eq!(run.state.snapshot().protocol_errors, 1);
    run.stop().await;
}

/// A frame the process could allocate (2 MiB) but over the configured bound (1 MiB) is
/// refused too: without ZMQ_MAXMSGSIZE libzmq would allocate it and wait for its bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_over_max_message_bytes_is_refused() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    let mut cfg = SubscriberConfig::new(endpoint.clone(), "");
    cfg.max_message_bytes = 1 << 20;
    let run = start(cfg);
    let outcome = frame_bomb::serve(&listener, "PUB", (2 << 20) + 1, 1, Duration::from_secs(3))
        .await
        .unwrap();
    assert!(outcome[0].handshake, "{outcome:?}");
    assert!(
        outcome[0].peer_closed,
        "a frame over the bound must close the connection"
    );
    wait_until("the violation counted", || {
        run.state.snapshot().protocol_errors == 1
    })
    .await;
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_dialling_a_bound_subscriber_with_a_frame_bomb_is_dropped() {
    let port = free_port();
    let mut cfg = SubscriberConfig::new(format!("tcp://127.0.0.1:{port}"), "");
    cfg.bind = true;
    let run = start(cfg);
    let addr = format!("127.0.0.1:{port}");
    // Dial until the subscriber has bound.
    let deadline = Instant::now() + WAIT;
    let outcome = loop {
        match frame_bomb::dial(&addr, "PUB", BOMB_LEN, WAIT).await {
            Ok(o) => break o,
            Err(e) => assert!(Instant::now() < deadline, "never bound: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(outcome.handshake && outcome.peer_closed, "{outcome:?}");
    // libzmq reports a violation on an accepted connection as a disconnect.
    wait_until("the disconnect counted", || {
        run.state.snapshot().disconnects >= 1
    })
    .await;
    // A vLLM publisher that connects (its endpoint has no wildcard) is still heard.
    let ctx = zmq::Context::new();
    let publisher = ctx.socket(zmq::PUB).unwrap();
    publisher.set_linger(0).unwrap();
    publisher.connect(&format!("tcp://{addr}")).unwrap();
    let payload = encode_batch(0.0, &one_block(7), &WireFormat::default());
    let deadline = Instant::now() + WAIT;
    let mut seq = 0u64;
    // PUB drops what it sends before the subscription arrives: resend, one seq each.
    while run.index.block_count() != 1 {
        assert!(Instant::now() < deadline, "the good batch never applied");
        let frames: [&[u8]; 3] = [b"", &seq.to_be_bytes(), &payload];
        publisher.send_multipart(frames, 0).unwrap();
        seq += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    run.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_endpoint_sending_a_frame_bomb_is_dropped_and_counted() {
    let p = Publisher::start(PublisherConfig {
        replay_endpoint: None,
        ..PublisherConfig::default()
    })
    .await
    .unwrap();
    let hostile = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut cfg = SubscriberConfig::new(p.endpoint(), "");
    cfg.replay_endpoint = Some(format!("tcp://{}", hostile.local_addr().unwrap()));
    let run = start(cfg);
    // The first connect asks the replay endpoint for its ring: the bomb answers.
    let outcome = frame_bomb::serve(&hostile, "ROUTER", BOMB_LEN, 1, WAIT)
        .await
        .unwrap();
    assert!(
        outcome[0].handshake && outcome[0].peer_closed,
        "{outcome:?}"
    );
    wait_until("the violation counted", || {
        let s = run.state.snapshot();
        s.protocol_errors == 1 && s.replays_failed == 1
    })
    .await;
    // The live stream is unaffected.
    wait_until("subscribed", || {
        p.stats()
            .subscribers
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1
    })
    .await;
    p.publish(one_block(7));
    wait_until("the live batch applied", || run.index.block_count() == 1).await;
    run.stop().await;
    p.close().await;
}

/// The real gateway process: a KV-event publisher it dials sends the bomb; the process
/// keeps serving, counts the violation and exports it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_survives_a_frame_bomb_and_exports_it() {
    let stub = Stub::start("s").await.unwrap();
    let hostile = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let routes = format!(
        "[[providers]]\nname = \"r0\"\nkind = \"openai_compatible\"\napi_base = \"{}\"\n\
         [providers.health]\nenabled = false\n\
         [providers.kv_events]\nendpoint = \"tcp://{}\"\n\n\
         [[routes]]\nmodel = \"alias\"\nstrategy = \"precise_cache_aware\"\n\
         [[routes.targets]]\nprovider = \"r0\"\nmodel = \"m\"\n",
        stub.url(),
        hostile.local_addr().unwrap()
    );
    let gw = Gateway::start(&routes).await;
    let outcome = frame_bomb::serve(&hostile, "PUB", BOMB_LEN, 1, WAIT)
        .await
        .unwrap();
    assert!(
        outcome[0].handshake && outcome[0].peer_closed,
        "{outcome:?}"
    );
    let series = "rolter_kv_stream_total{kind=\"protocol_errors\",provider=\"r0\"}";
    assert!(
        eventually(WAIT, || async { gw.metric(series).await == Some(1.0) }).await,
        "protocol error not exported"
    );
    let (status, _, _) = post_chat(&gw, chat_body("alias", "still here", false)).await;
    assert_eq!(status, 200, "the gateway still proxies");
}
