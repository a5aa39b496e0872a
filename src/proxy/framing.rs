//! A buffered request body, held in the pieces it arrived in, and the upstream request
//! gathered from them: the request head, then the body with its `model` value replaced,
//! as a list of slices for one vectored write. The body is never copied to be sent.
//!
//! Owns: the pieces (made contiguous from an offset on, for a reader that needs the bytes
//! in one slice) and the gather list. Must not: read sockets, parse JSON or HTTP; the
//! caller hands in the head bytes and the span of the `model` value.
//!
//! Why pieces: pingora hands each read of the body over as its own `Bytes` (its copy out
//! of the connection's read buffer); copying them into one buffer cost as much CPU again
//! as pingora's copy (more: the buffer is cold), and only the parse needs contiguous
//! bytes. A chat body resumed where its conversation's previous turn ended
//! (`prompt::resume`) is parsed from that offset on, so only its new part is made
//! contiguous; any other body is made contiguous whole once (one copy, as before).

use crate::pieces::Pieces;
use bytes::Bytes;
use std::io::IoSlice;
use std::ops::Range;

/// A request body held in pieces.
#[derive(Default)]
pub struct BodyBuf {
    pieces: Vec<Bytes>,
    len: usize,
}

impl BodyBuf {
    /// The body made of `pieces`, in order (empty ones dropped).
    pub fn from_pieces(mut pieces: Vec<Bytes>) -> Self {
        pieces.retain(|p| !p.is_empty());
        let len = pieces.iter().map(Bytes::len).sum();
        BodyBuf { pieces, len }
    }

    /// The pieces, to read without copying.
    pub fn pieces(&self) -> Pieces<'_> {
        Pieces::new(&self.pieces)
    }

    /// How many pieces hold the body.
    pub fn piece_count(&self) -> usize {
        self.pieces.len()
    }

    /// The body as the client sent it, in one slice (its pieces joined first if several).
    pub fn body(&mut self) -> &[u8] {
        self.contiguous_from(0)
    }

    /// `body[at..]` in one slice: the pieces from the one `at` falls in are joined into
    /// one first if they are several (from that piece's start: no byte is held twice).
    /// Joining copies and frees the old pieces in one step, with no await between: a body
    /// never holds its bytes twice for long.
    pub fn contiguous_from(&mut self, at: usize) -> &[u8] {
        assert!(at <= self.len, "offset past the body");
        let mut start = 0;
        let first = self
            .pieces
            .iter()
            .position(|p| {
                let inside = at < start + p.len();
                if !inside {
                    start += p.len();
                }
                inside
            })
            .unwrap_or(self.pieces.len());
        if first + 1 < self.pieces.len() {
            let mut joined = Vec::with_capacity(self.len - start);
            for p in &self.pieces[first..] {
                joined.extend_from_slice(p);
            }
            self.pieces.truncate(first);
            self.pieces.push(Bytes::from(joined));
        }
        match self.pieces.get(first) {
            Some(piece) => &piece[at - start..],
            None => &[],
        }
    }

    /// The body's length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the body is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Free the pieces: the request was delivered. The body is empty afterwards.
    pub fn release(&mut self) {
        self.pieces = Vec::new();
        self.len = 0;
    }

    /// The upstream request as slices: `head`, then the body with `body[span]` replaced by
    /// `replacement`.
    pub fn gather<'a>(
        &'a self,
        head: &'a [u8],
        span: Range<usize>,
        replacement: &'a [u8],
    ) -> Vec<IoSlice<'a>> {
        assert!(
            span.start <= span.end && span.end <= self.len,
            "span out of the body"
        );
        let pieces = self.pieces();
        let mut out = Vec::with_capacity(self.pieces.len() + 3);
        out.push(IoSlice::new(head));
        out.extend(pieces.slices(0..span.start).map(IoSlice::new));
        if !replacement.is_empty() {
            out.push(IoSlice::new(replacement));
        }
        out.extend(pieces.slices(span.end..self.len).map(IoSlice::new));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pieces::split;
    use proptest::prelude::*;

    fn expected(head: &[u8], body: &[u8], span: Range<usize>, repl: &[u8]) -> Vec<u8> {
        let mut out = head.to_vec();
        crate::prompt::rewrite_model_into(&mut out, body, span, repl);
        out
    }

    #[test]
    fn a_body_in_one_piece_is_read_in_place() {
        let body = Bytes::from_static(br#"{"model":"m","messages":[]}"#);
        let mut b = BodyBuf::from_pieces(vec![body.clone()]);
        assert_eq!(b.body().as_ptr(), body.as_ptr(), "no copy");
        assert_eq!(b.contiguous_from(10).as_ptr(), body[10..].as_ptr());
    }

    #[test]
    fn joining_from_an_offset_keeps_the_pieces_before_it() {
        let mut b = BodyBuf::from_pieces(split(b"abcdefghij", &[3, 6, 8]));
        assert_eq!(b.contiguous_from(4), b"efghij");
        // abc | defghij: joined from the start of the piece 4 fell in, nothing held twice.
        assert_eq!(b.piece_count(), 2);
        assert_eq!(b.pieces().slices(0..10).map(<[u8]>::len).sum::<usize>(), 10);
        let first = b.pieces.first().unwrap().as_ptr();
        assert_eq!(b.body(), b"abcdefghij");
        assert_eq!(b.piece_count(), 1);
        assert_ne!(b.body().as_ptr(), first, "joined whole");
    }

    proptest! {
        /// Any split, any offsets joined from, any head and model placement: the gathered
        /// request is the copying rewrite's, and the body reads as sent.
        #[test]
        fn the_gathered_request_matches_the_copying_rewrite(
            body in proptest::collection::vec(any::<u8>(), 0..400),
            cuts in proptest::collection::vec(any::<usize>(), 0..10),
            joins in proptest::collection::vec(any::<usize>(), 0..3),
            a in any::<usize>(),
            b in any::<usize>(),
            head in proptest::collection::vec(any::<u8>(), 0..64),
            repl in proptest::collection::vec(any::<u8>(), 0..40),
        ) {
            let mut buf = BodyBuf::from_pieces(split(&body, &cuts));
            prop_assert_eq!(buf.len(), body.len());
            for j in joins {
                let at = j % (body.len() + 1);
                prop_assert_eq!(buf.contiguous_from(at), &body[at..]);
                prop_assert_eq!(buf.len(), body.len());
            }
            let (a, b) = (a % (body.len() + 1), b % (body.len() + 1));
            let span = a.min(b)..a.max(b);
            let gathered: Vec<u8> = buf
                .gather(&head, span.clone(), &repl)
                .iter()
                .flat_map(|s| s.iter().copied())
                .collect();
            prop_assert_eq!(gathered, expected(&head, &body, span, &repl));
            prop_assert_eq!(buf.body(), &body[..]);
        }
    }
}
