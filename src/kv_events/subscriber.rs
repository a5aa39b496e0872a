//! The async side of one provider's KV-event stream: live messages and connection
//! reports from the SUB socket, replay requests, reconnects, staleness, and feeding the
//! target's index.
//!
//! Owns the decisions of [`super::sequence`]'s rules (gap → replay or rebuild, restart
//! → clear, stale → untrusted + reconnect). The sockets themselves are
//! [`super::socket`]'s (libzmq, blocking, each on a thread of its own). It does not
//! choose targets, register metrics or read config files: the caller builds a
//! [`SubscriberConfig`], shares an `Arc<ResidencyIndex>` and an `Arc<StreamState>` with
//! the router, and drives [`KvEventSubscriber::run`] (e.g. from a pingora
//! `BackgroundService`, passing its shutdown watch as the `shutdown` future).
//!
//! Connections:
//! - A connecting SUB is re-dialled by libzmq after a lost connection (back-off from
//!   `backoff_initial` to `backoff_max`); every completed handshake is a (re)connect.
//!   Batches published while it was down are lost (a gap or a restart): on each
//!   reconnect, with a replay endpoint, the stream replays from its last applied batch
//!   to prove continuity, repair what was missed, or find that the publisher restarted.
//! - On a stream's first connect (nothing applied yet), with a replay endpoint, it
//!   replays from sequence 0 at once: vLLM keeps its last 10,000 batches, so a freshly
//!   started gateway learns what each replica already holds without waiting for new
//!   batches.
//! - A peer that breaks the protocol (a frame over `max_message_bytes`, a malformed
//!   handshake) is disconnected by libzmq and counted (`protocol_errors`); a connecting
//!   socket that libzmq gave up on is replaced after `backoff_initial`.
//! - A dead or wedged connection is found by ZMTP heartbeats, by the staleness rule
//!   (requests routed, no batch followed) or, with a replay endpoint, by a periodic
//!   probe (a replay from the last applied batch); a stale stream or a failed probe
//!   replaces the socket.
//! - A restart is recognised wherever it shows: a live sequence that goes back, a
//!   changed stream id, or a replay from the last applied batch that comes back empty
//!   (the new publisher has not reached that sequence) or with other content at it. A
//!   restart slower than the probe interval is therefore still counted (and logged)
//!   when the publisher comes back.
//! - Endpoints: `tcp://host:port` connects (vLLM binds `tcp://*:port`); with
//!   [`SubscriberConfig::bind`] (the caller decides it from the configured text: a
//!   wildcard host `*`, `0.0.0.0` or `[::]`) the SUB binds instead, for vLLM publishers
//!   that connect. It is never re-derived from the endpoint string here: a host name
//!   the caller resolved to `0.0.0.0` is still a destination.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::decode::{decode_message, decode_replay, DecodeError, KvEvent, KvMessage, ReplayReply};
use super::sequence::{payload_digest, Applied, SeqClass, SeqTracker, StreamState};
use super::socket::{
    Incoming, Limits, LiveConfig, LiveSocket, ReplayDealer, SocketError, DEFAULT_MAX_MESSAGE_BYTES,
};
use crate::prefix::residency::ResidencyIndex;

/// Most batches accepted from one replay: twice vLLM's default `buffer_steps` (10,000).
const MAX_REPLAY_BATCHES: usize = 20_000;
/// Most payload bytes accepted from one replay (10,000 batches of 100 KiB, far more
/// than vLLM's ring holds at its default buffer of 10,000 typical batches).
const MAX_REPLAY_BYTES: usize = 1 << 30;
/// Longest interval between staleness / probe checks.
const MAX_TICK: Duration = Duration::from_millis(500);

/// Errors of one connection or replay attempt (logged and counted, never fatal).
#[derive(Debug, thiserror::Error)]
pub enum SubscribeError {
    /// The socket layer failed or the peer broke the protocol.
    #[error(transparent)]
    Socket(#[from] SocketError),
    /// A reply could not be decoded.
    #[error("decode: {0}")]
    Decode(#[from] DecodeError),
    /// The replay went past `MAX_REPLAY_BATCHES` or `MAX_REPLAY_BYTES`.
    #[error("replay sent more than {MAX_REPLAY_BATCHES} batches or {MAX_REPLAY_BYTES} bytes")]
    ReplayTooLong,
    /// A blocking replay task ended abnormally.
    #[error("replay task failed: {0}")]
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
    /// Largest inbound ZMQ frame on the SUB and the replay DEALER; a peer sending a
    /// larger one is disconnected and counted.
    pub max_message_bytes: u64,
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
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
        }
    }

    fn limits(&self) -> Limits {
        Limits {
            max_message_bytes: self.max_message_bytes,
            reconnect_initial: self.backoff_initial,
            reconnect_max: self.backoff_max,
            connect_timeout: self.connect_timeout,
        }
    }
}

/// What a replay from the last applied batch says about the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Continuity {
    /// It starts with the batch we applied last: the stream went on.
    Continuous,
    /// The publisher restarted: its ring ends before our last batch, holds other
    /// content at that sequence, or carries another stream id.
    Restarted,
    /// Its ring no longer reaches back to our last batch: too much was missed to tell.
    NotCovered,
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

    /// Run until `shutdown` completes: open the socket, apply batches, repair, reopen.
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        let mut backoff = self.cfg.backoff_initial;
        let tick = (self.cfg.staleness_limit / 4).clamp(Duration::from_millis(10), MAX_TICK);
        loop {
            let opened = LiveSocket::open(&LiveConfig {
                endpoint: self.cfg.endpoint.clone(),
                bind: self.cfg.bind,
                topic: self.cfg.topic.clone(),
                limits: self.cfg.limits(),
            });
            match opened {
                Ok(mut live) => {
                    let answered = self.serve(&mut live, &mut shutdown, tick).await;
                    live.close().await;
                    self.socket_down();
                    match answered {
                        None => return,
                        Some(true) => backoff = self.cfg.backoff_initial,
                        Some(false) => {}
                    }
                }
                Err(e) => {
                    log::warn!(
                        "kv_events {}: cannot open the socket: {e}",
                        self.cfg.endpoint
                    );
                    self.socket_down();
                }
            }
            tokio::select! {
                _ = &mut shutdown => return,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(self.cfg.backoff_max);
        }
    }

    /// Serve one socket until it must be replaced. `None` on shutdown; otherwise
    /// whether a publisher ever completed a handshake on it.
    async fn serve(
        &mut self,
        live: &mut LiveSocket,
        shutdown: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
        tick: Duration,
    ) -> Option<bool> {
        let opened = Instant::now();
        let mut answered = false;
        let mut warned = false;
        self.last_probe_ms = self.state.now_ms();
        let mut ticker = tokio::time::interval(tick);
        loop {
            tokio::select! {
                _ = shutdown.as_mut() => return None,
                report = live.recv() => match report {
                    Some(Incoming::Message(frames)) => self.on_live(&frames).await,
                    Some(Incoming::Up) => {
                        answered = true;
                        self.on_up().await;
                    }
                    Some(Incoming::Down { remaining }) => self.on_down(remaining),
                    Some(Incoming::ProtocolError(why)) => self.on_protocol_error("", why),
                    None => {
                        log::warn!("kv_events {}: socket closed, reopening", self.cfg.endpoint);
                        return Some(answered);
                    }
                },
                _ = ticker.tick() => {
                    if !self.cfg.bind
                        && !answered
                        && !warned
                        && opened.elapsed() >= self.cfg.connect_timeout
                    {
                        warned = true;
                        log::warn!(
                            "kv_events {}: no publisher answered within {:?}; still dialling",
                            self.cfg.endpoint,
                            self.cfg.connect_timeout
                        );
                    }
                    if !self.on_tick().await {
                        return Some(answered);
                    }
                }
            }
        }
    }

    /// A publisher connection completed its handshake.
    async fn on_up(&mut self) {
        log::info!("kv_events {}: publisher connected", self.cfg.endpoint);
        self.state.set_connected(true);
        StreamState::bump(&self.state.connects, 1);
        self.state.reset_staleness();
        self.last_probe_ms = self.state.now_ms();
        if self.cfg.replay_endpoint.is_none() {
            if self.tracker.last().is_some() {
                // Batches may have been missed while disconnected, or the publisher
                // restarted: the first batch will tell.
                self.state.set_trusted(false);
            }
            return;
        }
        if self.tracker.last().is_some() {
            // Prove continuity (or repair, or detect a restart) through the replay.
            self.state.set_trusted(false);
            self.probe().await;
        } else {
            // Nothing applied yet: learn what the publisher's ring already holds.
            match self.replay(0).await {
                Ok(replies) => {
                    if !replies.is_empty() {
                        log::info!(
                            "kv_events {}: replayed {} buffered batches on connect",
                            self.cfg.endpoint,
                            replies.len()
                        );
                        self.apply_replay(replies, None);
                    }
                }
                Err(e) => {
                    log::warn!(
                        "kv_events {}: initial replay failed: {e}",
                        self.cfg.endpoint
                    );
                    StreamState::bump(&self.state.replays_failed, 1);
                }
            }
        }
    }

    /// A publisher connection dropped.
    fn on_down(&mut self, remaining: usize) {
        StreamState::bump(&self.state.disconnects, 1);
        if remaining == 0 {
            log::info!("kv_events {}: publisher disconnected", self.cfg.endpoint);
            self.socket_down();
        }
    }

    /// A peer broke the protocol and libzmq disconnected it.
    fn on_protocol_error(&self, socket: &str, why: &str) {
        log::warn!(
            "kv_events {}: {socket}peer disconnected for a protocol violation: {why}",
            self.cfg.endpoint
        );
        StreamState::bump(&self.state.protocol_errors, 1);
    }

    fn socket_down(&self) {
        self.state.set_connected(false);
        if self.tracker.last().is_some() {
            self.state.set_trusted(false);
        }
    }

    /// Periodic checks; false when the socket should be replaced.
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
                if extra > 0 && self.continuity(&replies, last) != Continuity::Restarted {
                    StreamState::bump(&self.state.gaps, 1);
                }
                self.apply_verified_replay(replies, last).await;
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
        // A message proves a connection (a bound socket's count may lag behind).
        self.state.set_connected(true);
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
                log::warn!(
                    "kv_events {}: publisher restarted (seq {} after {:?}): clearing index",
                    self.cfg.endpoint,
                    msg.seq,
                    self.tracker.last().map(|a| a.seq)
                );
                StreamState::bump(&self.state.restarts, 1);
                self.rebuild_restarted();
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
            Ok(replies) => self.apply_verified_replay(replies, last).await,
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

    /// What a replay from the last applied batch `last` says about the stream.
    fn continuity(&self, replies: &[(KvMessage, u64)], last: Applied) -> Continuity {
        match replies.first() {
            // The ring ends before our last batch: the sequence went back.
            None => Continuity::Restarted,
            Some((m, _)) if !self.tracker.same_stream(m.stream_id) => Continuity::Restarted,
            Some((m, d)) if m.seq == last.seq && *d == last.digest => Continuity::Continuous,
            // The same number with other content: a new publisher's batch.
            Some((m, _)) if m.seq == last.seq => Continuity::Restarted,
            Some(_) => Continuity::NotCovered,
        }
    }

    /// Apply a replay from the last applied batch `last`: the missing batches if the
    /// stream went on; after a restart the new publisher's whole ring on an emptied
    /// index; otherwise whatever follows, on an emptied index.
    async fn apply_verified_replay(&mut self, replies: Vec<(KvMessage, u64)>, last: Applied) {
        match self.continuity(&replies, last) {
            Continuity::Continuous => {
                self.apply_replay(replies, Some(last));
            }
            Continuity::Restarted => {
                log::warn!(
                    "kv_events {}: publisher restarted (its replay from seq {} {}): clearing index",
                    self.cfg.endpoint,
                    last.seq,
                    match replies.first() {
                        None => "is empty".to_string(),
                        Some((m, _)) => format!("starts with other content at seq {}", m.seq),
                    }
                );
                StreamState::bump(&self.state.restarts, 1);
                self.rebuild_restarted();
                if let Ok(replies) = self.replay(0).await {
                    self.apply_replay(replies, None);
                }
            }
            Continuity::NotCovered => {
                log::info!(
                    "kv_events {}: replay could not prove continuity: index rebuilt",
                    self.cfg.endpoint
                );
                self.apply_replay(replies, Some(last));
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

    /// [`Self::rebuild`] after the publisher restarted: the replica's cache starts empty
    /// (and its size may have changed: `ResidencyIndex::restart`).
    fn rebuild_restarted(&mut self) {
        self.rebuild();
        self.index.restart();
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
        let limits = self.cfg.limits();
        let (connect_timeout, reply_timeout) = (self.cfg.connect_timeout, self.cfg.replay_timeout);
        let exchange = tokio::task::spawn_blocking(move || {
            replay_exchange(&endpoint, &limits, connect_timeout, reply_timeout, start)
        });
        let replies = match exchange.await {
            Ok(Err(SubscribeError::Socket(SocketError::Protocol(why)))) => {
                self.on_protocol_error("replay ", why);
                return Err(SocketError::Protocol(why).into());
            }
            Ok(r) => r?,
            Err(e) => return Err(SubscribeError::Task(e.to_string())),
        };
        if let Some((m, _)) = replies.last() {
            self.state.batches_replayed(replies.len() as u64, m.seq);
        }
        Ok(replies)
    }
}

/// One replay request over a fresh DEALER (blocking).
fn replay_exchange(
    endpoint: &str,
    limits: &Limits,
    connect_timeout: Duration,
    reply_timeout: Duration,
    start: u64,
) -> Result<Vec<(KvMessage, u64)>, SubscribeError> {
    let mut dealer = ReplayDealer::connect(endpoint, limits)?;
    dealer.wait_connected(connect_timeout)?;
    // vLLM's ROUTER expects [identity, b"", start]: the DEALER sends the empty
    // delimiter and the 8-byte big-endian start sequence.
    dealer.send(&[b"", &start.to_be_bytes()])?;
    let mut replies = Vec::new();
    let mut bytes = 0usize;
    loop {
        let frames = dealer.recv(reply_timeout)?;
        let refs: Vec<&[u8]> = frames.iter().map(|f| f.as_ref()).collect();
        match decode_replay(&refs)? {
            ReplayReply::End => return Ok(replies),
            ReplayReply::Batch(m) => {
                let payload = refs.last().copied().unwrap_or_default();
                bytes += payload.len();
                replies.push((m, payload_digest(payload)));
                if replies.len() > MAX_REPLAY_BATCHES || bytes > MAX_REPLAY_BYTES {
                    return Err(SubscribeError::ReplayTooLong);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
