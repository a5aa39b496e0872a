//! Peer gateways: other routers run in rolter's place so a report has a comparison row.
//!
//! Owns the naming (`smg_<policy>`, `vllm_router_<policy>`) and each peer's command line and
//! readiness probe; starting and stopping the process is `gateway`'s job. Peers are Python
//! packages installed by `loadtest/peers.sh` into a venv outside the repository; their
//! executables are looked up in that venv's `bin/`.
//!
//! - smg (PyPI `smg`, the Shepherd Model Gateway): `smg launch --policy P --worker-urls ...`
//!   with its defaults otherwise; its Prometheus listener (default 0.0.0.0:29000) is moved to a
//!   free loopback port so runs never collide. Ready when `GET /readiness` counts every worker
//!   healthy (it registers workers in the background after it starts listening).
//! - vllm-router (PyPI `vllm-router`): `vllm-router --policy P --worker-urls ...`, the same
//!   Prometheus move and readiness probe.
//!
//! Peers route on the served model name (what `/v1/models` lists), not rolter's route alias,
//! so the driver sends the fleet's model name to them; the prompt is the same.

use std::path::{Path, PathBuf};

/// Which peer program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerKind {
    Smg,
    VllmRouter,
}

/// A peer strategy: the program and its routing policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerSpec {
    pub kind: PeerKind,
    pub policy: String,
}

/// How to tell that a started gateway can route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// `GET {base}/health` answers 2xx (rolter).
    Health,
    /// `GET {base}/readiness` answers JSON with `healthy_workers` >= this many (smg and
    /// vllm-router both serve it).
    HealthyWorkers(usize),
}

/// Strategy-name prefixes of the peers, longest first.
const PREFIXES: [(&str, PeerKind); 2] = [
    ("vllm_router_", PeerKind::VllmRouter),
    ("smg_", PeerKind::Smg),
];

/// The peer a strategy name denotes (`smg_cache_aware` → smg with `cache_aware`), if any.
pub fn parse_peer(strategy: &str) -> Option<PeerSpec> {
    PREFIXES.iter().find_map(|(prefix, kind)| {
        strategy
            .strip_prefix(prefix)
            .filter(|p| !p.is_empty())
            .map(|policy| PeerSpec {
                kind: *kind,
                policy: policy.to_string(),
            })
    })
}

/// The venv `loadtest/peers.sh` installs into: `$ROLTER_PEERS_VENV`, else
/// `$HOME/.cache/rolter-peers/venv`.
pub fn default_venv() -> PathBuf {
    if let Some(v) = std::env::var_os("ROLTER_PEERS_VENV").filter(|v| !v.is_empty()) {
        return PathBuf::from(v);
    }
    let home = std::env::var_os("HOME").map_or_else(|| PathBuf::from("/root"), PathBuf::from);
    home.join(".cache/rolter-peers/venv")
}

impl PeerSpec {
    /// The executable's file name.
    pub fn program_name(&self) -> &'static str {
        match self.kind {
            PeerKind::Smg => "smg",
            PeerKind::VllmRouter => "vllm-router",
        }
    }

    /// The executable inside `venv`.
    pub fn program(&self, venv: &Path) -> PathBuf {
        venv.join("bin").join(self.program_name())
    }

    /// Command-line arguments: listen on 127.0.0.1:`port` in front of `workers`; `aux_port` is a
    /// second free port for listeners the peer opens besides (smg's Prometheus endpoint).
    pub fn args(&self, port: u16, aux_port: u16, workers: &[String]) -> Vec<String> {
        let mut a: Vec<String> = Vec::new();
        if self.kind == PeerKind::Smg {
            a.push("launch".into());
        }
        a.extend(
            [
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--policy",
                &self.policy,
            ]
            .map(String::from),
        );
        match self.kind {
            PeerKind::Smg => a.extend(
                [
                    "--prometheus-host",
                    "127.0.0.1",
                    "--prometheus-port",
                    &aux_port.to_string(),
                    "--log-level",
                    "warn",
                ]
                .map(String::from),
            ),
            PeerKind::VllmRouter => a.extend(
                [
                    "--prometheus-host",
                    "127.0.0.1",
                    "--prometheus-port",
                    &aux_port.to_string(),
                    "--log-level",
                    "warning",
                ]
                .map(String::from),
            ),
        }
        a.push("--worker-urls".into());
        a.extend(workers.iter().cloned());
        a
    }

    /// When the started peer can route to `workers` replicas.
    pub fn readiness(&self, workers: usize) -> Readiness {
        Readiness::HealthyWorkers(workers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(
            parse_peer("smg_cache_aware"),
            Some(PeerSpec {
                kind: PeerKind::Smg,
                policy: "cache_aware".into()
            })
        );
        assert_eq!(
            parse_peer("vllm_router_round_robin").map(|p| (p.kind, p.policy)),
            Some((PeerKind::VllmRouter, "round_robin".into()))
        );
        assert_eq!(parse_peer("cache_aware"), None);
        assert_eq!(parse_peer("smg_"), None);
        assert_eq!(parse_peer("precise_cache_aware"), None);
    }

    #[test]
    fn smg_command_line() {
        let p = parse_peer("smg_cache_aware").unwrap();
        let urls = vec![
            "http://127.0.0.1:1".to_string(),
            "http://127.0.0.1:2".into(),
        ];
        let a = p.args(20001, 20002, &urls);
        assert_eq!(a[0], "launch");
        let at = |flag: &str| a.iter().position(|x| x == flag).map(|i| a[i + 1].as_str());
        assert_eq!(at("--policy"), Some("cache_aware"));
        assert_eq!(at("--port"), Some("20001"));
        assert_eq!(at("--host"), Some("127.0.0.1"));
        assert_eq!(at("--prometheus-port"), Some("20002"));
        assert_eq!(&a[a.len() - 3..], ["--worker-urls", &urls[0], &urls[1]]);
        assert_eq!(p.readiness(2), Readiness::HealthyWorkers(2));
        assert_eq!(p.program(Path::new("/v")), PathBuf::from("/v/bin/smg"));
    }
}
