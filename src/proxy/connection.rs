//! A client connection before pingora parses its requests: the connection cap, the count
//! of open connections, and the gate every request header passes first (a whole-header
//! deadline and a size limit), with no read buffer held while a connection is idle.
//!
//! Owns: [`ClientConnections`], the pingora `ServerApp` of the proxy port. It takes each
//! accepted connection, refuses it past `limits.max_connections`, reads each request
//! header itself until it is complete, then hands the connection and those bytes to
//! pingora's HTTP proxy app (the same loop over keep-alive requests that pingora's own
//! `ServerApp` for HTTP apps runs, HTTP/1 only: rolter enables neither h2c nor TLS).
//! Must not: parse HTTP beyond finding where a header section ends, or touch requests
//! once pingora has them (that is [`super::Gateway`]).
//!
//! ## Why a gate in front of pingora
//! pingora 0.9.1 times each read of a request header, not the header (a header dribbled a
//! byte at a time stays open for as long as the bytes keep coming), re-parses the header
//! from its first byte after every read (a dribbled 1 MB header costs quadratic CPU), and
//! allows up to 1 MiB. Each accepted connection also got a 64 KiB read buffer
//! (`DEFAULT_L4_READ_BUFFER_SIZE`) for its whole life, idle or not: 7,000 idle connections
//! took RSS from 33 to 637 MiB. Here:
//! - the listener's L4 read buffer is off (`server.rs`), and an idle connection holds no
//!   buffer at all: a wait for a header reads into one per-thread scratch buffer, and only
//!   the bytes that arrived are kept;
//! - the header's end is found incrementally (each byte looked at once) and the header
//!   must be complete within `limits.client_header_timeout_ms` (from the accept for a
//!   connection's first request, from its first byte for a later one; nginx's
//!   `client_header_timeout`) and `limits.max_header_bytes`;
//! - the complete header (and any body bytes that came with it) goes to pingora as the
//!   session's *pipelined prefix* (`ServerSession::set_pipelined_prefix`, pingora's public
//!   hook for bytes already read from a connection), which pingora parses in place as its
//!   header buffer and keeps the body bytes in as its first body buffer: the bytes are
//!   parsed once, and copied out of the scratch buffer only when the read left room in it
//!   (a read that filled it is taken whole, see `keep_read`);
//! - after a flood of connections closes, each worker thread returns the memory it freed
//!   to the OS (see `BIG_DROP_FROM`).
//!
//! A header over the limit is answered 431 (Request Header Fields Too Large, RFC 6585) in
//! OpenAI's error shape, not pingora's bare 400: the client learns which limit it hit.
//! A header not complete by its deadline is answered 408. Both close the connection and
//! are counted (`rolter_request_errors_total{kind="header_too_large" |
//! "client_header_timeout"}`). A connection that sends nothing is closed without an answer
//! at its deadline (first request) or keep-alive timeout (later ones), as before.

use super::error::GatewayError;
use crate::metrics::METRICS;
use crate::runtime::Runtime;
use async_trait::async_trait;
use bytes::BytesMut;
use pingora::apps::{HttpPersistentSettings, HttpServerApp, ServerApp};
use pingora::protocols::http::ServerSession;
use pingora::protocols::Stream;
use pingora::server::ShutdownWatch;
use std::cell::RefCell;
use std::future::poll_fn;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::sync::watch;
use tokio_util::io::poll_read_buf;

/// How long connections already accepted keep being served after the listener closes;
/// below the shipped `grace_period_seconds`. On shutdown (SIGTERM, or SIGQUIT after a `-u`
/// upgrade handed the listening socket over) pingora 0.9.1 stops accepting and at once
/// runs the app's cleanup, which would drop connections accepted a moment earlier whose
/// request had not arrived yet (their clients get a closed connection, seen in
/// `tests/upgrade.rs` about once per few thousand fresh connections). Waiting lets those
/// requests be read and answered (pingora turns keep-alive off once shutdown started);
/// connections that stay idle are closed when the linger ends.
const SHUTDOWN_LINGER: Duration = Duration::from_secs(1);

/// Size of the per-thread buffer a header wait reads into: a typical request (header and
/// body) arrives in one read, as it did through pingora's 64 KiB L4 buffer.
const SCRATCH_LEN: usize = 64 * 1024;

/// How long a header wait reads before it also watches for the gateway's stop (see
/// `read_head`): the longest an idle connection stays open once the stop is signalled.
const QUIET_WAIT: Duration = Duration::from_millis(100);

/// A connection's timer for `QUIET_WAIT`, kept across its requests (see `read_head`).
type QuietTimer = Pin<Box<tokio::time::Sleep>>;

fn quiet_timer() -> QuietTimer {
    Box::pin(tokio::time::sleep(QUIET_WAIT))
}

/// How long an error answer to a header (408, 431) may take to write, and how long, and
/// for how long without a byte, the rest of a refused header is read and discarded before
/// the connection closes (so the client sees the answer instead of a reset).
const ANSWER_WRITE_LIMIT: Duration = Duration::from_secs(1);
const LINGER_TIME: Duration = Duration::from_secs(2);
const LINGER_IDLE: Duration = Duration::from_millis(500);

thread_local! {
    /// The buffer header waits on this worker thread read into (see the module docs).
    static SCRATCH: RefCell<BytesMut> = RefCell::new(BytesMut::with_capacity(SCRATCH_LEN));
}

/// The proxy port's connection handling, around pingora's HTTP proxy app `A`.
pub struct ClientConnections<A> {
    app: Arc<A>,
    runtime: Arc<Runtime>,
    open: Arc<OpenConnections>,
    /// Flipped once the shutdown linger has passed: idle connections close.
    stop: watch::Sender<bool>,
}

/// Client connections open now: counted, and capped at accept.
#[derive(Debug, Default)]
pub struct OpenConnections {
    open: AtomicUsize,
    /// The most open at once since the last big drop (see [`Slot`]'s drop).
    peak: AtomicUsize,
    /// Big drops so far: each worker thread hands its freed memory back once per drop.
    drops: AtomicUsize,
}

/// An open connection's place in [`OpenConnections`]; dropping it frees the place.
struct Slot<'a>(&'a OpenConnections);

/// A drop from at least this many open connections to a quarter of them or fewer is a
/// "big drop" (a flood ended): every worker thread then returns the memory it freed to the
/// OS (`allocator::release_freed`). mimalloc returns freed pages only when the thread that
/// owns them allocates near them again: after 7,000 connections closed, an idle gateway
/// kept about 30 MiB resident it no longer used. Under a steady number of connections,
/// however fast they come and go, nothing is released (a release per 1,024 closes cost up
/// to 4% more CPU per request with a new connection per request).
const BIG_DROP_FROM: usize = 1024;

thread_local! {
    /// The big drops this worker thread has released memory for.
    static RELEASED_DROPS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        let c = self.0;
        let open = c.open.fetch_sub(1, Ordering::AcqRel) - 1;
        let peak = c.peak.load(Ordering::Relaxed);
        if peak >= BIG_DROP_FROM
            && open <= peak / 4
            && c.peak
                .compare_exchange(peak, open, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            c.drops.fetch_add(1, Ordering::Relaxed);
        }
        // Each thread releases once per drop, on its next close (a drop's closes land on
        // every busy thread).
        let drops = c.drops.load(Ordering::Relaxed);
        if RELEASED_DROPS.get() != drops {
            RELEASED_DROPS.set(drops);
            crate::allocator::release_freed();
        }
    }
}

impl OpenConnections {
    /// Client connections open now.
    pub fn count(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    /// Take a place if fewer than `cap` are taken (exact under contention).
    fn try_open(&self, cap: usize) -> Option<Slot<'_>> {
        let before = self
            .open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < cap).then_some(n + 1)
            })
            .ok()?;
        self.peak.fetch_max(before + 1, Ordering::Relaxed);
        Some(Slot(self))
    }
}

impl<A> ClientConnections<A> {
    /// Connection handling for `app`, with limits from `runtime`'s live table and its open
    /// connections counted in `open`.
    pub fn new(app: A, runtime: Arc<Runtime>, open: Arc<OpenConnections>) -> Self {
        ClientConnections {
            app: Arc::new(app),
            runtime,
            open,
            stop: watch::channel(false).0,
        }
    }
}

/// The header limits, read from the live routing table once per header.
#[derive(Debug, Clone, Copy)]
struct HeadLimits {
    timeout: Duration,
    max_bytes: usize,
    keepalive: Duration,
}

/// How a wait for a request header ended.
#[derive(Debug)]
enum Head {
    /// The complete header, and whatever followed it in the same reads.
    Ready(BytesMut),
    /// The client closed, sent nothing in time, or the gateway is stopping.
    Closed,
    /// Over `limits.max_header_bytes` before it ended.
    TooLarge,
    /// Started but not complete by its deadline.
    TimedOut,
}

#[async_trait]
impl<A: HttpServerApp + Send + Sync + 'static> ServerApp for ClientConnections<A> {
    async fn process_new(
        self: &Arc<Self>,
        mut stream: Stream,
        shutdown: &ShutdownWatch,
    ) -> Option<Stream> {
        let accepted = Instant::now();
        let cap = self.runtime.table().limits.max_connections;
        let Some(_slot) = self.open.try_open(cap) else {
            // Dropped unread: closed at once, before any buffer or parse.
            METRICS.connections_refused.inc();
            return None;
        };
        let mut stop = self.stop.subscribe();
        let mut timer = quiet_timer();
        let mut first = true;
        let mut persistent = None;
        loop {
            let limits = {
                let table = self.runtime.table();
                HeadLimits {
                    timeout: Duration::from_millis(table.limits.client_header_timeout_ms),
                    max_bytes: table.limits.max_header_bytes,
                    keepalive: Duration::from_secs(table.limits.client_keepalive_timeout_s),
                }
            };
            // A first request's whole header is due `timeout` after the accept; a later one
            // may idle for the keep-alive time, then is due `timeout` after its first byte.
            let first_deadline = first.then(|| accepted + limits.timeout);
            let prefix = match read_head(
                &mut stream,
                first_deadline,
                &limits,
                &mut stop,
                &mut timer,
            )
            .await
            {
                Head::Ready(prefix) => prefix,
                Head::Closed => return None,
                Head::TooLarge => {
                    let e = GatewayError::HeaderTooLarge {
                        limit: limits.max_bytes,
                    };
                    refuse(&mut stream, &e).await;
                    linger(&mut stream).await;
                    return None;
                }
                Head::TimedOut => {
                    let e = GatewayError::ClientHeaderTimeout(limits.timeout.as_millis() as u64);
                    refuse(&mut stream, &e).await;
                    return None;
                }
            };
            let mut session = ServerSession::new_http1(stream);
            if let Some(settings) = persistent.take() {
                HttpPersistentSettings::apply_to_session(settings, &mut session);
            } else if first {
                // pingora's own first-request defaults (its `ServerApp` for HTTP apps); rolter
                // then sets its keep-alive per request (`admission::apply_client_limits`).
                session.set_keepalive((!*shutdown.borrow()).then_some(60));
                session.set_keepalive_reuses_remaining(
                    self.app
                        .server_options()
                        .and_then(|o| o.keepalive_request_limit),
                );
            }
            // rolter never enables pipelining, so a reused connection's settings carry no
            // prefix of their own for this one to replace.
            session.set_pipelined_prefix(prefix);
            let reused = self.app.process_new_http(session, shutdown).await?;
            (stream, persistent) = reused.consume();
            first = false;
        }
    }

    async fn cleanup(&self) {
        tokio::time::sleep(SHUTDOWN_LINGER).await;
        let _ = self.stop.send(true);
        self.app.http_cleanup().await;
    }
}

/// Wait for a complete request header on `stream`: a first request's until
/// `first_deadline`; a later one's for up to the keep-alive time, then for `limits.timeout`
/// from its first byte. Leading empty lines count toward the size limit (a client sending
/// only CRLFs is refused like any other oversized header).
async fn read_head(
    stream: &mut Stream,
    first_deadline: Option<Instant>,
    limits: &HeadLimits,
    stop: &mut watch::Receiver<bool>,
    timer: &mut QuietTimer,
) -> Head {
    let mut held = BytesMut::new();
    let mut end = HeadEnd::default();
    let mut deadline = first_deadline;
    loop {
        let wait = match deadline {
            Some(d) => d.saturating_duration_since(Instant::now()),
            None => limits.keepalive,
        };
        // The quiet wait's timer is the connection's own, re-armed for each wait by moving
        // its deadline later: while it has not fired that is one atomic update (tokio's
        // timer), where a timer per wait joins and leaves the runtime's timer wheel each
        // time. It fires at most once per request that outlasts it (one extra poll of the
        // connection's task, which finds nothing to do).
        // The stop signal is watched only once a read has waited `QUIET_WAIT`: a request
        // arriving on a busy keep-alive connection never registers with it (a waiter's
        // registration and removal take the signal's lock), while an idle connection
        // still closes within `QUIET_WAIT` of the stop. (A header still arriving in
        // pieces less than `QUIET_WAIT` apart is left to its deadline, or to the
        // runtime's end after the grace period.)
        let quiet = wait.min(QUIET_WAIT);
        timer.as_mut().reset(tokio::time::Instant::now() + quiet);
        let mut keep = |read: &mut BytesMut| keep_read(&mut held, read);
        let read = tokio::select! {
            biased;
            read = read_some(stream, &mut keep) => Ok(read),
            () = timer.as_mut() => Err(()),
        };
        let read = match read {
            Err(()) if quiet < wait => {
                // The rest: to the header's deadline, or (a kept-alive connection waiting
                // for its next request) the keep-alive time less the quiet wait, which
                // the timer's rounding may stretch by a few ms (no clock read for it).
                let left = match deadline {
                    Some(d) => d.saturating_duration_since(Instant::now()),
                    None => wait - quiet,
                };
                let read = pingora::time::timeout(left, read_some(stream, &mut keep));
                tokio::select! {
                    biased;
                    read = read => read.map_err(|_| ()),
                    _ = stop.changed() => return Head::Closed,
                }
            }
            read => read,
        };
        match read {
            Ok(Ok(0)) | Ok(Err(_)) => return Head::Closed,
            Ok(Ok(_)) => {}
            // Nothing at all by the deadline (an idle new connection), or nothing within the
            // keep-alive time: closed quietly, as an idle connection.
            Err(_) if held.is_empty() => return Head::Closed,
            Err(_) => return Head::TimedOut,
        }
        if let Some(len) = end.find(&held) {
            return if len > limits.max_bytes {
                Head::TooLarge
            } else {
                Head::Ready(held)
            };
        }
        if held.len() > limits.max_bytes {
            return Head::TooLarge;
        }
        deadline.get_or_insert_with(|| Instant::now() + limits.timeout);
    }
}

/// Read what `stream` has into the per-thread scratch buffer and hand it to `keep`, which
/// may take the buffer (nothing is allocated while the read pends); the number of bytes
/// read, 0 at EOF.
async fn read_some(
    stream: &mut Stream,
    mut keep: impl FnMut(&mut BytesMut),
) -> std::io::Result<usize> {
    poll_fn(|cx| {
        SCRATCH.with_borrow_mut(|scratch| {
            let read = poll_read_buf(Pin::new(&mut *stream), cx, scratch);
            if let Poll::Ready(Ok(_)) = read {
                keep(scratch);
                scratch.clear();
            }
            read
        })
    })
    .await
}

/// Add the bytes of one read (`read`, the scratch buffer) to `held`. A read that starts a
/// header and filled all of the scratch buffer's room (a long request arriving at once) is
/// taken whole, and the thread gets a fresh scratch buffer: its bytes are not copied (the
/// body bytes in it reach pingora, then the route, in that same allocation, whose room is
/// exactly those bytes). Any other read is copied: a header that came in one read is held
/// in exactly its bytes, one that came in several in a buffer grown as a `Vec` grows (up
/// to twice its bytes, for the request's life); pingora then copies the body bytes that
/// came with it out of that buffer at their size. Either way the body bytes are charged
/// exactly (`proxy::body`).
fn keep_read(held: &mut BytesMut, read: &mut BytesMut) {
    if held.is_empty() && read.len() == read.capacity() {
        *held = std::mem::replace(read, BytesMut::with_capacity(SCRATCH_LEN));
    } else {
        held.extend_from_slice(read);
    }
}

/// Where a request's header section ends, found in bytes that arrive in pieces: each byte
/// is looked at about once however the header is split (pingora re-parses from the start
/// after every read). The end is the first empty line after the request line: a LF
/// followed by LF or CRLF, as httparse reads it (bare LF line ends included). Empty lines
/// before the request line are skipped, as httparse skips them. Where httparse would see
/// no end, this sees none either (an empty line ends a header section, or the request is
/// malformed before it and pingora refuses it).
#[derive(Debug, Default)]
struct HeadEnd {
    /// Where the request line starts (past leading CR/LF), once seen.
    start: Option<usize>,
    /// Bytes already looked at.
    seen: usize,
}

impl HeadEnd {
    /// The header section's length (up to and including its empty line) in `buf`, which
    /// holds every byte so far (earlier calls saw a prefix of it); None while incomplete.
    fn find(&mut self, buf: &[u8]) -> Option<usize> {
        let start = match self.start {
            Some(start) => start,
            None => {
                let Some(at) = buf[self.seen..]
                    .iter()
                    .position(|b| !matches!(b, b'\r' | b'\n'))
                else {
                    self.seen = buf.len();
                    return None;
                };
                self.seen += at;
                *self.start.insert(self.seen)
            }
        };
        // A LF in the last two bytes looked at may begin the end with bytes that just came.
        let from = self.seen.saturating_sub(2).max(start);
        for lf in memchr::memchr_iter(b'\n', &buf[from..]) {
            let lf = from + lf;
            match (buf.get(lf + 1), buf.get(lf + 2)) {
                (Some(b'\n'), _) => return Some(lf + 2),
                (Some(b'\r'), Some(b'\n')) => return Some(lf + 3),
                (None, _) | (Some(b'\r'), None) => {
                    self.seen = lf;
                    return None;
                }
                _ => {}
            }
        }
        self.seen = buf.len();
        None
    }
}

/// Answer a refused header with `e` (OpenAI's error shape, `connection: close`), count it
/// and log its access line; the connection closes after.
async fn refuse(stream: &mut Stream, e: &GatewayError) {
    METRICS.errors.with_label_values(&[e.kind()]).inc();
    let status = http::StatusCode::from_u16(e.status()).expect("a valid status");
    METRICS
        .requests
        .with_label_values(&["-", "-", status.as_str()])
        .inc();
    // The access line of a request pingora never saw: method and path unknown.
    log::info!(
        target: "access",
        "method=- path=- status={} route=- target=- strategy=- reason=- score=- attempts=0 stream=false body_bytes=0 error={} ms=-",
        e.status(),
        e.kind()
    );
    let body = e.body();
    let answer = format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        status.as_str(),
        status.canonical_reason().unwrap_or(""),
        body.len()
    );
    let write = async {
        stream.write_all(answer.as_bytes()).await?;
        stream.flush().await
    };
    let _ = tokio::time::timeout(ANSWER_WRITE_LIMIT, write).await;
}

/// Read and discard what the client still sends, for at most [`LINGER_TIME`] and while
/// bytes keep coming: closing a socket with unread bytes resets the connection, and the
/// client might lose the answer just written (nginx's `lingering_close`).
async fn linger(stream: &mut Stream) {
    let drain = async {
        while let Ok(Ok(n)) = tokio::time::timeout(LINGER_IDLE, read_some(stream, |_| {})).await {
            if n == 0 {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(LINGER_TIME, drain).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn test_limits() -> HeadLimits {
        HeadLimits {
            timeout: Duration::from_secs(5),
            max_bytes: 8192,
            keepalive: Duration::from_secs(30),
        }
    }

    /// A connection on loopback: the client's end and the gateway's, as pingora wraps it.
    async fn loopback() -> (tokio::net::TcpStream, Stream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        (
            client,
            Box::new(pingora::protocols::l4::stream::Stream::from(server)),
        )
    }

    /// A kept-alive connection's wait for its next header on loopback: `act` gets the
    /// client's end and the stop signal; what the wait returned, and how long it took.
    async fn wait_for_head<F, Fut>(act: F) -> (Head, Duration)
    where
        F: FnOnce(tokio::net::TcpStream, watch::Sender<bool>) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let (client, mut stream) = loopback().await;
        let (stop, mut stopped) = watch::channel(false);
        let acting = tokio::spawn(act(client, stop));
        let started = Instant::now();
        let head = tokio::time::timeout(
            Duration::from_secs(10),
            read_head(
                &mut stream,
                None,
                &test_limits(),
                &mut stopped,
                &mut quiet_timer(),
            ),
        )
        .await
        .expect("the wait ended by itself");
        let took = started.elapsed();
        acting.abort();
        (head, took)
    }

    /// The connection's one quiet timer serves every wait: re-armed while pending (the
    /// next request came at once), after it fired (a request came after a pause), and
    /// it still ends an idle wait soon after the stop.
    #[tokio::test]
    async fn one_timer_serves_all_of_a_connections_waits() {
        const REQ: &[u8] = b"GET /health HTTP/1.1\r\nHost: a\r\n\r\n";
        let (mut client, mut stream) = loopback().await;
        let (stop, mut stopped) = watch::channel(false);
        let (limits, mut timer) = (test_limits(), quiet_timer());
        for gap in [
            Duration::ZERO,
            QUIET_WAIT * 3,
            Duration::ZERO,
            QUIET_WAIT / 2,
        ] {
            let write = async {
                tokio::time::sleep(gap).await;
                client.write_all(REQ).await.unwrap();
            };
            let wait_started = tokio::time::Instant::now();
            let wait = read_head(&mut stream, None, &limits, &mut stopped, &mut timer);
            let (head, ()) =
                tokio::time::timeout(Duration::from_secs(10), async { tokio::join!(wait, write) })
                    .await
                    .expect("the wait ended by itself");
            match head {
                Head::Ready(bytes) => assert_eq!(&bytes[..], REQ, "gap {gap:?}"),
                other => panic!("gap {gap:?}: {other:?}"),
            }
            // This wait armed the timer: its deadline is this wait's, not an earlier one's
            // (and it ran out if the header came after the quiet wait).
            assert!(timer.deadline() >= wait_started + QUIET_WAIT, "gap {gap:?}");
            assert!(timer.is_elapsed() || gap <= QUIET_WAIT, "gap {gap:?}");
        }
        let started = Instant::now();
        let stopping = async {
            tokio::time::sleep(QUIET_WAIT * 2).await;
            stop.send(true).unwrap();
        };
        let wait = read_head(&mut stream, None, &limits, &mut stopped, &mut timer);
        let (head, ()) = tokio::time::timeout(Duration::from_secs(10), async {
            tokio::join!(wait, stopping)
        })
        .await
        .expect("the wait ended by itself");
        assert!(matches!(head, Head::Closed), "{head:?}");
        let took = started.elapsed();
        assert!(
            took < QUIET_WAIT * 2 + Duration::from_millis(700),
            "closed after {took:?}"
        );
    }

    #[tokio::test]
    async fn an_idle_connection_closes_soon_after_the_stop_and_a_late_header_is_still_read() {
        const REQ: &[u8] = b"GET /health HTTP/1.1\r\nHost: a\r\n\r\n";
        // The stop, signalled while the connection idles, before and after the wait began
        // watching it: closed within QUIET_WAIT of it, not at the 30 s keep-alive time.
        for after in [Duration::from_millis(20), QUIET_WAIT * 3] {
            let (head, took) = wait_for_head(move |client, stop| async move {
                tokio::time::sleep(after).await;
                stop.send(true).unwrap();
                tokio::time::sleep(Duration::from_secs(60)).await;
                drop(client);
            })
            .await;
            assert!(
                matches!(head, Head::Closed),
                "stop after {after:?}: {head:?}"
            );
            assert!(
                took < after + Duration::from_millis(700),
                "stop after {after:?}: closed after {took:?}"
            );
        }
        // A header arriving at once, after the wait began watching the stop, and in two
        // parts across it: each is read whole.
        for (first, gap) in [
            (REQ.len(), Duration::ZERO),
            (0, QUIET_WAIT * 3),
            (5, QUIET_WAIT * 3),
        ] {
            let (head, _) = wait_for_head(move |mut client, stop| async move {
                client.write_all(&REQ[..first]).await.unwrap();
                tokio::time::sleep(gap).await;
                client.write_all(&REQ[first..]).await.unwrap();
                tokio::time::sleep(Duration::from_secs(60)).await;
                drop(stop);
            })
            .await;
            match head {
                Head::Ready(bytes) => assert_eq!(&bytes[..], REQ, "first {first}, gap {gap:?}"),
                other => panic!("first {first}, gap {gap:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_read_that_fills_the_scratch_buffer_is_taken_whole_and_any_other_copied() {
        let fresh = || BytesMut::with_capacity(SCRATCH_LEN);
        // A full first read: `held` gets that allocation, the scratch buffer a fresh one.
        let mut read = fresh();
        read.extend_from_slice(&[7; SCRATCH_LEN]);
        let at = read.as_ptr();
        let mut held = BytesMut::new();
        keep_read(&mut held, &mut read);
        assert_eq!(held.as_ptr(), at);
        assert_eq!((held.len(), held.capacity()), (SCRATCH_LEN, SCRATCH_LEN));
        assert!(read.is_empty());
        assert_eq!(read.capacity(), SCRATCH_LEN);
        assert_ne!(read.as_ptr(), at);
        // A later full read adds to what is held, copied.
        read.extend_from_slice(&[8; SCRATCH_LEN]);
        let next = read.as_ptr();
        keep_read(&mut held, &mut read);
        assert_eq!(held.len(), 2 * SCRATCH_LEN);
        assert_eq!(&held[SCRATCH_LEN - 1..SCRATCH_LEN + 1], &[7, 8]);
        assert_eq!(read.as_ptr(), next, "the scratch buffer stays the thread's");
        // A short first read is copied at its size; the scratch buffer stays.
        let mut read = fresh();
        read.extend_from_slice(b"GET / HTTP/1.1\r\n");
        let at = read.as_ptr();
        let mut held = BytesMut::new();
        keep_read(&mut held, &mut read);
        assert_eq!(&held[..], b"GET / HTTP/1.1\r\n");
        assert_eq!(held.capacity(), held.len());
        assert_eq!(read.as_ptr(), at);
    }

    /// Feed `pieces` one after another; the end found, and after which piece.
    fn end_of(pieces: &[&[u8]]) -> Option<(usize, usize)> {
        let mut end = HeadEnd::default();
        let mut buf = Vec::new();
        for (i, p) in pieces.iter().enumerate() {
            buf.extend_from_slice(p);
            if let Some(len) = end.find(&buf) {
                return Some((len, i));
            }
        }
        None
    }

    #[test]
    fn finds_the_end_of_a_header_however_it_is_split() {
        let req = b"GET / HTTP/1.1\r\nHost: a\r\n\r\nbody";
        let len = req.len() - 4;
        assert_eq!(end_of(&[req]), Some((len, 0)));
        // Every split into two pieces, and byte by byte.
        for cut in 0..req.len() {
            let (a, b) = req.split_at(cut);
            assert_eq!(end_of(&[a, b]).map(|e| e.0), Some(len), "cut at {cut}");
        }
        let bytes: Vec<&[u8]> = req.chunks(1).collect();
        assert_eq!(end_of(&bytes).map(|e| e.0), Some(len));
        // Bare LF line ends, and a request with no header fields.
        assert_eq!(end_of(&[b"GET / HTTP/1.1\nHost: a\n\nx"]), Some((24, 0)));
        assert_eq!(end_of(&[b"GET / HTTP/1.1\r\n\r\n"]), Some((18, 0)));
        // Leading empty lines are skipped, not taken for the end.
        assert_eq!(
            end_of(&[b"\r\n\r\n\n", b"GET / HTTP/1.1\r\n", b"\r\n"]),
            Some((23, 2))
        );
        assert_eq!(end_of(&[b"\r\n\r\n\r\n\r\n"]), None);
        // Not an end: a CR inside a line, a LF followed by other bytes.
        assert_eq!(end_of(&[b"GET / HTTP/1.1\r\nA: b\r\r\nC: d\r\n"]), None);
    }

    #[test]
    fn agrees_with_httparse_on_where_a_header_ends() {
        let samples: [&[u8]; 5] = [
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: g\r\nContent-Length: 2\r\n\r\n{}",
            b"GET / HTTP/1.1\nA: b\nC: d\n\n",
            b"\r\nGET / HTTP/1.1\r\nA: b\r\n\r\n",
            b"GET / HTTP/1.0\r\n\r\nGET / HTTP/1.0\r\n\r\n",
            b"GET / HTTP/1.1\r\nA: b\n\r\nrest",
        ];
        for sample in samples {
            let mut headers = [httparse::EMPTY_HEADER; 16];
            let mut req = httparse::Request::new(&mut headers);
            let httparse::Status::Complete(len) = req.parse(sample).unwrap() else {
                panic!("incomplete: {sample:?}");
            };
            for cut in 0..sample.len() {
                let (a, b) = sample.split_at(cut);
                assert_eq!(
                    end_of(&[a, b]).map(|e| e.0),
                    Some(len),
                    "{sample:?} cut at {cut}"
                );
            }
        }
    }

    #[test]
    fn a_big_drop_in_open_connections_is_counted_once_per_quarter() {
        let open = OpenConnections::default();
        let slots: Vec<_> = (0..2000).map(|_| open.try_open(10_000).unwrap()).collect();
        let mut slots = slots.into_iter();
        // Down to 501 of a peak of 2000: not yet a quarter.
        slots.by_ref().take(1499).for_each(drop);
        assert_eq!(open.drops.load(Ordering::Relaxed), 0);
        // 500: a big drop; the peak restarts from there, below the threshold for another.
        drop(slots.next());
        assert_eq!(open.drops.load(Ordering::Relaxed), 1);
        assert_eq!(open.peak.load(Ordering::Relaxed), 500);
        slots.for_each(drop);
        assert_eq!(open.drops.load(Ordering::Relaxed), 1);
        assert_eq!(open.count(), 0);
        // A steady trickle never is one.
        for _ in 0..5000 {
            drop(open.try_open(10_000).unwrap());
        }
        assert_eq!(open.drops.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn connection_places_are_capped_exactly_and_come_back() {
        let open = OpenConnections::default();
        let a = open.try_open(2).unwrap();
        let _b = open.try_open(2).unwrap();
        assert!(open.try_open(2).is_none());
        assert_eq!(open.count(), 2);
        drop(a);
        assert!(open.try_open(2).is_some());
        assert_eq!(open.count(), 1);
    }
}
