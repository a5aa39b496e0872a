//! Buffering a client request body in `request_filter`, bounded in size and time.
//!
//! A declared `Content-Length` over the limit is refused before reading a byte;
//! a chunked or lying body is refused as soon as it crosses the limit. After any refusal,
//! the rest of the body is read and discarded for a bounded while ([`discard_rest`]).

use super::admission::BodyBytes;
use super::error::GatewayError;
use super::framing::{BodyBuf, HEAD_ROOM};
use pingora::proxy::Session;
use std::time::Duration;

/// The most buffer reserved ahead of a body's bytes on the strength of its declared
/// `Content-Length`: a larger body grows its buffer (doubling) as it arrives, so a client
/// that declares the limit and sends nothing is not given it.
const RESERVE_AHEAD: usize = 64 * 1024;

/// Read the whole request body (at most `limit` bytes, within `timeout`) into a buffer
/// whose every allocation is charged to `charge` before it is made, within the global
/// budget of `budget` bytes: what is charged is the memory held, not the bytes received.
pub async fn read_body(
    session: &mut Session,
    limit: usize,
    timeout: Duration,
    charge: &mut BodyBytes<'_>,
    budget: usize,
) -> Result<BodyBuf, GatewayError> {
    let declared = content_length(session)?;
    if declared.is_some_and(|n| n > limit) {
        return Err(GatewayError::PayloadTooLarge { limit });
    }
    if is_expect_continue(session) {
        session
            .write_continue_response()
            .await
            .map_err(|e| GatewayError::ClientGone(e.to_string()))?;
    }
    // Read straight into a buffer with room for the upstream request head in front
    // (`framing`): the one copy of the body the gateway makes before forwarding it.
    let over_budget = || GatewayError::BodiesOverBudget { limit: budget };
    let reserve = declared.unwrap_or(16 * 1024).min(limit).min(RESERVE_AHEAD);
    if !charge.grow(HEAD_ROOM + reserve, budget) {
        return Err(over_budget());
    }
    let mut buf = BodyBuf::with_capacity(reserve);
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let chunk = match tokio::time::timeout_at(deadline, session.read_request_body()).await {
            Err(_) => return Err(GatewayError::ClientBodyTimeout(timeout.as_millis() as u64)),
            // The connection ended (closed or reset) before the body did: the client left.
            Ok(Err(e))
                if matches!(
                    e.etype(),
                    pingora::ErrorType::ConnectionClosed | pingora::ErrorType::ReadError
                ) =>
            {
                return Err(GatewayError::ClientGone(format!(
                    "the client left while sending its body: {e}"
                )))
            }
            Ok(Err(e)) => {
                return Err(GatewayError::BadRequest(format!(
                    "could not read the request body: {e}"
                )))
            }
            Ok(Ok(None)) => break,
            Ok(Ok(Some(chunk))) => chunk,
        };
        let needed = buf.len() + chunk.len();
        if needed > limit {
            return Err(GatewayError::PayloadTooLarge { limit });
        }
        if needed > buf.body_capacity() {
            let grown = needed.max(2 * buf.body_capacity()).min(limit);
            if !charge.grow(grown - buf.body_capacity(), budget) {
                return Err(over_budget());
            }
            buf.reserve_body(grown);
        }
        buf.extend(&chunk);
    }
    Ok(buf)
}

/// How long in all, how long without a byte, and how many bytes [`discard_rest`] keeps
/// reading a refused body. A client that stops sending (it read the answer, or it is a
/// slowloris) is let go after `LINGER_IDLE`.
const LINGER_TIME: Duration = Duration::from_secs(2);
const LINGER_IDLE: Duration = Duration::from_millis(500);
const LINGER_BYTES: usize = 64 << 20;

/// After an error answer to a request whose body is not read to its end (413 on a declared
/// length, 408, a refusal before the body was read): read and discard the rest for at most
/// [`LINGER_TIME`] / [`LINGER_BYTES`], and while bytes keep coming (`LINGER_IDLE`), before
/// the connection closes. Closing a socket with unread bytes makes the kernel reset the
/// connection, and a client that sends its whole body before reading (hyper, Python's
/// http.client, curl) then fails on a write and never sees the answer already sent to it;
/// nginx lingers the same way (`lingering_close`).
pub async fn discard_rest(session: &mut Session) {
    if session.is_body_done() {
        return;
    }
    let drain = async {
        let mut seen = 0usize;
        while let Ok(Ok(Some(chunk))) =
            tokio::time::timeout(LINGER_IDLE, session.read_request_body()).await
        {
            seen += chunk.len();
            if seen > LINGER_BYTES {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(LINGER_TIME, drain).await;
}

fn content_length(session: &Session) -> Result<Option<usize>, GatewayError> {
    let values = session
        .req_header()
        .headers
        .get_all(http::header::CONTENT_LENGTH);
    let mut found = None;
    for v in values {
        let n = std::str::from_utf8(v.as_bytes())
            .ok()
            .and_then(|s| s.trim().parse::<usize>().ok())
            .ok_or_else(|| GatewayError::BadRequest("invalid Content-Length".into()))?;
        if found.is_some_and(|f| f != n) {
            return Err(GatewayError::BadRequest(
                "conflicting Content-Length headers".into(),
            ));
        }
        found = Some(n);
    }
    Ok(found)
}

fn is_expect_continue(session: &Session) -> bool {
    session
        .req_header()
        .headers
        .get(http::header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"))
}
