//! Buffering a client request body in `request_filter`, bounded in size and time.
//!
//! A declared `Content-Length` over the limit is refused before reading a byte;
//! a chunked or lying body is refused as soon as it crosses the limit. After any refusal,
//! the rest of the body is read and discarded for a bounded while ([`discard_rest`]).
//!
//! Copies: pingora hands each received chunk over as its own `Bytes`, up to 64 KiB at a
//! time (a sized body's read that filled its buffer: that buffer; any other: a copy out of
//! it, at its size; vendor/README.md, rolter's patch of pingora-core), each keeping its
//! bytes allocated and no more. They are held as they are, as the body's pieces
//! ([`BodyBuf`]), not copied again: the first `HELD_FREE` whatever their size, later ones
//! from `MIN_PIECE` bytes on. A shorter later chunk (a client trickling
//! its body) is copied into a piece being gathered, closed at `MIN_PIECE` bytes (or copied
//! out at its size when a long chunk comes first), so the pieces stay few however the body
//! is cut. Every piece is charged to the body budget as it is taken: its bytes (a full
//! gathered piece: its whole buffer, at most twice its bytes) and `PIECE_OVERHEAD`; the
//! gathering buffer is charged when allocated. A body holds at most twice its bytes plus
//! one gathering buffer and the overheads, all charged.

use super::admission::BodyBytes;
use super::error::GatewayError;
use super::framing::BodyBuf;
use bytes::Bytes;
use pingora::proxy::Session;
use std::time::Duration;

/// Chunks held as they come, whatever their size.
const HELD_FREE: usize = 8;
/// Past the first `HELD_FREE` pieces, a chunk shorter than this is gathered with the
/// next ones into a piece of at least this size.
const MIN_PIECE: usize = 16 * 1024;
/// What a piece costs besides its bytes (its handle here, its allocation's bookkeeping):
/// charged with it.
const PIECE_OVERHEAD: usize = 64;

/// Read the whole request body (at most `limit` bytes, within `timeout`) into pieces
/// charged to `charge` as they are taken, within the global budget of `budget` bytes.
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
    let mut body = Receiving::new(limit, charge, budget);
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
    body.finish()
}

/// A body being received, and what is charged for it.
struct Receiving<'r, 'c> {
    limit: usize,
    budget: usize,
    charge: &'r mut BodyBytes<'c>,
    /// Body bytes received.
    received: usize,
    /// What this body has charged so far.
    charged: usize,
    pieces: Vec<Bytes>,
    /// Short chunks gathered into one piece (its capacity charged once allocated).
    gathering: Vec<u8>,
}

impl<'r, 'c> Receiving<'r, 'c> {
    fn new(limit: usize, charge: &'r mut BodyBytes<'c>, budget: usize) -> Self {
        Receiving {
            limit,
            budget,
            charge,
            received: 0,
            charged: 0,
            pieces: Vec::new(),
            gathering: Vec::new(),
        }
    }

    /// Take one received chunk: held as a piece of its own, or copied into the piece
    /// being gathered (see the module docs); charged first.
    fn push(&mut self, chunk: Bytes) -> Result<(), GatewayError> {
        let needed = self.received + chunk.len();
        if needed > self.limit {
            return Err(GatewayError::PayloadTooLarge { limit: self.limit });
        }
        if chunk.is_empty() {
            return Ok(());
        }
        if self.pieces.len() < HELD_FREE || chunk.len() >= MIN_PIECE {
            self.close_gathered()?;
            self.charge_more(chunk.len() + PIECE_OVERHEAD)?;
            self.pieces.push(chunk);
        } else {
            if self.gathering.capacity() == 0 {
                // Short of `MIN_PIECE` before, a chunk shorter than it: never reallocated.
                self.charge_more(2 * MIN_PIECE + PIECE_OVERHEAD)?;
                self.gathering = Vec::with_capacity(2 * MIN_PIECE);
            }
            self.gathering.extend_from_slice(&chunk);
            if self.gathering.len() >= MIN_PIECE {
                self.close_gathered()?;
            }
        }
        self.received = needed;
        Ok(())
    }

    /// Close the piece being gathered: a full one keeps its buffer (charged with it); a
    /// short one (a long chunk came first) is copied out at its size, charged as a piece,
    /// and the buffer is kept for the next: a body holds one gathering buffer at a time, so
    /// a client alternating short and long chunks cannot make it hold more than its bytes,
    /// the buffer and the overheads.
    fn close_gathered(&mut self) -> Result<(), GatewayError> {
        if self.gathering.len() >= MIN_PIECE {
            self.pieces
                .push(Bytes::from(std::mem::take(&mut self.gathering)));
        } else if !self.gathering.is_empty() {
            self.charge_more(self.gathering.len() + PIECE_OVERHEAD)?;
            self.pieces.push(Bytes::copy_from_slice(&self.gathering));
            self.gathering.clear();
        }
        Ok(())
    }

    fn charge_more(&mut self, n: usize) -> Result<(), GatewayError> {
        charge_more(self.charge, n, self.budget)?;
        self.charged += n;
        Ok(())
    }

    /// The whole body, in its pieces.
    fn finish(mut self) -> Result<BodyBuf, GatewayError> {
        self.close_gathered()?;
        Ok(BodyBuf::from_pieces(std::mem::take(&mut self.pieces)))
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

    /// The charge is what is held: each piece's bytes (a gathered one: its capacity) and
    /// its overhead; the pieces hold the bytes received.
    fn assert_charge_covers(r: &Receiving) {
        assert_eq!(r.charge.held(), r.charged);
        let held: usize = r.pieces.iter().map(Bytes::len).sum::<usize>() + r.gathering.len();
        assert_eq!(held, r.received);
        let open = usize::from(r.gathering.capacity() > 0);
        assert!(r.charged >= r.received + (r.pieces.len() + open) * PIECE_OVERHEAD);
        assert!(r.gathering.capacity() <= 2 * MIN_PIECE);
    }

    fn chunks_of(body: &[u8], size: usize) -> Vec<Bytes> {
        body.chunks(size).map(Bytes::copy_from_slice).collect()
    }

    #[test]
    fn chunks_are_held_as_they_came_not_copied() {
        let a = Admission::new();
        let mut charge = a.body_bytes();
        let body: Vec<u8> = (0..300_000u32).map(|i| i as u8).collect();
        let chunks = chunks_of(&body, 64 * 1024);
        let mut r = Receiving::new(LIMIT, &mut charge, BUDGET);
        for chunk in chunks.iter().cloned() {
            r.push(chunk).unwrap();
            assert_charge_covers(&r);
        }
        let mut buf = r.finish().unwrap();
        assert_eq!(buf.piece_count(), chunks.len());
        for (held, sent) in buf.pieces().slices(0..body.len()).zip(&chunks) {
            assert_eq!(held.as_ptr(), sent.as_ptr(), "the same bytes, not a copy");
        }
        assert_eq!(a.buffered(), body.len() + chunks.len() * PIECE_OVERHEAD);
        assert_eq!(buf.body(), &body[..]);
        drop(buf);
        drop(charge);
        assert_eq!(a.buffered(), 0);
    }

    #[test]
    fn a_trickle_of_tiny_chunks_is_gathered_into_few_pieces() {
        let a = Admission::new();
        let mut charge = a.body_bytes();
        let body: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let mut r = Receiving::new(LIMIT, &mut charge, BUDGET);
        for chunk in chunks_of(&body, 7) {
            r.push(chunk).unwrap();
            assert_charge_covers(&r);
        }
        let mut buf = r.finish().unwrap();
        assert!(
            buf.piece_count() <= HELD_FREE + body.len() / MIN_PIECE + 1,
            "{} pieces",
            buf.piece_count()
        );
        // A gathered piece is charged its capacity: at most twice its bytes, plus the last.
        assert!(
            a.buffered() <= 2 * body.len() + 2 * MIN_PIECE + buf.piece_count() * PIECE_OVERHEAD
        );
        assert_eq!(buf.body(), &body[..]);
    }

    #[test]
    fn short_and_long_chunks_alternating_hold_no_more_than_twice_the_bytes() {
        let a = Admission::new();
        let mut charge = a.body_bytes();
        let mut r = Receiving::new(LIMIT, &mut charge, BUDGET);
        let mut sent = Vec::new();
        for i in 0..200 {
            let n = if i % 2 == 0 { 1 } else { MIN_PIECE };
            let chunk = vec![(i % 251) as u8; n];
            sent.extend_from_slice(&chunk);
            r.push(Bytes::from(chunk)).unwrap();
            assert_charge_covers(&r);
        }
        let mut buf = r.finish().unwrap();
        let overheads = (buf.piece_count() + 1) * PIECE_OVERHEAD;
        assert!(
            a.buffered() <= 2 * sent.len() + 2 * MIN_PIECE + overheads,
            "{} charged for {} bytes",
            a.buffered(),
            sent.len()
        );
        assert_eq!(buf.body(), &sent[..]);
    }

    #[test]
    fn a_body_over_the_limit_is_refused_as_it_crosses_it() {
        let a = Admission::new();
        let mut charge = a.body_bytes();
        let mut r = Receiving::new(100_000, &mut charge, BUDGET);
        for _ in 0..10 {
            r.push(Bytes::from(vec![b'z'; 10_000])).unwrap();
        }
        assert!(matches!(
            r.push(Bytes::from_static(b"!")),
            Err(GatewayError::PayloadTooLarge { limit: 100_000 })
        ));
        assert_charge_covers(&r);
        drop(r);
        drop(charge);
        assert_eq!(a.buffered(), 0);
    }

    #[test]
    fn a_body_over_the_budget_is_refused_and_a_refused_charge_takes_nothing() {
        let a = Admission::new();
        let budget = 100_000;
        let mut other = a.body_bytes();
        assert!(other.grow(20_000, budget));
        let mut charge = a.body_bytes();
        let mut r = Receiving::new(LIMIT, &mut charge, budget);
        r.push(Bytes::from(vec![b'a'; 60_000])).unwrap();
        assert_eq!(a.buffered(), 20_000 + 60_000 + PIECE_OVERHEAD);
        let before = a.buffered();
        assert!(matches!(
            r.push(Bytes::from(vec![b'a'; 30_000])),
            Err(GatewayError::BodiesOverBudget { .. })
        ));
        assert_eq!(a.buffered(), before);
        assert_charge_covers(&r);
        drop(r);
        drop(charge);
        assert_eq!(a.buffered(), 20_000);
        drop(other);
        assert_eq!(a.buffered(), 0);
    }

    /// Read one request with a `Content-Length` body from pingora, the client writing it in
    /// `writes` (each sent once every byte before it was read), and return the pieces
    /// pingora handed over, after the session is gone.
    async fn pieces_from_pingora(writes: &[usize]) -> Vec<Bytes> {
        use pingora::protocols::http::v1::server::HttpSession;
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let total: usize = writes.iter().sum();
        let sizes = writes.to_vec();
        let (go_tx, mut go_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
        let client = tokio::spawn(async move {
            let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
            let head = format!("POST / HTTP/1.1\r\nHost: t\r\nContent-Length: {total}\r\n\r\n");
            c.write_all(head.as_bytes()).await.unwrap();
            for n in sizes {
                go_rx.recv().await.unwrap();
                c.write_all(&vec![b'x'; n]).await.unwrap();
            }
            c
        });
        let (tcp, _) = listener.accept().await.unwrap();
        let mut session =
            HttpSession::new(Box::new(pingora::protocols::l4::stream::Stream::from(tcp)));
        session.read_request().await.unwrap().unwrap();
        let mut pieces = Vec::new();
        let mut got = 0;
        let mut goal = 0;
        for &n in writes {
            goal += n;
            go_tx.send(()).unwrap();
            while got < goal {
                let piece = session.read_body_bytes().await.unwrap().unwrap();
                got += piece.len();
                pieces.push(piece);
            }
        }
        assert!(session.read_body_bytes().await.unwrap().is_none());
        drop(session);
        drop(client.await.unwrap());
        pieces
    }

    /// The charge counts a piece's bytes: that is what it keeps allocated. pingora (patched,
    /// vendor/README.md) hands a full read over as its buffer, anything else as a copy; a
    /// short last read must not come with a whole 64 KiB buffer behind it.
    #[tokio::test]
    async fn pieces_pingora_hands_over_keep_only_their_bytes() {
        for writes in [
            vec![65_535, 2],
            vec![65_536, 65_536, 100],
            vec![30_000, 60_000, 10_000],
            vec![65_536, 20_000],
        ] {
            let pieces =
                tokio::time::timeout(Duration::from_secs(10), pieces_from_pingora(&writes))
                    .await
                    .expect("the body is read within 10 s");
            let total: usize = pieces.iter().map(Bytes::len).sum();
            assert_eq!(total, writes.iter().sum::<usize>());
            for piece in pieces {
                let len = piece.len();
                // Unique now: owned back as a buffer, its capacity is its allocation's room.
                let owned = piece.try_into_mut().expect("no one else holds the piece");
                assert_eq!(
                    owned.capacity(),
                    len,
                    "writes {writes:?}: a {len}-byte piece"
                );
            }
        }
    }

    proptest! {
        /// Any chunking: the body comes out intact, the pieces stay few, and at every step
        /// the charge is what is held.
        #[test]
        fn any_chunking_keeps_the_body_and_the_charge_exact(
            sizes in proptest::collection::vec(0usize..70_000, 0..40),
        ) {
            let total: usize = sizes.iter().sum();
            let body: Vec<u8> = (0..total).map(|i| (i % 253) as u8).collect();
            let a = Admission::new();
            let mut charge = a.body_bytes();
            let mut r = Receiving::new(LIMIT, &mut charge, BUDGET);
            let mut at = 0;
            for n in sizes {
                r.push(Bytes::copy_from_slice(&body[at..at + n])).unwrap();
                at += n;
                assert_charge_covers(&r);
            }
            let mut buf = r.finish().unwrap();
            prop_assert!(buf.piece_count() <= HELD_FREE + 2 * (total / MIN_PIECE) + 1);
            prop_assert_eq!(buf.len(), total);
            prop_assert_eq!(buf.body(), &body[..]);
        }
    }
}
