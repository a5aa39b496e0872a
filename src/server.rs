//! Process wiring: the CLI (pingora's own flags plus rolter's), validating the routing
//! file before pingora bootstraps (so `-t` checks both files), the pingora `Server`
//! with the gateway service and background services, and the `--demo` fleet.
//!
//! Must not: hold request-path logic.

use crate::config::{DEFAULT_ROUTES_PATH, ROUTES_ENV};
use crate::lmcache_poll::LmcachePollService;
use crate::proxy::connection::{ClientConnections, OpenConnections};
use crate::proxy::Gateway;
use crate::runtime::{LoadContext, ReloadOnSighup, Runtime};
use clap::Parser;
use pingora::listeners::{L4BufferSettings, ListenerConfig};
use pingora::server::configuration::Opt;
use pingora::server::{RunArgs, Server};
use pingora::services::background::background_service;
use pingora::services::listening::Service;
use std::path::PathBuf;
use std::sync::Arc;

/// Grace periods when no `-c` YAML is given: pingora's own defaults (300 s grace, then
/// 5 s for runtimes to exit) made `rolter --demo` and any ad-hoc run take five minutes to
/// stop on SIGTERM. Above `proxy::connection`'s 1 s shutdown linger; a deployment sets its own in the YAML
/// (`conf/pingora.yaml`: 10 s and 20 s).
const NO_CONF_GRACE_PERIOD_S: u64 = 2;
const NO_CONF_SHUTDOWN_TIMEOUT_S: u64 = 2;

/// Default listen address of the proxy port.
pub const DEFAULT_LISTEN: &str = "0.0.0.0:8080";

/// rolter's command line: pingora's standard flags plus its own.
#[derive(Debug, Parser)]
#[command(
    name = "rolter",
    version,
    about = "Cache-aware gateway for vLLM / OpenAI-compatible fleets"
)]
pub struct Cli {
    /// pingora's flags: -c/--conf, -d/--daemon, -t/--test, -u/--upgrade.
    #[command(flatten)]
    pub pingora: Opt,
    /// Routing file (TOML).
    #[arg(long, env = ROUTES_ENV, default_value = DEFAULT_ROUTES_PATH)]
    pub routes: PathBuf,
    /// Address the proxy listens on.
    #[arg(long, default_value = DEFAULT_LISTEN)]
    pub listen: String,
    /// Start simulated replicas in-process and route to them (no GPU, no config); needs
    /// a build with the `demo` feature (scripts/demo.sh).
    #[arg(long)]
    pub demo: bool,
}

/// Run rolter with the given CLI; returns only on a startup error.
pub fn run(cli: Cli) -> Result<(), String> {
    serve(cli, LoadContext::default(), RunArgs::default())?;
    // As pingora's `run_forever`: the server ran and shut down.
    std::process::exit(0)
}

/// Run rolter with the given CLI, resolving names through `ctx` (tests inject a
/// resolver), until `args`' shutdown signal; returns once the server has shut down.
/// `rolter -t` exits the process after the checks, as pingora does.
pub fn serve(mut cli: Cli, ctx: LoadContext, args: RunArgs) -> Result<(), String> {
    survive_early_sighup()?;
    if cli.demo {
        #[cfg(feature = "demo")]
        {
            cli.routes = crate::demo::start(&cli.listen)?;
        }
        #[cfg(not(feature = "demo"))]
        return Err(
            "--demo: this build has no demo fleet (build with `--features demo`, as scripts/demo.sh does)"
                .into(),
        );
    }
    // SIGHUP re-reads this path later, and `-d` changes the working directory to `/`.
    cli.routes =
        std::path::absolute(&cli.routes).map_err(|e| format!("{}: {e}", cli.routes.display()))?;
    let runtime = Runtime::load_with(&cli.routes, ctx).map_err(|e| e.to_string())?;
    if cli.pingora.test {
        println!("{}: routing file ok", cli.routes.display());
    }
    let runtime = Arc::new(runtime);
    let no_conf = cli.pingora.conf.is_none();
    let mut server = Server::new(Some(cli.pingora)).map_err(|e| e.to_string())?;
    if no_conf {
        let conf = Arc::get_mut(&mut server.configuration)
            .ok_or("pingora's server configuration is already shared")?;
        conf.grace_period_seconds
            .get_or_insert(NO_CONF_GRACE_PERIOD_S);
        conf.graceful_shutdown_timeout_seconds
            .get_or_insert(NO_CONF_SHUTDOWN_TIMEOUT_S);
    }
    // Exits the process after checking pingora's YAML when `-t` was given.
    server.bootstrap();
    let connections = Arc::new(OpenConnections::default());
    let peering = Arc::new(crate::peering::Outbox::default());
    let gateway = Gateway::new(runtime.clone(), &server.configuration, connections.clone())
        .with_peering(peering.clone());
    let app = pingora::proxy::http_proxy(&server.configuration, gateway);
    let mut proxy = Service::new(
        "rolter".to_string(),
        ClientConnections::new(app, runtime.clone(), connections),
    );
    // No L4 read buffer: pingora's default gives every connection 64 KiB for its whole
    // life, idle or not; `ClientConnections` reads a request header through a per-thread
    // buffer and hands it to pingora, which then reads bodies straight into its own.
    proxy.add_listener(
        ListenerConfig::tcp(&cli.listen).l4_buffer(L4BufferSettings {
            read: Some(0),
            write: None,
        }),
    );
    server.add_service(proxy);
    server.add_service(background_service(
        "health-checks",
        crate::fleet::probe::HealthProber(runtime.clone()),
    ));
    server.add_service(background_service(
        "lmcache-poll",
        LmcachePollService(runtime.clone()),
    ));
    server.add_service(background_service(
        "cache-size-poll",
        crate::cache_size_poll::CacheSizePollService(runtime.clone()),
    ));
    server.add_service(background_service(
        "kv-events",
        crate::kv_events::service::KvEventService(runtime.clone()),
    ));
    server.add_service(background_service(
        "dns-discovery",
        crate::runtime::DiscoveryService(runtime.clone()),
    ));
    server.add_service(background_service(
        "peering",
        crate::peering::PeeringService(runtime.clone(), peering),
    ));
    server.add_service(background_service("sighup-reload", ReloadOnSighup(runtime)));
    log::info!("rolter listening on {}", cli.listen);
    server.run(args);
    Ok(())
}

/// SIGHUP's default action ends the process, and the reload service installs its
/// handler only when pingora starts the services, possibly after the proxy already
/// answers. Install tokio's process-wide SIGHUP handler now (tokio never uninstalls one,
/// even after this runtime is gone), so a SIGHUP that arrives before the reload service
/// listens is dropped instead of killing the gateway (the file was just read anyway).
fn survive_early_sighup() -> Result<(), String> {
    use tokio::signal::unix::{signal, SignalKind};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .map_err(|e| format!("cannot start a runtime to arm SIGHUP: {e}"))?;
    rt.block_on(async { signal(SignalKind::hangup()).map(drop) })
        .map_err(|e| format!("cannot install a SIGHUP handler: {e}"))
}
