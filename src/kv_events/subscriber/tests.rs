//! Tests of `subscriber`.

use super::*;
use parking_lot::Mutex;
use rmpv::Value;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::LazyLock;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

const TOPIC: &str = "kv@test";
const BS: u32 = 4;
/// Every wait in these tests is bounded by this.
const WAIT: Duration = Duration::from_secs(10);

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> Value {
    Value::Map(vec![
        ("type".into(), "BlockStored".into()),
        (
            "block_hashes".into(),
            Value::Array(hashes.iter().map(|h| Value::from(*h)).collect()),
        ),
        (
            "parent_block_hash".into(),
            parent.map_or(Value::Nil, Value::from),
        ),
        (
            "token_ids".into(),
            Value::Array(tokens.iter().map(|t| Value::from(*t)).collect()),
        ),
        ("block_size".into(), Value::from(BS)),
        ("lora_id".into(), Value::Nil),
        ("medium".into(), "GPU".into()),
        ("lora_name".into(), Value::Nil),
    ])
}

fn payload(events: Vec<Value>) -> Vec<u8> {
    let batch = Value::Array(vec![Value::F64(1.0), Value::Array(events), Value::from(0)]);
    let mut buf = Vec::new();
    rmpv::encode::write_value(&mut buf, &batch).unwrap();
    buf
}

fn tokens(block: u32) -> Vec<u32> {
    (block * BS..(block + 1) * BS).collect()
}

fn prompt(blocks: u32) -> Vec<u32> {
    (0..blocks * BS).collect()
}

/// Published (sequence, payload) pairs the replay ROUTER serves from.
type ReplayBuffer = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

/// Test sockets' libzmq context.
static TEST_CONTEXT: LazyLock<zmq::Context> = LazyLock::new(zmq::Context::new);

/// Bind a fresh socket of `kind` on `endpoint` (port 0: any), retrying while a closed
/// predecessor still holds the port; returns it and the bound endpoint.
fn bound(kind: zmq::SocketType, endpoint: &str) -> (zmq::Socket, String) {
    let sock = TEST_CONTEXT.socket(kind).unwrap();
    sock.set_linger(0).unwrap();
    let deadline = Instant::now() + WAIT;
    while let Err(e) = sock.bind(endpoint) {
        assert!(
            e == zmq::Error::EADDRINUSE && Instant::now() < deadline,
            "bind {endpoint}: {e}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let ep = sock.get_last_endpoint().unwrap().unwrap();
    (sock, ep)
}

/// An in-test vLLM publisher: PUB + replay ROUTER with a buffer, on loopback.
struct Publisher {
    pub_sock: zmq::Socket,
    pub_endpoint: String,
    replay_endpoint: String,
    buffer: ReplayBuffer,
    /// Replay requests received.
    requested: Arc<AtomicUsize>,
    /// When set, the ROUTER waits for this before answering.
    gate: Arc<Mutex<Option<std::sync::mpsc::Receiver<()>>>>,
    /// Stops the ROUTER thread (which then closes the socket).
    stop: Arc<AtomicBool>,
    router: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.router.take() {
            let _ = t.join();
        }
    }
}

impl Publisher {
    async fn start() -> Publisher {
        Self::start_on("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    }

    /// A publisher on given endpoints (a restarted one reuses its predecessor's).
    fn start_on(pub_ep: &str, replay_ep: &str) -> Publisher {
        let (pub_sock, pub_endpoint) = bound(zmq::PUB, pub_ep);
        let (router, replay_endpoint) = bound(zmq::ROUTER, replay_ep);
        let buffer: ReplayBuffer = Arc::default();
        let requested = Arc::new(AtomicUsize::new(0));
        let gate: Arc<Mutex<Option<std::sync::mpsc::Receiver<()>>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (buf, req, g, st) = (
            buffer.clone(),
            requested.clone(),
            gate.clone(),
            stop.clone(),
        );
        let thread = std::thread::spawn(move || {
            while !st.load(Ordering::Acquire) {
                if router.poll(zmq::POLLIN, 20).unwrap() == 0 {
                    continue;
                }
                let frames = router.recv_multipart(0).unwrap();
                let id = frames[0].clone();
                let start = u64::from_be_bytes(frames[2][..].try_into().unwrap());
                req.fetch_add(1, Ordering::AcqRel);
                let gate = g.lock().take();
                if let Some(gate) = gate {
                    let _ = gate.recv();
                }
                let batches: Vec<_> = buf
                    .lock()
                    .iter()
                    .filter(|(s, _)| *s >= start)
                    .cloned()
                    .collect();
                for (seq, p) in batches {
                    let reply: [&[u8]; 5] = [&id, b"", TOPIC.as_bytes(), &seq.to_be_bytes(), &p];
                    router.send_multipart(reply, 0).unwrap();
                }
                let end: [&[u8]; 5] = [&id, b"", b"", &[0xFF; 8], b""];
                router.send_multipart(end, 0).unwrap();
            }
        });
        Publisher {
            pub_sock,
            pub_endpoint,
            replay_endpoint,
            buffer,
            requested,
            gate,
            stop,
            router: Some(thread),
        }
    }

    /// Record a batch in the replay buffer and, unless `drop`, publish it.
    async fn publish(&mut self, seq: u64, events: Vec<Value>, drop: bool) {
        let p = payload(events);
        self.buffer.lock().push((seq, p.clone()));
        if !drop {
            let frames: [&[u8]; 3] = [TOPIC.as_bytes(), &seq.to_be_bytes(), &p];
            self.pub_sock.send_multipart(frames, 0).unwrap();
        }
    }
}

async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn config(p: &Publisher, replay: bool) -> SubscriberConfig {
    let mut cfg = SubscriberConfig::new(p.pub_endpoint.clone(), TOPIC);
    if replay {
        cfg.replay_endpoint = Some(p.replay_endpoint.clone());
    }
    cfg.connect_timeout = Duration::from_secs(2);
    cfg.replay_timeout = Duration::from_secs(2);
    cfg.staleness_limit = Duration::from_millis(300);
    cfg.probe_interval = None;
    cfg
}

/// Start a subscriber and wait until its subscription reached the publisher
/// (PUB drops messages before that: ZMQ's slow-joiner).
async fn start(
    cfg: SubscriberConfig,
) -> (
    Arc<ResidencyIndex>,
    Arc<StreamState>,
    oneshot::Sender<()>,
    JoinHandle<()>,
) {
    let index = Arc::new(ResidencyIndex::new(1_000));
    let state = Arc::new(StreamState::new());
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let sub = KvEventSubscriber::new(cfg, index.clone(), state.clone());
    let handle = tokio::spawn(sub.run(async move {
        let _ = stop_rx.await;
    }));
    wait_until("connect", || state.is_connected()).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    (index, state, stop_tx, handle)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gap_marks_untrusted_and_replay_restores() {
    tokio::time::timeout(Duration::from_secs(30), async {
        let mut p = Publisher::start().await;
        let (index, state, stop, handle) = start(config(&p, true)).await;
        let t = prompt(4);

        p.publish(0, vec![stored(&[1, 2], None, &t[..8])], false)
            .await;
        wait_until("first batch", || index.block_count() == 2).await;
        assert!(state.is_trusted());

        // seq 1 is lost on the wire; seq 2 shows the gap. Hold the replay until
        // the test has seen the target go untrusted.
        let (go, gate) = std::sync::mpsc::channel();
        *p.gate.lock() = Some(gate);
        let requests = p.requested.load(Ordering::Acquire);
        p.publish(1, vec![stored(&[3], Some(2), &tokens(2))], true)
            .await;
        p.publish(2, vec![stored(&[4], Some(3), &tokens(3))], false)
            .await;
        wait_until("replay requested", || {
            p.requested.load(Ordering::Acquire) > requests
        })
        .await;
        assert!(!state.is_trusted(), "a gap makes the target untrusted");
        go.send(()).unwrap();

        wait_until("replay applied", || index.block_count() == 4).await;
        wait_until("trusted again", || state.is_trusted()).await;
        assert_eq!(index.match_blocks(&t, BS as usize), 4);
        let s = state.snapshot();
        assert_eq!(
            (s.gaps, s.replays_ok, s.replays_failed, s.rebuilds),
            (1, 1, 0, 0)
        );
        assert_eq!(s.last_seq, Some(2));

        // The publisher restarts: sequence back to 0, its cache is empty.
        p.buffer.lock().clear();
        p.publish(0, vec![stored(&[9], None, &tokens(7))], false)
            .await;
        wait_until("restart handled", || state.snapshot().restarts == 1).await;
        wait_until("rebuilt", || index.block_count() == 1).await;
        assert_eq!(index.match_blocks(&t, BS as usize), 0);
        assert!(state.is_trusted());

        // Garbage is counted, not fatal.
        p.pub_sock
            .send_multipart([TOPIC.as_bytes(), b"x"], 0)
            .unwrap();
        wait_until("decode error counted", || {
            state.snapshot().decode_errors == 1
        })
        .await;

        stop.send(()).unwrap();
        handle.await.unwrap();
    })
    .await
    .expect("test bounded in time");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gap_without_replay_drops_the_index_and_staleness_needs_routed_requests() {
    tokio::time::timeout(Duration::from_secs(30), async {
        let mut p = Publisher::start().await;
        let (index, state, stop, handle) = start(config(&p, false)).await;
        let t = prompt(4);
        p.publish(0, vec![stored(&[1, 2], None, &t[..8])], false)
            .await;
        wait_until("first batch", || index.block_count() == 2).await;

        p.publish(1, vec![stored(&[3], Some(2), &tokens(2))], true)
            .await;
        p.publish(2, vec![stored(&[4], None, &tokens(0))], false)
            .await;
        wait_until("rebuilt", || state.snapshot().rebuilds == 1).await;
        assert_eq!(
            index.block_count(),
            1,
            "old entries dropped, new batch applied"
        );
        assert!(state.is_trusted(), "a dropped index under-reports only");

        // Silence is not staleness...
        tokio::time::sleep(Duration::from_millis(700)).await;
        assert!(state.is_trusted());
        assert_eq!(state.snapshot().stale, 0);
        // ...but requests routed with no batch following are.
        state.note_routed();
        wait_until("stale", || state.snapshot().stale == 1).await;
        // It reconnects; the next in-order batch restores trust.
        wait_until("reconnected", || state.snapshot().connects >= 2).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        p.publish(3, vec![stored(&[5], Some(4), &tokens(1))], false)
            .await;
        wait_until("trusted again", || state.is_trusted()).await;
        assert_eq!(index.match_blocks(&t, BS as usize), 2);

        stop.send(()).unwrap();
        handle.await.unwrap();
    })
    .await
    .expect("test bounded in time");
}

/// Issue #20 item 9: a freshly started subscriber learns the publisher's ring at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_connect_replays_what_the_publisher_already_published() {
    tokio::time::timeout(Duration::from_secs(30), async {
        let mut p = Publisher::start().await;
        let t = prompt(4);
        // Published before anyone subscribed: the PUB socket sends them to nobody.
        p.publish(0, vec![stored(&[1, 2], None, &t[..8])], false)
            .await;
        p.publish(1, vec![stored(&[3], Some(2), &tokens(2))], false)
            .await;
        p.publish(2, vec![stored(&[4], Some(3), &tokens(3))], false)
            .await;
        let (index, state, stop, handle) = start(config(&p, true)).await;
        wait_until("the ring replayed", || index.block_count() == 4).await;
        assert_eq!(index.match_blocks(&t, BS as usize), 4);
        let s = state.snapshot();
        assert_eq!((s.replays_ok, s.gaps, s.rebuilds), (1, 0, 0));
        assert_eq!(s.last_seq, Some(2));
        assert!(state.is_trusted());
        // The live stream continues in order from there.
        p.publish(3, vec![stored(&[5], Some(4), &tokens(4))], false)
            .await;
        wait_until("next batch", || index.block_count() == 5).await;
        assert_eq!(state.snapshot().gaps, 0);
        stop.send(()).unwrap();
        handle.await.unwrap();
    })
    .await
    .expect("test bounded in time");
}

/// Issue #20 item 11: a publisher that comes back (sequence from 0) after longer than
/// the probe interval is counted as a restart, not only as failed replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_slower_than_the_probe_interval_is_counted() {
    tokio::time::timeout(Duration::from_secs(30), async {
        let mut p = Publisher::start().await;
        let mut cfg = config(&p, true);
        cfg.probe_interval = Some(Duration::from_millis(200));
        cfg.connect_timeout = Duration::from_millis(300);
        cfg.replay_timeout = Duration::from_millis(300);
        cfg.backoff_initial = Duration::from_millis(50);
        cfg.backoff_max = Duration::from_millis(200);
        let (index, state, stop, handle) = start(cfg).await;
        let t = prompt(4);
        p.publish(0, vec![stored(&[1, 2], None, &t[..8])], false)
            .await;
        p.publish(1, vec![stored(&[3], Some(2), &tokens(2))], false)
            .await;
        wait_until("batches applied", || index.block_count() == 3).await;

        // The publisher goes away for several probe intervals.
        let (pub_ep, replay_ep) = (p.pub_endpoint.clone(), p.replay_endpoint.clone());
        drop(p);
        wait_until("a probe failed", || state.snapshot().replays_failed >= 1).await;
        assert!(!state.is_connected());
        assert_eq!(state.snapshot().restarts, 0);

        // It comes back with a fresh sequence and other content.
        let mut p = Publisher::start_on(&pub_ep, &replay_ep);
        p.publish(0, vec![stored(&[9], None, &tokens(7))], true)
            .await;
        wait_until("restart counted", || state.snapshot().restarts == 1).await;
        wait_until("rebuilt from the new ring", || index.block_count() == 1).await;
        assert_eq!(index.match_blocks(&t, BS as usize), 0);
        assert_eq!(index.match_blocks(&tokens(7), BS as usize), 1);
        wait_until("trusted", || state.is_trusted()).await;
        stop.send(()).unwrap();
        handle.await.unwrap();
    })
    .await
    .expect("test bounded in time");
}

#[test]
fn a_new_config_connects() {
    assert!(!SubscriberConfig::new("tcp://0.0.0.0:5557", "").bind);
}
