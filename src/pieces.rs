//! Reading a byte string held in pieces (a request body as its chunks arrived): the
//! slices that cover a range, and copies of short ranges.
//!
//! Owns: offset arithmetic over a list of `Bytes`. Must not: allocate or own the pieces
//! (`proxy::framing::BodyBuf` holds them; `prompt::resume` hashes and compares them).

use bytes::Bytes;
use std::ops::Range;

/// A byte string held as consecutive pieces.
#[derive(Clone, Copy)]
pub struct Pieces<'a> {
    first: &'a [u8],
    rest: &'a [Bytes],
    len: usize,
}

impl<'a> Pieces<'a> {
    pub fn new(pieces: &'a [Bytes]) -> Self {
        match pieces.split_first() {
            Some((first, rest)) => Pieces {
                first,
                rest,
                len: pieces.iter().map(Bytes::len).sum(),
            },
            None => Pieces::one(&[]),
        }
    }

    /// A string held in one slice.
    pub fn one(bytes: &'a [u8]) -> Self {
        Pieces {
            first: bytes,
            rest: &[],
            len: bytes.len(),
        }
    }

    /// The string's length.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The slices of the pieces that make up `range`, in order (none empty).
    pub fn slices(&self, range: Range<usize>) -> impl Iterator<Item = &'a [u8]> + 'a {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "range out of the pieces"
        );
        let mut start = 0;
        let all = std::iter::once(self.first).chain(self.rest.iter().map(|p| &p[..]));
        all.filter_map(move |p| {
            let (from, to) = (start, start + p.len());
            start = to;
            let (lo, hi) = (range.start.max(from), range.end.min(to));
            (lo < hi).then(|| &p[lo - from..hi - from])
        })
    }

    /// The bytes of `start..start + out.len()`, copied into `out`.
    pub fn copy_to(&self, start: usize, out: &mut [u8]) {
        let mut filled = 0;
        for s in self.slices(start..start + out.len()) {
            out[filled..filled + s.len()].copy_from_slice(s);
            filled += s.len();
        }
    }

    /// `range`, borrowed when one piece holds it, else copied.
    pub fn range(&self, range: Range<usize>) -> std::borrow::Cow<'a, [u8]> {
        let mut slices = self.slices(range.clone());
        match (slices.next(), slices.next()) {
            (None, _) => std::borrow::Cow::Borrowed(&[]),
            (Some(one), None) => std::borrow::Cow::Borrowed(one),
            _ => {
                let mut out = vec![0; range.len()];
                self.copy_to(range.start, &mut out);
                std::borrow::Cow::Owned(out)
            }
        }
    }
}

/// `bytes` cut at `cuts` (each taken modulo `bytes.len() + 1`, any order), for tests of
/// readers of pieces.
#[cfg(test)]
pub fn split(bytes: &[u8], cuts: &[usize]) -> Vec<Bytes> {
    let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    cuts.sort_unstable();
    let mut out = Vec::new();
    let mut at = 0;
    for c in cuts.into_iter().chain([bytes.len()]) {
        out.push(Bytes::copy_from_slice(&bytes[at..c]));
        at = c;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any split, any range: the slices, the copy and the range are the string's bytes.
        #[test]
        fn ranges_read_the_same_bytes_however_the_string_is_split(
            bytes in proptest::collection::vec(any::<u8>(), 0..300),
            cuts in proptest::collection::vec(any::<usize>(), 0..8),
            a in any::<usize>(),
            b in any::<usize>(),
        ) {
            let held = split(&bytes, &cuts);
            let p = Pieces::new(&held);
            prop_assert_eq!(p.len(), bytes.len());
            let (a, b) = (a % (bytes.len() + 1), b % (bytes.len() + 1));
            let r = a.min(b)..a.max(b);
            let joined: Vec<u8> = p.slices(r.clone()).flatten().copied().collect();
            prop_assert_eq!(&joined[..], &bytes[r.clone()]);
            prop_assert!(p.slices(r.clone()).all(|s| !s.is_empty()));
            let mut out = vec![0; r.len()];
            p.copy_to(r.start, &mut out);
            prop_assert_eq!(&out[..], &bytes[r.clone()]);
            prop_assert_eq!(&p.range(r.clone())[..], &bytes[r.clone()]);
            let one = Pieces::one(&bytes);
            prop_assert_eq!(&one.range(r.clone())[..], &bytes[r]);
        }
    }
}
