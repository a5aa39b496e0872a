//! The async side of one provider's KV-event stream: ZMQ SUB client, replay DEALER
//! client, reconnect with back-off, staleness, and feeding the target's index.
//!
//! Owns the sockets of one stream and the decisions of [`super::sequence`]'s rules
//! (gap → replay or rebuild, restart → clear, stale → untrusted + reconnect). It does
//! not choose targets, register metrics or read config files: the caller builds a
//! [`SubscriberConfig`], shares an `Arc<ResidencyIndex>` and an `Arc<StreamState>`
//! with the router, and drives [`KvEventSubscriber::run`] (e.g. from a pingora
//! `BackgroundService`, passing its shutdown watch as the `shutdown` future).
//!
//! Notes on the `zeromq` crate (0.7, pure Rust; the same version the simulator's
//! publisher uses), which shape this module:
//! - A SUB socket re-dials a peer that went away (0.4 did not), but reports nothing
//!   while it is gone: `recv` just pends, and batches published before the re-dial
//!   completes are lost (seen as a gap or a restart). A dead or wedged connection is
//!   still found by the staleness rule (requests routed, no batch followed) or, with a
//!   replay endpoint, by a periodic probe (a replay from the last applied batch, which
//!   also repairs missed batches and detects a restarted publisher); either way the
//!   socket is recreated.
//! - `connect` retries refused connections forever: it is bounded by a timeout.
//! - Some unexpected conditions hit `todo!()` inside the crate (a DEALER whose peer
//!   disconnects mid-reply, an unknown ZMTP command). Socket reads therefore run in
//!   their own tokio tasks; a panic there ends that task only and is handled as
//!   "socket down".
//! - Endpoints: `tcp://host:port` connects (vLLM binds `tcp://*:port`); with
//!   [`SubscriberConfig::bind`] (the caller decides it from the configured text: a
//!   wildcard host `*`, `0.0.0.0` or `[::]`) the SUB binds instead, for vLLM publishers
//!   that connect. It is never re-derived from the endpoint string here: a host name
//!   the caller resolved to `0.0.0.0` is still a destination.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use super::decode::{decode_message, decode_replay, DecodeError, KvEvent, KvMessage, ReplayReply};
use super::sequence::{payload_digest, Applied, SeqClass, SeqTracker, StreamState};
use crate::prefix::residency::ResidencyIndex;

/// Live messages buffered between the socket task and the apply loop. The
/// publisher's own queue is far larger (vLLM's `hwm` default 100,000); when this
/// fills, the socket task waits and ZMQ drops at its high-water mark, which
/// surfaces as a sequence gap.
const LIVE_CHANNEL_DEPTH: usize = 4096;
/// Most batches accepted from one replay: twice vLLM's default `buffer_steps` (10,000).
const MAX_REPLAY_BATCHES: usize = 20_000;
/// Longest interval between staleness / probe checks.
const MAX_TICK: Duration = Duration::from_millis(500);

/// Errors of one connection or replay attempt (logged and counted, never fatal).
#[derive(Debug, thiserror::Error)]
pub enum SubscribeError {
    /// The socket layer failed.
    #[error("zmq: {0}")]
    Zmq(#[from] zeromq::ZmqError),
    /// A connect, send or receive took longer than its limit.
    #[error("timed out: {0}")]
    Timeout(&'static str),
    /// A reply could not be decoded.
    #[error("decode: {0}")]
    Decode(#[from] DecodeError),
    /// The replay went past [`MAX_REPLAY_BATCHES`].
    #[error("replay sent more than {MAX_REPLAY_BATCHES} batches")]
    ReplayTooLong,
    /// A socket task ended abnormally (a panic inside the zeromq crate).
    #[error("socket task failed: {0}")]
    Task(String),
}

/// Where and how to subscribe (built by the caller from `[providers.kv_events]`).
#[derive(Debug, Clone)]
pub struct SubscriberConfig {
    /// PUB endpoint, e.g. `tcp://vllm-1:5557` (connect) or `tcp://*:5557` (bind).
    pub endpoint: String,
    /// Bind `endpoint` (a local wildcard address) instead of connecting to it.
    pub bind: bool,
    /// Topic prefix to subscribe to ("" = everything, vLLM's default topic).
    pub topic: String,
    /// Replay ROUTER endpoint, e.g. `tcp://vllm-1:5558`.
    pub replay_endpoint: Option<String>,
    /// Limit for establishing a connection.
    pub connect_timeout: Duration,
    /// First delay after a failed connection; doubles up to `backoff_max`.
    pub backoff_initial: Duration,
    /// Longest delay between connection attempts.
    pub backoff_max: Duration,
    /// How long after a request was routed a batch must follow (see `StreamState::note_routed`).
    pub staleness_limit: Duration,
    /// Limit for each replay reply to arrive.
    pub replay_timeout: Duration,
    /// With a replay endpoint: after this much silence, probe the stream with a
    /// replay from the last applied batch (`None` disables probing).
    pub probe_interval: Option<Duration>,
}

impl SubscriberConfig {
    /// A config that connects to `endpoint`, with the defaults below for everything
    /// but endpoint and topic.
    pub fn new(endpoint: impl Into<String>, topic: impl Into<String>) -> Self {
        SubscriberConfig {
            endpoint: endpoint.into(),
            bind: false,
            topic: topic.into(),
            replay_endpoint: None,
            connect_timeout: Duration::from_secs(5),
            backoff_initial: Duration::from_millis(200),
            backoff_max: Duration::from_secs(10),
            staleness_limit: Duration::from_secs(10),
            replay_timeout: Duration::from_secs(5),
            probe_interval: Some(Duration::from_secs(30)),
        }
    }
}

/// The address to bind for a wildcard endpoint (the socket layer spells `*` as `0.0.0.0`).
fn bind_address(endpoint: &str) -> String {
    endpoint.replacen("://*:", "://0.0.0.0:", 1)
}

/// A live connection: the socket task and its channel.
struct Live {
    rx: mpsc::Receiver<Vec<Bytes>>,
    task: JoinHandle<()>,
}

impl Drop for Live {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One provider's KV-event subscriber (see the module header).
pub struct KvEventSubscriber {
    cfg: SubscriberConfig,
    index: Arc<ResidencyIndex>,
    state: Arc<StreamState>,
    tracker: SeqTracker,
    last_probe_ms: u64,
}

impl KvEventSubscriber {
    /// A subscriber feeding `index` and publishing its state in `state`.
    pub fn new(cfg: SubscriberConfig, index: Arc<ResidencyIndex>, state: Arc<StreamState>) -> Self {
        KvEventSubscriber {
            cfg,
            index,
            state,
            tracker: SeqTracker::new(),
            last_probe_ms: 0,
        }
    }

    /// Run until `shutdown` completes: connect, apply batches, repair, reconnect.
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        let mut backoff = self.cfg.backoff_initial;
        let tick = (self.cfg.staleness_limit / 4).clamp(Duration::from_millis(10), MAX_TICK);
        loop {
            let connected = tokio::select! {
                _ = &mut shutdown => return,
                r = self.connect() => r,
            };
            let mut live = match connected {
                Ok(live) => live,
                Err(e) => {
                    log::warn!("kv_events {}: connect failed: {e}", self.cfg.endpoint);
                    self.socket_down();
                    tokio::select! {
                        _ = &mut shutdown => return,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(self.cfg.backoff_max);
                    continue;
                }
            };
            backoff = self.cfg.backoff_initial;
            self.state.set_connected(true);
            StreamState::bump(&self.state.connects, 1);
            self.state.reset_staleness();
            self.last_probe_ms = self.state.now_ms();
            if self.tracker.last().is_some() {
                // Batches may have been missed while disconnected, or the publisher
                // restarted: prove continuity through the replay endpoint, or wait
                // for the first batch to tell.
                self.state.set_trusted(false);
                if self.cfg.replay_endpoint.is_some() {
                    self.probe().await;
                }
            }
            let mut ticker = tokio::time::interval(tick);
            loop {
                tokio::select! {
                    _ = &mut shutdown => return,
                    frames = live.rx.recv() => match frames {
                        Some(frames) => self.on_live(&frames).await,
                        None => {
                            log::warn!("kv_events {}: socket closed", self.cfg.endpoint);
                            break;
                        }
                    },
                    _ = ticker.tick() => {
                        if !self.on_tick().await {
                            break;
                        }
                    }
                }
            }
            drop(live);
            self.socket_down();
        }
    }

    fn socket_down(&self) {
        self.state.set_connected(false);
        if self.tracker.last().is_some() {
            self.state.set_trusted(false);
        }
    }

    /// Periodic checks; false when the connection should be recreated.
    async fn on_tick(&mut self) -> bool {
        let now = self.state.now_ms();
        if self
            .state
            .is_stale_at(now, self.cfg.staleness_limit.as_millis() as u64)
        {
            log::warn!(
                "kv_events {}: no batch within {:?} of routed requests: stale, reconnecting",
                self.cfg.endpoint,
                self.cfg.staleness_limit
            );
            StreamState::bump(&self.state.stale, 1);
            self.state.set_trusted(false);
            self.state.reset_staleness();
            return false;
        }
        if let (Some(_), Some(interval), Some(_)) = (
            &self.cfg.replay_endpoint,
            self.cfg.probe_interval,
            self.tracker.last(),
        ) {
            let quiet = self
                .state
                .ms_since_last_batch(now)
                .is_none_or(|ms| ms >= interval.as_millis() as u64);
            if quiet && now.saturating_sub(self.last_probe_ms) >= interval.as_millis() as u64 {
                return self.probe().await;
            }
        }
        true
    }

    /// Replay from the last applied batch: proves continuity (or repairs missed
    /// batches, or detects a restart). False when the replay endpoint is unreachable.
    async fn probe(&mut self) -> bool {
        self.last_probe_ms = self.state.now_ms();
        let Some(last) = self.tracker.last() else {
            return true;
        };
        match self.replay(last.seq).await {
            Ok(replies) => {
                let extra = replies.iter().filter(|(m, _)| m.seq > last.seq).count();
                if extra > 0 {
                    StreamState::bump(&self.state.gaps, 1);
                }
                self.apply_replay(replies, Some(last));
                self.state.set_trusted(true);
                true
            }
            Err(e) => {
                log::warn!("kv_events {}: replay probe failed: {e}", self.cfg.endpoint);
                StreamState::bump(&self.state.replays_failed, 1);
                self.state.set_trusted(false);
                false
            }
        }
    }

    async fn connect(&self) -> Result<Live, SubscribeError> {
        let mut sub = SubSocket::new();
        sub.subscribe(&self.cfg.topic).await?;
        let attempt = async {
            if self.cfg.bind {
                sub.bind(&bind_address(&self.cfg.endpoint))
                    .await
                    .map(|_| ())
            } else {
                sub.connect(&self.cfg.endpoint).await
            }
        };
        tokio::time::timeout(self.cfg.connect_timeout, attempt)
            .await
            .map_err(|_| SubscribeError::Timeout("connect"))??;
        let (tx, rx) = mpsc::channel(LIVE_CHANNEL_DEPTH);
        let endpoint = self.cfg.endpoint.clone();
        let task = tokio::spawn(async move {
            loop {
                match sub.recv().await {
                    Ok(msg) => {
                        if tx.send(msg.into_vec()).await.is_err() {
                            return;
                        }
                    }
                    Err(e) => {
                        log::warn!("kv_events {endpoint}: recv failed: {e}");
                        return;
                    }
                }
            }
        });
        Ok(Live { rx, task })
    }

    /// Handle one live message.
    async fn on_live(&mut self, frames: &[Bytes]) {
        let refs: Vec<&[u8]> = frames.iter().map(|f| f.as_ref()).collect();
        let msg = match decode_message(&refs) {
            Ok(m) => m,
            Err(e) => {
                log::debug!("kv_events {}: undecodable message: {e}", self.cfg.endpoint);
                StreamState::bump(&self.state.decode_errors, 1);
                // A batch we cannot apply is a batch missed: the next one will show
                // the gap and repair it; until then the index may be wrong.
                self.state.set_trusted(false);
                return;
            }
        };
        let digest = payload_digest(&frames[2]);
        self.state.batch_arrived(msg.seq);
        match self.tracker.classify(msg.seq, msg.stream_id) {
            SeqClass::Duplicate => {}
            SeqClass::InOrder => {
                self.apply(&msg, digest);
                self.state.set_trusted(true);
            }
            SeqClass::First => {
                if msg.seq > 0 && self.cfg.replay_endpoint.is_some() {
                    // Learn what the publisher's buffer still holds from before we joined.
                    if let Ok(replies) = self.replay(0).await {
                        self.apply_replay(replies, None);
                    }
                }
                self.apply_unless_covered(&msg, digest);
                self.state.set_trusted(true);
            }
            SeqClass::Gap { expected } => {
                log::info!(
                    "kv_events {}: sequence gap, expected {expected}, got {}",
                    self.cfg.endpoint,
                    msg.seq
                );
                StreamState::bump(&self.state.gaps, 1);
                self.state.set_trusted(false);
                self.repair_gap().await;
                self.apply_unless_covered(&msg, digest);
                self.state.set_trusted(true);
            }
            SeqClass::Restart => {
                log::info!(
                    "kv_events {}: publisher restarted (seq {} after {:?}): clearing index",
                    self.cfg.endpoint,
                    msg.seq,
                    self.tracker.last().map(|a| a.seq)
                );
                StreamState::bump(&self.state.restarts, 1);
                self.rebuild();
                if msg.seq > 0 && self.cfg.replay_endpoint.is_some() {
                    if let Ok(replies) = self.replay(0).await {
                        self.apply_replay(replies, None);
                    }
                }
                self.apply_unless_covered(&msg, digest);
                self.state.set_trusted(true);
            }
        }
    }

    /// Repair a gap by replay from the last applied batch, else drop the index.
    async fn repair_gap(&mut self) {
        let Some(last) = self.tracker.last() else {
            return;
        };
        if self.cfg.replay_endpoint.is_none() {
            self.rebuild();
            return;
        }
        match self.replay(last.seq).await {
            Ok(replies) => {
                if !self.apply_replay(replies, Some(last)) {
                    log::info!(
                        "kv_events {}: replay could not prove continuity: index rebuilt",
                        self.cfg.endpoint
                    );
                }
            }
            Err(e) => {
                log::warn!(
                    "kv_events {}: replay failed: {e}: index rebuilt",
                    self.cfg.endpoint
                );
                StreamState::bump(&self.state.replays_failed, 1);
                self.rebuild();
            }
        }
    }

    /// Apply replayed batches. With `verify`, the first must be the last applied
    /// batch (same sequence and digest) or the index is rebuilt first. Returns
    /// whether continuity held.
    fn apply_replay(&mut self, replies: Vec<(KvMessage, u64)>, verify: Option<Applied>) -> bool {
        let before = self.tracker.last().map(|a| a.seq);
        let continuous = match verify {
            Some(v) => replies
                .first()
                .is_some_and(|(m, d)| m.seq == v.seq && *d == v.digest),
            None => true,
        };
        if continuous {
            StreamState::bump(&self.state.replays_ok, 1);
        } else {
            StreamState::bump(&self.state.replays_failed, 1);
            self.rebuild();
        }
        for (m, digest) in &replies {
            match self.tracker.last() {
                Some(a) if m.seq <= a.seq => continue,
                Some(a) if m.seq != a.seq + 1 => {
                    // A hole inside the replay: what follows cannot be trusted to
                    // extend what we hold.
                    StreamState::bump(&self.state.gaps, 1);
                    self.rebuild();
                }
                _ => {}
            }
            self.apply(m, *digest);
        }
        if let Some(a) = self.tracker.last() {
            self.tracker
                .replayed(if continuous { before } else { None }, a.seq);
        }
        continuous
    }

    /// Apply a live batch after a repair, unless the repair already covered it. If
    /// the repair stopped short of it (a hole remains), the index is rebuilt first.
    fn apply_unless_covered(&mut self, msg: &KvMessage, digest: u64) {
        match self.tracker.classify(msg.seq, msg.stream_id) {
            SeqClass::Duplicate => return,
            SeqClass::Gap { .. } | SeqClass::Restart => {
                if self.tracker.last().is_some_and(|a| msg.seq <= a.seq) {
                    return; // covered by the replay, outside its skip window
                }
                StreamState::bump(&self.state.gaps, 1);
                self.rebuild();
            }
            SeqClass::First | SeqClass::InOrder => {}
        }
        self.apply(msg, digest);
    }

    /// Drop the index and start over from the next batch.
    fn rebuild(&mut self) {
        StreamState::bump(&self.state.rebuilds, 1);
        self.index.clear();
        self.tracker.reset();
    }

    fn apply(&mut self, msg: &KvMessage, digest: u64) {
        let (mut stored, mut removed, mut cleared) = (0, 0, 0);
        for ev in &msg.batch.events {
            match ev {
                KvEvent::BlockStored(_) => stored += 1,
                KvEvent::BlockRemoved(_) => removed += 1,
                KvEvent::AllBlocksCleared => cleared += 1,
            }
        }
        let stats = self.index.apply(&msg.batch.events);
        let s = &self.state;
        StreamState::bump(&s.events_stored, stored);
        StreamState::bump(&s.events_removed, removed);
        StreamState::bump(&s.events_cleared, cleared);
        StreamState::bump(&s.orphan_stores, stats.orphan_stores);
        StreamState::bump(
            &s.skipped_stores,
            stats.misaligned_stores + stats.foreign_block_size_stores,
        );
        StreamState::bump(&s.evictions, stats.evictions);
        self.tracker.accept(msg.seq, msg.stream_id, digest);
    }

    /// Ask the replay endpoint for every buffered batch from `start` on.
    async fn replay(&self, start: u64) -> Result<Vec<(KvMessage, u64)>, SubscribeError> {
        let Some(endpoint) = self.cfg.replay_endpoint.clone() else {
            return Ok(Vec::new());
        };
        let connect_timeout = self.cfg.connect_timeout;
        let reply_timeout = self.cfg.replay_timeout;
        // The zeromq DEALER can panic on a peer that goes away mid-reply: contain it.
        let task = tokio::spawn(async move {
            let mut dealer = DealerSocket::new();
            tokio::time::timeout(connect_timeout, dealer.connect(&endpoint))
                .await
                .map_err(|_| SubscribeError::Timeout("replay connect"))??;
            // vLLM's ROUTER expects [identity, b"", start]: the DEALER sends the
            // empty delimiter and the 8-byte big-endian start sequence.
            let mut request = ZmqMessage::from(Bytes::new());
            request.push_back(Bytes::copy_from_slice(&start.to_be_bytes()));
            tokio::time::timeout(reply_timeout, dealer.send(request))
                .await
                .map_err(|_| SubscribeError::Timeout("replay request"))??;
            let mut replies = Vec::new();
            loop {
                let msg = tokio::time::timeout(reply_timeout, dealer.recv())
                    .await
                    .map_err(|_| SubscribeError::Timeout("replay reply"))??;
                let frames = msg.into_vec();
                let refs: Vec<&[u8]> = frames.iter().map(|f| f.as_ref()).collect();
                match decode_replay(&refs)? {
                    ReplayReply::End => return Ok(replies),
                    ReplayReply::Batch(m) => {
                        let digest = payload_digest(refs.last().copied().unwrap_or_default());
                        replies.push((m, digest));
                        if replies.len() > MAX_REPLAY_BATCHES {
                            return Err(SubscribeError::ReplayTooLong);
                        }
                    }
                }
            }
        });
        let replies = task
            .await
            .map_err(|e| SubscribeError::Task(e.to_string()))??;
        if let Some((m, _)) = replies.last() {
            self.state.batches_replayed(replies.len() as u64, m.seq);
        }
        Ok(replies)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use parking_lot::Mutex;
    use rmpv::Value;
    use tokio::sync::{oneshot, Notify};
    use zeromq::{PubSocket, RouterSocket};

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

    /// An in-test vLLM publisher: PUB + replay ROUTER with a buffer, on loopback.
    struct Publisher {
        pub_sock: PubSocket,
        pub_endpoint: String,
        replay_endpoint: String,
        buffer: ReplayBuffer,
        /// Notified when a replay request arrives.
        requested: Arc<Notify>,
        /// When set, the ROUTER waits for this before answering.
        gate: Arc<Mutex<Option<oneshot::Receiver<()>>>>,
    }

    impl Publisher {
        async fn start() -> Publisher {
            let mut pub_sock = PubSocket::new();
            let pub_endpoint = pub_sock
                .bind("tcp://127.0.0.1:0")
                .await
                .unwrap()
                .to_string();
            let mut router = RouterSocket::new();
            let replay_endpoint = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
            let buffer: ReplayBuffer = Arc::default();
            let requested = Arc::new(Notify::new());
            let gate: Arc<Mutex<Option<oneshot::Receiver<()>>>> = Arc::default();
            let (buf, req, g) = (buffer.clone(), requested.clone(), gate.clone());
            tokio::spawn(async move {
                while let Ok(msg) = router.recv().await {
                    let frames = msg.into_vec();
                    let id = frames[0].clone();
                    let start = u64::from_be_bytes(frames[2].as_ref().try_into().unwrap());
                    req.notify_one();
                    let gate = g.lock().take();
                    if let Some(gate) = gate {
                        let _ = gate.await;
                    }
                    let batches: Vec<_> = buf
                        .lock()
                        .iter()
                        .filter(|(s, _)| *s >= start)
                        .cloned()
                        .collect();
                    for (seq, p) in batches {
                        let reply = vec![
                            id.clone(),
                            Bytes::new(),
                            Bytes::from_static(TOPIC.as_bytes()),
                            Bytes::copy_from_slice(&seq.to_be_bytes()),
                            Bytes::from(p),
                        ];
                        router
                            .send(ZmqMessage::try_from(reply).unwrap())
                            .await
                            .unwrap();
                    }
                    let end = vec![
                        id,
                        Bytes::new(),
                        Bytes::new(),
                        Bytes::from_static(&[0xFF; 8]),
                        Bytes::new(),
                    ];
                    router
                        .send(ZmqMessage::try_from(end).unwrap())
                        .await
                        .unwrap();
                }
            });
            Publisher {
                pub_sock,
                pub_endpoint,
                replay_endpoint,
                buffer,
                requested,
                gate,
            }
        }

        /// Record a batch in the replay buffer and, unless `drop`, publish it.
        async fn publish(&mut self, seq: u64, events: Vec<Value>, drop: bool) {
            let p = payload(events);
            self.buffer.lock().push((seq, p.clone()));
            if !drop {
                let frames = vec![
                    Bytes::from_static(TOPIC.as_bytes()),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    Bytes::from(p),
                ];
                self.pub_sock
                    .send(ZmqMessage::try_from(frames).unwrap())
                    .await
                    .unwrap();
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
            let (go, gate) = oneshot::channel();
            *p.gate.lock() = Some(gate);
            p.publish(1, vec![stored(&[3], Some(2), &tokens(2))], true)
                .await;
            p.publish(2, vec![stored(&[4], Some(3), &tokens(3))], false)
                .await;
            tokio::time::timeout(WAIT, p.requested.notified())
                .await
                .expect("replay requested");
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
                .send(
                    ZmqMessage::try_from(vec![
                        Bytes::from_static(TOPIC.as_bytes()),
                        Bytes::from_static(b"x"),
                    ])
                    .unwrap(),
                )
                .await
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

    #[test]
    fn wildcard_bind_address() {
        assert_eq!(bind_address("tcp://*:5557"), "tcp://0.0.0.0:5557");
        assert_eq!(bind_address("tcp://[::]:5557"), "tcp://[::]:5557");
        assert!(!SubscriberConfig::new("tcp://0.0.0.0:5557", "").bind);
    }
}
