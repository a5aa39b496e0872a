//! The libzmq sockets of one KV-event stream: the live SUB, read on a thread of its own,
//! and the replay DEALER, used for one blocking request/reply exchange at a time.
//!
//! Owns socket options, the socket monitor (what connected, what dropped, who broke the
//! protocol) and the hand-off of received frames to async code. It decodes nothing and
//! makes no stream decisions (that is [`super::subscriber`]).
//!
//! Why libzmq (the `zmq` crate; zmq-sys builds libzmq 4.3.4 from the `zeromq-src`
//! crate): it is the reference ZMTP implementation and the one vLLM publishes with
//! (pyzmq bundles it). The pure-Rust `zeromq` 0.7 crate reserved a frame's declared
//! length before reading it (one 9-byte header declaring 2^50 bytes aborted the
//! process) and offered no bound; libzmq checks `ZMQ_MAXMSGSIZE` when a frame header
//! is decoded, before anything is allocated, and closes that connection. It also
//! re-dials a dropped publisher with back-off, detects a dead peer with ZMTP
//! heartbeats, and has no `todo!()` paths for unexpected peers.
//!
//! What the monitor can and cannot tell (libzmq 4.3.4, `stream_engine_base.cpp`,
//! `session_base.cpp`):
//! - A frame over the limit fails the decoder with `EMSGSIZE`; the engine ends with a
//!   *protocol* error, reported only as `ZMQ_EVENT_DISCONNECTED` (no handshake-failed
//!   event once the handshake is done). A malformed greeting or command is reported as
//!   `ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL` first.
//! - A connecting session re-dials after a *connection* error (peer closed, reset,
//!   heartbeat timeout), which the monitor shows as `ZMQ_EVENT_CONNECT_RETRIED` right
//!   after the disconnect, but gives up for good after a *protocol* error. So a
//!   disconnect of a connecting socket with no retry following within
//!   [`GIVE_UP_GRACE`] is a protocol violation: it is reported and the socket ends (the
//!   subscriber opens a new one, which dials the endpoint afresh).
//! - An accepted connection (bind mode) is never re-dialled, whatever ended it: a
//!   violation there is seen as a disconnect only ([`Incoming::Down`]); the listener
//!   stays up for the next publisher.
//! - Frame bounds are per frame. libzmq hands a multipart message over only once its
//!   last frame arrived, and nothing bounds the frame count of a message still coming
//!   in; the reader keeps at most [`MAX_FRAMES`] frames of any message it receives.
//!
//! libzmq sends monitor events blocking, from the I/O thread all sockets share: a
//! monitor must be read for as long as its socket lives, and silenced
//! (`Monitor::detach`) before the socket closes, or one unread event stalls every
//! socket of the process.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::mpsc;

/// Live messages buffered between the socket thread and the apply loop. The
/// publisher's own queue is far larger (vLLM's `hwm` default 100,000); when this
/// fills, the socket thread waits, libzmq stops reading the connection and the
/// publisher drops at its high-water mark, which surfaces as a sequence gap.
const LIVE_CHANNEL_DEPTH: usize = 4096;
/// Bytes of live frames buffered between the socket thread and the apply loop (one
/// message is always let through, whatever its size).
const LIVE_QUEUE_BYTES: usize = 64 << 20;
/// Complete messages libzmq queues per connection before it stops reading from it
/// (`ZMQ_RCVHWM`, default 1000). Small because each may be `max_message_bytes` long and
/// the reader thread drains the queue as fast as messages arrive.
const SUB_RCVHWM: i32 = 32;
/// Frames kept of one message: a live message has 3, a replay reply at most 5 (with
/// the DEALER's delimiter); the rest of a longer message is dropped unread.
pub const MAX_FRAMES: usize = 8;
/// How long the socket thread waits in one poll: the latency of noticing a close.
const POLL_INTERVAL: Duration = Duration::from_millis(50);
/// After a connecting socket's disconnect, how long to wait for libzmq's re-dial
/// (`ZMQ_EVENT_CONNECT_RETRIED`, emitted by the same I/O thread right after) before
/// concluding that libzmq gave up on a protocol violation.
pub const GIVE_UP_GRACE: Duration = Duration::from_secs(1);
/// ZMTP 3.1 heartbeat: a PING after this much silence from the peer...
const HEARTBEAT_IVL_MS: i32 = 5_000;
/// ...and the connection is dropped (and re-dialled) if nothing answers within this.
const HEARTBEAT_TIMEOUT_MS: i32 = 15_000;

pub use crate::config::{DEFAULT_MAX_MESSAGE_BYTES, MESSAGE_BYTES_RANGE};

/// The process's one libzmq context (one I/O thread shared by every stream's sockets).
/// Never dropped: terminating a context waits for every socket of it to close.
static CONTEXT: LazyLock<zmq::Context> = LazyLock::new(zmq::Context::new);
/// Numbers the inproc endpoints of socket monitors.
static MONITOR_ID: AtomicU64 = AtomicU64::new(0);

/// Errors of the socket layer.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    /// libzmq refused an operation (bad endpoint, address in use, ...).
    #[error("zmq: {0}")]
    Zmq(#[from] zmq::Error),
    /// No answer within the limit.
    #[error("timed out: {0}")]
    Timeout(&'static str),
    /// The peer broke the protocol (e.g. a frame over `max_message_bytes`) and libzmq
    /// disconnected it.
    #[error("protocol violation by the peer: {0}")]
    Protocol(&'static str),
    /// The peer closed the connection before the exchange completed.
    #[error("peer disconnected")]
    PeerGone,
    /// The reader thread could not be started.
    #[error("reader thread: {0}")]
    Thread(#[from] std::io::Error),
}

/// Socket settings shared by the SUB and the replay DEALER.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest inbound frame (`ZMQ_MAXMSGSIZE`); a larger one drops the connection.
    pub max_message_bytes: u64,
    /// First re-dial delay after a lost connection (`ZMQ_RECONNECT_IVL`).
    pub reconnect_initial: Duration,
    /// Longest re-dial delay (`ZMQ_RECONNECT_IVL_MAX`).
    pub reconnect_max: Duration,
    /// Limit of one TCP connect attempt (`ZMQ_CONNECT_TIMEOUT`).
    pub connect_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            reconnect_initial: Duration::from_millis(200),
            reconnect_max: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
        }
    }
}

fn millis(d: Duration) -> i32 {
    i32::try_from(d.as_millis()).unwrap_or(i32::MAX).max(1)
}

/// Options every stream socket gets before it connects or binds.
fn configure(sock: &zmq::Socket, limits: &Limits) -> Result<(), SocketError> {
    sock.set_maxmsgsize(i64::try_from(limits.max_message_bytes).unwrap_or(i64::MAX))?;
    sock.set_linger(0)?;
    sock.set_ipv6(true)?;
    sock.set_reconnect_ivl(millis(limits.reconnect_initial))?;
    sock.set_reconnect_ivl_max(millis(limits.reconnect_max))?;
    sock.set_connect_timeout(millis(limits.connect_timeout))?;
    sock.set_heartbeat_ivl(HEARTBEAT_IVL_MS)?;
    sock.set_heartbeat_timeout(HEARTBEAT_TIMEOUT_MS)?;
    Ok(())
}

/// What the live socket reports to the apply loop.
#[derive(Debug)]
pub enum Incoming {
    /// One message's frames (at most [`MAX_FRAMES`]).
    Message(Vec<Bytes>),
    /// A publisher connection completed its ZMTP handshake.
    Up,
    /// A publisher connection dropped; `remaining` connections are still open (always
    /// 0 for a connecting socket, which libzmq re-dials by itself).
    Down {
        /// Connections still open on a bound socket.
        remaining: usize,
    },
    /// A peer broke the protocol and was disconnected.
    ProtocolError(&'static str),
}

/// The monitor of one socket: turns libzmq's events into connection state.
struct Monitor {
    pair: zmq::Socket,
    bind: bool,
    /// Accepted connections still open (bind mode).
    open: usize,
    /// A connecting socket's connection is up.
    up: bool,
    /// A connecting socket's connection dropped at this instant and no re-dial followed yet.
    dropped_at: Option<Instant>,
    /// The connection being torn down was already reported as a protocol error.
    reported: bool,
}

/// A monitor event: what happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    Up,
    Down,
    ProtocolError(&'static str),
}

impl Monitor {
    /// Attach a monitor to `sock` (before it connects or binds, so no event is missed).
    fn attach(sock: &zmq::Socket, bind: bool) -> Result<Monitor, SocketError> {
        Self::attach_in(&CONTEXT, sock, bind)
    }

    /// [`Self::attach`] for a socket of context `ctx`.
    fn attach_in(
        ctx: &zmq::Context,
        sock: &zmq::Socket,
        bind: bool,
    ) -> Result<Monitor, SocketError> {
        let endpoint = format!(
            "inproc://rolter-kv-monitor-{}",
            MONITOR_ID.fetch_add(1, Ordering::Relaxed)
        );
        let events = zmq_sys_events::WANTED;
        sock.monitor(&endpoint, events)?;
        let pair = ctx.socket(zmq::PAIR)?;
        pair.set_linger(0)?;
        pair.connect(&endpoint)?;
        Ok(Monitor {
            pair,
            bind,
            open: 0,
            up: false,
            dropped_at: None,
            reported: false,
        })
    }

    /// Stop `sock` reporting to this monitor. Must run before `sock` is closed: libzmq
    /// stops a monitor only when the closed socket is finally destroyed, and events of
    /// the teardown in between are sent (blocking, from the shared I/O thread) to a
    /// monitor socket whose reader is gone, which stalls every socket of the context.
    /// Re-monitoring with no events is the public API's way to silence it.
    fn detach(sock: &zmq::Socket) {
        let endpoint = format!(
            "inproc://rolter-kv-monitor-off-{}",
            MONITOR_ID.fetch_add(1, Ordering::Relaxed)
        );
        if let Err(e) = sock.monitor(&endpoint, 0) {
            log::warn!("kv_events: cannot detach a socket monitor: {e}");
        }
    }

    /// Read every pending event; `out` gets what the stream must know.
    fn drain(&mut self, out: &mut Vec<Event>) -> Result<(), SocketError> {
        loop {
            let head = match self.pair.recv_bytes(zmq::DONTWAIT) {
                Ok(b) => b,
                Err(zmq::Error::EAGAIN) => return Ok(()),
                Err(e) => return Err(e.into()),
            };
            // The second frame (the endpoint) is not needed; it is part of the message.
            while self.pair.get_rcvmore()? {
                let _ = self.pair.recv_bytes(0)?;
            }
            if head.len() < 2 {
                continue;
            }
            let event = u16::from_ne_bytes([head[0], head[1]]);
            self.on_event(event, out);
        }
    }

    fn on_event(&mut self, event: u16, out: &mut Vec<Event>) {
        use zmq_sys_events as ev;
        match event {
            ev::HANDSHAKE_SUCCEEDED => {
                self.up = true;
                self.reported = false;
                out.push(Event::Up);
            }
            ev::HANDSHAKE_FAILED_PROTOCOL => {
                self.reported = true;
                out.push(Event::ProtocolError("malformed ZMTP handshake"));
            }
            ev::ACCEPTED => self.open += 1,
            ev::DISCONNECTED => {
                if self.bind {
                    self.open = self.open.saturating_sub(1);
                    out.push(Event::Down);
                } else {
                    if std::mem::take(&mut self.up) {
                        out.push(Event::Down);
                    }
                    self.dropped_at = Some(Instant::now());
                }
            }
            ev::CONNECT_RETRIED => {
                self.dropped_at = None;
                self.reported = false;
            }
            _ => {}
        }
    }

    /// A connecting socket whose dropped connection libzmq will not re-dial: the
    /// protocol error to report (unless already reported), or `None` while it may.
    fn gave_up(&mut self, now: Instant) -> Option<Option<&'static str>> {
        let at = self.dropped_at?;
        if now.duration_since(at) < GIVE_UP_GRACE {
            return None;
        }
        self.dropped_at = None;
        Some((!std::mem::take(&mut self.reported)).then_some("frame over max_message_bytes"))
    }
}

/// The monitor event numbers (`zmq.h`), read from the raw event frame. The `zmq`
/// crate's own `SocketEvent::from_raw` panics on a number it does not know.
mod zmq_sys_events {
    pub const CONNECT_RETRIED: u16 = 0x0004;
    pub const ACCEPTED: u16 = 0x0020;
    pub const DISCONNECTED: u16 = 0x0200;
    pub const HANDSHAKE_SUCCEEDED: u16 = 0x1000;
    pub const HANDSHAKE_FAILED_PROTOCOL: u16 = 0x2000;
    /// The events a stream socket's monitor subscribes to.
    pub const WANTED: i32 = (CONNECT_RETRIED
        | ACCEPTED
        | DISCONNECTED
        | HANDSHAKE_SUCCEEDED
        | HANDSHAKE_FAILED_PROTOCOL) as i32;
}

/// Where the live SUB connects or binds and what it subscribes to.
#[derive(Debug, Clone)]
pub struct LiveConfig {
    /// `tcp://host:port` (or a wildcard host to bind).
    pub endpoint: String,
    /// Bind instead of connect.
    pub bind: bool,
    /// Topic prefix ("" = everything).
    pub topic: String,
    /// Socket limits.
    pub limits: Limits,
}

/// The live SUB socket, read on its own thread (see the module header). Dropping it
/// stops the thread, which closes the socket within `POLL_INTERVAL` (50 ms).
///
/// Connection reports travel apart from messages, on an unbounded channel: the thread
/// must keep reading the socket monitor even while the message queue is full, because
/// libzmq sends monitor events blocking from its I/O thread, and a monitor left unread
/// past its high-water mark would stall every socket of the process. A report is a few
/// bytes; there are at most a few per connection attempt.
pub struct LiveSocket {
    rx: mpsc::Receiver<Incoming>,
    reports: mpsc::UnboundedReceiver<Incoming>,
    queued: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl LiveSocket {
    /// Create the socket, connect or bind it, and start its reader thread. Fails on a
    /// bad endpoint or an address in use; a publisher that is not up yet is not an
    /// error (libzmq keeps dialling; [`Incoming::Up`] tells when it answered).
    pub fn open(cfg: &LiveConfig) -> Result<LiveSocket, SocketError> {
        let sub = CONTEXT.socket(zmq::SUB)?;
        configure(&sub, &cfg.limits)?;
        sub.set_rcvhwm(SUB_RCVHWM)?;
        sub.set_subscribe(cfg.topic.as_bytes())?;
        let monitor = Monitor::attach(&sub, cfg.bind)?;
        let (tx, rx) = mpsc::channel(LIVE_CHANNEL_DEPTH);
        let (reports_tx, reports) = mpsc::unbounded_channel();
        let queued = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        // From here on the reader owns the socket: its Drop detaches the monitor before
        // the socket closes, on every path (a failed bind included).
        let reader = Reader {
            sub,
            monitor,
            tx,
            reports: reports_tx,
            queued: queued.clone(),
            stop: stop.clone(),
            endpoint: cfg.endpoint.clone(),
        };
        if cfg.bind {
            reader.sub.bind(&cfg.endpoint)?;
        } else {
            reader.sub.connect(&cfg.endpoint)?;
        }
        let thread = std::thread::Builder::new()
            .name("kv-events-sub".into())
            .spawn(move || reader.run())?;
        Ok(LiveSocket {
            rx,
            reports,
            queued,
            stop,
            thread: Some(thread),
        })
    }

    /// The next report (connection reports first); `None` when the socket ended (a
    /// protocol violation on a connecting socket, or a socket error): open a new one.
    pub async fn recv(&mut self) -> Option<Incoming> {
        let msg = tokio::select! {
            biased;
            Some(report) = self.reports.recv() => return Some(report),
            msg = self.rx.recv() => msg?,
        };
        if let Incoming::Message(frames) = &msg {
            self.queued.fetch_sub(frame_bytes(frames), Ordering::AcqRel);
        }
        Some(msg)
    }

    /// Stop the thread and wait until the socket is closed (so a bound port is free).
    pub async fn close(mut self) {
        self.stop.store(true, Ordering::Release);
        self.rx.close();
        if let Some(thread) = self.thread.take() {
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
    }
}

impl Drop for LiveSocket {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

fn frame_bytes(frames: &[Bytes]) -> usize {
    frames.iter().map(Bytes::len).sum()
}

/// Read the frames of one message (`Ok(None)`: nothing pending). libzmq delivers a
/// multipart message only once it is complete, so the frames after the first are
/// already there; those past [`MAX_FRAMES`] are dropped.
fn read_message(sock: &zmq::Socket) -> Result<Option<Vec<Bytes>>, zmq::Error> {
    let first = match sock.recv_bytes(zmq::DONTWAIT) {
        Ok(b) => b,
        Err(zmq::Error::EAGAIN) => return Ok(None),
        Err(e) => return Err(e),
    };
    let mut frames = vec![Bytes::from(first)];
    let mut part = zmq::Message::new();
    while sock.get_rcvmore()? {
        sock.recv(&mut part, 0)?;
        if frames.len() < MAX_FRAMES {
            frames.push(Bytes::copy_from_slice(&part));
        }
    }
    Ok(Some(frames))
}

/// Whether the reader thread goes on.
enum Flow {
    Continue,
    /// The receiver is gone, the socket was stopped, or libzmq gave up on the endpoint.
    End,
}

/// The SUB's reader thread.
struct Reader {
    sub: zmq::Socket,
    monitor: Monitor,
    tx: mpsc::Sender<Incoming>,
    reports: mpsc::UnboundedSender<Incoming>,
    queued: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    endpoint: String,
}

impl Drop for Reader {
    fn drop(&mut self) {
        Monitor::detach(&self.sub);
    }
}

impl Reader {
    fn run(mut self) {
        if let Err(e) = self.serve() {
            log::warn!("kv_events {}: socket failed: {e}", self.endpoint);
        }
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire) || self.tx.is_closed()
    }

    fn serve(&mut self) -> Result<(), SocketError> {
        while !self.stopped() {
            let sub_ready = {
                let mut items = [
                    self.sub.as_poll_item(zmq::POLLIN),
                    self.monitor.pair.as_poll_item(zmq::POLLIN),
                ];
                zmq::poll(&mut items, POLL_INTERVAL.as_millis() as i64)?;
                items[0].is_readable()
            };
            if let Flow::End = self.pump_reports()? {
                return Ok(());
            }
            if sub_ready {
                // A bounded batch per round, so reports and the stop flag stay timely.
                for _ in 0..256 {
                    let Some(frames) = read_message(&self.sub)? else {
                        break;
                    };
                    if let Flow::End = self.forward_message(frames)? {
                        return Ok(());
                    }
                }
            }
        }
        Ok(())
    }

    /// Read every pending monitor event and pass its report on (never blocks).
    fn pump_reports(&mut self) -> Result<Flow, SocketError> {
        let mut events = Vec::new();
        self.monitor.drain(&mut events)?;
        for e in events {
            let report = match e {
                Event::Up => Incoming::Up,
                Event::Down => Incoming::Down {
                    remaining: self.monitor.open,
                },
                Event::ProtocolError(why) => Incoming::ProtocolError(why),
            };
            if self.reports.send(report).is_err() {
                return Ok(Flow::End);
            }
        }
        if let Some(reported) = self.monitor.gave_up(Instant::now()) {
            if let Some(why) = reported {
                let _ = self.reports.send(Incoming::ProtocolError(why));
            }
            // libzmq will not dial this endpoint again: end; the owner reopens.
            return Ok(Flow::End);
        }
        Ok(Flow::Continue)
    }

    /// Queue one message within the channel's depth and byte budget (one message is
    /// always let through), reading the monitor while it waits.
    fn forward_message(&mut self, frames: Vec<Bytes>) -> Result<Flow, SocketError> {
        let n = frame_bytes(&frames);
        let mut msg = Incoming::Message(frames);
        loop {
            if self.stopped() {
                return Ok(Flow::End);
            }
            let queued = self.queued.load(Ordering::Acquire);
            if queued == 0 || queued + n <= LIVE_QUEUE_BYTES {
                // Counted before it can be received (the receiver subtracts it).
                self.queued.fetch_add(n, Ordering::AcqRel);
                match self.tx.try_send(msg) {
                    Ok(()) => return Ok(Flow::Continue),
                    Err(mpsc::error::TrySendError::Closed(_)) => return Ok(Flow::End),
                    Err(mpsc::error::TrySendError::Full(m)) => {
                        self.queued.fetch_sub(n, Ordering::AcqRel);
                        msg = m;
                    }
                }
            }
            if let Flow::End = self.pump_reports()? {
                return Ok(Flow::End);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// One replay exchange with a ROUTER endpoint, over a fresh DEALER (blocking: run it
/// on a blocking thread).
pub struct ReplayDealer {
    dealer: zmq::Socket,
    monitor: Monitor,
}

impl Drop for ReplayDealer {
    fn drop(&mut self) {
        Monitor::detach(&self.dealer);
    }
}

impl ReplayDealer {
    /// Create the DEALER and start dialling `endpoint`.
    pub fn connect(endpoint: &str, limits: &Limits) -> Result<ReplayDealer, SocketError> {
        let dealer = CONTEXT.socket(zmq::DEALER)?;
        configure(&dealer, limits)?;
        let monitor = Monitor::attach(&dealer, false)?;
        dealer.connect(endpoint)?;
        Ok(ReplayDealer { dealer, monitor })
    }

    /// Wait until the connection completed its handshake.
    pub fn wait_connected(&mut self, limit: Duration) -> Result<(), SocketError> {
        let deadline = Instant::now() + limit;
        let mut events = Vec::new();
        loop {
            self.monitor.drain(&mut events)?;
            for e in events.drain(..) {
                match e {
                    Event::Up => return Ok(()),
                    Event::ProtocolError(why) => return Err(SocketError::Protocol(why)),
                    Event::Down => {}
                }
            }
            self.check_gave_up()?;
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(SocketError::Timeout("replay connect"));
            }
            self.monitor
                .pair
                .poll(zmq::POLLIN, left.min(POLL_INTERVAL).as_millis() as i64)?;
        }
    }

    /// Send the frames of one request.
    pub fn send(&self, frames: &[&[u8]]) -> Result<(), SocketError> {
        self.dealer
            .send_multipart(frames.iter().copied(), zmq::DONTWAIT)?;
        Ok(())
    }

    /// The next reply's frames, waiting at most `limit`. A connection that drops fails
    /// the exchange at once (the rest of the reply is lost either way).
    pub fn recv(&mut self, limit: Duration) -> Result<Vec<Bytes>, SocketError> {
        let deadline = Instant::now() + limit;
        let mut events = Vec::new();
        loop {
            if let Some(frames) = read_message(&self.dealer)? {
                return Ok(frames);
            }
            self.monitor.drain(&mut events)?;
            for e in events.drain(..) {
                match e {
                    Event::ProtocolError(why) => return Err(SocketError::Protocol(why)),
                    Event::Down => return self.settle_drop(),
                    Event::Up => {}
                }
            }
            self.check_gave_up()?;
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(SocketError::Timeout("replay reply"));
            }
            let mut items = [
                self.dealer.as_poll_item(zmq::POLLIN),
                self.monitor.pair.as_poll_item(zmq::POLLIN),
            ];
            zmq::poll(&mut items, left.min(POLL_INTERVAL).as_millis() as i64)?;
        }
    }

    /// After a disconnect: a protocol violation if libzmq does not re-dial.
    fn settle_drop(&mut self) -> Result<Vec<Bytes>, SocketError> {
        let mut events = Vec::new();
        loop {
            self.check_gave_up()?;
            if self.monitor.dropped_at.is_none() {
                return Err(SocketError::PeerGone);
            }
            self.monitor
                .pair
                .poll(zmq::POLLIN, POLL_INTERVAL.as_millis() as i64)?;
            self.monitor.drain(&mut events)?;
            if let Some(Event::ProtocolError(why)) = events
                .drain(..)
                .find(|e| matches!(e, Event::ProtocolError(_)))
            {
                return Err(SocketError::Protocol(why));
            }
        }
    }

    fn check_gave_up(&mut self) -> Result<(), SocketError> {
        match self.monitor.gave_up(Instant::now()) {
            Some(why) => Err(SocketError::Protocol(
                why.unwrap_or("malformed ZMTP handshake"),
            )),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression: libzmq sends monitor events blocking, from the context's I/O thread;
    /// once the reader of a monitor is gone, the next event stalls that thread and with
    /// it every socket of the context (seen under gdb: a DISCONNECTED event of a socket
    /// being closed, whose reader thread had ended). `detach` must silence the monitor.
    /// Re-dial events every 10 ms after the reader left stand in for the teardown's. A
    /// private context keeps a failure local.
    #[test]
    fn a_detached_monitor_leaves_the_io_thread_free() {
        let ctx = zmq::Context::new();
        let wait = |sock: &zmq::Socket| sock.poll(zmq::POLLIN, 5_000).unwrap() > 0;
        let publisher = ctx.socket(zmq::PUB).unwrap();
        publisher.set_linger(0).unwrap();
        publisher.bind("tcp://127.0.0.1:*").unwrap();
        let endpoint = publisher.get_last_endpoint().unwrap().unwrap();
        let sub = ctx.socket(zmq::SUB).unwrap();
        sub.set_linger(0).unwrap();
        sub.set_reconnect_ivl(10).unwrap();
        sub.set_reconnect_ivl_max(10).unwrap();
        let mut monitor = Monitor::attach_in(&ctx, &sub, false).unwrap();
        sub.connect(&endpoint).unwrap();
        let mut events = Vec::new();
        while !events.contains(&Event::Up) {
            assert!(wait(&monitor.pair), "handshake");
            monitor.drain(&mut events).unwrap();
        }
        // The reader goes away first, as when a stream's socket thread ends.
        Monitor::detach(&sub);
        drop(monitor);
        // The publisher leaves: the SUB reports a disconnect, then a re-dial every 10 ms.
        drop(publisher);
        std::thread::sleep(Duration::from_millis(300));
        // The context still serves new sockets.
        let pub2 = ctx.socket(zmq::PUB).unwrap();
        pub2.set_linger(0).unwrap();
        pub2.bind("tcp://127.0.0.1:*").unwrap();
        let sub2 = ctx.socket(zmq::SUB).unwrap();
        sub2.set_linger(0).unwrap();
        sub2.set_subscribe(b"").unwrap();
        sub2.connect(&pub2.get_last_endpoint().unwrap().unwrap())
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut got = false;
        while !got && Instant::now() < deadline {
            pub2.send("x", 0).unwrap();
            got = sub2.poll(zmq::POLLIN, 20).unwrap() > 0;
        }
        assert!(got, "the I/O thread is stalled");
        drop((sub, sub2, pub2));
        // Never wait for the context's sockets here (they would hang a failing run).
        std::mem::forget(ctx);
    }

    #[test]
    fn a_connecting_socket_that_is_not_redialled_reports_one_protocol_error() {
        let sock = CONTEXT.socket(zmq::SUB).unwrap();
        let mut m = Monitor::attach(&sock, false).unwrap();
        let mut out = Vec::new();
        let t0 = Instant::now();
        m.on_event(zmq_sys_events::HANDSHAKE_SUCCEEDED, &mut out);
        m.on_event(zmq_sys_events::DISCONNECTED, &mut out);
        assert_eq!(out, vec![Event::Up, Event::Down]);
        assert_eq!(
            m.gave_up(t0),
            None,
            "within the grace libzmq may still re-dial"
        );
        // A connection error: libzmq re-dials, nothing to report.
        m.on_event(zmq_sys_events::CONNECT_RETRIED, &mut out);
        assert_eq!(m.gave_up(t0 + 2 * GIVE_UP_GRACE), None);
        // A protocol error: no re-dial follows.
        m.on_event(zmq_sys_events::HANDSHAKE_SUCCEEDED, &mut out);
        m.on_event(zmq_sys_events::DISCONNECTED, &mut out);
        assert_eq!(
            m.gave_up(Instant::now() + 2 * GIVE_UP_GRACE),
            Some(Some("frame over max_message_bytes"))
        );
        // A handshake already reported as malformed is not counted twice.
        m.on_event(zmq_sys_events::HANDSHAKE_FAILED_PROTOCOL, &mut out);
        m.on_event(zmq_sys_events::DISCONNECTED, &mut out);
        assert_eq!(m.gave_up(Instant::now() + 2 * GIVE_UP_GRACE), Some(None));
        assert_eq!(
            out.iter()
                .filter(|e| matches!(e, Event::ProtocolError(_)))
                .count(),
            1
        );
    }

    #[test]
    fn a_bound_socket_counts_open_connections() {
        let sock = CONTEXT.socket(zmq::SUB).unwrap();
        let mut m = Monitor::attach(&sock, true).unwrap();
        let mut out = Vec::new();
        m.on_event(zmq_sys_events::ACCEPTED, &mut out);
        m.on_event(zmq_sys_events::ACCEPTED, &mut out);
        m.on_event(zmq_sys_events::HANDSHAKE_SUCCEEDED, &mut out);
        m.on_event(zmq_sys_events::DISCONNECTED, &mut out);
        assert_eq!(m.open, 1);
        assert_eq!(out, vec![Event::Up, Event::Down]);
        assert_eq!(m.gave_up(Instant::now() + 2 * GIVE_UP_GRACE), None);
    }
}
