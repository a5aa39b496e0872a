//! Gateway peering: gateways behind one L4 balancer tell each other where they placed each
//! conversation's turns, so a turn that reaches the gateway which did not serve the turn
//! before it still goes where its history is.
//!
//! Why: a gateway learns what a replica holds from what it routed there. Behind a balancer
//! that sends each request to any gateway, a conversation's next turn reaches the other
//! gateway about half the time; that one's views hold none of the history, so it places
//! the turn as new work, by its own load and counts, and where the conversation's group
//! lives on two replicas the turn lands on the other one about half the time
//! (docs/routing.md, "Two gateways"). A note per placed turn (route, target, the
//! conversation's key, whether it was new work: `wire`; about 40 bytes, batched into
//! datagrams every few milliseconds) fixes that: the receiving gateway remembers the target
//! in the route's session table, marked as a peer's (the placement rule keeps the
//! conversation there while its view of the target holds the conversation's group), and
//! counts new work in the target's recent count, so `share_bound` sees what every gateway
//! placed.
//!
//! Owns the UDP socket, the outbox the request path hands notes to, and applying received
//! notes. Must not decide placement. The request path never waits on it: a note is encoded
//! and offered to a bounded queue (a full queue drops it, counted); one task sends the
//! queued notes every few milliseconds, as many to a datagram as fit, to every peer, and
//! one receives. A datagram is accepted only from an address in `[peering] peers` (each
//! gateway sends from its `listen` address, a specific one) and, with a `[peering]` key,
//! only sealed with it (`wire::seal`). Notes are hints: a lost one costs a cache miss,
//! never an answer.

pub mod wire;

use crate::fleet::ms_at;
use crate::metrics::METRICS;
use crate::runtime::{PeeringSettings, RouteTable, Runtime};
use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Instant;
use tokio::net::UdpSocket;
use tokio::sync::mpsc;

/// Notes waiting to be sent; past it, new ones are dropped.
pub const QUEUE_NOTES: usize = 4096;
/// How often queued notes are sent: a turn's next turn comes an answer and a user's pause
/// later, far beyond this.
pub const FLUSH_EVERY: std::time::Duration = std::time::Duration::from_millis(5);

/// Where the request path hands its notes; open once the peering service has its socket.
#[derive(Debug, Default)]
pub struct Outbox {
    queue: OnceLock<mpsc::Sender<Vec<u8>>>,
}

impl Outbox {
    /// Tell the peers that `route`'s conversation `conversation` went to `label`. Nothing
    /// when peering is off; never waits.
    pub fn tell(&self, route: &str, label: &str, conversation: u64, new_work: bool) {
        let Some(queue) = self.queue.get() else {
            return;
        };
        let note = wire::Note {
            route,
            label,
            conversation,
            new_work,
        };
        let event = match wire::encode(&note) {
            Ok(bytes) => match queue.try_send(bytes) {
                Ok(()) => return,
                Err(_) => "dropped",
            },
            Err(_) => "unsendable",
        };
        METRICS.peer_notes.with_label_values(&[event]).inc();
    }

    fn open(&self) -> Option<mpsc::Receiver<Vec<u8>>> {
        let (tx, rx) = mpsc::channel(QUEUE_NOTES);
        self.queue.set(tx).ok().map(|()| rx)
    }
}

/// Background service: binds `[peering] listen` (as the routing file had it at start),
/// sends the notes handed to the outbox (the proxy's) and applies the peers'.
pub struct PeeringService(pub Arc<Runtime>, pub Arc<Outbox>);

/// Wait between tries to bind `listen` while it is taken (e.g. by the process a `-u`
/// upgrade replaces, until that one exits).
const BIND_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

#[async_trait]
impl BackgroundService for PeeringService {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let Some(listen) = self.0.table().peering.listen else {
            return;
        };
        let mut warned = false;
        let socket = loop {
            match UdpSocket::bind(listen).await {
                Ok(s) => break s,
                Err(e) => {
                    if !warned {
                        log::warn!("peering: cannot listen on {listen} yet ({e}); retrying every {BIND_RETRY:?}");
                        warned = true;
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(BIND_RETRY) => {}
                        _ = shutdown.changed() => return,
                    }
                }
            }
        };
        let Some(outbox) = self.1.open() else {
            return;
        };
        // What the peers see as this gateway's address (and a sealed datagram's tag binds).
        let me = PeeringSettings::canonical(socket.local_addr().unwrap_or(listen));
        METRICS.peering_listening.set(1);
        log::info!("peering: listening on {listen}");
        tokio::select! {
            _ = send_notes(&self.0, &socket, me, outbox) => {}
            _ = receive_notes(&self.0, &socket) => {}
            _ = shutdown.changed() => {}
        }
        METRICS.peering_listening.set(0);
    }
}

/// Send the queued notes every [`FLUSH_EVERY`], as many to a datagram as fit. On a timer
/// rather than on each note: a task woken per note costs the request path a cross-thread
/// wake-up and the peer a datagram per turn.
/// `me`: the socket's address, which a sealed datagram's tag binds.
async fn send_notes(
    runtime: &Runtime,
    socket: &UdpSocket,
    me: std::net::SocketAddr,
    mut outbox: mpsc::Receiver<Vec<u8>>,
) {
    let mut tick = tokio::time::interval(FLUSH_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut packer = Packer::default();
    let mut stamp = 0;
    loop {
        tick.tick().await;
        loop {
            let key = key_of(&runtime.table().peering);
            match packer.next(&mut outbox, key.is_some()) {
                Packed::Datagram(notes) => {
                    if let Some(key) = &key {
                        // Above the last one even within one microsecond or after the
                        // clock stepped back: receivers refuse a stamp they have seen.
                        stamp = unix_us().max(stamp + 1);
                        wire::seal(&mut packer.datagram, key, me, stamp);
                    }
                    send(runtime, socket, &packer.datagram, notes).await
                }
                Packed::Empty => break,
                Packed::Closed => return,
            }
        }
    }
}

/// What [`Packer::next`] made of the queue.
#[derive(Debug, PartialEq, Eq)]
enum Packed {
    /// `Packer::datagram` holds this many notes.
    Datagram(u64),
    /// Nothing queued.
    Empty,
    /// Nothing queued and nothing will be (the outbox is gone).
    Closed,
}

/// The key `settings` seal datagrams with (the live table's: a reload may change it).
/// Keyed per datagram: a key schedule is two SHA-256 blocks, far below a datagram's cost.
fn key_of(settings: &crate::runtime::PeeringSettings) -> Option<wire::Key> {
    settings
        .key
        .as_ref()
        .and_then(|k| wire::Key::new(k.expose().as_bytes()))
}

/// The wall clock in Unix microseconds, as sealed datagrams are stamped.
fn unix_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// Packs queued notes into datagrams of at most [`wire::MAX_DATAGRAM`] bytes, in order: a
/// note that does not fit waits for the next datagram.
#[derive(Default)]
struct Packer {
    datagram: Vec<u8>,
    carried: Option<Vec<u8>>,
}

impl Packer {
    /// The next datagram's header and notes; `sealed`: in the sealed format, leaving room
    /// for the tag [`wire::seal`] appends.
    fn next(&mut self, outbox: &mut mpsc::Receiver<Vec<u8>>, sealed: bool) -> Packed {
        self.datagram.clear();
        let limit = if sealed {
            self.datagram.extend_from_slice(wire::MAGIC_SEALED);
            self.datagram.resize(wire::SEALED_HEADER, 0);
            wire::MAX_DATAGRAM - wire::TAG_BYTES
        } else {
            self.datagram.extend_from_slice(wire::MAGIC);
            wire::MAX_DATAGRAM
        };
        let mut notes = 0;
        if let Some(note) = self.carried.take() {
            self.datagram.extend_from_slice(&note);
            notes += 1;
        }
        loop {
            match outbox.try_recv() {
                Ok(note) if self.datagram.len() + note.len() > limit => {
                    self.carried = Some(note);
                    break;
                }
                Ok(note) => {
                    self.datagram.extend_from_slice(&note);
                    notes += 1;
                }
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) if notes == 0 => {
                    return Packed::Closed
                }
                Err(mpsc::error::TryRecvError::Disconnected) => break,
            }
        }
        if notes == 0 {
            Packed::Empty
        } else {
            Packed::Datagram(notes)
        }
    }
}

/// One datagram of `notes` notes to every peer.
async fn send(runtime: &Runtime, socket: &UdpSocket, datagram: &[u8], notes: u64) {
    let peers = runtime.table().peering.peers.clone();
    for peer in peers.iter() {
        let event = match socket.send_to(datagram, peer).await {
            Ok(_) => "sent",
            Err(e) => {
                log::debug!("peering: sending to {peer}: {e}");
                "send_failed"
            }
        };
        METRICS.peer_notes.with_label_values(&[event]).inc_by(notes);
    }
}

/// Apply every accepted datagram's notes.
async fn receive_notes(runtime: &Runtime, socket: &UdpSocket) {
    // One byte over the limit: a longer datagram is cut there and refused as too long.
    let mut buf = vec![0u8; wire::MAX_DATAGRAM + 1];
    // The last stamp accepted from each peer (sealed datagrams): one not above it is a
    // replay. Only this task touches it; bounded by the peers listed. Before a peer's
    // first, this task's start: a datagram captured before this process started (whose
    // stamps it never saw) is refused too.
    let mut last_stamp: HashMap<std::net::SocketAddr, u64> = HashMap::new();
    let started_us = unix_us();
    loop {
        let (len, from) = match socket.recv_from(&mut buf).await {
            Ok(r) => r,
            Err(e) => {
                // ICMP errors of an earlier send surface here on some systems: not fatal.
                log::debug!("peering: receiving: {e}");
                continue;
            }
        };
        let table = runtime.table();
        if !table.peering.accepts(from) {
            METRICS.peer_notes.with_label_values(&["refused"]).inc();
            continue;
        }
        let from = PeeringSettings::canonical(from);
        let notes = match key_of(&table.peering) {
            Some(key) => {
                let after = last_stamp.get(&from).copied().unwrap_or(started_us);
                wire::open(&buf[..len], &key, from, unix_us(), after).map(|(stamp, notes)| {
                    if last_stamp.len() >= 2 * crate::config::MAX_PEERS {
                        last_stamp.retain(|a, _| table.peering.accepts(*a));
                    }
                    last_stamp.insert(from, stamp);
                    notes
                })
            }
            None => wire::decode(&buf[..len]),
        };
        match notes {
            Ok(notes) => {
                let now_ms = ms_at(Instant::now());
                for note in &notes {
                    let event = if apply(runtime, &table, note, now_ms) {
                        "received"
                    } else {
                        "ignored"
                    };
                    METRICS.peer_notes.with_label_values(&[event]).inc();
                }
            }
            Err(e) => {
                log::debug!("peering: datagram from {from}: {e}");
                METRICS.peer_notes.with_label_values(&[refusal(&e)]).inc();
            }
        }
    }
}

/// The `rolter_peer_notes_total` event a refused datagram counts as: `unauthenticated` when
/// its seal (or its lack of one) is why, `refused` when it is malformed.
fn refusal(e: &wire::WireError) -> &'static str {
    use wire::WireError::*;
    match e {
        BadSeal | Sealed | Skew(_) | Replayed => "unauthenticated",
        Magic | TooLong(_) | Truncated | NotUtf8 | NameTooLong(_) | Flags(_) => "refused",
    }
}

/// Apply one note; false when this gateway has no such route (or its strategy does not use
/// notes) or target.
pub fn apply(runtime: &Runtime, table: &RouteTable, note: &wire::Note, now_ms: u64) -> bool {
    let Some(route) = table.route(note.route).filter(|r| r.strategy.hears_peers()) else {
        return false;
    };
    let Some(target) = route.targets.iter().find(|t| t.state.label() == note.label) else {
        return false;
    };
    if note.new_work {
        target.state.placed.note(now_ms);
    }
    if let Some(sessions) = runtime.registry().sessions_of(note.route) {
        sessions.put_conversation_from_peer(note.conversation, note.label, now_ms);
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::config::PeeringConfig;
    use crate::runtime::PeeringSettings;

    #[test]
    fn only_configured_peers_are_heard_whatever_the_address_family() {
        let s = PeeringSettings::from_config(&PeeringConfig {
            listen: Some("127.0.0.1:7100".into()),
            peers: vec!["127.0.0.1:7101".into(), "[::1]:7102".into()],
            ..Default::default()
        });
        assert_eq!(s.listen, Some("127.0.0.1:7100".parse().unwrap()));
        assert!(s.accepts("127.0.0.1:7101".parse().unwrap()));
        // A dual-stack socket reports an IPv4 sender as IPv4-mapped.
        assert!(s.accepts("[::ffff:127.0.0.1]:7101".parse().unwrap()));
        assert!(s.accepts("[::1]:7102".parse().unwrap()));
        assert!(!s.accepts("127.0.0.1:7102".parse().unwrap()));
        assert!(!s.accepts("127.0.0.2:7101".parse().unwrap()));
    }

    #[test]
    fn a_datagram_refused_for_its_seal_counts_apart_from_a_malformed_one() {
        use wire::WireError::*;
        for e in [BadSeal, Sealed, Skew(40_000), Replayed] {
            assert_eq!(refusal(&e), "unauthenticated", "{e:?}");
        }
        for e in [
            Magic,
            TooLong(1401),
            Truncated,
            NotUtf8,
            NameTooLong(300),
            Flags(2),
        ] {
            assert_eq!(refusal(&e), "refused", "{e:?}");
        }
    }

    #[test]
    fn queued_notes_leave_in_order_in_datagrams_that_fit() {
        // Unsealed, and sealed (the tag appended after packing still fits).
        let key = wire::Key::new(&[5; wire::MIN_KEY_BYTES]).unwrap();
        let me = "127.0.0.1:7100".parse().unwrap();
        const NOW_US: u64 = 1_796_000_000_000_000;
        for sealed in [false, true] {
            let outbox = Outbox::default();
            let mut rx = outbox.open().unwrap();
            let label = "provider-with-a-long-name/some-org/Model-70B-Instruct";
            for i in 0..100 {
                outbox.tell("chat", label, i, i % 3 == 0);
            }
            let mut packer = Packer::default();
            let mut seen = Vec::new();
            let mut datagrams = 0;
            while let Packed::Datagram(n) = packer.next(&mut rx, sealed) {
                let notes = if sealed {
                    // Room left for the tag, which then still fits.
                    assert!(packer.datagram.len() <= wire::MAX_DATAGRAM - wire::TAG_BYTES);
                    wire::seal(&mut packer.datagram, &key, me, NOW_US);
                    wire::open(&packer.datagram, &key, me, NOW_US, 0).unwrap().1
                } else {
                    wire::decode(&packer.datagram).unwrap()
                };
                assert!(packer.datagram.len() <= wire::MAX_DATAGRAM);
                assert_eq!(notes.len() as u64, n);
                seen.extend(notes.iter().map(|n| (n.conversation, n.new_work)));
                datagrams += 1;
            }
            let sent: Vec<(u64, bool)> = (0..100).map(|i| (i, i % 3 == 0)).collect();
            assert_eq!(seen, sent, "every note once, in order (sealed: {sealed})");
            assert!(datagrams > 1 && datagrams < 10, "{datagrams} datagrams");
            assert_eq!(packer.next(&mut rx, sealed), Packed::Empty);
            drop(outbox);
            assert_eq!(packer.next(&mut rx, sealed), Packed::Closed);
        }
    }

    #[tokio::test]
    async fn notes_wait_in_the_outbox_only_once_it_is_open_and_never_block() {
        let outbox = Outbox::default();
        // Closed: nothing queued, nothing waits.
        outbox.tell("r", "p/m", 1, true);
        let mut rx = outbox.open().unwrap();
        assert!(outbox.open().is_none(), "opened twice");
        for i in 0..QUEUE_NOTES as u64 + 10 {
            outbox.tell("r", "p/m", i, false);
        }
        let first = rx.recv().await.unwrap();
        let mut d = wire::MAGIC.to_vec();
        d.extend(first);
        let notes = wire::decode(&d).unwrap();
        assert_eq!(notes[0].conversation, 0);
        let mut queued = 1;
        while rx.try_recv().is_ok() {
            queued += 1;
        }
        assert_eq!(queued, QUEUE_NOTES, "the queue is bounded");
    }
}
