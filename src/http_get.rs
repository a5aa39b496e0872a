//! One bounded HTTP/1 `GET` for the gateway's pollers (LMCache status, replica cache
//! sizes): connect, send, read a 2xx body no larger than a limit, all within one deadline;
//! and [`PollResult`], what one poll found, as both pollers count and log it.
//!
//! Owns the exchange and the outcome's shape. Must not: resolve names or check the egress
//! policy (the caller hands it an address it has already checked) or interpret the body.
//!
//! It goes through pingora-core's HTTP/1 connector, the one the proxy already uses: no
//! second HTTP stack in the binary. Each call uses a fresh connection (`connection:
//! close`), so no pooled connection outlives the caller's egress decision.

use crate::egress::EgressError;
use bytes::{Bytes, BytesMut};
use pingora::connectors::http::v1::Connector;
use pingora::http::RequestHeader;
use pingora::upstreams::peer::HttpPeer;
use std::net::SocketAddr;
use std::time::Duration;

/// One request.
#[derive(Debug, Clone, Copy)]
pub struct Get<'a> {
    /// Where to connect.
    pub addr: SocketAddr,
    /// `Host` header value.
    pub authority: &'a str,
    /// Request target (path and query).
    pub path: &'a str,
    /// `Accept` header value.
    pub accept: &'a str,
    /// Connect, request and body together.
    pub timeout: Duration,
    /// Largest body accepted.
    pub max_body_bytes: usize,
}

/// Why a `GET` produced no body.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GetError {
    /// Slower than the deadline.
    #[error("timed out")]
    Timeout,
    /// Refused, reset, or not HTTP.
    #[error("{0}")]
    Failed(String),
    /// Answered with a status outside 2xx.
    #[error("HTTP {0}")]
    Status(u16),
    /// The body passed the limit.
    #[error("body larger than {0} bytes")]
    TooLarge(usize),
}

/// What one poll found: an answer of type `T`, or why there is none.
#[derive(Debug, Clone, PartialEq)]
pub enum PollResult<T> {
    /// A well-formed answer.
    Ok(T),
    /// Unresolvable, unreachable, broken connection or non-2xx.
    Error(String),
    /// Answered, but not the expected shape (or too large).
    Invalid(String),
    /// Slower than the poll's deadline.
    Timeout,
    /// The name or one of its addresses is denied by the egress policy: not contacted.
    Denied(EgressError),
}

impl<T> PollResult<T> {
    /// Metric label: ok, error, invalid, timeout, denied.
    pub fn label(&self) -> &'static str {
        match self {
            PollResult::Ok(_) => "ok",
            PollResult::Error(_) => "error",
            PollResult::Invalid(_) => "invalid",
            PollResult::Timeout => "timeout",
            PollResult::Denied(_) => "denied",
        }
    }
}

impl<T: std::fmt::Display> std::fmt::Display for PollResult<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PollResult::Ok(v) => write!(f, "ok: {v}"),
            PollResult::Error(why) => write!(f, "error: {why}"),
            PollResult::Invalid(why) => write!(f, "invalid answer: {why}"),
            PollResult::Timeout => write!(f, "timed out"),
            PollResult::Denied(e) => write!(f, "not polled: {e}"),
        }
    }
}

impl<T> From<GetError> for PollResult<T> {
    fn from(e: GetError) -> Self {
        match e {
            GetError::Timeout => PollResult::Timeout,
            GetError::TooLarge(_) => PollResult::Invalid(e.to_string()),
            GetError::Failed(_) | GetError::Status(_) => PollResult::Error(e.to_string()),
        }
    }
}

/// `GET` with `connector`, bounded by `req.timeout` as a whole.
pub async fn get(connector: &Connector, req: &Get<'_>) -> Result<Bytes, GetError> {
    tokio::time::timeout(req.timeout, exchange(connector, req))
        .await
        .unwrap_or(Err(GetError::Timeout))
}

async fn exchange(connector: &Connector, req: &Get<'_>) -> Result<Bytes, GetError> {
    let addr = req.addr;
    let failed = |e: Box<pingora::Error>| {
        use pingora::ErrorType::*;
        match e.etype() {
            ConnectTimedout | ReadTimedout | WriteTimedout => GetError::Timeout,
            _ => GetError::Failed(format!("{addr}: {e}")),
        }
    };
    let mut peer = HttpPeer::new(addr, false, String::new());
    peer.options.connection_timeout = Some(req.timeout);
    peer.options.read_timeout = Some(req.timeout);
    peer.options.write_timeout = Some(req.timeout);
    let (mut http, _) = connector.get_http_session(&peer).await.map_err(failed)?;
    http.read_timeout = Some(req.timeout);
    http.write_timeout = Some(req.timeout);
    let mut head =
        RequestHeader::build(http::Method::GET, req.path.as_bytes(), Some(3)).map_err(failed)?;
    head.insert_header(http::header::HOST, req.authority)
        .map_err(failed)?;
    head.insert_header(http::header::ACCEPT, req.accept)
        .map_err(failed)?;
    head.insert_header(http::header::CONNECTION, "close")
        .map_err(failed)?;
    http.write_request_header(Box::new(head))
        .await
        .map_err(failed)?;
    http.finish_body().await.map_err(failed)?;
    http.read_response().await.map_err(failed)?;
    let status = http.get_status().map_or(0, |s| s.as_u16());
    if !(200..300).contains(&status) {
        return Err(GetError::Status(status));
    }
    let mut body = BytesMut::new();
    while !http.is_body_done() {
        match http.read_body_bytes().await.map_err(failed)? {
            Some(chunk) => body.extend_from_slice(&chunk),
            None => break,
        }
        if body.len() > req.max_body_bytes {
            return Err(GetError::TooLarge(req.max_body_bytes));
        }
    }
    Ok(body.freeze())
}
