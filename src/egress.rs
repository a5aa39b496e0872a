//! The egress policy: which hosts and addresses the gateway may contact on its own
//! (upstream `api_base`, `lmcache.endpoint`, `kv_events.endpoint`, health probes).
//!
//! Owns: the `[egress]` rules ([`EgressPolicy`]), the built-in deny list
//! ([`DEFAULT_DENY`]), the injectable name [`Resolver`] and [`resolve_checked`], the one
//! helper every outbound connection goes through: check the name, resolve it, check
//! **every** resolved address. Must not: open connections or cache resolutions — callers
//! re-resolve whenever they (re)connect, so a name that starts resolving to a denied
//! address is caught on the next use.
//!
//! ## Semantics
//! A rule is a host name (`vllm-1`, matched exactly, case-insensitively, trailing dot
//! ignored), a host suffix (`.internal` matches `a.internal` and `a.b.internal`, not
//! `internal` itself) or a CIDR (`10.0.0.0/8`, `fd00::/8`; a bare address is a /32 or
//! /128). A destination `host` resolving to `addrs` is allowed when
//! 1. no deny rule matches `host` or any address in `addrs` (deny wins), and
//! 2. the allow list is empty, or an allow host/suffix rule matches `host`, or every
//!    address in `addrs` is in an allow CIDR.
//!
//! IPv4-mapped IPv6 addresses (`::ffff:169.254.169.254`) are checked as the IPv4
//! address they map to. An unspecified address is checked as the loopback address it
//! reaches on Linux (a connect to `0.0.0.0` lands on `127.0.0.1`, to `::` on `::1`), so
//! a rule for `127.0.0.0/8` or `::1` covers it; it is not refused outright because
//! `http://0.0.0.0:8000` is what vLLM prints and operators copy for a local replica.
//! Unless `deny_defaults = false`, the built-in [`DEFAULT_DENY`] list is part of the deny
//! list; an allow entry cannot override it (deny wins).
//!
//! Before resolution (config validation) only [`EgressPolicy::check_host`] can run: it
//! rejects a literal address outright, a name on a deny rule, and — when the allow list
//! has no CIDR that the name's addresses could still satisfy — a name on no allow rule.

use ipnet::IpNet;
use serde::Deserialize;
use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, ToSocketAddrs};
use std::sync::RwLock;
use thiserror::Error;

/// `[egress]`: allow and deny lists for every address the gateway contacts on its own.
/// Entries are host names (`vllm-1`), host suffixes (`.internal`) or CIDRs / addresses
/// (`10.0.0.0/8`, `fd00::/8`, `192.0.2.7`). Deny wins over allow.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct EgressConfig {
    /// If non-empty, only these destinations are allowed.
    pub allow: Vec<String>,
    /// Never contacted, whatever `allow` says.
    pub deny: Vec<String>,
    /// Also deny the built-in list (link-local, cloud metadata services).
    pub deny_defaults: bool,
}

impl Default for EgressConfig {
    fn default() -> Self {
        EgressConfig {
            allow: Vec::new(),
            deny: Vec::new(),
            deny_defaults: true,
        }
    }
}

/// Denied unless `[egress] deny_defaults = false`: link-local ranges (which hold most
/// clouds' instance metadata services) and the metadata services that live elsewhere.
/// Each entry is (rule, why), the why is quoted in errors.
pub const DEFAULT_DENY: &[(&str, &str)] = &[
    (
        "169.254.0.0/16",
        "IPv4 link-local, incl. the 169.254.169.254 metadata service of AWS, GCP, Azure, OCI, OpenStack",
    ),
    ("fe80::/10", "IPv6 link-local"),
    ("fd00:ec2::254/128", "AWS instance metadata over IPv6"),
    ("100.100.100.200/32", "Alibaba Cloud metadata service"),
    ("168.63.129.16/32", "Azure WireServer"),
    ("metadata.google.internal", "GCP metadata service"),
    ("metadata.goog", "GCP metadata service"),
    ("instance-data.ec2.internal", "AWS metadata service"),
];

/// Why a destination may not be contacted.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum EgressError {
    /// A deny rule matched the host or one of its addresses.
    #[error("{target} is denied by egress rule {rule}")]
    Denied {
        /// `host "x"`, `address 1.2.3.4` or `address 1.2.3.4 of "x"`.
        target: String,
        /// The rule and where it comes from, e.g. `deny "10.0.0.0/8" (egress.deny[0])`.
        rule: String,
    },
    /// An allow list exists and nothing on it matched.
    #[error("{target} matches no egress allow rule (egress.allow)")]
    NotAllowed {
        /// As in [`EgressError::Denied`].
        target: String,
    },
}

/// Why [`resolve_checked`] refused a destination.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum OutboundError {
    /// The name did not resolve (or to nothing).
    #[error("cannot resolve \"{host}\": {reason}")]
    Resolve { host: String, reason: String },
    /// The name or a resolved address is not allowed.
    #[error(transparent)]
    Egress(#[from] EgressError),
}

/// What a rule matches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pattern {
    /// An exact host name (lowercase, no trailing dot).
    Host(String),
    /// A host suffix starting with `.`.
    Suffix(String),
    /// A network; a single address is a /32 or /128.
    Net(IpNet),
}

impl Pattern {
    /// Parse one `[egress]` entry.
    pub fn parse(entry: &str) -> Result<Pattern, String> {
        if entry.contains('/') {
            return entry
                .parse::<IpNet>()
                .map(|n| Pattern::Net(n.trunc()))
                .map_err(|_| "not a valid CIDR (e.g. \"10.0.0.0/8\", \"fd00::/8\")".into());
        }
        if let Ok(ip) = entry.trim_start_matches('[').trim_end_matches(']').parse() {
            return Ok(Pattern::Net(IpNet::from(canonical(ip))));
        }
        if entry.starts_with("*.") {
            return Err(format!(
                "write \"{}\" to match every name under a domain",
                &entry[1..]
            ));
        }
        let host = normalize_host(entry);
        let name = host.strip_prefix('.').unwrap_or(&host);
        if !is_host_name(name) {
            return Err("not a host name, .suffix, address or CIDR".into());
        }
        if host.starts_with('.') {
            Ok(Pattern::Suffix(host))
        } else {
            Ok(Pattern::Host(host))
        }
    }

    fn matches_host(&self, host: &str) -> bool {
        match self {
            Pattern::Host(h) => h == host,
            Pattern::Suffix(s) => host.ends_with(s.as_str()),
            Pattern::Net(_) => false,
        }
    }

    fn matches_addr(&self, ip: IpAddr) -> bool {
        match self {
            Pattern::Net(n) => n.contains(&ip),
            _ => false,
        }
    }
}

/// Where a rule came from (quoted in errors so an operator finds it).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Origin {
    Builtin(&'static str),
    Config(&'static str, usize),
}

#[derive(Debug, Clone)]
struct Rule {
    text: String,
    pattern: Pattern,
    origin: Origin,
}

impl Rule {
    fn describe(&self, list: &str) -> String {
        match &self.origin {
            Origin::Builtin(why) => format!("{list} \"{}\" (built-in: {why})", self.text),
            Origin::Config(key, i) => format!("{list} \"{}\" (egress.{key}[{i}])", self.text),
        }
    }
}

/// A compiled `[egress]` table. Cheap to share (`Arc`), immutable once built.
#[derive(Debug, Clone)]
pub struct EgressPolicy {
    allow: Vec<Rule>,
    deny: Vec<Rule>,
}

impl Default for EgressPolicy {
    /// No allow list, the built-in deny list.
    fn default() -> Self {
        EgressPolicy::compile(&EgressConfig::default()).0
    }
}

impl EgressPolicy {
    /// Compile `[egress]`, or list its bad entries (one line each, with the key path).
    pub fn from_config(config: &EgressConfig) -> Result<Self, Vec<String>> {
        let (policy, problems) = Self::compile(config);
        if problems.is_empty() {
            Ok(policy)
        } else {
            Err(problems)
        }
    }

    /// Compile `[egress]` from its good entries, and list the bad ones. Validation uses
    /// the partial policy to keep checking endpoints while reporting the bad entries.
    pub fn compile(config: &EgressConfig) -> (Self, Vec<String>) {
        let mut problems = Vec::new();
        let mut list = |key: &'static str, entries: &[String]| -> Vec<Rule> {
            let mut rules = Vec::new();
            for (i, entry) in entries.iter().enumerate() {
                match Pattern::parse(entry) {
                    Ok(pattern) => rules.push(Rule {
                        text: entry.clone(),
                        pattern,
                        origin: Origin::Config(key, i),
                    }),
                    Err(why) => problems.push(format!("egress.{key}[{i}]: \"{entry}\": {why}")),
                }
            }
            rules
        };
        let allow = list("allow", &config.allow);
        let mut deny = list("deny", &config.deny);
        if config.deny_defaults {
            deny.extend(DEFAULT_DENY.iter().map(|&(text, why)| Rule {
                text: text.to_string(),
                pattern: Pattern::parse(text).expect("built-in rules parse"),
                origin: Origin::Builtin(why),
            }));
        }
        (EgressPolicy { allow, deny }, problems)
    }

    /// Check a host name (or literal address) before resolution. A name that passes may
    /// still be refused by [`check_resolved`](Self::check_resolved) once its addresses
    /// are known.
    pub fn check_host(&self, host: &str) -> Result<(), EgressError> {
        if let Some(ip) = literal_ip(host) {
            return self.check_addr(ip);
        }
        let host = normalize_host(host);
        self.deny_host(&host)?;
        let allow_nets = self
            .allow
            .iter()
            .any(|r| matches!(r.pattern, Pattern::Net(_)));
        if self.allow.is_empty() || allow_nets || self.allow_host(&host) {
            Ok(())
        } else {
            Err(EgressError::NotAllowed {
                target: format!("host \"{host}\""),
            })
        }
    }

    /// Check one address, with no name attached.
    pub fn check_addr(&self, ip: IpAddr) -> Result<(), EgressError> {
        let target = || format!("address {ip}");
        self.deny_addr(ip, &target)?;
        if self.allow.is_empty() || self.allow_addr(ip) {
            Ok(())
        } else {
            Err(EgressError::NotAllowed { target: target() })
        }
    }

    /// Check a name together with every address it resolved to (see the module docs).
    pub fn check_resolved(&self, host: &str, addrs: &[IpAddr]) -> Result<(), EgressError> {
        if let Some(ip) = literal_ip(host) {
            return self.check_addr(ip);
        }
        let host = normalize_host(host);
        self.deny_host(&host)?;
        for &ip in addrs {
            self.deny_addr(ip, &|| format!("address {ip} of \"{host}\""))?;
        }
        if self.allow.is_empty() || self.allow_host(&host) {
            return Ok(());
        }
        match addrs.iter().find(|&&ip| !self.allow_addr(ip)) {
            None if !addrs.is_empty() => Ok(()),
            None => Err(EgressError::NotAllowed {
                target: format!("host \"{host}\" (no addresses)"),
            }),
            Some(ip) => Err(EgressError::NotAllowed {
                target: format!("address {ip} of \"{host}\""),
            }),
        }
    }

    fn deny_host(&self, host: &str) -> Result<(), EgressError> {
        match self.deny.iter().find(|r| r.pattern.matches_host(host)) {
            Some(rule) => Err(EgressError::Denied {
                target: format!("host \"{host}\""),
                rule: rule.describe("deny"),
            }),
            None => Ok(()),
        }
    }

    fn deny_addr(&self, ip: IpAddr, target: &dyn Fn() -> String) -> Result<(), EgressError> {
        let canon = canonical(ip);
        match self
            .deny
            .iter()
            .find(|r| r.pattern.matches_addr(ip) || r.pattern.matches_addr(canon))
        {
            Some(rule) if ip.to_canonical().is_unspecified() => Err(EgressError::Denied {
                target: format!("{} (which reaches {canon})", target()),
                rule: rule.describe("deny"),
            }),
            Some(rule) => Err(EgressError::Denied {
                target: target(),
                rule: rule.describe("deny"),
            }),
            None => Ok(()),
        }
    }

    fn allow_host(&self, host: &str) -> bool {
        self.allow.iter().any(|r| r.pattern.matches_host(host))
    }

    fn allow_addr(&self, ip: IpAddr) -> bool {
        let canon = canonical(ip);
        self.allow
            .iter()
            .any(|r| r.pattern.matches_addr(ip) || r.pattern.matches_addr(canon))
    }
}

/// Name resolution, injectable so tests can re-point a name without touching
/// `/etc/hosts`. Implementations may block; async callers run them on a blocking thread.
pub trait Resolver: Send + Sync + 'static {
    /// Every address `host` resolves to (a literal address resolves to itself).
    fn lookup(&self, host: &str, port: u16) -> io::Result<Vec<IpAddr>>;
}

/// The operating system's resolver (`getaddrinfo`).
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemResolver;

impl Resolver for SystemResolver {
    fn lookup(&self, host: &str, port: u16) -> io::Result<Vec<IpAddr>> {
        if let Some(ip) = literal_ip(host) {
            return Ok(vec![ip]);
        }
        let mut addrs: Vec<IpAddr> = (host, port).to_socket_addrs()?.map(|a| a.ip()).collect();
        addrs.dedup();
        Ok(addrs)
    }
}

/// A fixed, mutable name table for tests: names not in it do not resolve; literal
/// addresses resolve to themselves.
#[derive(Debug, Default)]
pub struct StaticResolver {
    names: RwLock<HashMap<String, Vec<IpAddr>>>,
}

impl StaticResolver {
    /// Make `host` resolve to `addrs` from now on (an empty list: no addresses).
    pub fn set(&self, host: &str, addrs: &[IpAddr]) {
        self.names
            .write()
            .expect("resolver table poisoned")
            .insert(normalize_host(host), addrs.to_vec());
    }
}

impl Resolver for StaticResolver {
    fn lookup(&self, host: &str, _port: u16) -> io::Result<Vec<IpAddr>> {
        if let Some(ip) = literal_ip(host) {
            return Ok(vec![ip]);
        }
        self.names
            .read()
            .expect("resolver table poisoned")
            .get(&normalize_host(host))
            .cloned()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "unknown test host name"))
    }
}

/// Check `host`, resolve it, check every address; return the addresses (never empty).
/// The one way rolter turns a configured name into addresses it will connect to.
pub fn resolve_checked(
    resolver: &dyn Resolver,
    policy: &EgressPolicy,
    host: &str,
    port: u16,
) -> Result<Vec<IpAddr>, OutboundError> {
    let addrs = lookup_allowed_name(resolver, policy, host, port)?;
    policy.check_resolved(host, &addrs)?;
    Ok(addrs)
}

/// Look up a name the policy allows (a denied name is never even looked up); its
/// addresses are not checked yet. No address at all is a resolution error.
pub fn lookup_allowed_name(
    resolver: &dyn Resolver,
    policy: &EgressPolicy,
    host: &str,
    port: u16,
) -> Result<Vec<IpAddr>, OutboundError> {
    policy.check_host(host)?;
    let addrs = resolver
        .lookup(host, port)
        .map_err(|e| OutboundError::Resolve {
            host: host.to_string(),
            reason: e.to_string(),
        })?;
    if addrs.is_empty() {
        return Err(OutboundError::Resolve {
            host: host.to_string(),
            reason: "no addresses".into(),
        });
    }
    Ok(addrs)
}

/// Host and port of an endpoint URL (`scheme://host[:port]/...`), for egress checks of
/// any scheme (`http://`, `tcp://`). `default_port` applies when the URL has none.
pub fn url_host_port(url: &str, default_port: u16) -> Option<(String, u16)> {
    let uri: http::Uri = url.parse().ok()?;
    uri.scheme()?;
    let authority = uri.authority()?;
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    if host.is_empty() {
        return None;
    }
    Some((
        host.to_string(),
        authority.port_u16().unwrap_or(default_port),
    ))
}

/// `host` as a literal address, brackets allowed.
fn literal_ip(host: &str) -> Option<IpAddr> {
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .parse()
        .ok()
}

/// The address a connection to `ip` actually reaches: an IPv4-mapped IPv6 address as
/// the IPv4 address it stands for, an unspecified address as loopback (Linux connects
/// `0.0.0.0` to `127.0.0.1` and `::` to `::1`); others unchanged.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V4(v4) if v4.is_unspecified() => IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
        IpAddr::V6(v6) if v6.is_unspecified() => IpAddr::V6(std::net::Ipv6Addr::LOCALHOST),
        other => other,
    }
}

/// Lowercase, without a trailing dot (`Metadata.Google.Internal.` is the same host).
fn normalize_host(host: &str) -> String {
    host.trim_end_matches('.').to_ascii_lowercase()
}

/// Letters, digits, `-` and `_` in non-empty dot-separated labels.
fn is_host_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(allow: &[&str], deny: &[&str]) -> EgressPolicy {
        EgressPolicy::from_config(&EgressConfig {
            allow: allow.iter().map(|s| s.to_string()).collect(),
            deny: deny.iter().map(|s| s.to_string()).collect(),
            deny_defaults: true,
        })
        .expect("valid rules")
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn metadata_and_link_local_are_denied_by_default() {
        let p = EgressPolicy::default();
        for addr in [
            "169.254.169.254",
            "169.254.170.2",
            "169.254.0.1",
            "fe80::1",
            "fd00:ec2::254",
            "100.100.100.200",
            "168.63.129.16",
            "::ffff:169.254.169.254",
        ] {
            let err = p.check_addr(ip(addr)).unwrap_err();
            assert!(
                matches!(&err, EgressError::Denied { rule, .. } if rule.contains("built-in")),
                "{addr}: {err}"
            );
        }
        for host in [
            "metadata.google.internal",
            "METADATA.google.internal.",
            "metadata.goog",
            "instance-data.ec2.internal",
            "169.254.169.254",
            "[fe80::1]",
        ] {
            assert!(p.check_host(host).is_err(), "{host}");
        }
        for ok in ["127.0.0.1", "10.1.2.3", "::1", "fd00::1", "100.100.100.201"] {
            assert!(p.check_addr(ip(ok)).is_ok(), "{ok}");
        }
        assert!(p.check_host("vllm-1").is_ok());
        let err = p.check_addr(ip("169.254.169.254")).unwrap_err().to_string();
        assert_eq!(
            err,
            "address 169.254.169.254 is denied by egress rule deny \"169.254.0.0/16\" \
             (built-in: IPv4 link-local, incl. the 169.254.169.254 metadata service of AWS, GCP, Azure, OCI, OpenStack)"
        );
    }

    #[test]
    fn defaults_can_be_switched_off() {
        let p = EgressPolicy::from_config(&EgressConfig {
            deny_defaults: false,
            ..Default::default()
        })
        .unwrap();
        assert!(p.check_addr(ip("169.254.169.254")).is_ok());
        assert!(p.check_host("metadata.google.internal").is_ok());
    }

    #[test]
    fn cidr_rules_v4_and_v6() {
        let p = policy(
            &[],
            &["10.0.0.0/8", "2001:db8::/32", "192.0.2.7", "10.9.9.9/8"],
        );
        assert!(p.check_addr(ip("10.255.0.1")).is_err());
        assert!(p.check_addr(ip("11.0.0.1")).is_ok());
        assert!(p.check_addr(ip("2001:db8:1::5")).is_err());
        assert!(p.check_addr(ip("2001:db9::5")).is_ok());
        assert!(p.check_addr(ip("192.0.2.7")).is_err());
        assert!(p.check_addr(ip("192.0.2.8")).is_ok());
        // IPv4-mapped IPv6 is the IPv4 address.
        assert!(p.check_addr(ip("::ffff:10.0.0.1")).is_err());
        let err = p.check_addr(ip("10.1.1.1")).unwrap_err().to_string();
        assert!(
            err.contains("deny \"10.0.0.0/8\" (egress.deny[0])"),
            "{err}"
        );
    }

    #[test]
    fn suffix_and_exact_host_rules() {
        let p = policy(&[], &[".internal", "evil.example.com"]);
        assert!(p.check_host("a.internal").is_err());
        assert!(p.check_host("a.b.Internal.").is_err());
        assert!(
            p.check_host("internal").is_ok(),
            "a suffix needs a label before it"
        );
        assert!(p.check_host("xinternal").is_ok());
        assert!(p.check_host("evil.example.com").is_err());
        assert!(p.check_host("sub.evil.example.com").is_ok(), "exact rule");
        let err = p.check_host("x.internal").unwrap_err().to_string();
        assert_eq!(
            err,
            "host \"x.internal\" is denied by egress rule deny \".internal\" (egress.deny[0])"
        );
    }

    #[test]
    fn deny_wins_over_allow() {
        let p = policy(&["10.0.0.0/8", ".svc"], &["10.0.0.5", "bad.svc"]);
        assert!(p.check_addr(ip("10.0.0.4")).is_ok());
        assert!(p.check_addr(ip("10.0.0.5")).is_err());
        assert!(p.check_host("good.svc").is_ok());
        assert!(p.check_host("bad.svc").is_err());
        // Allowed by name, but one resolved address is denied.
        assert!(p
            .check_resolved("good.svc", &[ip("10.0.0.4"), ip("10.0.0.5")])
            .is_err());
        // Built-in denies win over an explicit allow too.
        let p = policy(&["169.254.169.254"], &[]);
        assert!(p.check_addr(ip("169.254.169.254")).is_err());
    }

    #[test]
    fn allow_list_admits_only_its_names_or_addresses() {
        let p = policy(&["10.0.0.0/8", ".svc.cluster.local"], &[]);
        assert!(matches!(
            p.check_addr(ip("192.168.1.1")),
            Err(EgressError::NotAllowed { .. })
        ));
        // A name on no allow rule may still resolve into an allowed CIDR.
        assert!(p.check_host("vllm-1").is_ok());
        assert!(p.check_resolved("vllm-1", &[ip("10.1.1.1")]).is_ok());
        let err = p
            .check_resolved("vllm-1", &[ip("10.1.1.1"), ip("192.168.1.1")])
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "address 192.168.1.1 of \"vllm-1\" matches no egress allow rule (egress.allow)"
        );
        // An allowed name is allowed whatever (non-denied) address it has.
        assert!(p
            .check_resolved("a.svc.cluster.local", &[ip("192.168.1.1")])
            .is_ok());
        // Names only: an unknown name is refused before resolution.
        let names_only = policy(&[".svc"], &[]);
        assert!(names_only.check_host("other").is_err());
        assert!(names_only.check_host("a.svc").is_ok());
        assert!(names_only.check_addr(ip("10.0.0.1")).is_err());
    }

    #[test]
    fn bad_entries_are_reported_with_their_key() {
        let problems = EgressPolicy::from_config(&EgressConfig {
            allow: vec!["10.0.0.0/33".into(), "ok.host".into()],
            deny: vec!["*.internal".into(), "bad host".into(), "".into()],
            deny_defaults: true,
        })
        .unwrap_err();
        assert_eq!(problems.len(), 4, "{problems:?}");
        assert!(problems[0].starts_with("egress.allow[0]: \"10.0.0.0/33\": not a valid CIDR"));
        assert!(problems[1].contains("egress.deny[0]: \"*.internal\": write \".internal\""));
        assert!(problems[2].starts_with("egress.deny[1]: \"bad host\""));
        assert!(problems[3].starts_with("egress.deny[2]: \"\""));
    }

    #[test]
    fn resolve_checked_checks_every_address() {
        let resolver = StaticResolver::default();
        let p = EgressPolicy::default();
        resolver.set("good", &[ip("127.0.0.1")]);
        resolver.set("sneaky", &[ip("127.0.0.1"), ip("169.254.169.254")]);
        resolver.set("empty", &[]);
        assert_eq!(
            resolve_checked(&resolver, &p, "good", 80).unwrap(),
            vec![ip("127.0.0.1")]
        );
        let err = resolve_checked(&resolver, &p, "sneaky", 80).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("address 169.254.169.254 of \"sneaky\" is denied"),
            "{err}"
        );
        assert!(matches!(
            resolve_checked(&resolver, &p, "empty", 80),
            Err(OutboundError::Resolve { .. })
        ));
        assert!(matches!(
            resolve_checked(&resolver, &p, "nowhere", 80),
            Err(OutboundError::Resolve { .. })
        ));
        // A denied name is refused before it is looked up.
        assert!(matches!(
            resolve_checked(&resolver, &p, "metadata.google.internal", 80),
            Err(OutboundError::Egress(_))
        ));
        assert_eq!(
            SystemResolver.lookup("127.0.0.1", 80).unwrap(),
            vec![ip("127.0.0.1")]
        );
    }

    proptest::proptest! {
        /// Deny wins: whatever the allow list says, an address is refused exactly when a
        /// deny CIDR contains it (v4, v6 and IPv4-mapped v6 alike).
        #[test]
        fn deny_wins_for_any_address(
            net in proptest::prelude::any::<[u8; 4]>(),
            len in 0u8..=32,
            x in proptest::prelude::any::<[u8; 4]>(),
            net6 in proptest::prelude::any::<[u16; 8]>(),
            len6 in 0u8..=128,
            x6 in proptest::prelude::any::<[u16; 8]>(),
        ) {
            let (v4, x4) = (std::net::Ipv4Addr::from(net), std::net::Ipv4Addr::from(x));
            let (v6, x6) = (std::net::Ipv6Addr::from(net6), std::net::Ipv6Addr::from(x6));
            let p = EgressPolicy::from_config(&EgressConfig {
                allow: vec!["0.0.0.0/0".into(), "::/0".into(), x4.to_string(), x6.to_string()],
                deny: vec![format!("{v4}/{len}"), format!("{v6}/{len6}")],
                deny_defaults: false,
            })
            .unwrap();
            let net4 = IpNet::new(IpAddr::V4(v4), len).unwrap();
            let net6 = IpNet::new(IpAddr::V6(v6), len6).unwrap();
            let denied = |ip: IpAddr| net4.contains(&ip) || net6.contains(&ip);
            let mapped = IpAddr::V6(x4.to_ipv6_mapped());
            for ip in [IpAddr::V4(x4), mapped, IpAddr::V6(x6)] {
                // An address is checked as itself and as the address it reaches.
                let expect = denied(ip) || denied(canonical(ip));
                proptest::prop_assert_eq!(p.check_addr(ip).is_err(), expect, "{}", ip);
                proptest::prop_assert_eq!(p.check_resolved("h", &[ip]).is_err(), expect);
            }
        }
    }

    /// Regression: a destination of 0.0.0.0 or `::` reaches loopback on Linux but
    /// passed a deny rule for loopback.
    #[test]
    fn unspecified_addresses_are_checked_as_the_loopback_they_reach() {
        let p = policy(&[], &["127.0.0.0/8", "::1"]);
        for addr in ["0.0.0.0", "::", "::ffff:0.0.0.0"] {
            let err = p.check_addr(ip(addr)).unwrap_err();
            assert!(matches!(&err, EgressError::Denied { .. }), "{addr}: {err}");
            assert!(p.check_host(addr).is_err(), "{addr}");
            assert!(
                p.check_resolved("zero.test", &[ip(addr)]).is_err(),
                "{addr}"
            );
        }
        assert_eq!(
            p.check_addr(ip("0.0.0.0")).unwrap_err().to_string(),
            "address 0.0.0.0 (which reaches 127.0.0.1) is denied by egress rule deny \"127.0.0.0/8\" (egress.deny[0])"
        );
        // Only loopback is denied here: an ordinary address still passes.
        assert!(p.check_addr(ip("10.0.0.1")).is_ok());
        // An allow list must admit loopback for 0.0.0.0 to pass.
        let p = policy(&["10.0.0.0/8"], &[]);
        assert!(p.check_addr(ip("0.0.0.0")).is_err());
        let p = policy(&["127.0.0.0/8"], &[]);
        assert!(p.check_addr(ip("0.0.0.0")).is_ok());
    }

    #[test]
    fn url_host_port_handles_schemes_and_brackets() {
        assert_eq!(
            url_host_port("http://vllm-1:9000/cache/status", 80),
            Some(("vllm-1".into(), 9000))
        );
        assert_eq!(
            url_host_port("tcp://[fe80::1]:5557", 0),
            Some(("fe80::1".into(), 5557))
        );
        assert_eq!(url_host_port("http://h/x", 80), Some(("h".into(), 80)));
        assert_eq!(url_host_port("no-scheme", 80), None);
    }
}
