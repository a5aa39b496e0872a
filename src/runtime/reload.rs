//! The SIGHUP reload service: re-reads the routing file on every SIGHUP, off the async
//! workers, one reload at a time.
//!
//! Owns the signal handling only; the reload itself is [`Runtime::reload`].

use super::Runtime;
use crate::metrics::METRICS;
use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use std::sync::Arc;

/// Background service: re-read the routing file on every SIGHUP.
pub struct ReloadOnSighup(pub Arc<Runtime>);

#[async_trait]
impl BackgroundService for ReloadOnSighup {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        use tokio::signal::unix::{signal, SignalKind};
        let mut hup = match signal(SignalKind::hangup()) {
            Ok(s) => s,
            Err(e) => {
                log::error!("cannot listen for SIGHUP, reload disabled: {e}");
                return;
            }
        };
        log::info!("SIGHUP re-reads {}", self.0.routes_path.display());
        loop {
            tokio::select! {
                _ = hup.recv() => {
                    // Reading the file and resolving upstreams blocks: keep it off the
                    // async workers (and off the request path). Reloads run one at a
                    // time; a SIGHUP during one is delivered once it ends.
                    let runtime = self.0.clone();
                    if let Err(e) = tokio::task::spawn_blocking(move || runtime.reload()).await {
                        // `reload` logs and counts its own outcomes; this is a panic.
                        METRICS.reloads.with_label_values(&["failed"]).inc();
                        log::error!("reload aborted, keeping the previous routes: {e}");
                    }
                }
                _ = shutdown.changed() => return,
            }
        }
    }
}
