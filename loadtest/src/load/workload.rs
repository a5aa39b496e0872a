//! Seeded workloads: what the load driver sends, independent of where it sends it.
//!
//! Owns the shape of each workload and its reproducible text; nothing here does I/O.
//! - `multi-turn`: S sessions; session i uses one of P long shared system prompts (~2,000
//!   tokens each) and asks T questions, each turn carrying the whole history (previous
//!   questions and the assistant's replies), so the shared prefix grows turn after turn.
//! - `few-shot`: R one-turn requests; each is one of P long templates (worked examples, ~1,500
//!   tokens) as the system message plus a short unique question.
//! - `unique`: R one-turn requests of unrelated text (nothing to share but the chat template).
//! - `agentic`: S agents, each with a long tool prompt (P tool prompts of ~4,000 tokens, agent i
//!   uses prompt i mod P) and T steps; each step fans out into F parallel calls (F drawn in
//!   `--fanout-min..=--fanout-max`), all sharing the tool prompt and the agent's history and
//!   ending in a short call-specific instruction; the next step starts when every call of the
//!   step answered and continues call 0's branch. Bursty by construction.
//! - `skewed`: S multi-turn sessions; a session's system prompt is the hot one (prompt 0) with
//!   probability `--hot-share` (0.6), else one of the other P − 1 (a long tail).
//!
//! Text is made of pseudo-words (one token each with the simulator's tokenizer), drawn from a
//! seeded RNG, so the same seed always yields byte-identical requests.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::tokenizer::ChatMessage;

/// Which workload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WorkloadKind {
    MultiTurn,
    FewShot,
    Unique,
    Agentic,
    Skewed,
}

impl WorkloadKind {
    pub fn name(self) -> &'static str {
        match self {
            WorkloadKind::MultiTurn => "multi-turn",
            WorkloadKind::FewShot => "few-shot",
            WorkloadKind::Unique => "unique",
            WorkloadKind::Agentic => "agentic",
            WorkloadKind::Skewed => "skewed",
        }
    }
}

/// Parameters of a workload.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkloadSpec {
    /// Workload shape.
    #[arg(long, value_enum, default_value_t = WorkloadKind::MultiTurn)]
    pub workload: WorkloadKind,
    /// RNG seed: same seed, same requests.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// multi-turn, skewed: number of sessions; agentic: number of agents.
    #[arg(long, default_value_t = 48)]
    pub sessions: usize,
    /// multi-turn, skewed: turns per session; agentic: steps per agent.
    #[arg(long, default_value_t = 5)]
    pub turns: usize,
    /// few-shot / unique: number of requests.
    #[arg(long, default_value_t = 200)]
    pub requests: usize,
    /// Shared prefixes: system prompts (multi-turn, skewed: the hot one and the tail), templates
    /// (few-shot) or tool prompts (agentic).
    #[arg(long, default_value_t = 4)]
    pub prefixes: usize,
    /// Tokens per shared prefix (multi-turn system prompt, few-shot template).
    #[arg(long, default_value_t = 2000)]
    pub prefix_tokens: usize,
    /// Tokens per user message (multi-turn question, few-shot question, unique prompt).
    #[arg(long, default_value_t = 60)]
    pub user_tokens: usize,
    /// Output tokens per request (`max_tokens`).
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// agentic: fewest parallel calls per step.
    #[arg(long, default_value_t = 4)]
    pub fanout_min: usize,
    /// agentic: most parallel calls per step.
    #[arg(long, default_value_t = 16)]
    pub fanout_max: usize,
    /// agentic: tokens of each call's own instruction (after the shared step message).
    #[arg(long, default_value_t = 24)]
    pub call_tokens: usize,
    /// skewed: probability that a session uses the hot system prompt.
    #[arg(long, default_value_t = 0.6)]
    pub hot_share: f64,
}

impl Default for WorkloadSpec {
    fn default() -> Self {
        Self {
            workload: WorkloadKind::MultiTurn,
            seed: 42,
            sessions: 48,
            turns: 5,
            requests: 200,
            prefixes: 4,
            prefix_tokens: 2000,
            user_tokens: 60,
            max_tokens: 32,
            fanout_min: 4,
            fanout_max: 16,
            call_tokens: 24,
            hot_share: 0.6,
        }
    }
}

/// A conversation: a fixed system message and user turns sent one after another, each with the
/// full history so far. A turn may fan out into parallel calls (agentic workloads).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Session {
    /// Sent as `x-session-id`.
    pub id: String,
    pub system: Option<String>,
    pub user_turns: Vec<String>,
    /// Parallel calls of each turn: turn t sends one request per entry of `calls[t]`, whose last
    /// user message is the turn's text followed by that entry; no entry (or a missing `calls[t]`)
    /// means one request with the turn's text alone. Later turns carry call 0 in their history.
    pub calls: Vec<Vec<String>>,
    pub max_tokens: usize,
}

impl Session {
    /// Requests turn `t` sends at once.
    pub fn calls_at(&self, t: usize) -> usize {
        self.calls.get(t).map_or(1, |c| c.len().max(1))
    }

    /// Requests the whole session sends.
    pub fn requests(&self) -> usize {
        (0..self.user_turns.len()).map(|t| self.calls_at(t)).sum()
    }

    /// The user message of turn `t`, call `call`.
    fn user_message(&self, t: usize, call: usize) -> String {
        match self.calls.get(t).and_then(|c| c.get(call)) {
            Some(extra) => format!("{} {extra}", self.user_turns[t]),
            None => self.user_turns[t].clone(),
        }
    }

    /// Messages of turn `t` (call 0) given the assistant replies of the earlier turns.
    pub fn messages(&self, t: usize, replies: &[String]) -> Vec<ChatMessage> {
        self.call_messages(t, 0, replies)
    }

    /// Messages of call `call` of turn `t` given the assistant replies of the earlier turns.
    pub fn call_messages(&self, t: usize, call: usize, replies: &[String]) -> Vec<ChatMessage> {
        let mut m = Vec::with_capacity(2 * t + 2);
        if let Some(s) = &self.system {
            m.push(ChatMessage::new("system", s.clone()));
        }
        for (i, reply) in replies[..t].iter().enumerate() {
            m.push(ChatMessage::new("user", self.user_message(i, 0)));
            m.push(ChatMessage::new("assistant", reply.clone()));
        }
        m.push(ChatMessage::new("user", self.user_message(t, call)));
        m
    }
}

/// Syllables of the pseudo-words; words are 2–3 syllables, at most 6 bytes (one token).
const SYLLABLES: [&str; 24] = [
    "ka", "lo", "mi", "ne", "su", "ta", "ro", "vi", "po", "da", "fe", "gu", "ha", "ji", "ze", "bo",
    "ri", "xa", "wu", "ce", "ny", "qo", "le", "sa",
];

fn word(rng: &mut StdRng) -> String {
    let n = rng.gen_range(2..=3);
    (0..n)
        .map(|_| SYLLABLES[rng.gen_range(0..SYLLABLES.len())])
        .collect()
}

/// `n` pseudo-words separated by spaces (`n` tokens).
pub fn text(rng: &mut StdRng, n: usize) -> String {
    let mut s = String::with_capacity(n * 6);
    for i in 0..n {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(&word(rng));
    }
    s
}

/// The sessions of a workload (one-turn sessions for few-shot and unique).
pub fn generate(spec: &WorkloadSpec) -> Vec<Session> {
    let mut rng = StdRng::seed_from_u64(spec.seed);
    let prefixes: Vec<String> = (0..spec.prefixes.max(1))
        .map(|p| format!("[prefix {p}] {}", text(&mut rng, spec.prefix_tokens)))
        .collect();
    let turns = spec.turns.max(1);
    let chat = |i: usize, system: String, rng: &mut StdRng| Session {
        id: format!("s{i}"),
        system: Some(system),
        user_turns: (0..turns)
            .map(|t| format!("q{i}.{t} {}", text(rng, spec.user_tokens)))
            .collect(),
        calls: Vec::new(),
        max_tokens: spec.max_tokens,
    };
    match spec.workload {
        WorkloadKind::MultiTurn => (0..spec.sessions)
            .map(|i| {
                let system = prefixes[rng.gen_range(0..prefixes.len())].clone();
                chat(i, system, &mut rng)
            })
            .collect(),
        WorkloadKind::Skewed => (0..spec.sessions)
            .map(|i| {
                let hot = prefixes.len() == 1 || rng.gen_bool(spec.hot_share.clamp(0.0, 1.0));
                let p = if hot {
                    0
                } else {
                    rng.gen_range(1..prefixes.len())
                };
                chat(i, prefixes[p].clone(), &mut rng)
            })
            .collect(),
        WorkloadKind::Agentic => {
            let lo = spec.fanout_min.max(1);
            let hi = spec.fanout_max.max(lo);
            (0..spec.sessions)
                .map(|i| Session {
                    id: format!("a{i}"),
                    system: Some(prefixes[i % prefixes.len()].clone()),
                    user_turns: (0..turns)
                        .map(|t| format!("step{i}.{t} {}", text(&mut rng, spec.user_tokens)))
                        .collect(),
                    calls: (0..turns)
                        .map(|t| {
                            let f = rng.gen_range(lo..=hi);
                            (0..f)
                                .map(|j| {
                                    format!("call{i}.{t}.{j} {}", text(&mut rng, spec.call_tokens))
                                })
                                .collect()
                        })
                        .collect(),
                    max_tokens: spec.max_tokens,
                })
                .collect()
        }
        WorkloadKind::FewShot => (0..spec.requests)
            .map(|i| Session {
                id: format!("r{i}"),
                system: Some(prefixes[rng.gen_range(0..prefixes.len())].clone()),
                user_turns: vec![format!("q{i} {}", text(&mut rng, spec.user_tokens))],
                calls: Vec::new(),
                max_tokens: spec.max_tokens,
            })
            .collect(),
        WorkloadKind::Unique => (0..spec.requests)
            .map(|i| Session {
                id: format!("u{i}"),
                system: None,
                user_turns: vec![format!("u{i} {}", text(&mut rng, spec.user_tokens))],
                calls: Vec::new(),
                max_tokens: spec.max_tokens,
            })
            .collect(),
    }
}

/// Total requests the sessions make.
pub fn request_count(sessions: &[Session]) -> usize {
    sessions.iter().map(Session::requests).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::{chat_tokens, tokenize};

    #[test]
    fn seeded_and_sized() {
        let spec = WorkloadSpec {
            sessions: 5,
            turns: 3,
            prefix_tokens: 100,
            user_tokens: 10,
            ..WorkloadSpec::default()
        };
        let a = generate(&spec);
        assert_eq!(a, generate(&spec));
        assert_ne!(
            a,
            generate(&WorkloadSpec {
                seed: 7,
                ..spec.clone()
            })
        );
        assert_eq!(a.len(), 5);
        assert_eq!(request_count(&a), 15);
        let sys = a[0].system.as_ref().unwrap();
        assert_eq!(tokenize(sys).len(), 102); // "[prefix" "0]" + 100 words
        assert_eq!(tokenize(&a[0].user_turns[1]).len(), 11);
    }

    #[test]
    fn history_grows_by_appending() {
        let spec = WorkloadSpec {
            sessions: 1,
            turns: 2,
            prefix_tokens: 50,
            user_tokens: 5,
            ..WorkloadSpec::default()
        };
        let s = &generate(&spec)[0];
        let t0 = chat_tokens(&s.messages(0, &[]));
        let t1 = chat_tokens(&s.messages(1, &["some reply".into()]));
        assert_eq!(&t1[..t0.len()], &t0[..]);
        assert_eq!(s.messages(1, &["r".into()]).len(), 4);
    }

    #[test]
    fn few_shot_and_unique_are_one_turn() {
        for w in [WorkloadKind::FewShot, WorkloadKind::Unique] {
            let s = generate(&WorkloadSpec {
                workload: w,
                requests: 7,
                prefix_tokens: 20,
                ..WorkloadSpec::default()
            });
            assert_eq!(request_count(&s), 7);
            assert_eq!(s[0].system.is_none(), w == WorkloadKind::Unique);
        }
    }

    #[test]
    fn skewed_sends_the_hot_share_to_one_prompt() {
        let spec = WorkloadSpec {
            workload: WorkloadKind::Skewed,
            sessions: 2000,
            turns: 1,
            prefixes: 40,
            prefix_tokens: 8,
            user_tokens: 2,
            ..WorkloadSpec::default()
        };
        let s = generate(&spec);
        let is_hot = |x: &Session| x.system.as_deref().unwrap().starts_with("[prefix 0]");
        let share = s.iter().filter(|x| is_hot(x)).count() as f64 / s.len() as f64;
        assert!((share - 0.6).abs() < 0.04, "hot share {share}");
        // The rest is a long tail: most of the other 39 prompts are used, none nearly as much.
        let mut counts = std::collections::HashMap::new();
        for x in &s {
            *counts.entry(x.system.clone().unwrap()).or_insert(0usize) += 1;
        }
        assert!(counts.len() >= 35, "{} prompts used", counts.len());
        let second = counts.values().filter(|&&c| c < 1000).max().unwrap();
        assert!(*second < 100, "largest tail prompt: {second} sessions");
        let none = generate(&WorkloadSpec {
            hot_share: 0.0,
            ..spec
        });
        assert!(!none.iter().any(is_hot));
    }

    #[test]
    fn agentic_steps_fan_out_over_a_shared_tool_prompt() {
        let spec = WorkloadSpec {
            workload: WorkloadKind::Agentic,
            sessions: 3,
            turns: 4,
            prefixes: 3,
            prefix_tokens: 300,
            user_tokens: 10,
            fanout_min: 4,
            fanout_max: 16,
            call_tokens: 5,
            ..WorkloadSpec::default()
        };
        let agents = generate(&spec);
        assert_eq!(agents, generate(&spec));
        let fanouts: Vec<usize> = agents
            .iter()
            .flat_map(|a| (0..a.user_turns.len()).map(|t| a.calls_at(t)))
            .collect();
        assert_eq!(fanouts.len(), 12);
        assert!(fanouts.iter().all(|f| (4..=16).contains(f)), "{fanouts:?}");
        assert!(fanouts.iter().any(|&f| f != fanouts[0]), "{fanouts:?}");
        assert_eq!(request_count(&agents), fanouts.iter().sum::<usize>());
        // Agents have their own tool prompts.
        assert_ne!(agents[0].system, agents[1].system);
        let a = &agents[0];
        let replies = vec!["r0".to_string(), "r1".to_string()];
        // The calls of a step share everything but their last message's tail...
        let c0 = chat_tokens(&a.call_messages(2, 0, &replies));
        let c1 = chat_tokens(&a.call_messages(2, 1, &replies));
        let shared = c0.iter().zip(&c1).take_while(|(x, y)| x == y).count();
        assert!(
            shared > 300 && c0.len() - shared < 12,
            "{shared} of {}",
            c0.len()
        );
        // ...and the next step continues call 0's branch.
        let step2 = chat_tokens(&a.call_messages(2, 0, &replies));
        let history = [replies.clone(), vec!["r2".into()]].concat();
        let next = chat_tokens(&a.call_messages(3, 5, &history));
        assert_eq!(&next[..step2.len()], &step2[..]);
    }
}
