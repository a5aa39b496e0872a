//! Starting and stopping a fleet of simulated replicas in-process.
//!
//! Owns addresses and lifecycles: bind each replica's HTTP listener and KV-event sockets
//! (port 0 = ephemeral; the real bound addresses are reported), serve, and shut everything down
//! within a bounded time. This is the library entry point that `rolter-sim`, the load driver's
//! `compare` and the gateway's `--demo` mode and tests use.
//!
//! Port layout with fixed base ports: replica `i` serves HTTP on `http_base_port + i`, publishes
//! KV events on `kv_base_port + 2i` and answers replay on `kv_base_port + 2i + 1` (so replica 0
//! gets vLLM's usual 5557/5558 with `kv_base_port = 5557`).

use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::serve::ListenerExt;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::cache::{BlockHash, CachedBlock};
use crate::kv_events::publisher::VLLM_DEFAULT_BUFFER_STEPS;
use crate::kv_events::{KvFault, Publisher, PublisherConfig, WireFormat};
use crate::replica::{
    HttpFault, LmcacheFault, LmcacheStatus, Replica, ReplicaConfig, ReplicaStats, RequestRecord,
};

/// How long `shutdown` waits for servers to drain before aborting them.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// KV-event settings shared by the replicas of a fleet.
#[derive(Debug, Clone)]
pub struct KvEventsConfig {
    /// ZMQ topic; `{replica}` is replaced by the replica index. vLLM's default is empty.
    pub topic: String,
    pub wire: WireFormat,
    /// Bind a replay ROUTER socket.
    pub replay: bool,
    /// Topic frame in replay replies (vLLM ≥ 0.26).
    pub replay_topic_frame: bool,
    pub buffer_steps: usize,
    /// Write `replica-{i}.bin` (+ `.jsonl`) dumps of the live stream here.
    pub dump_dir: Option<PathBuf>,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            topic: String::new(),
            wire: WireFormat::default(),
            replay: true,
            replay_topic_frame: false,
            buffer_steps: VLLM_DEFAULT_BUFFER_STEPS,
            dump_dir: None,
        }
    }
}

/// A fleet of replicas.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    pub replicas: usize,
    pub host: IpAddr,
    /// First HTTP port (replica `i` gets `+ i`); 0 for ephemeral ports.
    pub http_base_port: u16,
    /// First KV-event port (see the module header); 0 for ephemeral ports.
    pub kv_base_port: u16,
    pub replica: ReplicaConfig,
    /// `None`: no KV events.
    pub kv_events: Option<KvEventsConfig>,
}

impl Default for FleetConfig {
    fn default() -> Self {
        Self {
            replicas: 2,
            host: IpAddr::V4(Ipv4Addr::LOCALHOST),
            http_base_port: 0,
            kv_base_port: 0,
            replica: ReplicaConfig::default(),
            kv_events: Some(KvEventsConfig::default()),
        }
    }
}

/// One running replica: addresses, test hooks and fault injection.
#[derive(Debug, Clone)]
pub struct ReplicaHandle {
    pub index: usize,
    pub http_addr: SocketAddr,
    topic: Option<String>,
    replica: Arc<Replica>,
}

impl ReplicaHandle {
    /// KV-cache capacity in tokens (blocks × block size), what vLLM logs as "GPU KV cache
    /// size: N tokens".
    pub fn kv_cache_tokens(&self) -> usize {
        let c = self.replica.config();
        c.cache_blocks.saturating_mul(c.block_size)
    }

    /// `http://host:port`, the replica's OpenAI `api_base`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.http_addr)
    }

    /// The KV-event PUB endpoint, e.g. `tcp://127.0.0.1:5557`.
    pub fn kv_events_endpoint(&self) -> Option<String> {
        self.replica.kv_endpoints().map(|(p, _)| p)
    }

    /// The replay ROUTER endpoint.
    pub fn kv_replay_endpoint(&self) -> Option<String> {
        self.replica.kv_endpoints().and_then(|(_, r)| r)
    }

    /// The KV-event topic (after `{replica}` substitution).
    pub fn kv_topic(&self) -> Option<&str> {
        self.topic.as_deref()
    }

    /// The LMCache-style status URL.
    pub fn lmcache_status_url(&self) -> Option<String> {
        self.replica
            .config()
            .lmcache_status
            .then(|| format!("http://{}/cache/status", self.http_addr))
    }

    pub fn kv_fault(&self, f: KvFault) {
        self.replica.kv_fault(f);
    }

    pub fn set_lmcache_fault(&self, f: LmcacheFault) {
        self.replica.set_lmcache_fault(f);
    }

    /// Force the LMCache status answer (`None`: computed from the cache).
    pub fn set_lmcache_override(&self, status: Option<LmcacheStatus>) {
        self.replica.set_lmcache_override(status);
    }

    pub fn set_http_fault(&self, f: HttpFault) {
        self.replica.set_http_fault(f);
    }

    /// Clear the cache and publish `AllBlocksCleared`.
    pub fn reset_prefix_cache(&self) {
        self.replica.reset_prefix_cache();
    }

    /// Close the KV-event sockets.
    pub async fn stop_kv_publisher(&self) {
        self.replica.stop_publisher().await;
    }

    /// Rebind the KV-event sockets on the same ports, sequence from 0, cache emptied.
    pub async fn restart_kv_publisher(&self) -> std::io::Result<()> {
        self.replica.restart_publisher().await
    }

    /// Every cached block with its parent and tokens.
    pub fn cache_snapshot(&self) -> Vec<CachedBlock> {
        self.replica.cache_snapshot()
    }

    /// Hashes of every cached block (as u64, the `HashRepr::U64` wire value).
    pub fn cached_block_hashes(&self) -> HashSet<BlockHash> {
        self.cache_snapshot().into_iter().map(|b| b.hash).collect()
    }

    /// Token chunks of every cached block (hash-independent, for cross-replica comparisons).
    pub fn cached_token_chunks(&self) -> HashSet<Vec<u32>> {
        self.cache_snapshot()
            .into_iter()
            .map(|b| b.tokens)
            .collect()
    }

    /// Prompt tokens this replica would serve from cache right now.
    pub fn hit_tokens(&self, prompt: &[u32]) -> usize {
        self.replica.hit_tokens(prompt)
    }

    pub fn stats(&self) -> ReplicaStats {
        self.replica.stats()
    }

    pub fn recent_requests(&self) -> Vec<RequestRecord> {
        self.replica.recent_requests()
    }

    /// Connected KV-event subscribers.
    pub fn kv_subscribers(&self) -> usize {
        self.replica.stats().kv_subscribers
    }

    /// The engine itself.
    pub fn replica(&self) -> &Arc<Replica> {
        &self.replica
    }
}

/// A running fleet. Dropping it without [`FleetHandle::shutdown`] leaves the servers running
/// until the runtime stops.
#[derive(Debug)]
pub struct FleetHandle {
    replicas: Vec<ReplicaHandle>,
    shutdown_tx: watch::Sender<bool>,
    servers: Vec<JoinHandle<()>>,
}

impl FleetHandle {
    pub fn replicas(&self) -> &[ReplicaHandle] {
        &self.replicas
    }

    pub fn replica(&self, i: usize) -> &ReplicaHandle {
        &self.replicas[i]
    }

    pub fn base_urls(&self) -> Vec<String> {
        self.replicas.iter().map(ReplicaHandle::base_url).collect()
    }

    pub fn stats(&self) -> Vec<ReplicaStats> {
        self.replicas.iter().map(ReplicaHandle::stats).collect()
    }

    /// Wait until every replica's PUB socket has at least `n` subscribers (PUB drops messages
    /// sent before a subscriber connects). False on timeout.
    pub async fn wait_for_kv_subscribers(&self, n: usize, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if self.replicas.iter().all(|r| r.kv_subscribers() >= n) {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Stop serving: hanging handlers return, servers drain for up to [`SHUTDOWN_GRACE`], then
    /// are aborted; KV sockets are closed.
    pub async fn shutdown(self) {
        let _ = self.shutdown_tx.send(true);
        for s in self.servers {
            let abort = s.abort_handle();
            if tokio::time::timeout(SHUTDOWN_GRACE, s).await.is_err() {
                abort.abort();
            }
        }
        for r in &self.replicas {
            r.replica.stop_publisher().await;
        }
    }
}

fn port_at(base: u16, offset: usize) -> std::io::Result<u16> {
    if base == 0 {
        return Ok(0);
    }
    u16::try_from(usize::from(base) + offset)
        .map_err(|_| std::io::Error::other(format!("port {base} + {offset} out of range")))
}

fn tcp_endpoint(host: IpAddr, port: u16) -> String {
    match host {
        IpAddr::V4(ip) => format!("tcp://{ip}:{port}"),
        IpAddr::V6(ip) => format!("tcp://[{ip}]:{port}"),
    }
}

/// Start `cfg.replicas` replicas; returns once every socket is bound and serving.
pub async fn spawn_fleet(cfg: FleetConfig) -> std::io::Result<FleetHandle> {
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let mut replicas = Vec::with_capacity(cfg.replicas);
    let mut servers = Vec::with_capacity(cfg.replicas);
    for i in 0..cfg.replicas {
        let listener = tokio::net::TcpListener::bind((cfg.host, port_at(cfg.http_base_port, i)?))
            .await
            .map_err(|e| {
                std::io::Error::new(e.kind(), format!("replica {i}: binding HTTP: {e}"))
            })?;
        let http_addr = listener.local_addr()?;
        let (publisher, topic) = match &cfg.kv_events {
            Some(kv) => {
                let topic = kv.topic.replace("{replica}", &i.to_string());
                let pcfg = PublisherConfig {
                    endpoint: tcp_endpoint(cfg.host, port_at(cfg.kv_base_port, 2 * i)?),
                    replay_endpoint: kv
                        .replay
                        .then(|| port_at(cfg.kv_base_port, 2 * i + 1))
                        .transpose()?
                        .map(|p| tcp_endpoint(cfg.host, p)),
                    topic: topic.clone(),
                    wire: kv.wire,
                    buffer_steps: kv.buffer_steps,
                    replay_topic_frame: kv.replay_topic_frame,
                    dump: kv
                        .dump_dir
                        .as_ref()
                        .map(|d| d.join(format!("replica-{i}.bin"))),
                };
                let p = Publisher::start(pcfg.clone()).await.map_err(|e| {
                    std::io::Error::new(e.kind(), format!("replica {i}: binding KV events: {e}"))
                })?;
                (Some((p, pcfg)), Some(topic))
            }
            None => (None, None),
        };
        let replica = Replica::new(i, cfg.replica.clone(), publisher, shutdown_rx.clone());
        let app = crate::http::router(replica.clone());
        let mut rx = shutdown_rx.clone();
        // TCP_NODELAY like uvicorn: SSE chunks are small writes that Nagle's algorithm would
        // hold back for the client's delayed ACK (~40 ms), distorting TTFT.
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        servers.push(tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = rx.wait_for(|s| *s).await;
                })
                .await;
        }));
        replicas.push(ReplicaHandle {
            index: i,
            http_addr,
            topic,
            replica,
        });
    }
    Ok(FleetHandle {
        replicas,
        shutdown_tx,
        servers,
    })
}

/// A fleet on its own Tokio runtime, for callers without one (e.g. a synchronous `main` that
/// hands its thread to another server framework).
pub struct BackgroundFleet {
    runtime: Option<tokio::runtime::Runtime>,
    fleet: Option<FleetHandle>,
}

impl BackgroundFleet {
    /// Start a fleet on a new multi-threaded runtime with `worker_threads` threads.
    /// Must not be called from inside a Tokio runtime.
    pub fn start(cfg: FleetConfig, worker_threads: usize) -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(worker_threads.max(1))
            .thread_name("rolter-sim")
            .enable_all()
            .build()?;
        let fleet = runtime.block_on(spawn_fleet(cfg))?;
        Ok(Self {
            runtime: Some(runtime),
            fleet: Some(fleet),
        })
    }

    pub fn fleet(&self) -> &FleetHandle {
        self.fleet.as_ref().expect("fleet present until shutdown")
    }

    /// Shut the fleet down and stop the runtime.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if let (Some(rt), Some(fleet)) = (self.runtime.take(), self.fleet.take()) {
            rt.block_on(fleet.shutdown());
            rt.shutdown_timeout(SHUTDOWN_GRACE);
        }
    }
}

impl Drop for BackgroundFleet {
    fn drop(&mut self) {
        self.stop();
    }
}
