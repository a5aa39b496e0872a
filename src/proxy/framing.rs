//! A buffered request body with room in front of it, and the upstream request framed in
//! that room: the request head, then the body with its `model` value replaced, in one
//! contiguous slice that leaves in one write, without copying the body a second time.
//!
//! Owns: the buffer layout and the in-place rewrite (and its undo, for a retry on another
//! target). Must not: read sockets, parse JSON or HTTP; the caller hands in the head bytes
//! and the span of the `model` value.
//!
//! Why: the body arrives from pingora in chunks (the part read with the request head, then
//! the rest), so buffering it is one copy; building the upstream request (head + rewritten
//! body) was a second copy of every body byte. Framing in place leaves only the bytes in
//! front of the `model` value to move, usually `{"model":` or a few fields.

use std::ops::Range;

/// Bytes kept free in front of the body: the upstream request head (method, path,
/// forwarded headers, `host`, `content-length`) fits in it for ordinary clients; a longer
/// head falls back to a copy ([`BodyBuf::frame`] returns `None`).
pub const HEAD_ROOM: usize = 2048;
/// Longest `model` value (as sent, with its quotes) that [`BodyBuf::frame`] saves for the
/// undo; a longer one falls back to a copy. Kept inline in every request's future, so
/// small: route aliases and model ids are far shorter.
const SPAN_MAX: usize = 96;

/// A request body with [`HEAD_ROOM`] free bytes in front of it.
pub struct BodyBuf {
    /// `[room][body]`; after [`BodyBuf::frame`], `[.. head, body prefix, new model][rest]`.
    buf: Vec<u8>,
    /// The current frame, if the body's front is overwritten.
    framed: Option<Framed>,
}

struct Framed {
    /// Where the body prefix (the bytes before the `model` value) now starts.
    prefix_at: usize,
    /// The `model` value's span in the body.
    span: Range<usize>,
    /// The original `model` value bytes (`span.len()` of them).
    original: [u8; SPAN_MAX],
}

impl BodyBuf {
    /// An empty body with room for `expected` body bytes.
    pub fn with_capacity(expected: usize) -> Self {
        let mut buf = Vec::with_capacity(HEAD_ROOM + expected);
        buf.resize(HEAD_ROOM, 0);
        BodyBuf { buf, framed: None }
    }

    /// Bytes allocated for the body (its room in front not counted).
    pub fn body_capacity(&self) -> usize {
        self.buf.capacity().saturating_sub(HEAD_ROOM)
    }

    /// Make room for a body of `body_capacity` bytes in all (no more than that, so what
    /// the caller charged for it is what is allocated).
    pub fn reserve_body(&mut self, body_capacity: usize) {
        self.buf
            .reserve_exact((HEAD_ROOM + body_capacity).saturating_sub(self.buf.len()));
    }

    /// Append body bytes.
    pub fn extend(&mut self, bytes: &[u8]) {
        debug_assert!(self.framed.is_none(), "extended after framing");
        self.buf.extend_from_slice(bytes);
    }

    /// The body as the client sent it. Undoes a frame first.
    pub fn body(&mut self) -> &[u8] {
        self.unframe();
        self.buf.get(HEAD_ROOM..).unwrap_or_default()
    }

    /// The body's length (framed or not).
    pub fn len(&self) -> usize {
        self.buf.len().saturating_sub(HEAD_ROOM)
    }

    /// Free the buffer: the request was delivered. The body is empty afterwards.
    pub fn release(&mut self) {
        self.buf = Vec::new();
        self.framed = None;
    }

    /// Whether the body is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `head` followed by the body with `body[span]` replaced by `replacement`, built in
    /// place in front of the body; `None` (buffer unchanged) when it does not fit there
    /// (a head longer than the room allows, or a `model` value over [`SPAN_MAX`] bytes).
    /// A later [`BodyBuf::body`] or `frame` restores the body first.
    pub fn frame(&mut self, head: &[u8], span: Range<usize>, replacement: &[u8]) -> Option<&[u8]> {
        self.unframe();
        assert!(
            span.start <= span.end && span.end <= self.len(),
            "span out of the body"
        );
        if !fits(head.len(), &span, replacement.len()) {
            return None;
        }
        let end = HEAD_ROOM + span.end;
        let start = end - (head.len() + span.start + replacement.len());
        let prefix_at = start + head.len();
        let mut original = [0u8; SPAN_MAX];
        original[..span.len()].copy_from_slice(&self.buf[HEAD_ROOM + span.start..end]);
        // The prefix first (source and destination may overlap), then what goes around it.
        self.buf
            .copy_within(HEAD_ROOM..HEAD_ROOM + span.start, prefix_at);
        self.buf[prefix_at + span.start..end].copy_from_slice(replacement);
        self.buf[start..prefix_at].copy_from_slice(head);
        self.framed = Some(Framed {
            prefix_at,
            span,
            original,
        });
        Some(&self.buf[start..])
    }

    /// [`BodyBuf::frame`], or when that does not fit, the same bytes built in `spill`.
    pub fn frame_or_copy<'a>(
        &'a mut self,
        head: &[u8],
        span: Range<usize>,
        replacement: &[u8],
        spill: &'a mut Vec<u8>,
    ) -> &'a [u8] {
        if fits(head.len(), &span, replacement.len()) {
            return self.frame(head, span, replacement).expect("checked to fit");
        }
        let body = self.body();
        spill.clear();
        spill.reserve(head.len() + body.len() - span.len() + replacement.len());
        spill.extend_from_slice(head);
        crate::prompt::rewrite_model_into(spill, body, span, replacement);
        spill
    }

    /// Put the body's front back as the client sent it.
    fn unframe(&mut self) {
        let Some(f) = self.framed.take() else {
            return;
        };
        self.buf
            .copy_within(f.prefix_at..f.prefix_at + f.span.start, HEAD_ROOM);
        self.buf[HEAD_ROOM + f.span.start..HEAD_ROOM + f.span.end]
            .copy_from_slice(&f.original[..f.span.len()]);
    }
}

/// Whether a frame of `head_len` head bytes and a `replacement_len`-byte model value for
/// `span` fits in front of the body: the head and the growth of the model value within the
/// room, and the original value short enough to be saved for the undo.
fn fits(head_len: usize, span: &Range<usize>, replacement_len: usize) -> bool {
    head_len + replacement_len <= HEAD_ROOM + span.len() && span.len() <= SPAN_MAX
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn buf_of(body: &[u8]) -> BodyBuf {
        let mut b = BodyBuf::with_capacity(body.len());
        b.extend(body);
        b
    }

    fn expected(head: &[u8], body: &[u8], span: Range<usize>, repl: &[u8]) -> Vec<u8> {
        let mut out = head.to_vec();
        crate::prompt::rewrite_model_into(&mut out, body, span, repl);
        out
    }

    #[test]
    fn frames_in_place_and_restores_for_a_second_target() {
        let body = br#"{"model":"alias","messages":[{"role":"user","content":"hi"}]}"#;
        let span = 9..16;
        let mut b = buf_of(body);
        let first = b
            .frame(
                b"POST /a HTTP/1.1\r\n\r\n",
                span.clone(),
                br#""org/a-much-longer-model""#,
            )
            .unwrap()
            .to_vec();
        assert_eq!(
            first,
            expected(
                b"POST /a HTTP/1.1\r\n\r\n",
                body,
                span.clone(),
                br#""org/a-much-longer-model""#
            )
        );
        // A retry on another target: a different head and model, from the original body.
        let second = b
            .frame(
                b"POST /b HTTP/1.1\r\nhost: b\r\n\r\n",
                span.clone(),
                br#""m""#,
            )
            .unwrap()
            .to_vec();
        assert_eq!(
            second,
            expected(
                b"POST /b HTTP/1.1\r\nhost: b\r\n\r\n",
                body,
                span,
                br#""m""#
            )
        );
        assert_eq!(b.body(), body);
    }

    #[test]
    fn a_head_too_long_for_the_room_is_refused_and_leaves_the_body_alone() {
        let body = br#"{"model":"alias"}"#;
        let mut b = buf_of(body);
        // The 3-byte model replaces 7 bytes: 4 spare, so a head of `HEAD_ROOM + 5` cannot fit.
        let head = vec![b'h'; HEAD_ROOM + 5];
        assert!(b.frame(&head, 9..16, br#""m""#).is_none());
        let long_model = vec![b'x'; SPAN_MAX + 1];
        let mut body2 = br#"{"model":""#.to_vec();
        body2.extend_from_slice(&long_model);
        body2.extend_from_slice(br#""}"#);
        let mut b2 = buf_of(&body2);
        assert!(b2.frame(b"h", 9..body2.len() - 1, br#""m""#).is_none());
        assert_eq!(b.body(), body);
        assert_eq!(b2.body(), &body2[..]);
    }

    proptest! {
        /// Any head, body and model placement: the frame equals the copying encoder's
        /// output, or is refused; after any sequence of frames the body is intact.
        #[test]
        fn frame_matches_the_copying_rewrite(
            body in proptest::collection::vec(any::<u8>(), 0..600),
            a in 0usize..600,
            b in 0usize..600,
            heads in proptest::collection::vec(
                (proptest::collection::vec(any::<u8>(), 0..HEAD_ROOM + 300),
                 proptest::collection::vec(b'a'..=b'z', 0..300)),
                1..4),
        ) {
            let (lo, hi) = (a.min(b).min(body.len()), a.max(b).min(body.len()));
            let span = lo..hi;
            let mut buf = buf_of(&body);
            for (head, repl) in &heads {
                let repl = String::from_utf8(repl.clone()).unwrap();
                let mut spill = Vec::new();
                let either = buf.frame_or_copy(head, span.clone(), repl.as_bytes(), &mut spill).to_vec();
                prop_assert_eq!(either, expected(head, &body, span.clone(), repl.as_bytes()));
                match buf.frame(head, span.clone(), repl.as_bytes()) {
                    Some(framed) => {
                        prop_assert_eq!(framed.to_vec(), expected(head, &body, span.clone(), repl.as_bytes()));
                    }
                    None => prop_assert!(
                        head.len() + repl.len() > HEAD_ROOM + span.len() || span.len() > SPAN_MAX
                    ),
                }
            }
            prop_assert_eq!(buf.len(), body.len());
            prop_assert_eq!(buf.body(), &body[..]);
        }
    }
}
