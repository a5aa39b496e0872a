//! One upstream exchange over pingora-core's pooled HTTP/1 connector: send the rewritten
//! request, relay the response header and stream the body to the client chunk by chunk.
//!
//! Failures are classified by *when* they happened, because that decides what may be
//! retried: before any request byte reached the upstream (connect failure, or a pooled
//! connection that turned out dead) a retry is safe; after the response started,
//! nothing can be retried or replaced.

use super::error::GatewayError;
use bytes::Bytes;
use pingora::connectors::http::v1::Connector;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::protocols::http::v1::client::HttpSession;
use pingora::proxy::Session;
use pingora::upstreams::peer::HttpPeer;
use pingora::{Error, ErrorType};
use std::time::{Duration, Instant};

/// Hop-by-hop headers (RFC 9110 §7.6.1), those the gateway sets itself, and its own
/// routing hints. The token-id header is the gateway's alone and can be hundreds of KB:
/// vLLM behind uvicorn/h11 refuses a header section over 16 KiB, and a forwarded one
/// would turn a long prompt's routing hint into a failed request.
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
    "expect",
    "host",
    "content-length",
];
const NOT_FORWARDED_RESPONSE: &[&str] =
    &["connection", "keep-alive", "proxy-connection", "upgrade"];

/// How an exchange failed.
#[derive(Debug)]
pub enum ExchangeError {
    /// Nothing reached the upstream or the client: safe to try another target.
    Retryable(GatewayError),
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
}

/// Everything the exchange needs about its target.
pub struct Upstream<'a> {
    pub peer: &'a HttpPeer,
    pub label: &'a str,
    pub idle_timeout: Duration,
}

/// Build the upstream request header from the client's, for a body of `body_len` bytes.
pub fn upstream_request(
    client: &RequestHeader,
    host: &str,
    base_path: &str,
    body_len: usize,
) -> Result<RequestHeader, GatewayError> {
    let path_and_query = client.uri.path_and_query().map_or("/", |pq| pq.as_str());
    let path = format!("{base_path}{path_and_query}");
    let bad =
        |e: Box<Error>| GatewayError::BadRequest(format!("cannot build upstream request: {e}"));
    let mut req = RequestHeader::build(
        client.method.clone(),
        path.as_bytes(),
        Some(client.headers.len() + 2),
    )
    .map_err(bad)?;
    for (name, value) in client.headers.iter() {
        if !NOT_FORWARDED_REQUEST.contains(&name.as_str()) {
            req.append_header(name.clone(), value.clone())
                .map_err(bad)?;
        }
    }
    req.insert_header(http::header::HOST, host).map_err(bad)?;
    req.insert_header(http::header::CONTENT_LENGTH, body_len.to_string())
        .map_err(bad)?;
    Ok(req)
}

/// Send `req` + `body` to the upstream and relay its response to `session`.
/// `on_response` runs once the upstream's response header is in, before it is relayed.
pub async fn exchange(
    connector: &Connector,
    up: &Upstream<'_>,
    session: &mut Session,
    req: &RequestHeader,
    body: &Bytes,
    started: Instant,
    on_response: impl FnOnce(u16),
) -> Result<ExchangeOutcome, ExchangeError> {
    // A pooled connection can die between uses; such a failure before the response
    // started gets one more try on a fresh connection to the same target.
    let mut http = None;
    let mut reused = false;
    for _ in 0..2 {
        let (mut s, r) = connector
            .get_http_session(up.peer)
            .await
            .map_err(|e| ExchangeError::Retryable(connect_error(up.label, &e)))?;
        s.read_timeout = up.peer.options.read_timeout;
        s.write_timeout = up.peer.options.write_timeout;
        match send_request(&mut s, req, body).await {
            Ok(()) => {
                http = Some(s);
                reused = r;
                break;
            }
            Err(e) if r => log::debug!("stale pooled connection to {}: {e}", up.label),
            Err(e) => return Err(ExchangeError::Final(upstream_error(up.label, &e))),
        }
    }
    let mut http = http.ok_or_else(|| {
        ExchangeError::Final(GatewayError::UpstreamBroken {
            target: up.label.to_string(),
            reason: "pooled connections kept failing".into(),
        })
    })?;
    crate::metrics::METRICS
        .upstream_connections
        .with_label_values(&[if reused { "true" } else { "false" }])
        .inc();

    // Skip informational (1xx) responses; vLLM does not send them but others may.
    loop {
        http.read_response()
            .await
            .map_err(|e| ExchangeError::Final(upstream_error(up.label, &e)))?;
        let status = http.get_status().map_or(0, |s| s.as_u16());
        if !(100..200).contains(&status) || status == 101 {
            break;
        }
    }
    let ttfb = started.elapsed();
    let upstream_header = http.resp_header().expect("response header was just read");
    let status = upstream_header.status.as_u16();
    on_response(status);
    let header = downstream_response(upstream_header)
        .map_err(|e| ExchangeError::Final(upstream_error(up.label, &e)))?;
    let no_body = http.is_body_done();
    session
        .write_response_header(Box::new(header), no_body)
        .await
        .map_err(|e| ExchangeError::Final(GatewayError::ClientGone(e.to_string())))?;

    // Stream the body through as it arrives: SSE chunks are never held back.
    while !no_body && !http.is_body_done() {
        let chunk = match http.read_body_bytes().await {
            Ok(Some(chunk)) => chunk,
            Ok(None) => break,
            Err(e) => return Err(ExchangeError::Final(upstream_error(up.label, &e))),
        };
        session
            .write_response_body(Some(chunk), false)
            .await
            .map_err(|e| ExchangeError::Final(GatewayError::ClientGone(e.to_string())))?;
    }
    session
        .write_response_body(None, true)
        .await
        .map_err(|e| ExchangeError::Final(GatewayError::ClientGone(e.to_string())))?;
    connector
        .release_http_session(http, up.peer, Some(up.idle_timeout))
        .await;
    Ok(ExchangeOutcome {
        status,
        ttfb,
        reused,
    })
}

async fn send_request(
    s: &mut HttpSession,
    req: &RequestHeader,
    body: &Bytes,
) -> pingora::Result<()> {
    s.write_request_header(Box::new(req.clone())).await?;
    s.write_body(body).await?;
    s.finish_body().await?;
    Ok(())
}

fn downstream_response(up: &ResponseHeader) -> pingora::Result<ResponseHeader> {
    let mut h = ResponseHeader::build(up.status, Some(up.headers.len() + 1))?;
    for (name, value) in up.headers.iter() {
        if !NOT_FORWARDED_RESPONSE.contains(&name.as_str()) {
            h.append_header(name.clone(), value.clone())?;
        }
    }
    let framed = h.headers.contains_key(http::header::CONTENT_LENGTH)
        || h.headers.contains_key(http::header::TRANSFER_ENCODING);
    if !framed {
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
