//! A hostile ZMQ peer for hardening tests: a raw-TCP ZMTP 3.0 handshake as a chosen socket
//! type, then one frame header declaring a huge length and no data (the "frame bomb").
//!
//! Owns the bytes of that exchange and nothing else: no libzmq, so it can send what a
//! well-behaved implementation never would. A receiver that reserves the declared length
//! before reading (the `zeromq` 0.7 crate did) aborts on it; libzmq with `ZMQ_MAXMSGSIZE`
//! closes the connection, which [`Outcome::peer_closed`] reports. The `zmq-frame-bomb`
//! binary wraps [`serve`] (a hostile PUB or ROUTER the gateway dials) and [`dial`] (a hostile
//! publisher dialling a gateway whose SUB binds).

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The length the bomb declares: 2^50 bytes (1 PiB).
pub const BOMB_LEN: u64 = 1 << 50;
/// Length of a ZMTP 3 greeting.
const GREETING_LEN: usize = 64;
/// ZMTP frame flags: more frames follow / 8-byte length / command.
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;
/// Largest command body read from the peer (a READY with a few properties is ~30 bytes).
const MAX_COMMAND: usize = 4096;

/// What happened to one hostile exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// The peer completed the ZMTP handshake (so the bomb reached its frame decoder).
    pub handshake: bool,
    /// The peer closed the connection after the bomb (within the wait given).
    pub peer_closed: bool,
}

/// The 64-byte ZMTP 3.0 greeting with the NULL mechanism, as a client.
pub fn greeting() -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10] = 3; // version major
    g[11] = 0; // version minor
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// A READY command announcing `socket_type` (e.g. `"PUB"`, `"ROUTER"`).
pub fn ready(socket_type: &str) -> Vec<u8> {
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    body.extend_from_slice(socket_type.as_bytes());
    let mut frame = vec![FLAG_COMMAND, body.len() as u8];
    frame.extend_from_slice(&body);
    frame
}

/// A long message frame header declaring `len` bytes (no data follows).
pub fn bomb_header(len: u64) -> [u8; 9] {
    let mut h = [0u8; 9];
    h[0] = FLAG_LONG;
    h[1..].copy_from_slice(&len.to_be_bytes());
    h
}

/// Read one ZMTP frame and return its flags (the body is discarded).
async fn read_frame(stream: &mut TcpStream) -> std::io::Result<u8> {
    let flags = stream.read_u8().await?;
    let len = if flags & FLAG_LONG != 0 {
        stream.read_u64().await?
    } else {
        u64::from(stream.read_u8().await?)
    };
    if len > MAX_COMMAND as u64 {
        return Err(std::io::Error::other("peer frame too long for a handshake"));
    }
    let mut body = vec![0u8; len as usize];
    stream.read_exact(&mut body).await?;
    Ok(flags)
}

/// Handshake as `socket_type` on a connected stream, send a frame header declaring
/// `declared` bytes (e.g. [`BOMB_LEN`]), and wait up to `wait` for the peer to close. Every
/// step is bounded by `wait`.
pub async fn bomb(
    stream: &mut TcpStream,
    socket_type: &str,
    declared: u64,
    wait: Duration,
) -> Outcome {
    let handshake = tokio::time::timeout(wait, async {
        stream.write_all(&greeting()).await?;
        let mut peer = [0u8; GREETING_LEN];
        stream.read_exact(&mut peer).await?;
        if peer[0] != 0xFF || peer[9] != 0x7F {
            return Err(std::io::Error::other("peer greeting is not ZMTP"));
        }
        stream.write_all(&ready(socket_type)).await?;
        // The peer's READY (a command frame).
        while read_frame(stream).await? & FLAG_COMMAND == 0 {}
        stream.write_all(&bomb_header(declared)).await?;
        Ok::<_, std::io::Error>(())
    })
    .await
    .is_ok_and(|r| r.is_ok());
    if !handshake {
        return Outcome {
            handshake,
            peer_closed: false,
        };
    }
    // Whatever the peer still sends (a SUB's subscription) is read and dropped until EOF.
    let peer_closed = tokio::time::timeout(wait, async {
        let mut sink = [0u8; 1024];
        loop {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .is_ok();
    Outcome {
        handshake,
        peer_closed,
    }
}

/// Accept `count` connections on `listener` (a peer the victim dials) and bomb each as
/// `socket_type` (`"PUB"` against a SUB, `"ROUTER"` against a replay DEALER).
pub async fn serve(
    listener: &TcpListener,
    socket_type: &str,
    declared: u64,
    count: usize,
    wait: Duration,
) -> std::io::Result<Vec<Outcome>> {
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        let (mut stream, _) = tokio::time::timeout(wait, listener.accept())
            .await
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "accept"))??;
        out.push(bomb(&mut stream, socket_type, declared, wait).await);
    }
    Ok(out)
}

/// Dial `addr` (a victim that binds, e.g. a gateway SUB on `tcp://*:port`) and bomb it as
/// `socket_type`.
pub async fn dial(
    addr: &str,
    socket_type: &str,
    declared: u64,
    wait: Duration,
) -> std::io::Result<Outcome> {
    let mut stream = tokio::time::timeout(wait, TcpStream::connect(addr))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "connect"))??;
    Ok(bomb(&mut stream, socket_type, declared, wait).await)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_zmtp_3() {
        let g = greeting();
        assert_eq!(g.len(), 64);
        assert_eq!(
            (&g[..1], &g[9..12], &g[12..16]),
            (&[0xFF][..], &[0x7F, 3, 0][..], &b"NULL"[..])
        );
        let r = ready("PUB");
        assert_eq!(r[0], FLAG_COMMAND);
        assert_eq!(r[1] as usize, r.len() - 2);
        assert!(r.ends_with(b"Socket-Type\0\0\0\x03PUB"));
        assert_eq!(bomb_header(BOMB_LEN), [2, 0, 4, 0, 0, 0, 0, 0, 0]);
    }
}
