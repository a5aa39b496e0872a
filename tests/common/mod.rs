//! Test harness: the real `rolter` binary on a loopback port in front of in-process
//! stubs. Everything is bounded in time and torn down on drop.
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[allow(unused_imports)]
pub use rolter_loadtest::stub::{Behaviour, Stub};

/// How long a gateway may take to come up.
const STARTUP_LIMIT: Duration = Duration::from_secs(20);

/// A running gateway process.
pub struct Gateway {
    pub child: Child,
    pub port: u16,
    pub routes: PathBuf,
    pub dir: TempDir,
}

/// A directory of its own, removed on drop. Its name is unique among every test's
/// directories (`tempfile` creates it exclusively): tests run in parallel in one process,
/// and a name two tests shared would let one test's drop remove the other's files, the
/// log its gateway is still writing included.
pub struct TempDir(tempfile::TempDir);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let dir = tempfile::Builder::new()
            .prefix(&format!("rolter-test-{tag}-"))
            .tempdir()
            .expect("a temporary directory");
        TempDir(dir)
    }

    pub fn path(&self) -> &Path {
        self.0.path()
    }
}

/// A loopback port nobody listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The rolter binary cargo built for these tests.
pub fn rolter_bin() -> &'static str {
    env!("CARGO_BIN_EXE_rolter")
}

/// One provider per URL, named p0, p1, ….
pub fn providers_toml(urls: &[String]) -> String {
    let mut s = String::new();
    for (i, u) in urls.iter().enumerate() {
        s += &format!(
            "[[providers]]\nname = \"p{i}\"\nkind = \"openai_compatible\"\napi_base = \"{u}\"\n\n"
        );
    }
    s
}

/// A routing file with one provider per URL and one route over all of them.
pub fn routes_toml(urls: &[String], strategy: &str, extra: &str) -> String {
    let mut s = providers_toml(urls);
    s += &format!("[[routes]]\nmodel = \"alias\"\nstrategy = \"{strategy}\"\n");
    for i in 0..urls.len() {
        s += &format!("[[routes.targets]]\nprovider = \"p{i}\"\nmodel = \"upstream-model-{i}\"\n");
    }
    s += extra;
    s
}

/// A minimal pingora YAML giving this gateway its own pid file and upgrade socket.
fn pingora_yaml(dir: &std::path::Path) -> PathBuf {
    let path = dir.join("pingora.yaml");
    let yaml = format!(
        "---\nversion: 1\nthreads: 2\npid_file: {0}/rolter.pid\nupgrade_sock: {0}/upgrade.sock\ngrace_period_seconds: 1\ngraceful_shutdown_timeout_seconds: 1\n",
        dir.display()
    );
    std::fs::write(&path, yaml).unwrap();
    path
}

/// [`pingora_yaml`] for tests that run the binary themselves (pid file and upgrade
/// socket in `dir`, 1 s grace periods).
pub fn write_pingora_yaml(dir: &std::path::Path) -> PathBuf {
    pingora_yaml(dir)
}

/// The file in a gateway's `dir` that [`Gateway::start_logged`] writes its log to.
pub const LOG_FILE: &str = "rolter.log";

/// Wait until a gateway on `port` answers `/health` with 200 and rolter's `ok` (a stub
/// that took the port answers 200 with nothing; false after `limit`).
pub async fn wait_healthy_on(port: u16, limit: Duration) -> bool {
    let client = reqwest::Client::new();
    let url = format!("http://127.0.0.1:{port}/health");
    eventually(limit, || {
        let req = client.get(&url).timeout(Duration::from_secs(1)).send();
        async move {
            match req.await {
                Ok(r) if r.status().is_success() => r.text().await.is_ok_and(|b| b == "ok\n"),
                _ => false,
            }
        }
    })
    .await
}

impl Gateway {
    /// Start the gateway with `routes` TOML and wait until it answers `/health`.
    /// A port picked free can be taken by another process before the gateway binds it
    /// (parallel test binaries); then the gateway exits and we retry on a new port.
    pub async fn start(routes: &str) -> Gateway {
        Self::start_with_args(routes, &[]).await
    }

    /// [`Gateway::start`] with extra command-line arguments.
    pub async fn start_with_args(routes: &str, extra: &[&str]) -> Gateway {
        Self::spawn(routes, extra, false).await
    }

    /// Like [`start`](Self::start), with the gateway's log (`RUST_LOG=info`, or
    /// `$ROLTER_TEST_LOG`) written to `dir/rolter.log` for [`log`](Self::log).
    pub async fn start_logged(routes: &str) -> Gateway {
        Self::spawn(routes, &[], true).await
    }

    /// Spawn the binary on a fresh port (retrying if another process took the port
    /// first) and wait until it is healthy.
    async fn spawn(routes: &str, extra: &[&str], logged: bool) -> Gateway {
        for _ in 0..3 {
            let dir = TempDir::new("gw");
            let routes_path = dir.path().join("routes.toml");
            std::fs::write(&routes_path, routes).unwrap();
            let port = free_port();
            let conf = pingora_yaml(dir.path());
            let (level, stderr) = if logged {
                let log = std::fs::File::create(dir.path().join(LOG_FILE)).unwrap();
                ("info", Stdio::from(log))
            } else {
                ("warn", Stdio::inherit())
            };
            let child = Command::new(rolter_bin())
                .arg("-c")
                .arg(&conf)
                .arg("--routes")
                .arg(&routes_path)
                .arg("--listen")
                .arg(format!("127.0.0.1:{port}"))
                .args(extra)
                .env(
                    "RUST_LOG",
                    std::env::var("ROLTER_TEST_LOG").unwrap_or_else(|_| level.into()),
                )
                .stdout(Stdio::null())
                .stderr(stderr)
                .spawn()
                .expect("spawn rolter");
            let mut gw = Gateway {
                child,
                port,
                routes: routes_path,
                dir,
            };
            if gw.wait_healthy().await {
                return gw;
            }
        }
        panic!("gateway did not start in 3 attempts");
    }

    /// The log written so far by a gateway started with [`start_logged`](Self::start_logged).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join(LOG_FILE)).unwrap_or_default()
    }

    /// Wait until *our* process answers `/health`; false if it exited first.
    ///
    /// The port was free when picked but another test's stub may have bound it since
    /// (stubs bind port 0 too, and the kernel hands a just-released port out again):
    /// then our gateway fails to bind and exits, but until it does the stub answers
    /// `/health` with 200, and taking that for the gateway sent a whole test's traffic
    /// to another test's stub. rolter's `/health` says `ok`; the stubs' says nothing.
    async fn wait_healthy(&mut self) -> bool {
        let deadline = Instant::now() + STARTUP_LIMIT;
        let client = reqwest::Client::new();
        while Instant::now() < deadline {
            if self.child.try_wait().ok().flatten().is_some() {
                return false;
            }
            if let Ok(r) = client.get(self.url("/health")).send().await {
                let ok = r.status().is_success();
                let rolter = r.text().await.is_ok_and(|body| body == "ok\n");
                if ok && rolter && self.child.try_wait().ok().flatten().is_none() {
                    return true;
                }
                if ok && !rolter {
                    // Someone else's server: ours cannot have the port.
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return false;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("gateway did not become healthy within {STARTUP_LIMIT:?}");
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// The body of `GET path` (panics if the gateway does not answer).
    pub async fn get_text(&self, path: &str) -> String {
        reqwest::get(self.url(path))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// The value of a metric line `name{labels}` (labels must match exactly), or None.
    pub async fn metric(&self, series: &str) -> Option<f64> {
        let text = reqwest::get(self.url("/metrics"))
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        text.lines()
            .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }

    /// Send a signal to the gateway process.
    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.child.id().to_string())
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{sig} failed");
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A chat request body for `model` with one user message.
pub fn chat_body(model: &str, content: &str, stream: bool) -> String {
    serde_json::json!({
        "model": model,
        "stream": stream,
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": content}]
    })
    .to_string()
}

/// POST a chat request to the gateway; returns (status, x-stub-id, body).
pub async fn post_chat(gw: &Gateway, body: String) -> (u16, Option<String>, String) {
    post_chat_with(gw, body, &[]).await
}

/// Same as [`post_chat`] with extra headers.
pub async fn post_chat_with(
    gw: &Gateway,
    body: String,
    headers: &[(&str, &str)],
) -> (u16, Option<String>, String) {
    let client = reqwest::Client::new();
    let mut req = client
        .post(gw.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .timeout(Duration::from_secs(20))
        .body(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await.expect("request to gateway");
    let status = resp.status().as_u16();
    let stub = resp
        .headers()
        .get("x-stub-id")
        .map(|v| v.to_str().unwrap().to_string());
    (status, stub, resp.text().await.unwrap())
}

/// POST a chat body to the gateway in `pieces` (its bytes, in order), each written `gap`
/// after the one before, under the whole body's Content-Length; `client` keeps its
/// connection for the next call. Returns the response.
pub async fn post_chat_in_pieces(
    client: &reqwest::Client,
    gw: &Gateway,
    pieces: Vec<Vec<u8>>,
    gap: Duration,
) -> reqwest::Response {
    use futures_util::StreamExt;
    let len: usize = pieces.iter().map(Vec::len).sum();
    let stream = futures_util::stream::iter(pieces).then(move |piece| async move {
        tokio::time::sleep(gap).await;
        Ok::<_, std::io::Error>(piece)
    });
    client
        .post(gw.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("content-length", len)
        .timeout(Duration::from_secs(20))
        .body(reqwest::Body::wrap_stream(stream))
        .send()
        .await
        .expect("request to gateway")
}

/// Poll `check` until it returns true or `limit` passes.
pub async fn eventually<F, Fut>(limit: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    false
}

/// A routing file for a simulated fleet: one provider per replica with its KV-event
/// streams (health checks off), and one precise_cache_aware route `alias` over them
/// (upstream model `sim-model`); `route_extra` adds lines to the route (e.g. a tokenizer).
pub fn precise_fleet_routes(fleet: &rolter_loadtest::FleetHandle, route_extra: &str) -> String {
    let mut s = String::new();
    for (i, r) in fleet.replicas().iter().enumerate() {
        s += &format!(
            "[[providers]]\nname = \"r{i}\"\nkind = \"openai_compatible\"\napi_base = \"{}\"\n\
             [providers.health]\nenabled = false\n\
             [providers.kv_events]\nendpoint = \"{}\"\nreplay_endpoint = \"{}\"\nstaleness_ms = 2000\n\n",
            r.base_url(),
            r.kv_events_endpoint().unwrap(),
            r.kv_replay_endpoint().unwrap(),
        );
    }
    s += "[[routes]]\nmodel = \"alias\"\nstrategy = \"precise_cache_aware\"\n";
    s += route_extra;
    for i in 0..fleet.replicas().len() {
        s += &format!("[[routes.targets]]\nprovider = \"r{i}\"\nmodel = \"sim-model\"\n");
    }
    s
}
