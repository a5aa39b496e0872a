//! A replica's KV-event publisher: ZMQ PUB for live batches, ROUTER for replay, fault injection.
//!
//! Owns the sockets, the sequence numbers and the replay buffer, mirroring vLLM's
//! `ZmqEventPublisher`: each batch goes out as three frames `(topic, seq as 8 bytes big-endian,
//! msgpack payload)`, sequence numbers start at 0, the last `buffer_steps` payloads are kept,
//! and a DEALER that sends `(b"", start_seq)` to the ROUTER gets one `(b"", seq, payload)` per
//! buffered batch with `seq >= start_seq`, then `(b"", -1 as 8 bytes, b"")`. From vLLM 0.26
//! (PR #45177) replay replies also carry the topic: `(b"", topic, seq, payload)`; that is
//! [`PublisherConfig::replay_topic_frame`].
//!
//! Faults act on the live stream only (the replay buffer always holds the true payloads, so a
//! subscriber can repair a gap): drop the next batch, corrupt the next payload, stall (hold
//! batches until resumed), or restart (sequence back to 0, buffer emptied, like a restarted
//! vLLM; the replica empties its cache at the same moment).
//!
//! It must not block the request path: [`Publisher::publish`] only queues. The sockets are
//! libzmq's (the `zmq` crate, as vLLM's pyzmq), owned by one thread that polls the ROUTER, a
//! wake-up pipe for queued commands and the PUB socket's monitor. Like vLLM, the PUB socket
//! queues up to 100,000 messages per subscriber before dropping. It is an XPUB (the same wire
//! behaviour for subscribers) so that [`PublisherStats::subscribers`] counts subscriptions
//! that arrived, not bare connections: a batch published after it rose reaches the new
//! subscriber (a PUB drops what it sends before the subscription is in).

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, LazyLock};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::encode::{corrupt_payload, encode_batch, WireFormat};
use crate::cache::CacheEvent;

/// vLLM's default replay buffer length (`buffer_steps`).
pub const VLLM_DEFAULT_BUFFER_STEPS: usize = 10_000;
/// The replay end marker: sequence −1 as 8 big-endian bytes.
pub const END_SEQ: [u8; 8] = [0xff; 8];
/// vLLM's PUB high-water mark (`ZmqEventPublisher(hwm=100_000)`).
const VLLM_PUB_HWM: i32 = 100_000;
/// How long a restarted publisher retries binding a port its predecessor still holds
/// (libzmq closes a socket's listener asynchronously).
const REBIND_PATIENCE: Duration = Duration::from_secs(5);
/// Longest wait in one poll of the socket thread (commands also wake it at once).
const POLL_MS: i64 = 100;

/// The libzmq context of the simulator's publishers (never dropped: terminating a context
/// waits for all of its sockets).
static CONTEXT: LazyLock<zmq::Context> = LazyLock::new(zmq::Context::new);
/// Numbers the inproc endpoints of PUB monitors.
static MONITOR_ID: AtomicU64 = AtomicU64::new(0);

/// Publisher settings.
#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// PUB endpoint to bind, e.g. `tcp://127.0.0.1:5557` (port 0 picks a free port).
    pub endpoint: String,
    /// ROUTER endpoint to bind for replay, if any.
    pub replay_endpoint: Option<String>,
    pub topic: String,
    pub wire: WireFormat,
    pub buffer_steps: usize,
    /// Put the topic frame in replay replies (vLLM ≥ 0.26).
    pub replay_topic_frame: bool,
    /// Append every live message's frames and its logical events to files (see [`dump`]).
    pub dump: Option<PathBuf>,
}

impl Default for PublisherConfig {
    fn default() -> Self {
        Self {
            endpoint: "tcp://127.0.0.1:0".into(),
            replay_endpoint: Some("tcp://127.0.0.1:0".into()),
            topic: String::new(),
            wire: WireFormat::default(),
            buffer_steps: VLLM_DEFAULT_BUFFER_STEPS,
            replay_topic_frame: false,
            dump: None,
        }
    }
}

/// A fault to apply to the live stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvFault {
    /// Skip sending the next batch (its sequence number is used: subscribers see a gap).
    DropNext,
    /// Send garbage instead of the next payload.
    CorruptNext,
    /// Hold batches until [`KvFault::Resume`].
    Stall,
    /// Send held batches and continue.
    Resume,
    /// Restart the sequence at 0 and empty the replay buffer.
    Restart,
}

enum Command {
    Publish(Vec<CacheEvent>),
    Fault(KvFault),
    Close(tokio::sync::oneshot::Sender<()>),
}

/// Counters readable while the publisher runs.
#[derive(Debug, Default)]
pub struct PublisherStats {
    /// Batches given a sequence number.
    pub batches: AtomicU64,
    /// Batches actually sent on the PUB socket.
    pub sent: AtomicU64,
    /// Replay requests served.
    pub replays: AtomicU64,
    /// Subscribed subscribers: subscriptions received, less connections dropped.
    pub subscribers: AtomicUsize,
}

/// Handle to a running publisher thread.
#[derive(Clone)]
pub struct Publisher {
    endpoint: String,
    replay_endpoint: Option<String>,
    tx: mpsc::Sender<Command>,
    /// Written to after each command, to wake the socket thread from its poll.
    wake: Arc<UnixStream>,
    stats: Arc<PublisherStats>,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("endpoint", &self.endpoint)
            .field("replay_endpoint", &self.replay_endpoint)
            .finish()
    }
}

impl Publisher {
    /// Bind the sockets and start the publishing thread; it ends when every handle is dropped.
    pub async fn start(cfg: PublisherConfig) -> std::io::Result<Self> {
        let (wake_rx, wake_tx) = UnixStream::pair()?;
        wake_rx.set_nonblocking(true)?;
        wake_tx.set_nonblocking(true)?;
        let (tx, rx) = mpsc::channel();
        let stats = Arc::new(PublisherStats::default());
        let (bound_tx, bound_rx) = tokio::sync::oneshot::channel();
        let thread_stats = stats.clone();
        std::thread::Builder::new()
            .name("sim-kv-publisher".into())
            .spawn(move || match Task::open(cfg, thread_stats, wake_rx) {
                Ok(task) => {
                    let bound = (task.endpoint.clone(), task.replay_endpoint.clone());
                    let _ = bound_tx.send(Ok(bound));
                    task.run(rx);
                }
                Err(e) => {
                    let _ = bound_tx.send(Err(e));
                }
            })?;
        let (endpoint, replay_endpoint) = bound_rx
            .await
            .map_err(|_| std::io::Error::other("publisher thread ended"))??;
        Ok(Self {
            endpoint,
            replay_endpoint,
            tx,
            wake: Arc::new(wake_tx),
            stats,
        })
    }

    /// The bound PUB endpoint, e.g. `tcp://127.0.0.1:40123`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The bound replay ROUTER endpoint.
    pub fn replay_endpoint(&self) -> Option<&str> {
        self.replay_endpoint.as_deref()
    }

    fn command(&self, cmd: Command) -> bool {
        if self.tx.send(cmd).is_err() {
            return false;
        }
        // A full pipe already holds a pending wake-up.
        let _ = (&*self.wake).write(&[1]);
        true
    }

    /// Queue one batch (no-op for an empty one: vLLM publishes only non-empty batches).
    pub fn publish(&self, events: Vec<CacheEvent>) {
        if !events.is_empty() {
            self.command(Command::Publish(events));
        }
    }

    /// Apply a fault, ordered with the batches queued before it.
    pub fn fault(&self, fault: KvFault) {
        self.command(Command::Fault(fault));
    }

    pub fn stats(&self) -> &PublisherStats {
        &self.stats
    }

    /// Close both sockets (unbinding their ports) and end the thread.
    pub async fn close(&self) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.command(Command::Close(tx)) {
            let _ = rx.await;
        }
    }
}

fn io_err(e: zmq::Error) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

/// Bind `sock` to `endpoint`, retrying while a closed predecessor still holds the port.
fn bind(sock: &zmq::Socket, endpoint: &str) -> std::io::Result<String> {
    let started = Instant::now();
    loop {
        match sock.bind(endpoint) {
            Ok(()) => break,
            Err(zmq::Error::EADDRINUSE) if started.elapsed() < REBIND_PATIENCE => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(io_err(e)),
        }
    }
    sock.get_last_endpoint()
        .map_err(io_err)?
        .map_err(|_| std::io::Error::other("bound endpoint is not UTF-8"))
}

struct Task {
    cfg: PublisherConfig,
    endpoint: String,
    replay_endpoint: Option<String>,
    pub_sock: zmq::Socket,
    monitor: zmq::Socket,
    replay: Option<zmq::Socket>,
    wake: UnixStream,
    stats: Arc<PublisherStats>,
    seq: u64,
    buffer: VecDeque<(u64, Bytes)>,
    held: VecDeque<(u64, Bytes, Vec<CacheEvent>)>,
    stalled: bool,
    drop_next: bool,
    corrupt_next: bool,
    dump: Option<dump::Dump>,
}

impl Drop for Task {
    /// Silence the PUB socket's monitor before it closes: libzmq stops a monitor only when
    /// the closed socket is destroyed, and teardown events sent in between (blocking, from
    /// the context's I/O thread) to a monitor nobody reads would stall every socket of the
    /// context. Re-monitoring with no events is the public API's way to silence it.
    fn drop(&mut self) {
        let endpoint = format!(
            "inproc://sim-kv-pub-monitor-off-{}",
            MONITOR_ID.fetch_add(1, Ordering::Relaxed)
        );
        let _ = self.pub_sock.monitor(&endpoint, 0);
    }
}

impl Task {
    fn open(
        cfg: PublisherConfig,
        stats: Arc<PublisherStats>,
        wake: UnixStream,
    ) -> std::io::Result<Task> {
        let pub_sock = CONTEXT.socket(zmq::XPUB).map_err(io_err)?;
        pub_sock.set_linger(0).map_err(io_err)?;
        pub_sock.set_sndhwm(VLLM_PUB_HWM).map_err(io_err)?;
        // Every subscription message reaches the thread, not only a topic's first.
        pub_sock.set_xpub_verbose(true).map_err(io_err)?;
        let monitor_ep = format!(
            "inproc://sim-kv-pub-monitor-{}",
            MONITOR_ID.fetch_add(1, Ordering::Relaxed)
        );
        let wanted = i32::from(zmq_sys_event::DISCONNECTED);
        pub_sock.monitor(&monitor_ep, wanted).map_err(io_err)?;
        let monitor = CONTEXT.socket(zmq::PAIR).map_err(io_err)?;
        monitor.set_linger(0).map_err(io_err)?;
        monitor.connect(&monitor_ep).map_err(io_err)?;
        let endpoint = bind(&pub_sock, &cfg.endpoint)?;
        let (replay, replay_endpoint) = match &cfg.replay_endpoint {
            Some(ep) => {
                let r = CONTEXT.socket(zmq::ROUTER).map_err(io_err)?;
                r.set_linger(0).map_err(io_err)?;
                // The whole ring fits in one reply stream (a ROUTER drops past its HWM).
                let hwm = i32::try_from(cfg.buffer_steps.saturating_add(16)).unwrap_or(i32::MAX);
                r.set_sndhwm(hwm).map_err(io_err)?;
                let bound = bind(&r, ep)?;
                (Some(r), Some(bound))
            }
            None => (None, None),
        };
        let dump = match &cfg.dump {
            Some(path) => Some(dump::Dump::create(path)?),
            None => None,
        };
        Ok(Task {
            cfg,
            endpoint,
            replay_endpoint,
            pub_sock,
            monitor,
            replay,
            wake,
            stats,
            seq: 0,
            buffer: VecDeque::new(),
            held: VecDeque::new(),
            stalled: false,
            drop_next: false,
            corrupt_next: false,
            dump,
        })
    }

    fn run(mut self, rx: mpsc::Receiver<Command>) {
        loop {
            let (replay_ready, monitor_ready, subscription) = {
                let mut items = vec![
                    zmq::PollItem::from_fd(self.wake.as_raw_fd(), zmq::POLLIN),
                    self.monitor.as_poll_item(zmq::POLLIN),
                    self.pub_sock.as_poll_item(zmq::POLLIN),
                ];
                if let Some(r) = &self.replay {
                    items.push(r.as_poll_item(zmq::POLLIN));
                }
                if zmq::poll(&mut items, POLL_MS).is_err() {
                    return;
                }
                (
                    items.get(3).is_some_and(|i| i.is_readable()),
                    items[1].is_readable(),
                    items[2].is_readable(),
                )
            };
            let mut sink = [0u8; 256];
            while matches!(self.wake.read(&mut sink), Ok(n) if n > 0) {}
            loop {
                match rx.try_recv() {
                    Ok(Command::Publish(events)) => self.publish(events),
                    Ok(Command::Fault(f)) => self.fault(f),
                    Ok(Command::Close(done)) => {
                        drop(self);
                        let _ = done.send(());
                        return;
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => return,
                }
            }
            if subscription {
                while let Ok(m) = self.pub_sock.recv_bytes(zmq::DONTWAIT) {
                    if m.first() == Some(&1) {
                        self.stats.subscribers.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            if monitor_ready {
                self.watch_subscribers();
            }
            if replay_ready {
                while let Ok(req) = self
                    .replay
                    .as_ref()
                    .map_or(Err(zmq::Error::EAGAIN), |r| r.recv_multipart(zmq::DONTWAIT))
                {
                    self.serve_replay(req);
                }
            }
        }
    }

    /// A dropped connection takes its subscriber away (from the PUB socket's monitor).
    fn watch_subscribers(&self) {
        while let Ok(frames) = self.monitor.recv_multipart(zmq::DONTWAIT) {
            let Some(head) = frames.first().filter(|h| h.len() >= 2) else {
                continue;
            };
            if u16::from_ne_bytes([head[0], head[1]]) == zmq_sys_event::DISCONNECTED {
                let _ = self.stats.subscribers.fetch_update(
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                    |n| n.checked_sub(1),
                );
            }
        }
    }

    fn publish(&mut self, events: Vec<CacheEvent>) {
        let seq = self.seq;
        self.seq += 1;
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
        let payload = Bytes::from(encode_batch(unix_ts(), &events, &self.cfg.wire));
        self.buffer.push_back((seq, payload.clone()));
        while self.buffer.len() > self.cfg.buffer_steps {
            self.buffer.pop_front();
        }
        if self.stalled {
            self.held.push_back((seq, payload, events));
        } else {
            self.send_live(seq, payload, &events);
        }
    }

    fn send_live(&mut self, seq: u64, payload: Bytes, events: &[CacheEvent]) {
        if std::mem::take(&mut self.drop_next) {
            return;
        }
        let payload = if std::mem::take(&mut self.corrupt_next) {
            Bytes::from(corrupt_payload(&payload))
        } else {
            payload
        };
        if let Some(d) = self.dump.as_mut() {
            d.write(self.cfg.topic.as_bytes(), seq, &payload, events);
        }
        let frames: [&[u8]; 3] = [self.cfg.topic.as_bytes(), &seq.to_be_bytes(), &payload];
        // A PUB socket never blocks: past its high-water mark it drops, as vLLM's does.
        if self.pub_sock.send_multipart(frames, zmq::DONTWAIT).is_ok() {
            self.stats.sent.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn fault(&mut self, f: KvFault) {
        match f {
            KvFault::DropNext => self.drop_next = true,
            KvFault::CorruptNext => self.corrupt_next = true,
            KvFault::Stall => self.stalled = true,
            KvFault::Resume => {
                self.stalled = false;
                while let Some((seq, payload, events)) = self.held.pop_front() {
                    self.send_live(seq, payload, &events);
                }
            }
            KvFault::Restart => {
                self.seq = 0;
                self.buffer.clear();
                self.held.clear();
            }
        }
    }

    /// Answer one replay request: `(identity, b"", start_seq)`.
    fn serve_replay(&mut self, frames: Vec<Vec<u8>>) {
        if frames.len() != 3 || frames[2].len() != 8 {
            return; // vLLM logs "Invalid replay request" and ignores it
        }
        let id = &frames[0];
        let start = u64::from_be_bytes(frames[2][..].try_into().expect("8 bytes"));
        self.stats.replays.fetch_add(1, Ordering::Relaxed);
        let topic = self.cfg.topic.as_bytes();
        let with_topic = self.cfg.replay_topic_frame;
        let Some(replay) = self.replay.as_ref() else {
            return;
        };
        let reply = |seq: &[u8], payload: &[u8]| {
            let mut m: Vec<&[u8]> = vec![id, b""];
            if with_topic {
                m.push(topic);
            }
            m.push(seq);
            m.push(payload);
            // A peer that went away is dropped silently by the ROUTER.
            replay.send_multipart(m, zmq::DONTWAIT).is_ok()
        };
        for (seq, payload) in self.buffer.iter().filter(|(s, _)| *s >= start) {
            if !reply(&seq.to_be_bytes(), payload) {
                return;
            }
        }
        reply(&END_SEQ, b"");
    }
}

/// Monitor event numbers (`zmq.h`); the `zmq` crate's `SocketEvent::from_raw` panics on
/// numbers it does not know, so the raw frame is read.
mod zmq_sys_event {
    pub const DISCONNECTED: u16 = 0x0200;
}

fn unix_ts() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// The `--events-dump` format, for decoders that cannot open a ZMQ socket.
///
/// `PATH` gets, per live message, `u32 BE frame count` then per frame `u32 BE length` + bytes
/// (frames exactly as sent). `PATH.jsonl` gets one JSON line per message with `seq` and the
/// logical `events` (`{"type": "BlockStored", "block_hashes": [u64...], "parent_block_hash",
/// "token_ids", "block_size"}`, `{"type": "BlockRemoved", "block_hashes"}`,
/// `{"type": "AllBlocksCleared"}`), so an independent decoder can compare field by field.
pub mod dump {
    use super::*;

    pub(super) struct Dump {
        frames: std::fs::File,
        json: std::fs::File,
    }

    impl Dump {
        pub(super) fn create(path: &std::path::Path) -> std::io::Result<Self> {
            let mut json_path = path.as_os_str().to_owned();
            json_path.push(".jsonl");
            Ok(Self {
                frames: std::fs::File::create(path)?,
                json: std::fs::File::create(json_path)?,
            })
        }

        pub(super) fn write(
            &mut self,
            topic: &[u8],
            seq: u64,
            payload: &[u8],
            events: &[CacheEvent],
        ) {
            let seq_bytes = seq.to_be_bytes();
            let frames: [&[u8]; 3] = [topic, &seq_bytes, payload];
            let mut buf = Vec::with_capacity(payload.len() + 32);
            buf.extend_from_slice(&(frames.len() as u32).to_be_bytes());
            for f in frames {
                buf.extend_from_slice(&(f.len() as u32).to_be_bytes());
                buf.extend_from_slice(f);
            }
            let _ = self.frames.write_all(&buf);
            let line = serde_json::json!({
                "seq": seq,
                "events": events.iter().map(event_json).collect::<Vec<_>>(),
            });
            let _ = writeln!(self.json, "{line}");
        }
    }

    /// The logical content of an event as JSON.
    pub fn event_json(ev: &CacheEvent) -> serde_json::Value {
        use serde_json::json;
        match ev {
            CacheEvent::Stored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
            } => json!({
                "type": "BlockStored",
                "block_hashes": block_hashes,
                "parent_block_hash": parent_block_hash,
                "token_ids": token_ids,
                "block_size": block_size,
            }),
            CacheEvent::Removed { block_hashes } => {
                json!({"type": "BlockRemoved", "block_hashes": block_hashes})
            }
            CacheEvent::AllCleared => json!({"type": "AllBlocksCleared"}),
        }
    }
}
