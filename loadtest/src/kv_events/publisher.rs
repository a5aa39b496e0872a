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
//! It must not block the request path: [`Publisher::publish`] only queues.

use std::collections::VecDeque;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::mpsc;
use zeromq::{Socket, SocketEvent, SocketRecv, SocketSend, ZmqMessage};

use super::encode::{corrupt_payload, encode_batch, WireFormat};
use crate::cache::CacheEvent;

/// vLLM's default replay buffer length (`buffer_steps`).
pub const VLLM_DEFAULT_BUFFER_STEPS: usize = 10_000;
/// The replay end marker: sequence −1 as 8 big-endian bytes.
pub const END_SEQ: [u8; 8] = [0xff; 8];

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
    /// Connected subscribers (from the PUB socket's monitor).
    pub subscribers: AtomicUsize,
}

/// Handle to a running publisher task.
#[derive(Clone)]
pub struct Publisher {
    endpoint: String,
    replay_endpoint: Option<String>,
    tx: mpsc::UnboundedSender<Command>,
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
    /// Bind the sockets and start the publishing task; it ends when every handle is dropped.
    pub async fn start(cfg: PublisherConfig) -> std::io::Result<Self> {
        let mut pub_sock = zeromq::PubSocket::new();
        let monitor = pub_sock.monitor();
        let endpoint = pub_sock
            .bind(&cfg.endpoint)
            .await
            .map_err(io_err)?
            .to_string();
        let (replay, replay_endpoint) = match &cfg.replay_endpoint {
            Some(ep) => {
                let mut r = zeromq::RouterSocket::new();
                let bound = r.bind(ep).await.map_err(io_err)?.to_string();
                (Some(r), Some(bound))
            }
            None => (None, None),
        };
        let stats = Arc::new(PublisherStats::default());
        tokio::spawn(watch_subscribers(monitor, stats.clone()));
        let (tx, rx) = mpsc::unbounded_channel();
        let dump = match &cfg.dump {
            Some(path) => Some(dump::Dump::create(path)?),
            None => None,
        };
        let task = Task {
            cfg,
            pub_sock,
            replay,
            stats: stats.clone(),
            seq: 0,
            buffer: VecDeque::new(),
            held: VecDeque::new(),
            stalled: false,
            drop_next: false,
            corrupt_next: false,
            dump,
        };
        tokio::spawn(task.run(rx));
        Ok(Self {
            endpoint,
            replay_endpoint,
            tx,
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

    /// Queue one batch (no-op for an empty one: vLLM publishes only non-empty batches).
    pub fn publish(&self, events: Vec<CacheEvent>) {
        if !events.is_empty() {
            let _ = self.tx.send(Command::Publish(events));
        }
    }

    /// Apply a fault, ordered with the batches queued before it.
    pub fn fault(&self, fault: KvFault) {
        let _ = self.tx.send(Command::Fault(fault));
    }

    pub fn stats(&self) -> &PublisherStats {
        &self.stats
    }

    /// Close both sockets (unbinding their ports) and end the task.
    pub async fn close(&self) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.tx.send(Command::Close(tx)).is_ok() {
            let _ = rx.await;
        }
    }
}

fn io_err(e: zeromq::ZmqError) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

async fn watch_subscribers(
    mut monitor: impl futures_util::Stream<Item = SocketEvent> + Unpin,
    stats: Arc<PublisherStats>,
) {
    use futures_util::StreamExt;
    while let Some(ev) = monitor.next().await {
        match ev {
            SocketEvent::Accepted(..) => {
                stats.subscribers.fetch_add(1, Ordering::Relaxed);
            }
            SocketEvent::Disconnected(..) => {
                let _ = stats
                    .subscribers
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
            }
            _ => {}
        }
    }
}

struct Task {
    cfg: PublisherConfig,
    pub_sock: zeromq::PubSocket,
    replay: Option<zeromq::RouterSocket>,
    stats: Arc<PublisherStats>,
    seq: u64,
    buffer: VecDeque<(u64, Bytes)>,
    held: VecDeque<(u64, Bytes, Vec<CacheEvent>)>,
    stalled: bool,
    drop_next: bool,
    corrupt_next: bool,
    dump: Option<dump::Dump>,
}

impl Task {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Command>) {
        loop {
            let cmd = match self.replay.as_mut() {
                Some(replay) => tokio::select! {
                    cmd = rx.recv() => cmd,
                    req = replay.recv() => {
                        if let Ok(req) = req {
                            self.serve_replay(req).await;
                        }
                        continue;
                    }
                },
                None => rx.recv().await,
            };
            match cmd {
                Some(Command::Publish(events)) => self.publish(events).await,
                Some(Command::Fault(f)) => self.fault(f).await,
                Some(Command::Close(done)) => {
                    self.close().await;
                    let _ = done.send(());
                    return;
                }
                None => break,
            }
        }
        self.close().await;
    }

    async fn close(self) {
        let _ = self.pub_sock.close().await;
        if let Some(r) = self.replay {
            let _ = r.close().await;
        }
    }

    async fn publish(&mut self, events: Vec<CacheEvent>) {
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
            self.send_live(seq, payload, &events).await;
        }
    }

    async fn send_live(&mut self, seq: u64, payload: Bytes, events: &[CacheEvent]) {
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
        let mut msg = ZmqMessage::from(Bytes::from(self.cfg.topic.clone().into_bytes()));
        msg.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
        msg.push_back(payload);
        if self.pub_sock.send(msg).await.is_ok() {
            self.stats.sent.fetch_add(1, Ordering::Relaxed);
        }
    }

    async fn fault(&mut self, f: KvFault) {
        match f {
            KvFault::DropNext => self.drop_next = true,
            KvFault::CorruptNext => self.corrupt_next = true,
            KvFault::Stall => self.stalled = true,
            KvFault::Resume => {
                self.stalled = false;
                while let Some((seq, payload, events)) = self.held.pop_front() {
                    self.send_live(seq, payload, &events).await;
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
    async fn serve_replay(&mut self, req: ZmqMessage) {
        let frames = req.into_vec();
        if frames.len() != 3 || frames[2].len() != 8 {
            return; // vLLM logs "Invalid replay request" and ignores it
        }
        let (id, start) = (frames[0].clone(), &frames[2]);
        let start = u64::from_be_bytes(start[..].try_into().expect("8 bytes"));
        self.stats.replays.fetch_add(1, Ordering::Relaxed);
        let topic = Bytes::from(self.cfg.topic.clone().into_bytes());
        let with_topic = self.cfg.replay_topic_frame;
        let Some(replay) = self.replay.as_mut() else {
            return;
        };
        let reply = |seq: Bytes, payload: Bytes| {
            let mut m = ZmqMessage::from(id.clone());
            m.push_back(Bytes::new());
            if with_topic {
                m.push_back(topic.clone());
            }
            m.push_back(seq);
            m.push_back(payload);
            m
        };
        for (seq, payload) in self.buffer.iter().filter(|(s, _)| *s >= start) {
            let m = reply(Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone());
            if replay.send(m).await.is_err() {
                return;
            }
        }
        let _ = replay
            .send(reply(Bytes::from_static(&END_SEQ), Bytes::new()))
            .await;
    }
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
