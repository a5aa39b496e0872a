//! Stopping a gateway started without a pingora YAML (`-c`): `rolter --demo`, or any
//! ad-hoc run. pingora's own default grace period is 300 s; without `-c` rolter sets short
//! ones, so SIGTERM ends the process within seconds.

mod common;

use common::*;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How long a SIGTERM'd gateway without `-c` may take to exit: its 2 s grace period, 2 s
/// for the runtimes, and slack for a busy CI machine.
const STOP_LIMIT: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_without_a_yaml_stops_within_seconds_of_sigterm() {
    let port = free_port();
    let child = Command::new(rolter_bin())
        .args(["--demo", "--listen", &format!("127.0.0.1:{port}")])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut gw = Gateway {
        child,
        port,
        routes: std::path::PathBuf::from("unused"),
        dir: TempDir::new("stop"),
    };
    assert!(
        wait_healthy_on(port, Duration::from_secs(20)).await,
        "the demo did not come up"
    );
    gw.signal("TERM");
    let sent = Instant::now();
    while sent.elapsed() < STOP_LIMIT {
        if gw.child.try_wait().unwrap().is_some() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("still running {STOP_LIMIT:?} after SIGTERM");
}
