//! `rolter-load traces DIR`: what a strategy did with conversations and shared prompts, read
//! from the per-request traces `--trace-dir` writes (`runner::write_trace`).
//!
//! Owns the arithmetic over trace rows and its text; reading the files is the binary's. Per
//! trace: how often a conversation's next turn went to another replica than its previous turn
//! (each move recomputes the whole history there), the cached share of first turns (where
//! only the shared system prompt can hit) and of later turns, and per system prompt how many
//! replicas served it and the busiest one's share (one replica: the group is kept together;
//! all replicas: every cache holds a copy of the prompt, under pressure each evicts it).
//! Where the misses are: the (system prompt, replica) pairs in all (each beyond a prompt's
//! first recomputed that prompt on one more replica), the first turns that found less of
//! their system prompt cached than the best first turn of the same prompt did, and the
//! uncached tokens of first and of later turns as shares of all prompt tokens.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use serde::Deserialize;

/// One line of a trace (the fields this summary reads).
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct TraceRow {
    pub session: usize,
    pub system: Option<String>,
    pub turn: usize,
    #[serde(default)]
    pub call: usize,
    pub replica: Option<usize>,
    pub prompt_tokens: usize,
    pub cached_tokens: Option<usize>,
}

/// How one system prompt's requests were spread.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptSpread {
    pub system: String,
    pub requests: usize,
    /// Distinct replicas that served it.
    pub replicas: usize,
    /// The busiest of them, as a fraction of the prompt's requests.
    pub top_share: f64,
}

/// One trace in numbers.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceSummary {
    pub requests: usize,
    /// Turns after a session's first (call 0 of each).
    pub continuations: usize,
    /// Of those, served by another replica than the previous turn's call 0.
    pub moves: usize,
    /// Cached prompt tokens / prompt tokens, first turns and later turns.
    pub first_turn_hit: f64,
    pub later_turn_hit: f64,
    /// Per system prompt, most requests first.
    pub prompts: Vec<PromptSpread>,
    /// First turns that found fewer tokens cached than the most any first turn of the same
    /// system prompt found (its shared part): they recomputed some of it.
    pub short_first_turns: usize,
    /// Uncached prompt tokens of first turns, and of later turns, over all prompt tokens.
    pub first_turn_miss: f64,
    pub later_turn_miss: f64,
}

impl TraceSummary {
    /// (system prompt, replica) pairs that served a request: the prompts' homes.
    pub fn homes(&self) -> usize {
        self.prompts.iter().map(|p| p.replicas).sum()
    }
}

fn ratio(num: usize, den: usize) -> f64 {
    if den == 0 {
        0.0
    } else {
        num as f64 / den as f64
    }
}

/// Summarize trace rows (any order).
pub fn summarize_trace(rows: &[TraceRow]) -> TraceSummary {
    // session -> turn -> replica of call 0
    let mut turns: HashMap<usize, BTreeMap<usize, Option<usize>>> = HashMap::new();
    let (mut first, mut later) = ((0, 0), (0, 0));
    let mut by_prompt: BTreeMap<&str, HashMap<Option<usize>, usize>> = BTreeMap::new();
    // system prompt -> most tokens any of its first turns found cached
    let mut shared: HashMap<&str, usize> = HashMap::new();
    for r in rows {
        if let (0, Some(s)) = (r.turn, &r.system) {
            let best = shared.entry(s.as_str()).or_default();
            *best = (*best).max(r.cached_tokens.unwrap_or(0));
        }
        if r.call == 0 {
            turns
                .entry(r.session)
                .or_default()
                .insert(r.turn, r.replica);
        }
        let slot = if r.turn == 0 { &mut first } else { &mut later };
        slot.0 += r.cached_tokens.unwrap_or(0);
        slot.1 += r.prompt_tokens;
        if let Some(s) = &r.system {
            *by_prompt
                .entry(s.as_str())
                .or_default()
                .entry(r.replica)
                .or_default() += 1;
        }
    }
    let (mut continuations, mut moves) = (0, 0);
    for by_turn in turns.values() {
        let mut prev: Option<(usize, Option<usize>)> = None;
        for (&t, &replica) in by_turn {
            if let Some((pt, pr)) = prev {
                if pt + 1 == t {
                    continuations += 1;
                    moves += usize::from(pr != replica);
                }
            }
            prev = Some((t, replica));
        }
    }
    let mut prompts: Vec<PromptSpread> = by_prompt
        .into_iter()
        .map(|(system, per_replica)| {
            let requests: usize = per_replica.values().sum();
            let top = per_replica.values().copied().max().unwrap_or(0);
            PromptSpread {
                system: system.to_string(),
                requests,
                replicas: per_replica.len(),
                top_share: ratio(top, requests),
            }
        })
        .collect();
    prompts.sort_by(|a, b| b.requests.cmp(&a.requests).then(a.system.cmp(&b.system)));
    let short_first_turns = rows
        .iter()
        .filter(|r| r.turn == 0)
        .filter(|r| {
            r.system
                .as_deref()
                .and_then(|s| shared.get(s))
                .copied()
                .unwrap_or(0)
                > r.cached_tokens.unwrap_or(0)
        })
        .count();
    let all = first.1 + later.1;
    TraceSummary {
        requests: rows.len(),
        continuations,
        moves,
        first_turn_hit: ratio(first.0, first.1),
        later_turn_hit: ratio(later.0, later.1),
        prompts,
        short_first_turns,
        first_turn_miss: ratio(first.1.saturating_sub(first.0), all),
        later_turn_miss: ratio(later.1.saturating_sub(later.0), all),
    }
}

/// A few lines about one trace; at most `max_prompts` prompts listed.
pub fn render_summary(name: &str, s: &TraceSummary, max_prompts: usize) -> String {
    let mut out = format!(
        "{name}: {} requests; {} of {} next turns moved replica ({:.0}%); cached share {:.1}% \
         on first turns, {:.1}% on later turns\n",
        s.requests,
        s.moves,
        s.continuations,
        ratio(s.moves, s.continuations) * 100.0,
        s.first_turn_hit * 100.0,
        s.later_turn_hit * 100.0,
    );
    let _ = writeln!(
        out,
        "  {} homes (system prompt, replica) for {} prompts; {} first turns found less of their \
         system prompt cached than its best first turn did",
        s.homes(),
        s.prompts.len(),
        s.short_first_turns,
    );
    let _ = writeln!(
        out,
        "  uncached (new messages included): {:.2}% of all prompt tokens on first turns, \
         {:.2}% on later turns",
        s.first_turn_miss * 100.0,
        s.later_turn_miss * 100.0,
    );
    for p in s.prompts.iter().take(max_prompts) {
        let _ = writeln!(
            out,
            "  system {}: {} requests on {} replica(s), busiest {:.0}%",
            p.system,
            p.requests,
            p.replicas,
            p.top_share * 100.0
        );
    }
    if s.prompts.len() > max_prompts {
        let _ = writeln!(out, "  ... {} more prompts", s.prompts.len() - max_prompts);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(session: usize, system: &str, turn: usize, call: usize, replica: usize) -> TraceRow {
        TraceRow {
            session,
            system: Some(system.into()),
            turn,
            call,
            replica: Some(replica),
            prompt_tokens: 100,
            cached_tokens: Some(if turn == 0 { 20 } else { 90 }),
        }
    }

    #[test]
    fn moves_spread_and_hit_shares() {
        let rows = vec![
            // Session 0 stays on replica 1; session 1 moves once (turn 2).
            row(0, "s1", 0, 0, 1),
            row(0, "s1", 1, 0, 1),
            row(1, "s1", 0, 0, 1),
            row(1, "s1", 1, 0, 1),
            row(1, "s1", 2, 0, 2),
            // An agent step's calls on two replicas: only call 0 is the continuation.
            row(2, "s2", 0, 0, 3),
            row(2, "s2", 0, 1, 0),
            row(2, "s2", 1, 0, 3),
        ];
        let s = summarize_trace(&rows);
        assert_eq!(s.requests, 8);
        assert_eq!((s.continuations, s.moves), (4, 1));
        assert!((s.first_turn_hit - 0.2).abs() < 1e-9);
        assert!((s.later_turn_hit - 0.9).abs() < 1e-9);
        assert_eq!(
            s.prompts[0],
            PromptSpread {
                system: "s1".into(),
                requests: 5,
                replicas: 2,
                top_share: 0.8
            }
        );
        assert_eq!((s.prompts[1].replicas, s.prompts[1].requests), (2, 3));
        // s1 on replicas 1 and 2, s2 on 3 and 0.
        assert_eq!(s.homes(), 4);
        // Every first turn found 20 tokens: none found less than its prompt's best.
        assert_eq!(s.short_first_turns, 0);
        // 8 rows of 100 tokens: first turns (4 rows) miss 80 each, later (4) miss 10.
        assert!((s.first_turn_miss - 0.4).abs() < 1e-9);
        assert!((s.later_turn_miss - 0.05).abs() < 1e-9);
        let text = render_summary("cache_aware", &s, 1);
        assert!(
            text.contains("1 of 4 next turns moved replica (25%)"),
            "{text}"
        );
        assert!(text.contains("system s1: 5 requests on 2 replica(s), busiest 80%"));
        assert!(
            text.contains("4 homes (system prompt, replica) for 2 prompts"),
            "{text}"
        );
        assert!(
            text.contains("40.00% of all prompt tokens on first turns, 5.00% on later turns"),
            "{text}"
        );
        assert!(text.contains("1 more prompts"));
    }

    /// A first turn that found less than its system prompt's shared part cached is counted;
    /// one that found as much, or a later turn, is not.
    #[test]
    fn first_turns_short_of_their_system_prompt() {
        let first = |session, system: &str, replica, cached| TraceRow {
            cached_tokens: Some(cached),
            ..row(session, system, 0, 0, replica)
        };
        let rows = vec![
            first(0, "a", 0, 0),  // short: the prompt's first, nothing cached anywhere yet
            first(1, "a", 0, 64), // found its shared part
            first(2, "a", 1, 0),  // short: opened it on another replica
            first(3, "a", 1, 64),
            first(4, "b", 2, 32), // b's first turns all found its best (32)
            first(5, "b", 2, 32),
            row(0, "a", 1, 0, 0), // a later turn never counts
        ];
        let s = summarize_trace(&rows);
        assert_eq!(s.short_first_turns, 2);
        assert_eq!(s.homes(), 3);
    }

    #[test]
    fn reads_the_lines_write_trace_writes() {
        let line = r#"{"session":3,"system":"0a0b0c0d","turn":1,"call":0,"replica":2,
            "prompt_tokens":2100,"cached_tokens":2048,"sent_ms":1.5,"e2e_ms":60.0,"ok":true}"#;
        let r: TraceRow = serde_json::from_str(line).unwrap();
        assert_eq!((r.session, r.turn, r.replica), (3, 1, Some(2)));
        // Traces written before calls existed have no "call".
        let old = r#"{"session":0,"system":null,"turn":0,"replica":null,"prompt_tokens":5,
            "cached_tokens":null}"#;
        assert_eq!(serde_json::from_str::<TraceRow>(old).unwrap().call, 0);
    }
}
