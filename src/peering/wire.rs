//! The peering datagram: notes a gateway sends its peers about the turns it placed.
//!
//! A datagram is [`MAGIC`] followed by notes, each: the route alias and the target label
//! (one length byte, then UTF-8), the conversation key (`PlacementKeys::conversation`, 8
//! bytes little-endian: the same on every gateway for the same first two messages or
//! `x-session-id`) and a flags byte (bit 0: the turn was new work). At most
//! [`MAX_DATAGRAM`] bytes, so it fits one Ethernet frame unfragmented.
//!
//! Owns the encoding and its checks. Must not touch sockets or routing state.

use thiserror::Error;

/// First bytes of every datagram (format version 1).
pub const MAGIC: &[u8; 4] = b"RLP1";
/// Largest datagram sent or accepted: under a 1,500-byte MTU with IPv6 and UDP headers.
pub const MAX_DATAGRAM: usize = 1400;
/// Longest route alias or target label a note carries.
pub const MAX_NAME: usize = u8::MAX as usize;

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
    let mut rest = datagram.strip_prefix(MAGIC).ok_or(WireError::Magic)?;
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
        assert_eq!(decode(b"RLP2"), Err(WireError::Magic));
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

    proptest! {
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
