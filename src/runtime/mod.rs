//! The live routing state: an `ArcSwap<RouteTable>` read once per request, the target
//! [`Registry`] whose per-target state survives reloads, and the reload itself.
//!
//! Owns: swapping tables atomically and dropping what a reload removed ([`Runtime`]).
//! The table's types are [`table`], turning a validated `Config` into one is [`build`]
//! (DNS resolution and egress checks happen there, at load time, never per request), and
//! the SIGHUP service is [`reload`].
//! Must not: parse TOML (that is `config`) or decide routes (that is `routing`).

pub mod auth;
pub mod build;
pub mod discovery;
pub mod generations;
pub mod reload;
pub mod table;
#[cfg(test)]
mod tests;

pub use build::LoadContext;
pub use discovery::DiscoveryService;
pub use reload::ReloadOnSighup;
pub use table::{KvEntry, KvSpec, PeeringSettings, Route, RouteTable, RouteTarget};

use crate::config::{self, ConfigError};
use crate::egress::{EgressError, Resolver};
use crate::fleet::probe::{ProviderEntry, Providers};
use crate::fleet::{Registry, TargetKey};
use crate::metrics::METRICS;
use crate::routing::ResponseAffinity;
use arc_swap::ArcSwap;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use thiserror::Error;

/// Why a routing file could not become live routes.
#[derive(Debug, Error)]
pub enum LoadError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("{path}: providers[{index}].{key}: cannot resolve \"{authority}\": {reason}")]
    Resolve {
        path: String,
        index: usize,
        key: &'static str,
        authority: String,
        reason: String,
    },
    #[error("{path}: routes[{index}].tokenizer: {error}")]
    Tokenizer {
        path: String,
        index: usize,
        error: crate::tokenize::LoadError,
    },
    /// A key (`api_key_env`, `[auth]`) could not be read; never carries the value.
    #[error("{path}: {key}: {reason}")]
    Secret {
        path: String,
        key: String,
        reason: String,
    },
    #[error("{path}: providers[{index}].{key}: provider \"{provider}\": {error}")]
    Egress {
        path: String,
        index: usize,
        provider: String,
        key: &'static str,
        error: EgressError,
    },
}

/// The process's routing state.
pub struct Runtime {
    table: ArcSwap<RouteTable>,
    registry: Registry,
    /// Responses API ids → the target holding each; kept across reloads.
    responses: ResponseAffinity,
    pub(crate) routes_path: PathBuf,
    ctx: LoadContext,
    /// The config the live table was built from (a discovery rebuild builds it again),
    /// locked for a whole build and swap so reloads and rebuilds follow one another.
    /// Never taken on the request path.
    config: parking_lot::Mutex<config::Config>,
}

impl Runtime {
    /// Load the routing file at `path` and build the first table.
    pub fn load(path: &Path) -> Result<Self, LoadError> {
        Self::load_with(path, LoadContext::default())
    }

    /// [`load`](Self::load) with a given resolver (tests) and status board.
    pub fn load_with(path: &Path, ctx: LoadContext) -> Result<Self, LoadError> {
        let registry = Registry::default();
        let (config, table) = Self::read_table(path, &registry, &ctx, |_| Ok(()))?;
        let l = &table.limits;
        let responses = ResponseAffinity::new(l.response_affinity_ttl_s, l.response_affinity_cap);
        Ok(Runtime {
            table: ArcSwap::from_pointee(table),
            registry,
            responses,
            routes_path: path.to_path_buf(),
            ctx,
            config: parking_lot::Mutex::new(config),
        })
    }

    /// Read the routing file at `path` and build its table, unless `accept` refuses the
    /// config first (before any name is resolved or tokenizer loaded).
    fn read_table(
        path: &Path,
        registry: &Registry,
        ctx: &LoadContext,
        accept: impl FnOnce(&config::Config) -> Result<(), LoadError>,
    ) -> Result<(config::Config, RouteTable), LoadError> {
        let config = config::load_file(path)?;
        accept(&config)?;
        let table = RouteTable::build_with(&config, &path.display().to_string(), registry, ctx)?;
        Ok((config, table))
    }

    /// The resolver every configured name goes through.
    pub fn resolver(&self) -> Arc<dyn Resolver> {
        self.ctx.resolver.clone()
    }

    /// The current table (one atomic load; hold it for the whole request).
    pub fn table(&self) -> Arc<RouteTable> {
        self.table.load_full()
    }

    /// Where each known Responses API response lives (survives reloads).
    pub fn responses(&self) -> &ResponseAffinity {
        &self.responses
    }

    /// The per-target state registry.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Re-read the routing file; swap it in if valid, keep the old table if not.
    /// Every outcome is logged and counted in `rolter_config_reloads_total{result}`.
    pub fn reload(&self) -> Result<(), LoadError> {
        let mut live = self.config.lock();
        let built = Self::read_table(&self.routes_path, &self.registry, &self.ctx, |config| {
            if config.peering.listen == live.peering.listen {
                return Ok(());
            }
            // The socket is bound at start; peers would list an address this gateway no
            // longer sends from.
            Err(LoadError::Config(ConfigError::Invalid {
                path: self.routes_path.display().to_string(),
                problems: vec![format!(
                    "peering.listen: changed from {:?} to {:?}; it takes effect only at a restart",
                    live.peering.listen, config.peering.listen
                )],
            }))
        });
        let (config, table) = match built {
            Ok(built) => built,
            Err(e) => {
                METRICS.reloads.with_label_values(&["failed"]).inc();
                log::error!(
                    "reload of {} rejected, keeping the previous routes: {e}",
                    self.routes_path.display()
                );
                return Err(e);
            }
        };
        *live = config;
        let (routes, targets, added, removed) = self.install(table);
        drop(live);
        METRICS.reloads.with_label_values(&["ok"]).inc();
        log::info!(
            "reloaded routes from {}: {routes} routes, {targets} targets ({added} added, {removed} removed)",
            self.routes_path.display(),
        );
        Ok(())
    }

    /// DNS discovery found `addrs` for provider `name` (resolving `host`, port `port`),
    /// in place of `seen`, the set it compared them with: rebuild the live config with
    /// them and swap the table in, as a reload does. Returns false (nothing done) if a
    /// reload changed the provider or its set meanwhile (a newer resolution is live).
    pub fn apply_discovered(
        &self,
        name: &str,
        host: &str,
        port: u16,
        seen: &[std::net::IpAddr],
        addrs: &[std::net::IpAddr],
    ) -> Result<bool, LoadError> {
        let live = self.config.lock();
        let current = self.table();
        if !current
            .discovered()
            .iter()
            .any(|d| d.name == name && d.host == host && d.port == port && d.addrs == seen)
        {
            return Ok(false);
        }
        let before = self.ctx.dns.get(name, host, port);
        self.ctx.dns.put(name, host, port, addrs);
        let origin = self.routes_path.display().to_string();
        let table = match RouteTable::build_from(
            &live,
            &origin,
            &self.registry,
            &self.ctx,
            build::DnsSource::Board(&current),
        ) {
            Ok(table) => table,
            Err(e) => {
                if let Some(before) = before {
                    self.ctx.dns.put(name, host, port, &before);
                }
                return Err(e);
            }
        };
        drop(current);
        let (_, targets, added, removed) = self.install(table);
        drop(live);
        log::info!(
            "discovery: provider {name} ({host}) now has {} address(es): {targets} targets ({added} added, {removed} removed)",
            addrs.len()
        );
        Ok(true)
    }

    /// Swap `table` in and drop the state and metric series of what it no longer has.
    /// Returns (routes, targets, targets added, targets removed).
    fn install(&self, table: RouteTable) -> (usize, usize, usize, usize) {
        let keep = table.target_keys();
        let providers: HashSet<String> = table.providers.iter().map(|p| p.name.clone()).collect();
        let aliases: HashSet<String> = table.routes.keys().cloned().collect();
        let keep_lmcache = table.lmcache.iter().map(|e| e.key()).collect();
        let keep_kv: HashSet<String> = table.kv.iter().map(|e| e.provider.clone()).collect();
        let keep_dns: HashSet<String> = table.discovered.iter().map(|d| d.name.clone()).collect();
        let unprobed: Vec<String> = (table.providers.iter())
            .filter(|p| !p.health.enabled)
            .map(|p| p.name.clone())
            .collect();
        let routes = table.routes.len();
        self.responses.configure(
            table.limits.response_affinity_ttl_s,
            table.limits.response_affinity_cap,
        );
        // The swap: requests that loaded the old table finish on it.
        let old = self.table.swap(Arc::new(table));
        // Held from dropping the removed state to dropping its series: a scrape exports
        // from the registry under this lock, so it sees a removed target either with its
        // series still to be dropped or not at all, and cannot re-create a dropped series.
        let exporting = crate::metrics::EXPORT_LOCK.lock();
        self.registry.retain(&keep, &providers);
        self.registry.retain_sessions(&aliases);
        self.ctx.lmcache.retain(&keep_lmcache);
        self.registry.retain_kv(&keep_kv);
        self.ctx
            .dns
            .retain(&keep_dns.iter().map(String::as_str).collect());
        // Drop the series of what is gone, so no gauge reports a removed target and a
        // re-added one starts from zero (its state starts afresh too).
        let old_keys = old.target_keys();
        let removed: Vec<&TargetKey> = old_keys.difference(&keep).collect();
        for key in &removed {
            crate::metrics::forget_target(&key.label());
        }
        for p in old
            .providers
            .iter()
            .filter(|p| !providers.contains(&p.name))
        {
            crate::metrics::forget_provider(&p.name);
        }
        for d in old
            .discovered
            .iter()
            .filter(|d| !keep_dns.contains(&d.name))
        {
            crate::metrics::forget_discovery(&d.name);
        }
        // Nothing probes a provider whose checks are off: no health gauge, as at start.
        for name in &unprobed {
            crate::metrics::forget_health_gauge(name);
        }
        for e in old.kv.iter().filter(|e| !keep_kv.contains(&e.provider)) {
            crate::metrics::forget_kv_stream(&e.provider);
        }
        for alias in old.routes.keys().filter(|a| !aliases.contains(*a)) {
            crate::metrics::forget_route(alias);
        }
        drop(exporting);
        let added = keep.difference(&old_keys).count();
        (routes, keep.len(), added, removed.len())
    }
}

impl Providers for Runtime {
    fn current(&self) -> Vec<ProviderEntry> {
        self.table().providers.clone()
    }
}
