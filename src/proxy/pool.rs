//! Idle upstream connections, kept per upstream address for reuse.
//!
//! Owns: the idle stacks, the "is it still usable" test on reuse, the idle timeout and the
//! background sweep that closes connections an idle upstream dropped. New connections are
//! made by pingora-core's `TransportConnector` (connect timeout, socket options, bind
//! addresses from the server conf). Must not: read or write HTTP (that is [`super::upstream`]),
//! or know about routes and targets beyond the peer address it is handed.
//!
//! ## Why not pingora's connection pool
//! pingora-core's pool (`TransportConnector::release_stream` / `reused_stream`) spawns a
//! tokio task per released connection to watch it while idle, wraps every connection in an
//! `Arc<Mutex<_>>`, hashes the whole peer twice per request, keeps a global LRU behind a
//! mutex, and calls `getpeername` on every reuse. Under `loadtest/overhead.sh` that was
//! about 10% of the gateway's user-space instructions per request (callgrind,
//! `loadtest/profile.sh`) and the largest piece of it we control. Here a release is a push
//! onto the address's stack and a reuse a pop plus the same non-blocking one-byte read
//! pingora does to reject a connection the upstream closed (on release too); one task per
//! gateway visits every stack once a second (its lock, then a readiness check of each idle
//! connection that makes no syscall unless the socket turned readable) and closes
//! connections idle past the timeout or closed by their upstream, so an idle upstream's
//! closes do not leave them half-open here (what pingora's per-connection watcher was for),
//! and forgets stacks of addresses no route uses any more.
//!
//! The stacks are LIFO so the hottest connections are reused and the coldest age out at the
//! bottom, where puts and sweeps trim them. Each stack is its own short mutex (push/pop of
//! a 32-byte entry): striped by upstream, never held across an await.
//!
//! The sweeper is spawned on the runtime of the first release (pingora's proxy runtime). A
//! route target remembers its stack ([`UpstreamPool::stack_for`]), so a routing table must
//! be served by one pool (one gateway), as it is in the binary.

use crate::fleet::idle::Idle;
pub use crate::fleet::idle::IdleStack;
use dashmap::DashMap;
use pingora::connectors::{ConnectorOptions, TransportConnector};
use pingora::protocols::Stream;
use pingora::server::configuration::ServerConf;
use pingora::upstreams::peer::HttpPeer;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};
use tokio::io::AsyncReadExt;

/// How often the sweeper visits every stack.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// Idle connections to every upstream, and the connector for new ones.
pub struct UpstreamPool {
    connector: TransportConnector,
    stacks: Arc<DashMap<SocketAddr, Arc<IdleStack>>>,
    /// Most idle connections kept per upstream address.
    per_address: usize,
    /// The idle timeout last asked for, in ms, for the sweeper (routing files can change it).
    idle_timeout_ms: Arc<AtomicU64>,
    sweeper: std::sync::Once,
}

impl UpstreamPool {
    /// A pool holding up to pingora's `upstream_keepalive_pool_size` idle connections per
    /// upstream address, connecting with the server conf's connector options.
    pub fn new(conf: &ServerConf) -> Self {
        Self::with_capacity(
            ConnectorOptions::from_server_conf(conf),
            conf.upstream_keepalive_pool_size,
        )
    }

    fn with_capacity(options: ConnectorOptions, per_address: usize) -> Self {
        UpstreamPool {
            connector: TransportConnector::new(Some(options)),
            stacks: Arc::default(),
            per_address,
            idle_timeout_ms: Arc::new(AtomicU64::new(0)),
            sweeper: std::sync::Once::new(),
        }
    }

    /// A connection to `peer`: the most recently released one in `peer`'s `stack` that is
    /// still open and was idle less than `idle_timeout` as of `now`, else a new one. The flag
    /// says whether it was reused.
    pub async fn get(
        &self,
        peer: &HttpPeer,
        stack: Option<&IdleStack>,
        idle_timeout: Duration,
        now: Instant,
    ) -> pingora::Result<(Stream, bool)> {
        if let Some(stack) = stack {
            loop {
                let Some(mut idle) = stack.conns.lock().pop() else {
                    break;
                };
                if now.duration_since(idle.since) < idle_timeout && still_open(&mut idle.stream) {
                    return Ok((idle.stream, true));
                }
            }
        }
        // Boxed: pingora's connect future is ~1.9 KB, and inline it would be part of every
        // request's future (moved to the heap when the request starts), reused or not.
        Ok((Box::pin(self.connector.new_stream(peer)).await?, false))
    }

    /// Keep `stream` (whose last exchange ended cleanly at `now`) in its upstream's `stack`
    /// for the next request.
    pub fn put(&self, stack: &IdleStack, mut stream: Stream, idle_timeout: Duration, now: Instant) {
        // Closed right after its response (a FIN racing it, a request cap without
        // `connection: close`): not worth a slot.
        if self.per_address == 0 || idle_timeout.is_zero() || !still_open(&mut stream) {
            return;
        }
        let ms = idle_timeout.as_millis() as u64;
        // Read first: a store on every request would bounce the line between workers.
        if self.idle_timeout_ms.load(Ordering::Relaxed) != ms {
            self.idle_timeout_ms.store(ms, Ordering::Relaxed);
        }
        self.start_sweeper();
        let mut conns = stack.conns.lock();
        // The bottom of the stack is the longest idle: expired ones go, and a full stack
        // makes room by dropping its coldest connection.
        let expired = conns
            .iter()
            .take_while(|c| now.duration_since(c.since) >= idle_timeout)
            .count();
        let overflow = (conns.len() - expired + 1).saturating_sub(self.per_address);
        let gone: Vec<Idle> = conns.drain(..expired + overflow).collect();
        conns.push(Idle { stream, since: now });
        drop(conns);
        drop(gone); // closed outside the lock
    }

    /// Idle connections currently kept for `addr` (tests and debugging).
    pub fn idle_count(&self, addr: SocketAddr) -> usize {
        self.stacks
            .get(&addr)
            .map_or(0, |s| s.value().conns.lock().len())
    }

    /// The idle stack of `peer`'s address (made on first use; `None` for a non-IP peer,
    /// which is never pooled).
    pub fn stack_for(&self, peer: &HttpPeer) -> Option<Arc<IdleStack>> {
        let addr = *peer._address.as_inet()?;
        if let Some(s) = self.stacks.get(&addr) {
            return Some(s.value().clone());
        }
        Some(self.stacks.entry(addr).or_default().value().clone())
    }

    /// Start the sweep task on the runtime that serves requests (first put only).
    fn start_sweeper(&self) {
        self.sweeper.call_once(|| {
            let stacks = Arc::downgrade(&self.stacks);
            let timeout = self.idle_timeout_ms.clone();
            tokio::spawn(sweep_forever(stacks, timeout));
        });
    }
}

/// Every [`SWEEP_EVERY`], close connections idle past the timeout or closed by their
/// upstream; ends when the pool is dropped.
async fn sweep_forever(stacks: Weak<DashMap<SocketAddr, Arc<IdleStack>>>, timeout: Arc<AtomicU64>) {
    let mut tick = tokio::time::interval(SWEEP_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(stacks) = stacks.upgrade() else {
            return;
        };
        let idle_timeout = Duration::from_millis(timeout.load(Ordering::Relaxed));
        // A stack no route target holds (its address left the routing file) and that is
        // empty goes; `retain` holds each shard's write lock, so `stack_for` cannot race it.
        stacks.retain(|_, s| Arc::strong_count(s) > 1 || !s.conns.lock().is_empty());
        let all: Vec<Arc<IdleStack>> = stacks.iter().map(|s| s.value().clone()).collect();
        drop(stacks);
        for stack in all {
            sweep(&stack, idle_timeout, Instant::now());
        }
    }
}

fn sweep(stack: &IdleStack, idle_timeout: Duration, now: Instant) {
    let gone: Vec<Idle> = stack
        .conns
        .lock()
        .extract_if(.., |c| {
            now.duration_since(c.since) >= idle_timeout || !still_open(&mut c.stream)
        })
        .collect();
    drop(gone); // closed outside the lock
}

/// Whether an idle connection can carry another request: nothing to read yet. A read that
/// completes at once means the upstream closed it (0 bytes), reset it, or sent bytes
/// nobody asked for; pingora's `test_reusable_stream` applies the same rule. No syscall
/// unless the socket was reported readable.
fn still_open(stream: &mut Stream) -> bool {
    let mut byte = [0u8; 1];
    // Outside the task's cooperative budget (as pingora does): a spent budget would make
    // the read pend and a dead connection look idle.
    let read = std::pin::pin!(tokio::task::unconstrained(stream.read(&mut byte)));
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    read.poll(&mut cx).is_pending()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;
    use tokio::net::{TcpListener, TcpStream};

    const LONG: Duration = Duration::from_secs(60);

    /// A pool of `per_address` connections to a loopback listener.
    struct Fixture {
        pool: UpstreamPool,
        listener: TcpListener,
        peer: HttpPeer,
        addr: SocketAddr,
    }

    impl Fixture {
        async fn new(per_address: usize) -> Self {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            Fixture {
                pool: UpstreamPool::with_capacity(ConnectorOptions::new(per_address), per_address),
                listener,
                peer: HttpPeer::new(addr, false, String::new()),
                addr,
            }
        }

        fn stack(&self) -> Arc<IdleStack> {
            self.pool.stack_for(&self.peer).unwrap()
        }

        /// A connection from the pool (reused or new) and whether it was reused.
        async fn get(&self, idle_timeout: Duration) -> (Stream, bool) {
            let stack = self.stack();
            let got = self
                .pool
                .get(&self.peer, Some(&stack), idle_timeout, Instant::now());
            got.await.unwrap()
        }

        /// A new connection and the upstream's end of it.
        async fn connect(&self) -> (Stream, TcpStream) {
            let (s, reused) = self.get(LONG).await;
            assert!(!reused);
            (s, self.listener.accept().await.unwrap().0)
        }

        fn put(&self, s: Stream) {
            self.pool.put(&self.stack(), s, LONG, Instant::now());
        }

        fn idle(&self) -> usize {
            self.pool.idle_count(self.addr)
        }
    }

    #[tokio::test]
    async fn a_released_connection_is_reused_and_a_second_caller_gets_a_new_one() {
        let f = Fixture::new(4).await;
        let (s, _upstream) = f.connect().await;
        f.put(s);
        assert_eq!(f.idle(), 1);
        let (s, reused) = f.get(LONG).await;
        assert!(reused, "the pooled connection should be handed out again");
        assert_eq!(f.idle(), 0);
        let (_s2, reused) = f.get(LONG).await;
        assert!(!reused, "the only pooled connection is in use");
        drop(s);
    }

    #[tokio::test]
    async fn a_connection_the_upstream_closed_or_wrote_on_is_not_reused() {
        let f = Fixture::new(4).await;
        let (a, upstream_a) = f.connect().await;
        let (b, mut upstream_b) = f.connect().await;
        f.put(a);
        f.put(b);
        drop(upstream_a);
        upstream_b.write_all(b"unsolicited").await.unwrap();
        // Let the reactor see the FIN and the bytes.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let (_c, reused) = f.get(LONG).await;
        assert!(!reused, "both pooled connections were unusable");
        assert_eq!(f.idle(), 0);
    }

    #[tokio::test]
    async fn the_stack_is_capped_per_address_and_its_coldest_connection_goes_first() {
        let f = Fixture::new(2).await;
        let (mut conns, mut ups) = (Vec::new(), Vec::new());
        for _ in 0..3 {
            let (s, up) = f.connect().await;
            conns.push(s);
            ups.push(up);
        }
        for s in conns {
            f.put(s);
        }
        assert_eq!(f.idle(), 2, "the cap is per address");
        // The first released (coldest) went: closing its upstream end changes nothing.
        drop(ups.remove(0));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            f.get(LONG).await.1 && f.get(LONG).await.1,
            "both kept ones are live"
        );
    }

    #[tokio::test]
    async fn connections_idle_past_the_timeout_are_not_reused() {
        let f = Fixture::new(4).await;
        let (a, _up_a) = f.connect().await;
        let (b, _up_b) = f.connect().await;
        f.put(a);
        f.put(b);
        tokio::time::sleep(Duration::from_millis(30)).await;
        // Control: both are open and reusable under a long timeout...
        let (a, reused) = f.get(LONG).await;
        assert!(reused);
        f.put(a);
        // ...but not once idle past a short one (the other one's upstream end is open too).
        tokio::time::sleep(Duration::from_millis(30)).await;
        let (_s, reused) = f.get(Duration::from_millis(10)).await;
        assert!(!reused, "every pooled connection was idle past the timeout");
        assert_eq!(f.idle(), 0);
    }

    #[tokio::test]
    async fn a_put_drops_the_connections_idle_past_the_timeout() {
        let f = Fixture::new(4).await;
        let (a, _up_a) = f.connect().await;
        let (b, _up_b) = f.connect().await;
        let (c, _up_c) = f.connect().await;
        let short = Duration::from_millis(10);
        f.pool.put(&f.stack(), a, short, Instant::now());
        f.pool.put(&f.stack(), b, short, Instant::now());
        tokio::time::sleep(Duration::from_millis(30)).await;
        f.pool.put(&f.stack(), c, short, Instant::now());
        assert_eq!(f.idle(), 1, "only the one just released stays");
    }

    #[tokio::test]
    async fn a_zero_cap_or_idle_timeout_keeps_nothing() {
        let f = Fixture::new(0).await;
        let (a, _up) = f.connect().await;
        f.put(a);
        assert_eq!(f.idle(), 0);
        let f = Fixture::new(4).await;
        let (a, _up) = f.connect().await;
        f.pool.put(&f.stack(), a, Duration::ZERO, Instant::now());
        assert_eq!(f.idle(), 0);
    }

    #[tokio::test]
    async fn a_connection_closed_before_its_release_is_not_kept() {
        let f = Fixture::new(4).await;
        let (a, up) = f.connect().await;
        drop(up);
        tokio::time::sleep(Duration::from_millis(50)).await;
        f.put(a);
        assert_eq!(f.idle(), 0);
    }

    #[tokio::test]
    async fn the_sweep_closes_connections_their_upstream_closed() {
        let f = Fixture::new(4).await;
        let (a, upstream_a) = f.connect().await;
        let (b, _upstream_b) = f.connect().await;
        f.put(a);
        f.put(b);
        drop(upstream_a);
        tokio::time::sleep(Duration::from_millis(50)).await;
        sweep(&f.stack(), LONG, Instant::now());
        assert_eq!(f.idle(), 1, "only the closed connection goes");
        sweep(&f.stack(), Duration::ZERO, Instant::now());
        assert_eq!(f.idle(), 0, "then everything past the timeout");
    }
}
