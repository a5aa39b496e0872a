//! The pingora background service that keeps one [`KvEventSubscriber`] running per
//! `[providers.kv_events]` of the live route table.
//!
//! Reconciles with the table every `RECONCILE_INTERVAL` (250 ms): a provider whose stream
//! settings are unchanged keeps its subscriber (and index) across reloads; a changed
//! endpoint restarts the subscriber with an emptied index (the old replica's blocks
//! mean nothing for the new one); a removed provider's subscriber stops. A provider
//! removed and re-added between two checks comes back with a fresh state, so its
//! subscriber restarts to feed that state rather than the dropped one.

use super::subscriber::{KvEventSubscriber, SubscriberConfig};
use crate::fleet::KvState;
use crate::runtime::{KvSpec, Runtime};
use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::BackgroundService;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// How often the service compares its subscribers with the live table.
use crate::runtime::generations::RECONCILE_INTERVAL;

/// Background service running the KV-event subscribers.
pub struct KvEventService(pub Arc<Runtime>);

struct Running {
    spec: KvSpec,
    state: Arc<KvState>,
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl Running {
    async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}

#[async_trait]
impl BackgroundService for KvEventService {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut running: HashMap<String, Running> = HashMap::new();
        loop {
            let table = self.0.table();
            let wanted = table.kv_streams();
            let gone: Vec<String> = running
                .keys()
                .filter(|p| !wanted.iter().any(|e| &e.provider == *p))
                .cloned()
                .collect();
            for provider in gone {
                if let Some(r) = running.remove(&provider) {
                    r.stop().await;
                }
            }
            for entry in wanted {
                if running
                    .get(&entry.provider)
                    .is_some_and(|r| r.spec == entry.spec && Arc::ptr_eq(&r.state, &entry.state))
                {
                    continue;
                }
                if let Some(old) = running.remove(&entry.provider) {
                    old.stop().await;
                    // Another endpoint may be another replica: its size is learned anew.
                    entry.state.index.restart();
                }
                let mut cfg =
                    SubscriberConfig::new(entry.spec.endpoint.clone(), entry.spec.topic.clone());
                cfg.bind = entry.spec.bind;
                cfg.replay_endpoint = entry.spec.replay_endpoint.clone();
                cfg.staleness_limit = Duration::from_millis(entry.spec.staleness_ms);
                cfg.max_message_bytes = entry.spec.max_message_bytes;
                let sub = KvEventSubscriber::new(
                    cfg,
                    entry.state.index.clone(),
                    entry.state.stream.clone(),
                );
                let (stop, stopped) = oneshot::channel::<()>();
                let task = tokio::spawn(sub.run(async move {
                    let _ = stopped.await;
                }));
                log::info!(
                    "kv-events: subscribed to {} for {}",
                    entry.spec.endpoint,
                    entry.provider
                );
                running.insert(
                    entry.provider.clone(),
                    Running {
                        spec: entry.spec.clone(),
                        state: entry.state.clone(),
                        stop,
                        task,
                    },
                );
            }
            drop(table);
            tokio::select! {
                _ = tokio::time::sleep(RECONCILE_INTERVAL) => {}
                _ = shutdown.changed() => break,
            }
        }
        for (_, r) in running.drain() {
            r.stop().await;
        }
    }
}
