//! One upstream exchange over a pooled HTTP/1 connection ([`super::pool`]): send the
//! rewritten request, relay the response header and stream the body to the client chunk by
//! chunk.
//!
//! Failures are classified by *when* they happened, because that decides what may be
//! retried: before any request byte reached the upstream (connect failure, or a pooled
//! connection that turned out dead) a retry is safe; after the response started,
//! nothing can be retried or replaced.

use super::admission::BodyBytes;
use super::error::GatewayError;
use super::framing::BodyBuf;
use super::pool::{IdleStack, UpstreamPool};
use super::retry::RetryReason;
use crate::config::XForwardedFor;
use crate::runtime::auth::X_API_KEY;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::protocols::http::v1::client::HttpSession;
use pingora::protocols::Stream;
use pingora::proxy::Session;
use pingora::upstreams::peer::HttpPeer;
use pingora::{Error, ErrorType, RetryType};
use std::io::IoSlice;
use std::io::Write as _;
use std::net::IpAddr;
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;

/// Hop-by-hop headers (RFC 9110 §7.6.1, plus `http2-settings`, RFC 7540 §3.2.1, and the
/// non-standard `proxy-connection`), those the gateway sets itself, and its own routing
/// hints. The token-id header is the gateway's alone and can be hundreds of KB: vLLM behind
/// uvicorn/h11 refuses a header section over 16 KiB, and a forwarded one would turn a long
/// prompt's routing hint into a failed request. Headers the client's `Connection` header
/// names are dropped too ([`HopByHop`]).
const NOT_FORWARDED_REQUEST: &[&str] = &[
    crate::prompt::TOKEN_IDS_HEADER,
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "http2-settings",
    "expect",
    "host",
    "content-length",
];
/// The de facto standard header carrying the client address chain (`[forwarding]`).
const X_FORWARDED_FOR: &str = "x-forwarded-for";
const NOT_FORWARDED_RESPONSE: &[&str] =
    &["connection", "keep-alive", "proxy-connection", "upgrade"];

/// How an exchange failed.
#[derive(Debug)]
pub enum ExchangeError {
    /// Nothing reached the client and the upstream did not act on the request (it could
    /// not be reached, reset the connection before answering, or answered 502/503): safe
    /// to try another target.
    Retryable(GatewayError, RetryReason),
    /// Not safe to retry (the upstream may have acted, or the client saw bytes).
    Final(GatewayError),
}

/// What a completed exchange looked like.
#[derive(Debug, Clone, Copy)]
pub struct ExchangeOutcome {
    /// Upstream status, relayed to the client.
    pub status: u16,
    /// Selection-to-response-header time.
    pub ttfb: Duration,
    /// Whether the upstream connection came from the pool.
    pub reused: bool,
    /// When the upstream's response ended (its last byte read).
    pub finished: Instant,
}

/// The request to send: the client's body, gathered behind `head` with the `model` value
/// at `model_span` replaced, and the charge for its pieces. Both are let go as soon as the
/// upstream's response header is in:
/// nothing is retried after that, and a long stream should not hold its prompt's memory
/// (nor the body budget) for minutes.
pub struct Outgoing<'a, 'b> {
    pub body: &'a mut BodyBuf,
    pub head: &'a [u8],
    pub model_span: std::ops::Range<usize>,
    pub model: &'a [u8],
    pub charge: &'a mut BodyBytes<'b>,
}

/// Everything the exchange needs about its target.
pub struct Upstream<'a> {
    pub peer: &'a HttpPeer,
    /// The peer's idle connections (`None`: not pooled).
    pub idle: Option<&'a IdleStack>,
    pub label: &'a str,
    pub idle_timeout: Duration,
    /// Whether a 502 or 503 answer is kept from the client and returned as
    /// [`ExchangeError::Retryable`] (another attempt will be made).
    pub retry_on_status: bool,
}

/// What the upstream is told about the client: `X-Forwarded-For` per `[forwarding]`.
#[derive(Debug, Clone, Copy)]
pub struct ClientInfo {
    pub x_forwarded_for: XForwardedFor,
    /// The client's address (none on a Unix socket).
    pub addr: Option<IpAddr>,
}

/// What the upstream gets as `Authorization` (the client's `x-api-key` goes with the
/// client's `Authorization`: forwarded only under `Forward`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamAuth<'a> {
    /// The client's header, as sent (no provider key, no `[auth]`).
    Forward,
    /// None: the client's header carried its key for rolter (`[auth]`), not for the
    /// upstream.
    Drop,
    /// This value (`Bearer <provider api_key>`) in place of the client's.
    Replace(&'a str),
}

/// The request headers not forwarded: [`NOT_FORWARDED_REQUEST`] and the names the client's
/// `Connection` header lists (RFC 9110 §7.6.1: the sender marks them hop-by-hop).
struct HopByHop {
    /// Listed names not in the fixed list, lowercased and sorted; empty (no allocation)
    /// for the usual `Connection: keep-alive` or `close`. Sorted so that a header section
    /// naming thousands of them costs a binary search per header, not a scan.
    listed: Vec<String>,
}

impl HopByHop {
    /// Add the names a `Connection` header value lists (the fixed ones are known already).
    fn add_listed(listed: &mut Vec<String>, connection: &http::HeaderValue) {
        for token in connection.as_bytes().split(|b| *b == b',') {
            let token = token.trim_ascii();
            if token.is_empty()
                || NOT_FORWARDED_REQUEST
                    .iter()
                    .any(|n| n.as_bytes().eq_ignore_ascii_case(token))
            {
                continue;
            }
            listed.push(String::from_utf8_lossy(token).to_ascii_lowercase());
        }
    }

    fn new(mut listed: Vec<String>) -> Self {
        listed.sort_unstable();
        listed.dedup();
        HopByHop { listed }
    }

    fn contains(&self, name: &str) -> bool {
        NOT_FORWARDED_REQUEST.contains(&name)
            || (!self.listed.is_empty()
                && self
                    .listed
                    .binary_search_by(|l| l.as_str().cmp(name))
                    .is_ok())
    }
}

/// The upstream request head for a body of `body_len` bytes (after the model rewrite): the
/// client's method and path under `base_path`, its end-to-end headers, `x-forwarded-for`
/// (per `info`), `host` and `content-length`. The caller gathers the body's pieces behind
/// it (`framing::BodyBuf::gather`), so the request leaves in one vectored write (one TCP
/// segment on loopback instead of two).
///
/// Every piece comes from an already validated source: the method, URI and header
/// names/values were parsed by pingora (an `http` type holds no CR, LF or NUL, and a
/// path no space), and `host`/`base_path` were checked when the routing file loaded.
/// Two passes over the client's headers (sizes and the `Connection` header, then the
/// copy) and no map lookup: a lookup hashes the name, a pass compares known names.
pub fn encode_head(
    client: &RequestHeader,
    host: &str,
    base_path: &str,
    body_len: usize,
    info: ClientInfo,
    auth: UpstreamAuth<'_>,
) -> Vec<u8> {
    let path_and_query = client.uri.path_and_query().map_or("/", |pq| pq.as_str());
    // An upper bound (dropped headers included); the X-Forwarded-For line's own words and
    // an address fit in the slack.
    let replacement = match auth {
        UpstreamAuth::Replace(value) => Some(value),
        _ => None,
    };
    let mut head_len = 128
        + base_path.len()
        + path_and_query.len()
        + host.len()
        + replacement.map_or(0, |v| v.len() + 17);
    let mut listed = Vec::new();
    for (name, value) in client.headers.iter() {
        head_len += name.as_str().len() + value.len() + 4;
        if name == http::header::CONNECTION {
            HopByHop::add_listed(&mut listed, value);
        }
    }
    let hop = HopByHop::new(listed);
    // Under `append` and `replace` the client's own list is not copied as it stands; under
    // `append` its values start the new one (unless the client marked it hop-by-hop).
    let rewrite_xff = info.x_forwarded_for != XForwardedFor::Off;
    let keep_list = info.x_forwarded_for == XForwardedFor::Append;
    let mut list: Vec<&[u8]> = Vec::new();
    let mut out = Vec::with_capacity(head_len);
    let mut put = |parts: &[&[u8]]| parts.iter().for_each(|p| out.extend_from_slice(p));
    put(&[
        client.method.as_str().as_bytes(),
        b" ",
        base_path.as_bytes(),
        path_and_query.as_bytes(),
        b" HTTP/1.1\r\n",
    ]);
    for (name, value) in client.headers.iter() {
        let name = name.as_str();
        if hop.contains(name) {
            continue;
        }
        // The client's key (OpenAI's or Anthropic's header) was for rolter or is replaced.
        if (name == "authorization" || name == X_API_KEY) && auth != UpstreamAuth::Forward {
            continue;
        }
        if rewrite_xff && name == X_FORWARDED_FOR {
            if keep_list {
                list.push(value.as_bytes());
            }
            continue;
        }
        put(&[name.as_bytes(), b": ", value.as_bytes(), b"\r\n"]);
    }
    if let Some(value) = replacement {
        put(&[b"authorization: ", value.as_bytes(), b"\r\n"]);
    }
    if rewrite_xff && (!list.is_empty() || info.addr.is_some()) {
        put(&[X_FORWARDED_FOR.as_bytes(), b": "]);
        for (i, value) in list.iter().enumerate() {
            put(&[if i == 0 { b"" } else { b", " }, value]);
        }
        if let Some(ip) = info.addr {
            if !list.is_empty() {
                out.extend_from_slice(b", ");
            }
            write_ip(&mut out, ip);
        }
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"host: ");
    out.extend_from_slice(host.as_bytes());
    out.extend_from_slice(b"\r\ncontent-length: ");
    write!(out, "{body_len}\r\n\r\n").expect("writing to a Vec cannot fail");
    out
}

/// An address as text (`192.0.2.7`, `2001:db8::1`). IPv4 by hand: `Display` goes through
/// the formatting machinery, about 700 instructions per request (callgrind,
/// `loadtest/profile.sh`).
fn write_ip(out: &mut Vec<u8>, ip: IpAddr) {
    match ip {
        IpAddr::V4(v4) => {
            for (i, n) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    out.push(b'.');
                }
                if n >= 100 {
                    out.push(b'0' + n / 100);
                }
                if n >= 10 {
                    out.push(b'0' + n / 10 % 10);
                }
                out.push(b'0' + n % 10);
            }
        }
        IpAddr::V6(v6) => write!(out, "{v6}").expect("writing to a Vec cannot fail"),
    }
}

/// The upstream's answer with its head read, not yet relayed ([`relay`] does that).
pub struct Answer {
    http: HttpSession,
    /// Whether the upstream connection came from the pool.
    reused: bool,
    /// Upstream status.
    pub status: u16,
    /// Selection-to-response-header time.
    pub ttfb: Duration,
}

impl Answer {
    /// Whether the answer is an SSE stream (`Content-Type: text/event-stream`).
    pub fn is_event_stream(&self) -> bool {
        self.http
            .resp_header()
            .and_then(|h| h.headers.get(http::header::CONTENT_TYPE))
            .is_some_and(|v| {
                v.as_bytes()
                    .get(..17)
                    .is_some_and(|t| t.eq_ignore_ascii_case(b"text/event-stream"))
            })
    }
}

/// Send the request to the upstream and read its response head. The request's buffer and
/// its charge are let go as soon as the head is in.
pub async fn send(
    pool: &UpstreamPool,
    up: &Upstream<'_>,
    session: &mut Session,
    out: Outgoing<'_, '_>,
    started: Instant,
) -> Result<Answer, ExchangeError> {
    let sent = {
        let request = out.body.gather(out.head, out.model_span.clone(), out.model);
        unless_client_gone(session, send_and_read_head(pool, up, &request, started)).await
    };
    let (http, reused) = sent.map_err(ExchangeError::Final)??;
    let status = http
        .resp_header()
        .expect("response header was just read")
        .status
        .as_u16();
    if let Some(reason) = RetryReason::for_status(status).filter(|_| up.retry_on_status) {
        // Kept from the client: the body stays for the next attempt, and this connection
        // (its unread answer body with it) is closed rather than pooled.
        return Err(ExchangeError::Retryable(
            GatewayError::UpstreamStatus {
                target: up.label.to_string(),
                status,
            },
            reason,
        ));
    }
    out.body.release();
    out.charge.release();
    crate::metrics::UPSTREAM_CONNECTIONS[usize::from(reused)].inc();
    let ttfb = started.elapsed();
    Ok(Answer {
        http,
        reused,
        status,
        ttfb,
    })
}

/// Relay an answer to `session`: its head, then its body as it arrives (each chunk shown
/// to `observe` first); the upstream connection goes back to the pool when the body ends,
/// and `upstream_done` is called then, before the client can see the answer end.
/// The head is taken out of the upstream session, not copied: from then on the session's
/// `resp_header()` holds only what its keep-alive decision reads (status, version,
/// `Connection`, `Keep-Alive`, `Transfer-Encoding`), so anything else of the head (its
/// content type, say) must be read before this is called, as `Answer::status` and
/// `Answer::is_event_stream` are.
pub async fn relay(
    pool: &UpstreamPool,
    up: &Upstream<'_>,
    session: &mut Session,
    answer: Answer,
    observe: &mut (dyn FnMut(&[u8]) + Send),
    upstream_done: &(dyn Fn() + Sync),
) -> Result<ExchangeOutcome, ExchangeError> {
    let Answer {
        mut http,
        reused,
        status,
        ttfb,
    } = answer;
    let upstream_header = http.take_resp_header().expect("response header was read");
    let header = downstream_response(upstream_header)
        .map_err(|e| ExchangeError::Final(upstream_error(up.label, &e)))?;
    let no_body = http.is_body_done();
    session
        .write_response_header(header, no_body)
        .await
        .map_err(|e| ExchangeError::Final(GatewayError::client_write(&e)))?;

    // Stream the body through as it arrives: SSE chunks are never held back. The chunk
    // that ends the body waits until the upstream connection is released below.
    let mut last = None;
    while !no_body && !http.is_body_done() {
        // A stream can pause for long (a tool call being generated).
        let read = unless_client_gone(session, http.read_body_bytes());
        let chunk = match read.await.map_err(ExchangeError::Final)? {
            Ok(Some(chunk)) => chunk,
            Ok(None) => break,
            Err(e) => return Err(ExchangeError::Final(upstream_error(up.label, &e))),
        };
        observe(&chunk);
        if http.is_body_done() {
            last = Some(chunk);
            break;
        }
        session
            .write_response_body(Some(chunk), false)
            .await
            .map_err(|e| ExchangeError::Final(GatewayError::client_write(&e)))?;
    }
    // The upstream is done with: its connection goes back before the client can see the
    // answer end (a client sending its next request at once finds it in the pool instead
    // of racing this task to it, and opening a new one) and before the last write to a
    // client that may be slow. pingora's keep-alive rules (response version and
    // `connection` header, a body read to its end with nothing extra, no upgrade) decide
    // whether it may. The in-flight slot goes back then too, for the same reason: a
    // client's next request must not find the target still busy with this one (load-based
    // routing would avoid an idle target).
    http.respect_keepalive();
    let finished = Instant::now();
    if let (Some(stream), Some(idle)) = (http.reuse().await, up.idle) {
        pool.put(idle, stream, up.idle_timeout, finished);
    }
    upstream_done();
    if let Some(chunk) = last {
        session
            .write_response_body(Some(chunk), false)
            .await
            .map_err(|e| ExchangeError::Final(GatewayError::client_write(&e)))?;
    }
    session
        .write_response_body(None, true)
        .await
        .map_err(|e| ExchangeError::Final(GatewayError::client_write(&e)))?;
    Ok(ExchangeOutcome {
        status,
        ttfb,
        reused,
        finished,
    })
}

/// Send a small bodiless `request` (rolter's own, not a client's) and read the whole
/// answer: its status and at most `max_bytes` of body (more is an error).
pub async fn fetch_small(
    pool: &UpstreamPool,
    up: &Upstream<'_>,
    request: &[u8],
    max_bytes: usize,
) -> Result<(u16, Vec<u8>), GatewayError> {
    let unwrap = |e: ExchangeError| match e {
        ExchangeError::Retryable(e, _) | ExchangeError::Final(e) => e,
    };
    let (mut http, _) = send_and_read_head(pool, up, &[IoSlice::new(request)], Instant::now())
        .await
        .map_err(unwrap)?;
    let status = http.resp_header().map_or(0, |h| h.status.as_u16());
    let mut body = Vec::new();
    while !http.is_body_done() {
        match http.read_body_bytes().await {
            Ok(Some(chunk)) if body.len() + chunk.len() <= max_bytes => {
                body.extend_from_slice(&chunk)
            }
            Ok(Some(_)) => {
                return Err(GatewayError::UpstreamBroken {
                    target: up.label.to_string(),
                    reason: format!("answer over {max_bytes} bytes"),
                })
            }
            Ok(None) => break,
            Err(e) => return Err(upstream_error(up.label, &e)),
        }
    }
    http.respect_keepalive();
    if let (Some(stream), Some(idle)) = (http.reuse().await, up.idle) {
        pool.put(idle, stream, up.idle_timeout, Instant::now());
    }
    Ok((status, body))
}

/// `work`, unless the client leaves first. Until the answer starts nothing is written to
/// the client, and a stream can pause for long, so only its connection tells that it
/// left; `work` (an upstream read) is then dropped, which closes the upstream connection:
/// that is how vLLM learns to abort the generation (and the in-flight slot is freed at
/// once).
async fn unless_client_gone<T>(
    session: &mut Session,
    work: impl std::future::Future<Output = T>,
) -> Result<T, GatewayError> {
    tokio::select! {
        biased;
        done = work => Ok(done),
        gone = client_gone(session) => Err(gone),
    }
}

/// Resolves when the client has closed (or reset) its connection; pends while it is
/// there. Called once the request body is read to its end: pingora's `read_body_or_idle`
/// then waits for the socket to become readable. It is cancel-safe (a dropped probe has
/// read nothing), and it reads nothing while no byte arrives (tokio reads only after the
/// socket is reported readable), so the request path pays no system call for it.
///
/// Bytes after the request (a pipelined next request, which the gateway does not serve)
/// do not mean the client left: watching stops, and the connection closes after this
/// answer, as it does for a pipelined request already buffered.
async fn client_gone(session: &mut Session) -> GatewayError {
    match session.read_body_or_idle(true).await {
        Err(e)
            if matches!(
                e.etype(),
                ErrorType::ConnectionClosed | ErrorType::ReadError
            ) =>
        {
            GatewayError::ClientGone(format!("the client left before the answer ended: {e}"))
        }
        _ => {
            session.set_keepalive(None);
            std::future::pending().await
        }
    }
}

/// Send `request` on a pooled (or new) connection and read the response head. A separate
/// future from [`exchange`]'s, so its retry state is not kept through the body relay.
async fn send_and_read_head(
    pool: &UpstreamPool,
    up: &Upstream<'_>,
    request: &[IoSlice<'_>],
    started: Instant,
) -> Result<(HttpSession, bool), ExchangeError> {
    // A pooled connection can die between uses (the upstream closed it while idle): a write
    // that fails on one, or a response that never starts on one (closed or reset before a
    // byte came back: pingora marks that `ReusedOnly`, and pingora-proxy retries it the same
    // way), gets one more try on another connection to the same target. A request the
    // upstream closed an idle connection on was never read, so it cannot have acted on it.
    // That try uses a new connection: after an upstream restart every pooled one is dead.
    for try_number in 0..2 {
        let idle = if try_number == 0 { up.idle } else { None };
        let (stream, reused) = pool
            .get(up.peer, idle, up.idle_timeout, started)
            .await
            .map_err(|e| {
                ExchangeError::Retryable(connect_error(up.label, &e), RetryReason::Connect)
            })?;
        let mut s = match send_request(stream, up.peer, request).await {
            Ok(s) => s,
            Err(e) if reused => {
                log::debug!("stale pooled connection to {}: {e}", up.label);
                continue;
            }
            Err(e) => return Err(before_head(up.label, &e)),
        };
        match read_response_head(&mut s).await {
            Ok(()) => return Ok((s, reused)),
            Err(e) if reused && matches!(e.retry, RetryType::ReusedOnly) => {
                log::debug!("pooled connection to {} closed unanswered: {e}", up.label);
            }
            Err(e) => return Err(before_head(up.label, &e)),
        }
    }
    // Unreachable while the second try is on a new connection; nothing was processed.
    Err(ExchangeError::Retryable(
        GatewayError::UpstreamBroken {
            target: up.label.to_string(),
            reason: "pooled connections kept failing".into(),
        },
        RetryReason::Reset,
    ))
}

/// A failure on a fresh connection before the response head arrived. A connection the
/// upstream closed or reset before answering (a replica shutting down, a proxy in front
/// of one whose backend is gone) is retryable: no answer was started, so nothing reached
/// the client, and an inference request that produced no answer has no effect to repeat.
/// A timeout is not: the upstream may still be working on it (and retrying a slow
/// request multiplies the load that made it slow). Neither is a malformed answer.
fn before_head(label: &str, e: &Error) -> ExchangeError {
    let gateway_error = upstream_error(label, e);
    match e.etype() {
        ErrorType::ConnectionClosed | ErrorType::ReadError | ErrorType::WriteError => {
            ExchangeError::Retryable(gateway_error, RetryReason::Reset)
        }
        _ => ExchangeError::Final(gateway_error),
    }
}

/// Most informational (1xx) responses accepted ahead of the final one. vLLM sends none; a
/// well-behaved server sends one `100 Continue` or a few `103 Early Hints`. An upstream
/// that keeps sending them is broken (and each costs a header parse).
const MAX_INFORMATIONAL: usize = 8;

/// Read the final response head, skipping informational (1xx) responses. The whole head,
/// 1xx responses included, must arrive within the session's read timeout: that timeout is
/// otherwise per read, and an upstream sending `100 Continue` (or a byte of header) just
/// often enough would hold the request forever. One timer either way: the per-read one is
/// off while the head's deadline runs, and back on for the body.
///
/// A `101 Switching Protocols` is an upstream fault: rolter never asks for an upgrade (it
/// does not forward `Upgrade`), and relaying one would hand the client whatever raw bytes
/// follow as if they were a second response.
async fn read_response_head(s: &mut HttpSession) -> pingora::Result<()> {
    let read_timeout = s.read_timeout.take();
    let head = async {
        for _ in 0..=MAX_INFORMATIONAL {
            s.read_response().await?;
            match s.get_status().map_or(0, |s| s.as_u16()) {
                101 => {
                    return Error::e_explain(
                        ErrorType::InvalidHTTPHeader,
                        "101 Switching Protocols to a request that asked for no upgrade",
                    )
                }
                100..=199 => continue,
                _ => return Ok(()),
            }
        }
        Error::e_explain(
            ErrorType::InvalidHTTPHeader,
            format!("more than {MAX_INFORMATIONAL} informational (1xx) responses"),
        )
    };
    let result = match read_timeout {
        Some(limit) => pingora::time::timeout(limit, head)
            .await
            .unwrap_or_else(|_| {
                Error::e_explain(
                    ErrorType::ReadTimedout,
                    format!("no final response header within {} ms", limit.as_millis()),
                )
            }),
        None => head.await,
    };
    s.read_timeout = read_timeout;
    result
}

/// Write the encoded request (its slices in order, in vectored writes) on a pooled or
/// fresh connection and hand back a client session ready to read the response (a fresh
/// `HttpSession` over the same stream: the request bytes bypassed pingora's header writer,
/// which flushes the head on its own).
async fn send_request(
    mut stream: Stream,
    peer: &HttpPeer,
    request: &[IoSlice<'_>],
) -> pingora::Result<HttpSession> {
    let (read_timeout, write_timeout) = (peer.options.read_timeout, peer.options.write_timeout);
    let write = async {
        write_all_vectored(&mut stream, request).await?;
        stream.flush().await
    };
    let written = match write_timeout {
        Some(t) => tokio::time::timeout(t, write)
            .await
            .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into())),
        None => write.await,
    };
    written.map_err(|e| {
        let kind = if e.kind() == std::io::ErrorKind::TimedOut {
            ErrorType::WriteTimedout
        } else {
            ErrorType::WriteError
        };
        Error::because(kind, "while writing the request", e)
    })?;
    let mut s = HttpSession::new_with_options(stream, peer);
    s.read_timeout = read_timeout;
    s.write_timeout = write_timeout;
    Ok(s)
}

/// Write all of `request`'s slices, in as many vectored writes as the socket takes (the
/// slice list is copied, to be advanced, only when the first write is partial).
async fn write_all_vectored(stream: &mut Stream, request: &[IoSlice<'_>]) -> std::io::Result<()> {
    let total: usize = request.iter().map(|s| s.len()).sum();
    let first = stream.write_vectored(request).await?;
    if first == total {
        return Ok(());
    }
    if first == 0 {
        return Err(std::io::ErrorKind::WriteZero.into());
    }
    let mut slices = request.to_vec();
    let mut left = &mut slices[..];
    IoSlice::advance_slices(&mut left, first);
    while !left.is_empty() {
        let n = stream.write_vectored(left).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut left, n);
    }
    Ok(())
}

/// The client's response header: the upstream's (taken out of its session, not copied; the
/// session keeps what its keep-alive decision reads) with the hop-by-hop headers removed.
fn downstream_response(mut h: Box<ResponseHeader>) -> pingora::Result<Box<ResponseHeader>> {
    // One pass over the names instead of a hashed lookup per name: vLLM sends none of the
    // hop-by-hop ones.
    let (mut hop_by_hop, mut framed) = (false, false);
    for name in h.headers.keys() {
        hop_by_hop |= NOT_FORWARDED_RESPONSE.contains(&name.as_str());
        framed |= name == http::header::CONTENT_LENGTH || name == http::header::TRANSFER_ENCODING;
    }
    h.set_version(http::Version::HTTP_11);
    h.set_reason_phrase(None)?;
    if hop_by_hop {
        for name in NOT_FORWARDED_RESPONSE {
            h.remove_header(*name);
        }
    }
    // 1xx, 204 and 304 have no body by definition (and may not carry transfer-encoding).
    let bodiless = matches!(h.status.as_u16(), 100..=199 | 204 | 304);
    if !framed && !bodiless {
        // A close-delimited upstream body is re-framed as chunked for the client.
        h.insert_header(http::header::TRANSFER_ENCODING, "chunked")?;
    }
    Ok(h)
}

fn is_timeout(e: &Error) -> bool {
    matches!(
        e.etype(),
        ErrorType::ConnectTimedout | ErrorType::ReadTimedout | ErrorType::WriteTimedout
    )
}

fn connect_error(label: &str, e: &Error) -> GatewayError {
    if is_timeout(e) {
        GatewayError::UpstreamTimeout {
            target: label.to_string(),
            reason: e.to_string(),
        }
    } else {
        GatewayError::UpstreamConnect {
            target: label.to_string(),
            reason: e.to_string(),
        }
    }
}

fn upstream_error(label: &str, e: &Error) -> GatewayError {
    if is_timeout(e) {
        GatewayError::UpstreamTimeout {
            target: label.to_string(),
            reason: e.to_string(),
        }
    } else {
        GatewayError::UpstreamBroken {
            target: label.to_string(),
            reason: e.to_string(),
        }
    }
}

#[cfg(test)]
mod tests;
