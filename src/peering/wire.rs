//! The peering datagram: notes a gateway sends its peers about the turns it placed.
//!
//! A datagram is [`MAGIC`] followed by notes, each: the route alias and the target label
//! (one length byte, then UTF-8), the conversation key (`PlacementKeys::conversation`, 8
//! bytes little-endian: the same on every gateway for the same first two messages or
//! `x-session-id`) and a flags byte (bit 0: the turn was new work). At most
//! [`MAX_DATAGRAM`] bytes, so it fits one Ethernet frame unfragmented.
//!
//! With a shared key (`[peering] key_file` / `key_env`) a datagram is sealed instead:
//! [`MAGIC_SEALED`], a stamp (the sender's wall-clock time in Unix µs, raised so that each
//! datagram's is above the one before; 8 bytes little-endian), the notes, then the first
//! [`TAG_BYTES`] bytes of HMAC-SHA-256 under the key over the sender's address (its
//! `listen`, as text) and everything before the tag. A receiver with the key accepts a
//! sealed datagram only when the tag verifies for the address it came from, its stamp is
//! within [`MAX_SKEW_MS`] of the receiver's clock and above the last one it accepted from
//! that sender (before the first, above the receiver's start), so a captured datagram can
//! be neither replayed nor passed off as another peer's; one without a key accepts only
//! unsealed datagrams.
//!
//! Owns the encoding, the seal and their checks. Must not touch sockets or routing state.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::net::SocketAddr;
use thiserror::Error;

/// First bytes of every unsealed datagram (format version 1).
pub const MAGIC: &[u8; 4] = b"RLP1";
/// First bytes of every sealed datagram (format version 2).
pub const MAGIC_SEALED: &[u8; 4] = b"RLP2";
/// Largest datagram sent or accepted: under a 1,500-byte MTU with IPv6 and UDP headers.
pub const MAX_DATAGRAM: usize = 1400;
/// Longest route alias or target label a note carries.
pub const MAX_NAME: usize = u8::MAX as usize;
/// Bytes of the HMAC-SHA-256 tag a sealed datagram carries (128 bits, as TLS's truncated
/// MACs and RFC 2104's guidance of at least half the hash allow).
pub const TAG_BYTES: usize = 16;
/// A sealed datagram's header: the magic and the stamp.
pub const SEALED_HEADER: usize = MAGIC_SEALED.len() + 8;
/// How far a sealed datagram's stamp may be from the receiver's clock: far beyond the
/// milliseconds a datagram takes, room for clocks kept by NTP.
pub const MAX_SKEW_MS: u64 = 30_000;
/// Shortest key accepted (`[peering] key_file` / `key_env`).
pub const MIN_KEY_BYTES: usize = crate::config::MIN_PEERING_KEY_BYTES;

const NEW_WORK: u8 = 1;

/// One placed turn, as a peer hears of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Note<'a> {
    /// The route's alias.
    pub route: &'a str,
    /// The chosen target's label (`provider/model`).
    pub label: &'a str,
    /// The conversation's placement key.
    pub conversation: u64,
    /// Placed as new work (the placement rule's share counts it).
    pub new_work: bool,
}

/// Why a note or a datagram was refused.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum WireError {
    #[error("not a peering datagram")]
    Magic,
    #[error("datagram of {0} bytes, over {MAX_DATAGRAM}")]
    TooLong(usize),
    #[error("note cut short")]
    Truncated,
    #[error("name is not UTF-8")]
    NotUtf8,
    #[error("name of {0} bytes, over {MAX_NAME}")]
    NameTooLong(usize),
    #[error("unknown flags {0:#x}")]
    Flags(u8),
    #[error("not sealed with this gateway's key")]
    BadSeal,
    #[error("sealed, and this gateway has no key")]
    Sealed,
    #[error("sent {0} ms from this gateway's clock, over {MAX_SKEW_MS}")]
    Skew(u64),
    #[error("stamped no later than a datagram already accepted from its sender")]
    Replayed,
}

/// The shared key peers seal datagrams with. `Debug` never shows it.
#[derive(Clone)]
pub struct Key(Hmac<Sha256>);

impl Key {
    /// A key of at least [`MIN_KEY_BYTES`] bytes; `None` if shorter.
    pub fn new(secret: &[u8]) -> Option<Key> {
        (secret.len() >= MIN_KEY_BYTES)
            .then(|| Hmac::new_from_slice(secret).ok().map(Key))
            .flatten()
    }

    /// The MAC of `bytes` sent from `sender`.
    fn tag(&self, sender: SocketAddr, bytes: &[u8]) -> Hmac<Sha256> {
        let mut mac = self.0.clone();
        let sender = sender.to_string();
        mac.update(&[sender.len() as u8]);
        mac.update(sender.as_bytes());
        mac.update(bytes);
        mac
    }
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Key(..)")
    }
}

/// Seal `datagram`, built as [`MAGIC_SEALED`], [`SEALED_HEADER`] − 4 bytes of any value and
/// the notes (at most [`MAX_DATAGRAM`] − [`TAG_BYTES`] bytes in all), as sent from `sender`
/// (the socket's address) with `stamp` (Unix µs, above the sender's previous stamp): writes
/// the stamp and appends the tag.
pub fn seal(datagram: &mut Vec<u8>, key: &Key, sender: SocketAddr, stamp: u64) {
    debug_assert!(datagram.starts_with(MAGIC_SEALED) && datagram.len() >= SEALED_HEADER);
    datagram[MAGIC_SEALED.len()..SEALED_HEADER].copy_from_slice(&stamp.to_le_bytes());
    let tag = key.tag(sender, datagram).finalize().into_bytes();
    datagram.extend_from_slice(&tag[..TAG_BYTES]);
}

/// A sealed datagram's stamp and notes, checked as [`decode`] checks an unsealed one: sealed
/// with `key` as sent from `sender`, stamped within [`MAX_SKEW_MS`] of `now_us` and above
/// `after` (the last stamp accepted from `sender`; 0 for none).
pub fn open<'a>(
    datagram: &'a [u8],
    key: &Key,
    sender: SocketAddr,
    now_us: u64,
    after: u64,
) -> Result<(u64, Vec<Note<'a>>), WireError> {
    if datagram.len() > MAX_DATAGRAM {
        return Err(WireError::TooLong(datagram.len()));
    }
    if !datagram.starts_with(MAGIC_SEALED) {
        return Err(if datagram.starts_with(MAGIC) {
            WireError::BadSeal
        } else {
            WireError::Magic
        });
    }
    if datagram.len() < SEALED_HEADER + TAG_BYTES {
        return Err(WireError::Truncated);
    }
    let (sealed, tag) = datagram.split_at(datagram.len() - TAG_BYTES);
    key.tag(sender, sealed)
        .verify_truncated_left(tag)
        .map_err(|_| WireError::BadSeal)?;
    let mut stamp = [0; 8];
    stamp.copy_from_slice(&sealed[MAGIC_SEALED.len()..SEALED_HEADER]);
    let stamp = u64::from_le_bytes(stamp);
    let skew_ms = stamp.abs_diff(now_us) / 1000;
    if skew_ms > MAX_SKEW_MS {
        return Err(WireError::Skew(skew_ms));
    }
    if stamp <= after {
        return Err(WireError::Replayed);
    }
    Ok((stamp, notes(&sealed[SEALED_HEADER..])?))
}

/// `note` encoded (without the datagram's magic).
pub fn encode(note: &Note) -> Result<Vec<u8>, WireError> {
    let mut out = Vec::with_capacity(note.route.len() + note.label.len() + 11);
    for name in [note.route, note.label] {
        let len = u8::try_from(name.len()).map_err(|_| WireError::NameTooLong(name.len()))?;
        out.push(len);
        out.extend_from_slice(name.as_bytes());
    }
    out.extend_from_slice(&note.conversation.to_le_bytes());
    out.push(if note.new_work { NEW_WORK } else { 0 });
    Ok(out)
}

/// The notes of `datagram`, all or none: a datagram with one bad note is refused whole.
pub fn decode(datagram: &[u8]) -> Result<Vec<Note<'_>>, WireError> {
    if datagram.len() > MAX_DATAGRAM {
        return Err(WireError::TooLong(datagram.len()));
    }
    if datagram.starts_with(MAGIC_SEALED) {
        return Err(WireError::Sealed);
    }
    notes(datagram.strip_prefix(MAGIC).ok_or(WireError::Magic)?)
}

/// The notes packed back to back in `rest`, all or none.
fn notes(mut rest: &[u8]) -> Result<Vec<Note<'_>>, WireError> {
    let mut notes = Vec::new();
    while !rest.is_empty() {
        let route = name(&mut rest)?;
        let label = name(&mut rest)?;
        let (key, tail) = rest.split_first_chunk::<8>().ok_or(WireError::Truncated)?;
        let (&flags, tail) = tail.split_first().ok_or(WireError::Truncated)?;
        if flags & !NEW_WORK != 0 {
            return Err(WireError::Flags(flags));
        }
        rest = tail;
        notes.push(Note {
            route,
            label,
            conversation: u64::from_le_bytes(*key),
            new_work: flags & NEW_WORK != 0,
        });
    }
    Ok(notes)
}

fn name<'a>(rest: &mut &'a [u8]) -> Result<&'a str, WireError> {
    let (&len, tail) = rest.split_first().ok_or(WireError::Truncated)?;
    if tail.len() < len as usize {
        return Err(WireError::Truncated);
    }
    let (bytes, tail) = tail.split_at(len as usize);
    *rest = tail;
    std::str::from_utf8(bytes).map_err(|_| WireError::NotUtf8)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn datagram(notes: &[Note]) -> Vec<u8> {
        let mut d = MAGIC.to_vec();
        for n in notes {
            d.extend(encode(n).unwrap());
        }
        d
    }

    #[test]
    fn notes_come_back_as_they_were_sent() {
        let notes = [
            Note {
                route: "chat",
                label: "vllm-0/llama",
                conversation: 0x0123_4567_89ab_cdef,
                new_work: true,
            },
            Note {
                route: "chat",
                label: "vllm-1/llama",
                conversation: u64::MAX,
                new_work: false,
            },
        ];
        assert_eq!(decode(&datagram(&notes)).unwrap(), notes);
        assert_eq!(decode(MAGIC).unwrap(), vec![]);
    }

    #[test]
    fn bad_datagrams_are_refused_whole() {
        let note = Note {
            route: "r",
            label: "p/m",
            conversation: 7,
            new_work: false,
        };
        let good = datagram(&[note, note]);
        assert_eq!(decode(b"RLP0"), Err(WireError::Magic));
        assert_eq!(decode(b"RLP2"), Err(WireError::Sealed));
        assert_eq!(decode(&good[..good.len() - 1]), Err(WireError::Truncated));
        let mut flags = good.clone();
        *flags.last_mut().unwrap() = 0x80;
        assert_eq!(decode(&flags), Err(WireError::Flags(0x80)));
        let mut utf8 = good.clone();
        utf8[5] = 0xff;
        assert_eq!(decode(&utf8), Err(WireError::NotUtf8));
        let long = "x".repeat(256);
        let too_long = Note {
            route: &long,
            ..note
        };
        assert_eq!(encode(&too_long), Err(WireError::NameTooLong(256)));
        assert_eq!(
            decode(&vec![0; MAX_DATAGRAM + 1]),
            Err(WireError::TooLong(MAX_DATAGRAM + 1))
        );
    }

    /// A wall-clock time in Unix µs.
    const NOW: u64 = 1_796_000_000_000_000;
    const SKEW_US: u64 = MAX_SKEW_MS * 1000;

    fn key(byte: u8) -> Key {
        Key::new(&[byte; MIN_KEY_BYTES]).unwrap()
    }

    fn addr(text: &str) -> SocketAddr {
        text.parse().unwrap()
    }

    fn sealed(notes: &[Note], key: &Key, sender: SocketAddr, stamp: u64) -> Vec<u8> {
        let mut d = MAGIC_SEALED.to_vec();
        d.extend([0; SEALED_HEADER - 4]);
        for n in notes {
            d.extend(encode(n).unwrap());
        }
        seal(&mut d, key, sender, stamp);
        d
    }

    const NOTE: Note = Note {
        route: "chat",
        label: "vllm-0/llama",
        conversation: 42,
        new_work: true,
    };

    #[test]
    fn a_sealed_datagram_opens_only_with_its_key_from_its_sender_unaltered_and_on_time() {
        let (k, a) = (key(1), addr("10.0.0.11:7100"));
        let d = sealed(&[NOTE, NOTE], &k, a, NOW);
        assert_eq!(
            d.len(),
            SEALED_HEADER + 2 * encode(&NOTE).unwrap().len() + TAG_BYTES
        );
        let notes = vec![NOTE, NOTE];
        assert_eq!(open(&d, &k, a, NOW, 0).unwrap(), (NOW, notes.clone()));
        assert_eq!(open(&d, &k, a, NOW + SKEW_US, 0).unwrap().1, notes);
        assert_eq!(open(&d, &k, a, NOW - SKEW_US, NOW - 1).unwrap().1, notes);
        // Another key, another sender (a datagram one peer sent, replayed from another's
        // address), any altered byte (header, note or tag).
        assert_eq!(open(&d, &key(2), a, NOW, 0), Err(WireError::BadSeal));
        for other in [
            "10.0.0.12:7100",
            "10.0.0.11:7101",
            "[::ffff:10.0.0.11]:7100",
        ] {
            assert_eq!(
                open(&d, &k, addr(other), NOW, 0),
                Err(WireError::BadSeal),
                "{other}"
            );
        }
        for i in 0..d.len() {
            let mut bad = d.clone();
            bad[i] ^= 0x01;
            let e = open(&bad, &k, a, NOW, 0).unwrap_err();
            assert!(
                matches!(e, WireError::BadSeal | WireError::Magic),
                "byte {i}: {e:?}"
            );
        }
        // Stale or future, and not above the sender's last accepted stamp (a replay).
        assert_eq!(
            open(&d, &k, a, NOW + SKEW_US + 1000, 0),
            Err(WireError::Skew(MAX_SKEW_MS + 1))
        );
        assert_eq!(
            open(&d, &k, a, NOW - SKEW_US - 1000, 0),
            Err(WireError::Skew(MAX_SKEW_MS + 1))
        );
        assert_eq!(open(&d, &k, a, NOW, NOW), Err(WireError::Replayed));
        assert_eq!(open(&d, &k, a, NOW, NOW + 5), Err(WireError::Replayed));
        // Each side refuses the other's format: a keyed gateway takes no unsealed notes, an
        // unkeyed one no sealed ones.
        assert_eq!(
            open(&datagram(&[NOTE]), &k, a, NOW, 0),
            Err(WireError::BadSeal)
        );
        assert_eq!(decode(&d), Err(WireError::Sealed));
        assert_eq!(
            open(&d[..SEALED_HEADER + TAG_BYTES - 1], &k, a, NOW, 0),
            Err(WireError::Truncated)
        );
        let empty = sealed(&[], &k, a, NOW);
        assert_eq!(open(&empty, &k, a, NOW, 0).unwrap(), (NOW, vec![]));
    }

    #[test]
    fn keys_shorter_than_32_bytes_are_refused_and_never_printed() {
        assert!(Key::new(&[7; MIN_KEY_BYTES - 1]).is_none());
        let k = Key::new(b"0123456789abcdef0123456789abcdef").unwrap();
        assert_eq!(format!("{k:?}"), "Key(..)");
    }

    proptest! {
        /// Whatever arrives on a keyed socket, opening returns (no panic, no read past the end).
        #[test]
        fn any_bytes_open_or_are_refused(tail in proptest::collection::vec(any::<u8>(), 0..300)) {
            let mut d = MAGIC_SEALED.to_vec();
            d.extend(tail);
            let _ = open(&d, &key(3), addr("127.0.0.1:1"), NOW, 0);
        }

        /// Whatever arrives on the socket, decoding returns (no panic, no read past the end).
        #[test]
        fn any_bytes_decode_or_are_refused(tail in proptest::collection::vec(any::<u8>(), 0..300)) {
            let mut d = MAGIC.to_vec();
            d.extend(tail);
            let _ = decode(&d);
        }

        #[test]
        fn any_note_round_trips(route in "[a-z/._-]{0,40}", label in "\\PC{0,60}",
                                conversation: u64, new_work: bool) {
            let note = Note { route: &route, label: &label, conversation, new_work };
            let d = datagram(&[note]);
            prop_assert_eq!(decode(&d).unwrap(), vec![note]);
        }
    }
}
