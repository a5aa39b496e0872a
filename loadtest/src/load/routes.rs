//! The routing file `compare` writes for rolter: one provider per simulated replica, one route.
//!
//! Owns the TOML text only (no I/O). `precise_cache_aware` gets `[providers.kv_events]`,
//! `lmcache_aware` gets `[providers.lmcache]` and `cache_aware`, `pipeline` and
//! `precise_cache_aware` get each provider's `kv_cache_tokens` (the replica's cache size,
//! which sizes the prefix tries and the share bound's spill test); other strategies get none
//! of these.

use std::fmt::Write as _;

use crate::fleet::FleetHandle;

/// Prompt bytes per token of the simulator's workloads (`workload.rs` words: 2-3 two-byte
/// syllables and a space, one token each).
pub const SIM_BYTES_PER_TOKEN: f64 = 6.0;

/// The routing TOML for `strategy` over `fleet`, route alias `model`.
pub fn routes_toml(
    fleet: &FleetHandle,
    strategy: &str,
    model: &str,
    upstream_model: &str,
) -> String {
    routes_toml_with(fleet, strategy, model, upstream_model, &[], &[], true)
}

/// [`routes_toml`] with extra `key = value` lines in the route's table (`--route-option`)
/// and in each provider's (`--provider-option`), and the providers' `kv_cache_tokens` only
/// when `kv_cache_tokens` (`compare --without-kv-cache-tokens` leaves it out, as an
/// operator who never copied it would).
pub fn routes_toml_with(
    fleet: &FleetHandle,
    strategy: &str,
    model: &str,
    upstream_model: &str,
    route_options: &[String],
    provider_options: &[String],
    kv_cache_tokens: bool,
) -> String {
    let mut s = String::from("# Written by rolter-load compare.\n");
    for r in fleet.replicas() {
        let _ = write!(
            s,
            "\n[[providers]]\nname = \"sim-{}\"\nkind = \"openai_compatible\"\napi_base = \"{}\"\n",
            r.index,
            r.base_url()
        );
        if kv_cache_tokens && matches!(strategy, "cache_aware" | "pipeline" | "precise_cache_aware")
        {
            // What an operator copies from vLLM's "GPU KV cache size: N tokens" log line.
            let _ = writeln!(s, "kv_cache_tokens = {}", r.kv_cache_tokens());
        }
        for line in provider_options {
            let _ = writeln!(s, "{line}");
        }
        if strategy == "precise_cache_aware" {
            if let Some(ep) = r.kv_events_endpoint() {
                let _ = write!(
                    s,
                    "[providers.kv_events]\nendpoint = \"{ep}\"\ntopic = \"{}\"\n",
                    r.kv_topic().unwrap_or("")
                );
                if let Some(rep) = r.kv_replay_endpoint() {
                    let _ = writeln!(s, "replay_endpoint = \"{rep}\"");
                }
            }
        }
        if strategy == "lmcache_aware" {
            if let Some(url) = r.lmcache_status_url() {
                let _ = write!(s, "[providers.lmcache]\nendpoint = \"{url}\"\n");
            }
        }
    }
    let _ = write!(
        s,
        "\n[[routes]]\nmodel = \"{model}\"\nstrategy = \"{strategy}\"\n"
    );
    let overridden = route_options
        .iter()
        .any(|l| l.trim_start().starts_with("prompt_bytes_per_token"));
    if (strategy == "cache_aware" || strategy == "pipeline") && !overridden {
        // What an operator sets for their traffic: the simulator's pseudo-words are one
        // token of 4-6 bytes plus a space each.
        let _ = writeln!(s, "prompt_bytes_per_token = {SIM_BYTES_PER_TOKEN:?}");
    }
    for line in route_options {
        let _ = writeln!(s, "{line}");
    }
    for r in fleet.replicas() {
        let _ = write!(
            s,
            "[[routes.targets]]\nprovider = \"sim-{}\"\nmodel = \"{upstream_model}\"\nweight = 1\n",
            r.index
        );
    }
    s
}
