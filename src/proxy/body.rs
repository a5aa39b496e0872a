//! Buffering a client request body in `request_filter`, bounded in size and time.
//!
//! A declared `Content-Length` over the limit is refused before reading a byte;
//! a chunked or lying body is refused as soon as it crosses the limit. After any refusal,
//! the rest of the body is read and discarded for a bounded while ([`discard_rest`]).
//!
//! Copies: pingora hands each received chunk over as its own `Bytes` (its copy out of
//! the connection's read buffer). Up to `HELD_CHUNKS` of them are held as they are and
//! copied once into a buffer ([`Receiving`]) sized when the body ends (its exact length),
//! when a declared body has sent `1 / DECLARED_SHARE` of its `Content-Length` past the
//! first reservation (the whole declared length), or when the slots run out (double
//! the reservation). So a body that arrives in at most `HELD_CHUNKS` chunks (pingora reads
//! up to 64 KiB at a time), or is declared and sends an eighth of its length within
//! them (any body up to `DECLARED_SHARE * RESERVE_AHEAD` that is not trickled), is
//! copied once, with no reallocation. Every byte held is charged to the body budget: a
//! buffer before it is allocated, a held chunk as it is received.

use super::admission::BodyBytes;
use super::error::GatewayError;
use super::framing::{BodyBuf, HEAD_ROOM};
use bytes::Bytes;
use pingora::proxy::Session;
use std::time::Duration;

/// The most memory reserved ahead of a body's bytes on the strength of its declared
/// `Content-Length`: a client that declares the limit and sends nothing is not given it.
const RESERVE_AHEAD: usize = 64 * 1024;
/// What a body without a declared length is first reserved.
const RESERVE_UNDECLARED: usize = 16 * 1024;
/// A declared body is given its whole buffer once `1 / DECLARED_SHARE` of it has arrived
/// (before that, its chunks are held or its buffer doubles): a client holds at most this
/// many times the bytes it sent (all of them charged), and a body up to
/// `DECLARED_SHARE * RESERVE_AHEAD` (512 KiB) that is not trickled is copied once, into a
/// buffer of its exact size.
const DECLARED_SHARE: usize = 8;
/// Chunks held before the first copy. Few, so a client trickling tiny chunks cannot
/// make the holding cost more than it is charged: the held bytes are charged, and the
/// overhead of their allocations (at most `HELD_CHUNKS` blocks) fits in the charged
/// `HEAD_ROOM`, which is not allocated until the buffer is.
const HELD_CHUNKS: usize = 8;

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
    let mut body = Receiving::new(declared, limit, charge, budget)?;
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
        body.push(chunk)?;
    }
    Ok(body.finish())
}

/// A body being received, and what is charged for it: [`HEAD_ROOM`] plus the body
/// capacity `reserved`, which covers the held chunks (the first reservation, or their
/// length past it) until the buffer exists, then the buffer's capacity.
struct Receiving<'r, 'c> {
    declared: Option<usize>,
    limit: usize,
    budget: usize,
    charge: &'r mut BodyBytes<'c>,
    /// Body bytes charged (beyond the room in front).
    reserved: usize,
    /// Body bytes received.
    received: usize,
    /// Chunks received before the buffer was allocated, not copied yet.
    held: [Option<Bytes>; HELD_CHUNKS],
    held_count: usize,
    /// The buffer, once the held chunks outgrow the reservation or the slots.
    buf: Option<BodyBuf>,
}

impl<'r, 'c> Receiving<'r, 'c> {
    /// Charge the first reservation: the declared length up to [`RESERVE_AHEAD`].
    fn new(
        declared: Option<usize>,
        limit: usize,
        charge: &'r mut BodyBytes<'c>,
        budget: usize,
    ) -> Result<Self, GatewayError> {
        let reserved = declared
            .unwrap_or(RESERVE_UNDECLARED)
            .min(limit)
            .min(RESERVE_AHEAD);
        charge_more(charge, HEAD_ROOM + reserved, budget)?;
        Ok(Receiving {
            declared,
            limit,
            budget,
            charge,
            reserved,
            received: 0,
            held: Default::default(),
            held_count: 0,
            buf: None,
        })
    }

    /// Take one received chunk: held while a slot is free (and a declared body is not
    /// due its whole buffer), else copied into the buffer (allocated or grown first, and
    /// charged).
    fn push(&mut self, chunk: Bytes) -> Result<(), GatewayError> {
        let needed = self.received + chunk.len();
        if needed > self.limit {
            return Err(GatewayError::PayloadTooLarge { limit: self.limit });
        }
        if self.buf.is_none() && self.held_count < HELD_CHUNKS && !self.given_whole(needed) {
            // Past the reservation, a held chunk is charged as it comes (it is its own
            // allocation of its length): a body that ends within `HELD_CHUNKS` chunks, or
            // is given its whole buffer by then, is copied once.
            if needed > self.reserved {
                charge_more(self.charge, needed - self.reserved, self.budget)?;
                self.reserved = needed;
            }
            self.held[self.held_count] = Some(chunk);
            self.held_count += 1;
            self.received = needed;
            return Ok(());
        }
        if needed > self.reserved {
            let grown = self.grown(needed);
            charge_more(self.charge, grown - self.reserved, self.budget)?;
            self.reserved = grown;
        }
        let reserved = self.reserved;
        let buf = self.buffer(reserved);
        buf.reserve_body(reserved);
        buf.extend(&chunk);
        self.received = needed;
        Ok(())
    }

    /// The declared length, once `needed` bytes are `1 / DECLARED_SHARE` of it or more.
    fn whole_due(&self, needed: usize) -> Option<usize> {
        self.declared
            .filter(|&declared| needed.saturating_mul(DECLARED_SHARE) >= declared)
    }

    /// Whether a declared body past its reservation gets its whole length with `needed`
    /// bytes in.
    fn given_whole(&self, needed: usize) -> bool {
        needed > self.reserved && self.whole_due(needed).is_some()
    }

    /// The body capacity for `needed` bytes: a declared body's whole length once a
    /// `1 / DECLARED_SHARE` of it is in, else double the reservation.
    fn grown(&self, needed: usize) -> usize {
        match (self.whole_due(needed), self.declared) {
            (Some(declared), _) => declared.max(needed),
            (None, Some(declared)) => needed.max(2 * self.reserved).min(declared),
            (None, None) => needed.max(2 * self.reserved),
        }
        .min(self.limit)
    }

    /// The buffer, allocated with `capacity` body bytes and the held chunks copied in
    /// if it does not exist yet.
    fn buffer(&mut self, capacity: usize) -> &mut BodyBuf {
        self.buf.get_or_insert_with(|| {
            let mut buf = BodyBuf::with_capacity(capacity);
            for chunk in self.held[..self.held_count]
                .iter_mut()
                .filter_map(Option::take)
            {
                buf.extend(&chunk);
            }
            self.held_count = 0;
            buf
        })
    }

    /// The whole body. Held chunks are copied into a buffer of their exact size, and
    /// the reservation it does not use is given back.
    fn finish(mut self) -> BodyBuf {
        if self.buf.is_none() && self.reserved > self.received {
            self.charge.give_back(self.reserved - self.received);
            self.reserved = self.received;
        }
        let exact = self.received;
        self.buffer(exact);
        self.buf.take().expect("just made")
    }
}

/// Charge `n` more bytes to `charge`, or refuse the body: the global budget is spent.
fn charge_more(charge: &mut BodyBytes, n: usize, budget: usize) -> Result<(), GatewayError> {
    if charge.grow(n, budget) {
        Ok(())
    } else {
        Err(GatewayError::BodiesOverBudget { limit: budget })
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::admission::Admission;
    use proptest::prelude::*;

    const LIMIT: usize = 4 << 20;
    const BUDGET: usize = 64 << 20;

    /// The charge matches what is held: the room, plus the buffer's capacity or (before
    /// it exists) a reservation that covers the held chunks.
    fn assert_charge_covers(r: &Receiving) {
        assert_eq!(r.charge.held(), HEAD_ROOM + r.reserved);
        // What is reserved ahead of the bytes (`limits.max_buffered_body_bytes` docs).
        assert!(r.reserved - r.received <= RESERVE_AHEAD.max(7 * r.received));
        match &r.buf {
            Some(buf) => assert_eq!(buf.body_capacity(), r.reserved),
            None => {
                let held: usize = r.held.iter().flatten().map(Bytes::len).sum();
                assert_eq!(held, r.received);
                assert!(held <= r.reserved && r.held_count <= HELD_CHUNKS);
            }
        }
    }

    fn chunks_of(body: &[u8], size: usize) -> Vec<Bytes> {
        body.chunks(size).map(Bytes::copy_from_slice).collect()
    }

    #[test]
    fn a_declared_body_is_copied_once_into_a_buffer_of_its_exact_size() {
        let a = Admission::new();
        let mut charge = a.body_bytes();
        let body: Vec<u8> = (0..300_000u32).map(|i| i as u8).collect();
        let mut r = Receiving::new(Some(body.len()), LIMIT, &mut charge, BUDGET).unwrap();
        for chunk in chunks_of(&body, 64 * 1024) {
            r.push(chunk).unwrap();
            assert_charge_covers(&r);
        }
        assert_eq!(r.buf.as_ref().unwrap().body_capacity(), body.len());
        let mut buf = r.finish();
        assert_eq!(buf.body(), &body[..]);
        assert_eq!(a.buffered(), HEAD_ROOM + body.len());
        drop(charge);
        assert_eq!(a.buffered(), 0);
    }

    #[test]
    fn a_declared_length_larger_than_sent_is_reserved_only_as_bytes_arrive() {
        let a = Admission::new();
        let mut charge = a.body_bytes();
        let declared = LIMIT;
        let mut r = Receiving::new(Some(declared), LIMIT, &mut charge, BUDGET).unwrap();
        assert_eq!(a.buffered(), HEAD_ROOM + RESERVE_AHEAD, "nothing sent yet");
        r.push(Bytes::from_static(&[b' '; 10])).unwrap();
        assert!(r.buf.is_none(), "a held chunk allocates no buffer");
        // Past the first reservation the chunks are held, charged as they come, until an
        // eighth of the declared length is in: then the buffer takes the whole of it,
        // allocated once.
        let mut received = 10;
        while received < declared {
            let n = (64 * 1024).min(declared - received);
            r.push(Bytes::from(vec![b'x'; n])).unwrap();
            received += n;
            assert_charge_covers(&r);
            assert!(
                r.reserved <= (DECLARED_SHARE * received).max(RESERVE_AHEAD),
                "{} reserved for {received} received",
                r.reserved
            );
            if let Some(buf) = &r.buf {
                assert_eq!(buf.body_capacity(), declared, "allocated once, whole");
            }
        }
        assert_eq!(r.reserved, declared);
        assert_eq!(r.finish().len(), declared);
    }

    #[test]
    fn an_undeclared_body_ends_in_a_buffer_of_its_size_and_the_rest_is_given_back() {
        let a = Admission::new();
        let mut charge = a.body_bytes();
        let mut r = Receiving::new(None, LIMIT, &mut charge, BUDGET).unwrap();
        assert_eq!(a.buffered(), HEAD_ROOM + RESERVE_UNDECLARED);
        r.push(Bytes::from_static(b"{\"model\":")).unwrap();
        r.push(Bytes::from_static(b"\"m\"}")).unwrap();
        let mut buf = r.finish();
        assert_eq!(buf.body(), b"{\"model\":\"m\"}");
        assert_eq!(a.buffered(), HEAD_ROOM + 13);
        assert_eq!(buf.body_capacity(), 13);
        drop(buf);
        drop(charge);
        assert_eq!(a.buffered(), 0);
        // A larger one in few chunks is held, charged as it comes, and copied once.
        let mut charge = a.body_bytes();
        let body = vec![b'w'; 300_000];
        let mut r = Receiving::new(None, LIMIT, &mut charge, BUDGET).unwrap();
        for chunk in chunks_of(&body, 64 * 1024) {
            r.push(chunk).unwrap();
            assert_charge_covers(&r);
            assert!(r.buf.is_none());
        }
        let mut buf = r.finish();
        assert_eq!(buf.body(), &body[..]);
        assert_eq!(a.buffered(), HEAD_ROOM + body.len());
        drop(buf);
        drop(charge);
        // One in many chunks is held until the slots run out, then grows by doubling,
        // charged for each capacity.
        let mut charge = a.body_bytes();
        let body = vec![b'y'; 200_000];
        let mut r = Receiving::new(None, LIMIT, &mut charge, BUDGET).unwrap();
        for chunk in chunks_of(&body, 5000) {
            r.push(chunk).unwrap();
            assert_charge_covers(&r);
        }
        let mut buf = r.finish();
        assert_eq!(buf.body(), &body[..]);
        assert_eq!(a.buffered(), HEAD_ROOM + buf.body_capacity());
    }

    #[test]
    fn a_trickle_of_tiny_chunks_is_held_in_few_slots_then_copied() {
        let a = Admission::new();
        let mut charge = a.body_bytes();
        let body: Vec<u8> = (0..3000u32).map(|i| (i % 251) as u8).collect();
        let mut r = Receiving::new(Some(body.len()), LIMIT, &mut charge, BUDGET).unwrap();
        for (i, chunk) in chunks_of(&body, 1).into_iter().enumerate() {
            r.push(chunk).unwrap();
            assert_charge_covers(&r);
            assert_eq!(r.buf.is_some(), i >= HELD_CHUNKS, "chunk {i}");
            assert_eq!(
                a.buffered(),
                HEAD_ROOM + body.len(),
                "never more than declared"
            );
        }
        assert_eq!(r.finish().body(), &body[..]);
    }

    #[test]
    fn a_body_over_the_limit_is_refused_as_it_crosses_it() {
        let a = Admission::new();
        let mut charge = a.body_bytes();
        // Chunked (or lying): refused on the chunk that crosses the limit.
        let mut r = Receiving::new(None, 100_000, &mut charge, BUDGET).unwrap();
        for _ in 0..10 {
            r.push(Bytes::from(vec![b'z'; 10_000])).unwrap();
        }
        assert!(matches!(
            r.push(Bytes::from_static(b"!")),
            Err(GatewayError::PayloadTooLarge { limit: 100_000 })
        ));
        assert_charge_covers(&r);
        assert!(r.reserved <= 100_000, "never reserved past the limit");
        drop(r);
        drop(charge);
        assert_eq!(a.buffered(), 0);
    }

    /// A 30,000-byte chunk past the budget is refused, and nothing more is charged.
    fn refused_taking_nothing(r: &mut Receiving, a: &Admission) {
        let before = a.buffered();
        assert!(matches!(
            r.push(Bytes::from(vec![b'a'; 30_000])),
            Err(GatewayError::BodiesOverBudget { .. })
        ));
        assert_eq!(a.buffered(), before);
    }

    #[test]
    fn a_body_over_the_budget_is_refused_and_a_refused_charge_takes_nothing() {
        let a = Admission::new();
        let budget = HEAD_ROOM + 100_000;
        let mut other = a.body_bytes();
        assert!(other.grow(budget - HEAD_ROOM - 1000, budget));
        // The first reservation does not fit.
        let mut charge = a.body_bytes();
        assert!(matches!(
            Receiving::new(Some(5000), LIMIT, &mut charge, budget),
            Err(GatewayError::BodiesOverBudget { .. })
        ));
        assert_eq!(charge.held(), 0);
        // It fits, but the growth to the declared length does not.
        drop(other);
        let mut other = a.body_bytes();
        assert!(other.grow(20_000, budget));
        let declared = 90_000;
        let mut r = Receiving::new(Some(declared), LIMIT, &mut charge, budget).unwrap();
        r.push(Bytes::from(vec![b'a'; 60_000])).unwrap();
        refused_taking_nothing(&mut r, &a);
        drop(r);
        charge.release();
        // A held chunk past the reservation is charged too.
        let mut r = Receiving::new(None, LIMIT, &mut charge, budget).unwrap();
        r.push(Bytes::from(vec![b'a'; 60_000])).unwrap();
        assert_eq!(a.buffered(), 20_000 + HEAD_ROOM + 60_000);
        refused_taking_nothing(&mut r, &a);
        drop(r);
        drop(charge);
        assert_eq!(a.buffered(), 20_000);
        drop(other);
        assert_eq!(a.buffered(), 0);
    }

    proptest! {
        /// Any chunking, declared or not: the body comes out intact, and at every step
        /// the charge is the room plus what is allocated or reserved for held chunks.
        #[test]
        fn any_chunking_keeps_the_body_and_the_charge_exact(
            sizes in proptest::collection::vec(0usize..70_000, 0..12),
            declare in any::<bool>(),
        ) {
            let total: usize = sizes.iter().sum();
            let body: Vec<u8> = (0..total).map(|i| (i % 253) as u8).collect();
            let a = Admission::new();
            let mut charge = a.body_bytes();
            let declared = declare.then_some(total);
            let mut r = Receiving::new(declared, LIMIT, &mut charge, BUDGET).unwrap();
            let mut at = 0;
            for n in sizes {
                r.push(Bytes::copy_from_slice(&body[at..at + n])).unwrap();
                at += n;
                assert_charge_covers(&r);
            }
            let mut buf = r.finish();
            prop_assert_eq!(a.buffered(), HEAD_ROOM + buf.body_capacity());
            if declare {
                prop_assert_eq!(buf.body_capacity(), total);
            }
            prop_assert_eq!(buf.body(), &body[..]);
        }
    }
}
