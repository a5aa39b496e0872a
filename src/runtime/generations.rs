//! Background work that follows the route table: a set of tasks started for the current
//! table and restarted whenever a reload (or DNS discovery) swaps it in.
//!
//! Owns the reconcile loop only. Must not: know what the tasks do (the pollers pass a
//! function that spawns them for a table).
//!
//! Pingora fixes its background services at startup, but a reload may add, remove or
//! change what they serve; so such a service runs one task per item of the *current*
//! table and restarts the set when the table changes (checked every
//! [`RECONCILE_INTERVAL`]). State that must survive the restart lives outside the tasks
//! (the registry, the boards).

use super::{RouteTable, Runtime};
use pingora::server::ShutdownWatch;
use std::sync::{Arc, Weak};
use std::time::Duration;
use tokio::task::JoinSet;

/// How often a service checks whether a reload swapped the route table.
pub const RECONCILE_INTERVAL: Duration = Duration::from_millis(250);

/// Run the tasks `spawn` starts for the current table, stopping them (abort, and wait
/// until they are gone) and starting the next table's whenever the table is swapped,
/// until `shutdown` fires.
pub async fn run_per_table(
    runtime: &Runtime,
    shutdown: &mut ShutdownWatch,
    mut spawn: impl FnMut(&Arc<RouteTable>, &mut JoinSet<()>),
) {
    let mut tasks = JoinSet::new();
    let mut current: Weak<RouteTable> = Weak::new();
    loop {
        let table = runtime.table();
        if !std::ptr::eq(current.as_ptr(), Arc::as_ptr(&table)) {
            tasks.shutdown().await;
            spawn(&table, &mut tasks);
            current = Arc::downgrade(&table);
        }
        drop(table);
        tokio::select! {
            _ = tokio::time::sleep(RECONCILE_INTERVAL) => {}
            _ = shutdown.changed() => return,
        }
    }
}
