//! The placement rule's decision as one debug log line (`RUST_LOG=placement=debug`): what
//! the rule saw of each eligible target and what it chose, so an operator can tell why a
//! request went where it did, and `rolter-load traces` can say, by reason, which decisions
//! opened a prompt group on another replica.
//!
//! Owns the line's format (space-separated `key=value` fields, stated in
//! docs/metrics.md; `loadtest/src/load/placement_log.rs` parses it). Must not decide
//! anything: it formats what [`super::placement`] was asked and answered, and only when
//! the `placement` log target is enabled at debug level.

use super::placement::{Ask, Choice, GroupHome, Placed};
use std::fmt;

/// The log target of the decision lines.
pub const LOG_TARGET: &str = "placement";

/// One decision, formatted as its log line (without the logger's prefix).
pub struct Explained<'a> {
    /// What the rule was asked.
    pub ask: &'a Ask,
    /// The eligible targets as the rule saw them.
    pub choices: &'a [Choice<'a>],
    /// Its answer.
    pub placed: &'a Placed,
}

impl fmt::Display for Explained<'_> {
    /// `group=<hex16> conversation=<hex16> tokens=<n> first=<n> home=<known:i|expected:i|->
    /// previous=<i|-> targets=<i:inflight:cached:placed>;... chosen=<i> reason=<reason>
    /// new_work=<bool> label=<label>`: indices are the route's target indices, `cached` the
    /// prompt tokens the target holds as far as the gateway knows, `placed` its recent new
    /// work. The label is last: a model name may hold any character but a newline.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Explained {
            ask,
            choices,
            placed,
        } = self;
        write!(
            f,
            "group={:016x} conversation={:016x} tokens={:.0} first={:.0} home=",
            ask.keys.group, ask.keys.conversation, ask.tokens, ask.first_message_tokens
        )?;
        match ask.group_home {
            Some(GroupHome::Known(i)) => write!(f, "known:{i}")?,
            Some(GroupHome::Expected(i)) => write!(f, "expected:{i}")?,
            None => f.write_str("-")?,
        }
        match ask.previous {
            Some(i) => write!(f, " previous={i} targets=")?,
            None => f.write_str(" previous=- targets=")?,
        }
        for (n, c) in choices.iter().enumerate() {
            let sep = if n == 0 { "" } else { ";" };
            write!(
                f,
                "{sep}{}:{}:{:.0}:{:.0}",
                c.index, c.inflight, c.cached_tokens, c.placed
            )?;
        }
        let label = choices
            .iter()
            .find(|c| c.index == placed.index)
            .map_or("-", |c| c.label);
        write!(
            f,
            " chosen={} reason={} new_work={} label={label}",
            placed.index,
            placed.reason.as_str(),
            placed.new_work
        )
    }
}

/// Log `ask`'s placement at debug level on [`LOG_TARGET`], if that is enabled (nothing is
/// formatted otherwise).
pub fn log_decision(ask: &Ask, choices: &[Choice], placed: &Placed) {
    if log::log_enabled!(target: LOG_TARGET, log::Level::Debug) {
        log::debug!(target: LOG_TARGET, "{}", Explained { ask, choices, placed });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routing::placement::{PlacementKeys, PlacementRule};
    use crate::routing::Reason;

    fn choice(index: usize, inflight: u64, cached: f64, label: &'static str) -> Choice<'static> {
        Choice {
            index,
            inflight,
            cached_tokens: cached,
            label,
            room_tokens: 0.0,
            cache_tokens: 0.0,
            placed: inflight as f64 + 0.4,
            homes: 0,
            quiet: false,
        }
    }

    /// The line `loadtest/src/load/placement_log.rs`'s tests parse (`a_written_line_is_read_back`
    /// checks the two agree).
    #[test]
    fn a_decision_reads_as_the_documented_line() {
        let ask = Ask {
            tokens: 1570.4,
            first_message_tokens: 1504.0,
            keys: PlacementKeys {
                group: 0x6e54_8b20_b7da_a59a,
                conversation: 0x5ce2,
            },
            previous: None,
            previous_from_peer: false,
            group_home: Some(GroupHome::Known(0)),
        };
        // Target 2 is not eligible: the rule never saw it.
        let choices = [
            choice(0, 4, 0.0, "sim-0/m"),
            choice(1, 3, 1504.0, "sim-1/m"),
            choice(3, 2, 0.0, "sim-3/m"),
        ];
        let placed = PlacementRule::default().place(&ask, &choices).unwrap();
        assert_eq!(placed.index, 1, "{placed:?}");
        assert_eq!(placed.reason, Reason::CacheHit);
        assert_eq!(
            Explained {
                ask: &ask,
                choices: &choices,
                placed: &placed
            }
            .to_string(),
            "group=6e548b20b7daa59a conversation=0000000000005ce2 tokens=1570 first=1504 \
             home=known:0 previous=- targets=0:4:0:4;1:3:1504:3;3:2:0:2 chosen=1 \
             reason=cache_hit new_work=true label=sim-1/m"
        );
        let expected = Ask {
            group_home: Some(GroupHome::Expected(3)),
            previous: Some(1),
            previous_from_peer: false,
            ..ask
        };
        let line = Explained {
            ask: &expected,
            choices: &choices[..1],
            placed: &placed,
        }
        .to_string();
        assert!(
            line.contains(" home=expected:3 previous=1 targets=0:4:0:4 chosen=1 "),
            "{line}"
        );
        // A chosen index the choices do not hold (never, from the rule) has no label.
        assert!(line.ends_with(" label=-"), "{line}");
    }

    /// What this module writes, `rolter-load traces` reads back field for field (its parser
    /// lives with the load-test tools, which the gateway does not link).
    #[test]
    fn a_written_line_is_read_back() {
        use rolter_loadtest::load::placement_log::{self as reader, Home};
        assert_eq!(reader::LOG_TARGET, LOG_TARGET);
        let ask = Ask {
            tokens: 2100.0,
            first_message_tokens: 2000.0,
            keys: PlacementKeys {
                group: u64::MAX - 1,
                conversation: 7,
            },
            previous: Some(3),
            previous_from_peer: false,
            group_home: Some(GroupHome::Expected(1)),
        };
        let choices = [
            choice(1, 0, 0.0, "p/m"),
            choice(3, 9, 2100.0, "prov/model name=x"),
        ];
        let placed = PlacementRule::default().place(&ask, &choices).unwrap();
        let line = Explained {
            ask: &ask,
            choices: &choices,
            placed: &placed,
        }
        .to_string();
        let read = reader::parse_line(&format!("[2026-12-05T00:00:00Z DEBUG placement] {line}"))
            .unwrap_or_else(|| panic!("unreadable: {line}"));
        assert_eq!(read.group, ask.keys.group);
        assert_eq!(read.conversation, 7);
        assert_eq!((read.tokens, read.first), (2100.0, 2000.0));
        assert_eq!(read.home, Some(Home::Expected(1)));
        assert_eq!(read.previous, Some(3));
        let seen: Vec<(usize, u64, f64)> = read
            .targets
            .iter()
            .map(|t| (t.index, t.inflight, t.cached_tokens))
            .collect();
        assert_eq!(seen, vec![(1, 0, 0.0), (3, 9, 2100.0)]);
        assert_eq!(read.chosen, placed.index);
        assert_eq!(read.reason, placed.reason.as_str());
        assert_eq!(read.new_work, placed.new_work);
        let label = choices
            .iter()
            .find(|c| c.index == placed.index)
            .unwrap()
            .label;
        assert_eq!(read.label, label);
    }
}
