//! `zmq-frame-bomb`: a hostile ZMQ peer for soak and hardening runs. It completes a ZMTP 3
//! handshake over raw TCP, sends one frame header declaring 2^50 bytes (`--declared-bytes`),
//! and reports whether
//! the victim closed the connection and (with `--health`) whether the gateway still answers.
//!
//! ```text
//! zmq-frame-bomb --listen 127.0.0.1:5557 --count 3          # a PUB the gateway dials
//! zmq-frame-bomb --listen 127.0.0.1:5558 --socket-type ROUTER # a replay endpoint
//! zmq-frame-bomb --connect 127.0.0.1:5557                    # dial a gateway SUB that binds
//!     [--health http://127.0.0.1:8080/health]
//! ```
//! Prints one JSON line per exchange and a summary line; exits 0 when every exchange
//! reached the victim's frame decoder and was disconnected and the gateway is alive.

use std::time::Duration;

use clap::Parser;
use rolter_loadtest::kv_events::frame_bomb::{self, Outcome};
use serde_json::json;

#[derive(Parser)]
#[command(about = "Hostile ZMQ peer: ZMTP handshake, then a frame header declaring 2^50 bytes")]
struct Args {
    /// Listen here and bomb each victim that dials in (a PUB or replay ROUTER endpoint).
    #[arg(long, conflicts_with = "connect", required_unless_present = "connect")]
    listen: Option<String>,
    /// Dial this address (a gateway SUB bound on `tcp://*:port`) and bomb it.
    #[arg(long)]
    connect: Option<String>,
    /// Socket type announced in the handshake: PUB against a SUB, ROUTER against a DEALER.
    #[arg(long, default_value = "PUB")]
    socket_type: String,
    /// Frame length the header declares (default 2^50; any value above the victim's
    /// max_message_bytes must get the connection closed).
    #[arg(long, default_value_t = frame_bomb::BOMB_LEN)]
    declared_bytes: u64,
    /// Exchanges to run (connections accepted, or dials made).
    #[arg(long, default_value_t = 1)]
    count: usize,
    /// Bound on each step (handshake, waiting for the victim to close).
    #[arg(long, default_value_t = 5_000)]
    wait_ms: u64,
    /// After the exchanges, GET this URL and report whether it answered 200.
    #[arg(long)]
    health: Option<String>,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::io::Result<()> {
    let args = Args::parse();
    let wait = Duration::from_millis(args.wait_ms);
    let outcomes: Vec<Outcome> = match (&args.listen, &args.connect) {
        (Some(addr), _) => {
            let listener = tokio::net::TcpListener::bind(addr).await?;
            eprintln!("zmq-frame-bomb: listening on {}", listener.local_addr()?);
            frame_bomb::serve(
                &listener,
                &args.socket_type,
                args.declared_bytes,
                args.count,
                wait,
            )
            .await?
        }
        (None, Some(addr)) => {
            let mut v = Vec::with_capacity(args.count);
            for _ in 0..args.count {
                v.push(frame_bomb::dial(addr, &args.socket_type, args.declared_bytes, wait).await?);
            }
            v
        }
        (None, None) => unreachable!("clap requires --listen or --connect"),
    };
    for o in &outcomes {
        println!(
            "{}",
            json!({"handshake": o.handshake, "peer_closed": o.peer_closed})
        );
    }
    let alive = match &args.health {
        Some(url) => Some(
            reqwest::Client::builder()
                .timeout(wait)
                .build()
                .map_err(std::io::Error::other)?
                .get(url)
                .send()
                .await
                .is_ok_and(|r| r.status().is_success()),
        ),
        None => None,
    };
    let ok = outcomes.iter().all(|o| o.handshake && o.peer_closed) && alive != Some(false);
    println!(
        "{}",
        json!({
            "exchanges": outcomes.len(),
            "handshakes": outcomes.iter().filter(|o| o.handshake).count(),
            "peer_closed": outcomes.iter().filter(|o| o.peer_closed).count(),
            "gateway_alive": alive,
            "ok": ok,
        })
    );
    std::process::exit(if ok { 0 } else { 1 });
}
