//! The gateway's placement log (`RUST_LOG=placement=debug`, one line per decision of the
//! `cache_aware` and `precise_cache_aware` rules) as `compare --trace-dir` keeps it and
//! `rolter-load traces` reads it: which rule opened a prompt group on more replicas than it
//! needed, and what the targets' loads were at that moment.
//!
//! Owns the `RUST_LOG` value that turns the lines on (added to the gateway's own, only when the
//! caller asks), picking the lines out of a gateway log into `<trace>.placement.log`, parsing
//! them, and the summary and its text. Must not touch the line's format: that is the gateway's
//! (src/routing/explain.rs, whose tests write the line this module's tests parse and read back
//! what it writes); a line this parser cannot read is counted, not guessed at. Which processes
//! get the value and where the files go is `compare`'s.
//!
//! An extra home: a decision that placed a group on a target the group had not been placed on
//! yet, when it had already been placed on at least one other (the group's first target is its
//! home, every further one recomputes its first message there once more). It is attributed to
//! the decision's reason.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use thiserror::Error;

/// The gateway's log target of the decision lines (src/routing/explain.rs `LOG_TARGET`).
pub const LOG_TARGET: &str = "placement";

/// The file name suffix of a kept placement log.
pub const FILE_SUFFIX: &str = ".placement.log";

/// Errors reading or writing placement logs.
#[derive(Debug, Error)]
pub enum PlacementLogError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("writing {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The gateway's `RUST_LOG` with the placement lines turned on: `current` (the value the
/// gateway would inherit; unset means the gateway's own default, `info`, and an empty value
/// env_logger's, `error`) with `placement=debug` added to its directives (before a `/regex`
/// filter, which is kept). Every other target keeps its level.
pub fn rust_log_with_placement(current: Option<&str>) -> String {
    let current = current.unwrap_or("info");
    let (directives, filter) = match current.split_once('/') {
        Some((d, f)) => (d, Some(f)),
        None => (current, None),
    };
    let directives = directives.trim().trim_end_matches(',');
    let directives = if directives.trim().is_empty() {
        "error"
    } else {
        directives
    };
    let mut out = format!("{directives},{LOG_TARGET}=debug");
    if let Some(f) = filter {
        out.push('/');
        out.push_str(f);
    }
    out
}

/// Whether a gateway log line is a placement decision: env_logger's `[... placement] `
/// prefix (its header's last word the target itself, not a module path ending in it), or
/// the message alone.
pub fn is_placement_line(line: &str) -> bool {
    match line.split_once("] ") {
        Some((head, _)) if head.starts_with('[') => head.rsplit(' ').next() == Some(LOG_TARGET),
        _ => line.starts_with("group="),
    }
}

/// The kept file's name for gateway `k` of `count` behind trace `trace_name`:
/// `<trace>.placement.log` for one gateway, `<trace>.gw<k>.placement.log` for several.
pub fn file_name(trace_name: &str, k: usize, count: usize) -> String {
    if count > 1 {
        format!("{trace_name}.gw{k}{FILE_SUFFIX}")
    } else {
        format!("{trace_name}{FILE_SUFFIX}")
    }
}

/// Copy the placement lines of the gateway log `from` (whole, in order) to `to`, if it has
/// any (a strategy without the placement rule writes none, and gets no file); returns how
/// many.
pub fn copy_placement_lines(from: &Path, to: &Path) -> Result<usize, PlacementLogError> {
    let bytes = std::fs::read(from).map_err(|source| PlacementLogError::Read {
        path: from.to_path_buf(),
        source,
    })?;
    let text = String::from_utf8_lossy(&bytes);
    let mut out = String::new();
    let mut n = 0;
    for line in text.lines().filter(|l| is_placement_line(l)) {
        out.push_str(line);
        out.push('\n');
        n += 1;
    }
    if n == 0 {
        return Ok(0);
    }
    std::fs::write(to, out).map_err(|source| PlacementLogError::Write {
        path: to.to_path_buf(),
        source,
    })?;
    Ok(n)
}

/// The group's home as the rule was told it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Home {
    /// `known:I`: the home every gateway names for a group it has seen at least twice
    /// (src/routing/group_homes.rs).
    Known(usize),
    /// `expected:I`: the home a group seen once would get on joining the known set.
    Expected(usize),
}

/// One eligible target as the rule saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    pub index: usize,
    pub inflight: u64,
    pub cached_tokens: f64,
    pub placed: f64,
}

/// One decision line.
#[derive(Debug, Clone, PartialEq)]
pub struct PlacementLine {
    pub group: u64,
    pub conversation: u64,
    pub tokens: f64,
    pub first: f64,
    pub home: Option<Home>,
    pub previous: Option<usize>,
    pub targets: Vec<Target>,
    pub chosen: usize,
    pub reason: String,
    pub new_work: bool,
    pub label: String,
}

/// `key=value` at the start of `rest` up to the next space: the value and what follows it.
fn field<'a>(rest: &'a str, key: &str) -> Option<(&'a str, &'a str)> {
    let rest = rest.strip_prefix(key)?.strip_prefix('=')?;
    Some(rest.split_once(' ').unwrap_or((rest, "")))
}

fn hex16(s: &str) -> Option<u64> {
    if s.len() != 16 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(s, 16).ok()
}

/// Decimal digits only (no sign).
fn digits<T: std::str::FromStr>(s: &str) -> Option<T> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

fn index(s: &str) -> Option<usize> {
    digits(s)
}

fn tokens(s: &str) -> Option<f64> {
    s.parse::<f64>().ok().filter(|t| t.is_finite())
}

fn home(s: &str) -> Option<Option<Home>> {
    if s == "-" {
        return Some(None);
    }
    if let Some(i) = s.strip_prefix("known:") {
        return Some(Some(Home::Known(index(i)?)));
    }
    Some(Some(Home::Expected(index(s.strip_prefix("expected:")?)?)))
}

fn previous(s: &str) -> Option<Option<usize>> {
    if s == "-" {
        Some(None)
    } else {
        Some(Some(index(s)?))
    }
}

fn targets(s: &str) -> Option<Vec<Target>> {
    if s.is_empty() {
        return Some(Vec::new());
    }
    s.split(';')
        .map(|t| {
            let mut parts = t.split(':');
            let target = Target {
                index: index(parts.next()?)?,
                inflight: digits(parts.next()?)?,
                cached_tokens: tokens(parts.next()?)?,
                placed: tokens(parts.next()?)?,
            };
            parts.next().is_none().then_some(target)
        })
        .collect()
}

/// Parse one log line: the message (`group=... label=...`, fields in the order
/// src/routing/explain.rs writes them), after env_logger's `[... placement] ` prefix if there
/// is one. `None` if a field is missing, out of order or unreadable.
pub fn parse_line(line: &str) -> Option<PlacementLine> {
    let line = line.trim_end_matches(['\r', '\n']);
    let msg = if line.starts_with("group=") {
        line
    } else {
        line.split_once("] ")?.1
    };
    let (group, rest) = field(msg, "group")?;
    let (conversation, rest) = field(rest, "conversation")?;
    let (tokens_, rest) = field(rest, "tokens")?;
    let (first, rest) = field(rest, "first")?;
    let (home_, rest) = field(rest, "home")?;
    let (previous_, rest) = field(rest, "previous")?;
    let (targets_, rest) = field(rest, "targets")?;
    let (chosen, rest) = field(rest, "chosen")?;
    let (reason, rest) = field(rest, "reason")?;
    let (new_work, rest) = field(rest, "new_work")?;
    // The label is the rest of the line, whatever it holds.
    let label = rest.strip_prefix("label=")?;
    if reason.is_empty() {
        return None;
    }
    Some(PlacementLine {
        group: hex16(group)?,
        conversation: hex16(conversation)?,
        tokens: tokens(tokens_)?,
        first: tokens(first)?,
        home: home(home_)?,
        previous: previous(previous_)?,
        targets: targets(targets_)?,
        chosen: index(chosen)?,
        reason: reason.to_string(),
        new_work: match new_work {
            "true" => true,
            "false" => false,
            _ => return None,
        },
        label: label.to_string(),
    })
}

/// A decision that opened an extra home for its group.
#[derive(Debug, Clone, PartialEq)]
pub struct ExtraHome {
    /// Its number among the file's decisions, from 1.
    pub decision: usize,
    pub line: PlacementLine,
}

/// One placement log in numbers.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PlacementSummary {
    pub decisions: usize,
    /// Non-empty lines that did not parse (skipped).
    pub unreadable: usize,
    /// Decisions per reason, most first (then by name).
    pub by_reason: Vec<(String, usize)>,
    /// Distinct prompt groups.
    pub groups: usize,
    /// Distinct (group, chosen target) pairs.
    pub homes: usize,
    /// Extra homes per reason, most first (then by name); they sum to `homes - groups`.
    pub extra_by_reason: Vec<(String, usize)>,
    /// Every extra-home decision, in decision order.
    pub extra: Vec<ExtraHome>,
}

fn by_count(counts: HashMap<String, usize>) -> Vec<(String, usize)> {
    let mut v: Vec<(String, usize)> = counts.into_iter().collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    v
}

/// Summarize a placement log's lines, in decision order; unreadable lines are counted and
/// skipped, empty ones ignored.
pub fn summarize_lines<'a>(lines: impl IntoIterator<Item = &'a str>) -> PlacementSummary {
    let mut s = PlacementSummary::default();
    let mut reasons: HashMap<String, usize> = HashMap::new();
    let mut extra_reasons: HashMap<String, usize> = HashMap::new();
    // group -> the targets it has been placed on
    let mut placed_on: BTreeMap<u64, HashSet<usize>> = BTreeMap::new();
    for line in lines {
        if line.trim().is_empty() {
            continue;
        }
        let Some(d) = parse_line(line) else {
            s.unreadable += 1;
            continue;
        };
        s.decisions += 1;
        *reasons.entry(d.reason.clone()).or_default() += 1;
        let on = placed_on.entry(d.group).or_default();
        if on.insert(d.chosen) && on.len() > 1 {
            *extra_reasons.entry(d.reason.clone()).or_default() += 1;
            s.extra.push(ExtraHome {
                decision: s.decisions,
                line: d,
            });
        }
    }
    s.groups = placed_on.len();
    s.homes = placed_on.values().map(HashSet::len).sum();
    s.by_reason = by_count(reasons);
    s.extra_by_reason = by_count(extra_reasons);
    s
}

/// Read and summarize the placement log at `path`.
pub fn summarize_file(path: &Path) -> Result<PlacementSummary, PlacementLogError> {
    let bytes = std::fs::read(path).map_err(|source| PlacementLogError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(summarize_lines(String::from_utf8_lossy(&bytes).lines()))
}

/// Every `*.placement.log` in `dir`, by file name.
pub fn find_logs(dir: &Path) -> Result<Vec<PathBuf>, PlacementLogError> {
    super::files_ending_with(dir, FILE_SUFFIX).map_err(|source| PlacementLogError::Read {
        path: dir.to_path_buf(),
        source,
    })
}

fn counts(v: &[(String, usize)]) -> String {
    if v.is_empty() {
        return "none".into();
    }
    v.iter()
        .map(|(r, n)| format!("{r} {n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `#17 6e548b -> 0 group_home (home known:0) inflight 0:4 1:5 cached 1:1504`: an extra-home
/// decision with the group's first six hex digits and every eligible target's in-flight count
/// and (where any) cached tokens.
pub fn render_extra(e: &ExtraHome) -> String {
    let d = &e.line;
    let group = format!("{:016x}", d.group);
    let home = match d.home {
        Some(Home::Known(i)) => format!("known:{i}"),
        Some(Home::Expected(i)) => format!("expected:{i}"),
        None => "-".into(),
    };
    let inflight: Vec<String> = d
        .targets
        .iter()
        .map(|t| format!("{}:{}", t.index, t.inflight))
        .collect();
    let cached: Vec<String> = d
        .targets
        .iter()
        .filter(|t| t.cached_tokens > 0.0)
        .map(|t| format!("{}:{:.0}", t.index, t.cached_tokens))
        .collect();
    format!(
        "#{} {} -> {} {} (home {home}) inflight {} cached {}",
        e.decision,
        &group[..6],
        d.chosen,
        d.reason,
        inflight.join(" "),
        if cached.is_empty() {
            "none".into()
        } else {
            cached.join(" ")
        }
    )
}

/// One summary line about the log `name`, then its first `max_listed` extra-home decisions
/// indented.
pub fn render_summary(name: &str, s: &PlacementSummary, max_listed: usize) -> String {
    let mut out = format!(
        "{name}: {} decisions, {} groups, {} homes ({} beyond one a group); by reason: {}; \
         extra homes by reason: {}",
        s.decisions,
        s.groups,
        s.homes,
        s.homes.saturating_sub(s.groups),
        counts(&s.by_reason),
        counts(&s.extra_by_reason),
    );
    if s.unreadable > 0 {
        let _ = write!(out, "; {} unreadable lines skipped", s.unreadable);
    }
    out.push('\n');
    for e in s.extra.iter().take(max_listed) {
        let _ = writeln!(out, "  {}", render_extra(e));
    }
    if s.extra.len() > max_listed {
        let _ = writeln!(
            out,
            "  ... {} more extra-home decisions",
            s.extra.len() - max_listed
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// src/routing/explain.rs's test line (message part), with env_logger's prefix.
    const SAMPLE: &str = "[2026-12-05T22:01:16Z DEBUG placement] group=6e548b20b7daa59a \
        conversation=0000000000005ce2 tokens=1570 first=1504 home=known:0 previous=- \
        targets=0:4:0:4;1:3:1504:3;3:2:0:2 chosen=1 reason=cache_hit new_work=true \
        label=sim-1/m";

    #[test]
    fn the_gateways_line_parses() {
        let d = parse_line(SAMPLE).expect("parses");
        assert_eq!(d.group, 0x6e54_8b20_b7da_a59a);
        assert_eq!(d.conversation, 0x5ce2);
        assert_eq!((d.tokens, d.first), (1570.0, 1504.0));
        assert_eq!(d.home, Some(Home::Known(0)));
        assert_eq!(d.previous, None);
        assert_eq!(
            d.targets,
            vec![
                Target {
                    index: 0,
                    inflight: 4,
                    cached_tokens: 0.0,
                    placed: 4.0
                },
                Target {
                    index: 1,
                    inflight: 3,
                    cached_tokens: 1504.0,
                    placed: 3.0
                },
                Target {
                    index: 3,
                    inflight: 2,
                    cached_tokens: 0.0,
                    placed: 2.0
                },
            ]
        );
        assert_eq!(d.chosen, 1);
        assert_eq!(d.reason, "cache_hit");
        assert!(d.new_work);
        assert_eq!(d.label, "sim-1/m");
    }

    #[test]
    fn the_label_is_the_rest_of_the_line_and_the_prefix_is_optional() {
        let msg = SAMPLE.split_once("] ").unwrap().1;
        let odd = msg
            .replace("label=sim-1/m", "label=prov/model name=x ] label=y")
            .replace("home=known:0 previous=-", "home=expected:3 previous=2")
            .replace("new_work=true", "new_work=false");
        let d = parse_line(&odd).expect("parses without the prefix");
        assert_eq!(d.label, "prov/model name=x ] label=y");
        assert_eq!(d.home, Some(Home::Expected(3)));
        assert_eq!(d.previous, Some(2));
        assert!(!d.new_work);
        // With a prefix too, and whatever the prefix says before its `] `.
        let prefixed = format!("[2026-12-05T22:01:16Z DEBUG placement] {odd}");
        assert_eq!(parse_line(&prefixed), Some(d));
        assert_eq!(
            parse_line(msg).map(|d| d.label),
            Some("sim-1/m".to_string())
        );
    }

    #[test]
    fn malformed_lines_are_rejected() {
        let bad = [
            // A field missing.
            SAMPLE.replace(" first=1504", ""),
            SAMPLE.replace(" label=sim-1/m", ""),
            // Bad hex, short hex.
            SAMPLE.replace("group=6e548b20b7daa59a", "group=6e548b20b7daa59g"),
            SAMPLE.replace("group=6e548b20b7daa59a", "group=6e548b"),
            // Fields out of order.
            SAMPLE.replace("tokens=1570 first=1504", "first=1504 tokens=1570"),
            // A target with a part missing, an unknown home, a bad flag, no chosen index.
            SAMPLE.replace("1:3:1504:3", "1:3:1504"),
            SAMPLE.replace("home=known:0", "home=maybe:0"),
            SAMPLE.replace("new_work=true", "new_work=yes"),
            SAMPLE.replace("chosen=1", "chosen=-"),
            // Another logger line.
            "[2026-12-05T22:01:16Z INFO  access] GET /health 200".to_string(),
            String::new(),
        ];
        for line in &bad {
            assert_eq!(parse_line(line), None, "{line}");
        }
    }

    /// A decision line for group `g` placed on `chosen` for `reason` (four targets).
    fn decision(g: u64, chosen: usize, reason: &str) -> String {
        format!(
            "[2026-12-05T22:01:16Z DEBUG placement] group={g:016x} conversation={:016x} \
             tokens=2000 first=1500 home=known:0 previous=- \
             targets=0:5:1500:5;1:1:0:1;2:2:0:2;3:0:1500:0 chosen={chosen} reason={reason} \
             new_work=true label=sim-{chosen}/m",
            g + 7
        )
    }

    #[test]
    fn extra_homes_are_new_targets_of_an_already_placed_group() {
        let (a, b) = (0xaaaa_0000_0000_0001, 0xbbbb_0000_0000_0002);
        let lines = [
            decision(a, 0, "below_threshold"), // a's first home: not extra
            decision(a, 0, "cache_hit"),       // again on 0: not extra
            decision(b, 3, "below_threshold"), // b's first home
            decision(a, 1, "overloaded"),      // extra
            "garbage".to_string(),
            decision(b, 3, "cache_hit"),   // b stays on 3
            decision(a, 2, "group_home"),  // extra
            decision(a, 1, "cache_hit"),   // a already had 1: not extra
            decision(a, 0, "share_bound"), // nor 0
            String::new(),
        ];
        let s = summarize_lines(lines.iter().map(String::as_str));
        assert_eq!(s.decisions, 8);
        assert_eq!(s.unreadable, 1);
        assert_eq!(s.groups, 2);
        assert_eq!(s.homes, 4);
        assert_eq!(
            s.extra_by_reason,
            vec![("group_home".to_string(), 1), ("overloaded".to_string(), 1)]
        );
        assert_eq!(
            s.by_reason,
            vec![
                ("cache_hit".to_string(), 3),
                ("below_threshold".to_string(), 2),
                ("group_home".to_string(), 1),
                ("overloaded".to_string(), 1),
                ("share_bound".to_string(), 1),
            ]
        );
        let listed: Vec<(usize, usize, &str)> = s
            .extra
            .iter()
            .map(|e| (e.decision, e.line.chosen, e.line.reason.as_str()))
            .collect();
        assert_eq!(listed, vec![(4, 1, "overloaded"), (6, 2, "group_home")]);
        let text = render_summary("cache_aware.placement.log", &s, 1);
        let mut lines = text.lines();
        assert_eq!(
            lines.next(),
            Some(
                "cache_aware.placement.log: 8 decisions, 2 groups, 4 homes (2 beyond one a \
                 group); by reason: cache_hit 3, below_threshold 2, group_home 1, overloaded 1, \
                 share_bound 1; extra homes by reason: group_home 1, overloaded 1; 1 unreadable \
                 lines skipped"
            )
        );
        assert_eq!(
            lines.next(),
            Some(
                "  #4 aaaa00 -> 1 overloaded (home known:0) inflight 0:5 1:1 2:2 3:0 cached \
                 0:1500 3:1500"
            )
        );
        assert_eq!(lines.next(), Some("  ... 1 more extra-home decisions"));
        assert_eq!(lines.next(), None);
    }

    #[test]
    fn one_group_on_one_target_has_no_extra_home() {
        let lines: Vec<String> = (0..5).map(|_| decision(9, 2, "overloaded")).collect();
        let s = summarize_lines(lines.iter().map(String::as_str));
        assert_eq!((s.decisions, s.groups, s.homes), (5, 1, 1));
        assert!(s.extra.is_empty() && s.extra_by_reason.is_empty());
        assert!(
            render_summary("x", &s, 10).contains("extra homes by reason: none"),
            "{s:?}"
        );
    }

    #[test]
    fn placement_debug_is_added_to_the_gateways_own_level() {
        assert_eq!(rust_log_with_placement(None), "info,placement=debug");
        assert_eq!(
            rust_log_with_placement(Some("warn")),
            "warn,placement=debug"
        );
        assert_eq!(
            rust_log_with_placement(Some("warn,access=info,")),
            "warn,access=info,placement=debug"
        );
        assert_eq!(rust_log_with_placement(Some("")), "error,placement=debug");
        assert_eq!(
            rust_log_with_placement(Some("info/foo")),
            "info,placement=debug/foo"
        );
    }

    #[test]
    fn kept_lines_and_file_names() {
        assert!(is_placement_line(SAMPLE));
        assert!(!is_placement_line(
            "[2026-12-05T22:01:16Z INFO  access] GET /v1/chat/completions 200"
        ));
        // The message alone (a logger without env_logger's prefix) is one too; a target whose
        // module path ends in `placement` is not.
        assert!(is_placement_line(SAMPLE.split_once("] ").unwrap().1));
        assert!(!is_placement_line(
            "[2026-12-05T22:01:16Z DEBUG rolter::routing::placement] group=1"
        ));
        assert_eq!(file_name("cache_aware", 0, 1), "cache_aware.placement.log");
        assert_eq!(
            file_name("cache_aware@2.r3", 1, 2),
            "cache_aware@2.r3.gw1.placement.log"
        );
        let dir = std::env::temp_dir().join(format!("placement-log-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (from, to) = (dir.join("gateway.log"), dir.join("x.placement.log"));
        let log = format!("starting\n{SAMPLE}\n[... INFO  access] GET / 200\n{SAMPLE}\n");
        std::fs::write(&from, log).unwrap();
        assert_eq!(copy_placement_lines(&from, &to).unwrap(), 2);
        assert_eq!(
            std::fs::read_to_string(&to).unwrap(),
            format!("{SAMPLE}\n{SAMPLE}\n")
        );
        assert_eq!(find_logs(&dir).unwrap(), vec![to.clone()]);
        assert_eq!(summarize_file(&to).unwrap().decisions, 2);
        // A log without placement lines (a strategy without the placement rule) gets no file.
        let none = dir.join("y.placement.log");
        std::fs::write(&from, "starting\n[... INFO  access] GET / 200\n").unwrap();
        assert_eq!(copy_placement_lines(&from, &none).unwrap(), 0);
        assert!(!none.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
