//! Seeded workloads: what the load driver sends, independent of where it sends it.
//!
//! Owns the shape of each workload and its reproducible text; nothing here does I/O.
//! - `multi-turn`: S sessions; session i uses one of P long shared system prompts (~2,000
//!   tokens each) and asks T questions, each turn carrying the whole history (previous
//!   questions and the assistant's replies), so the shared prefix grows turn after turn.
//! - `few-shot`: R one-turn requests; each is one of P long templates (worked examples, ~1,500
//!   tokens) as the system message plus a short unique question.
//! - `unique`: R one-turn requests of unrelated text (nothing to share but the chat template).
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
}

impl WorkloadKind {
    pub fn name(self) -> &'static str {
        match self {
            WorkloadKind::MultiTurn => "multi-turn",
            WorkloadKind::FewShot => "few-shot",
            WorkloadKind::Unique => "unique",
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
    /// multi-turn: number of sessions.
    #[arg(long, default_value_t = 48)]
    pub sessions: usize,
    /// multi-turn: turns per session.
    #[arg(long, default_value_t = 5)]
    pub turns: usize,
    /// few-shot / unique: number of requests.
    #[arg(long, default_value_t = 200)]
    pub requests: usize,
    /// Shared prefixes: system prompts (multi-turn) or templates (few-shot).
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
        }
    }
}

/// A conversation: a fixed system message and user turns sent one after another, each with the
/// full history so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    /// Sent as `x-session-id`.
    pub id: String,
    pub system: Option<String>,
    pub user_turns: Vec<String>,
    pub max_tokens: usize,
}

impl Session {
    /// Messages of turn `t` given the assistant replies of the earlier turns.
    pub fn messages(&self, t: usize, replies: &[String]) -> Vec<ChatMessage> {
        let mut m = Vec::with_capacity(2 * t + 2);
        if let Some(s) = &self.system {
            m.push(ChatMessage::new("system", s.clone()));
        }
        for (i, u) in self.user_turns[..=t].iter().enumerate() {
            m.push(ChatMessage::new("user", u.clone()));
            if i < t {
                m.push(ChatMessage::new("assistant", replies[i].clone()));
            }
        }
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
    match spec.workload {
        WorkloadKind::MultiTurn => (0..spec.sessions)
            .map(|i| Session {
                id: format!("s{i}"),
                system: Some(prefixes[rng.gen_range(0..prefixes.len())].clone()),
                user_turns: (0..spec.turns.max(1))
                    .map(|t| format!("q{i}.{t} {}", text(&mut rng, spec.user_tokens)))
                    .collect(),
                max_tokens: spec.max_tokens,
            })
            .collect(),
        WorkloadKind::FewShot => (0..spec.requests)
            .map(|i| Session {
                id: format!("r{i}"),
                system: Some(prefixes[rng.gen_range(0..prefixes.len())].clone()),
                user_turns: vec![format!("q{i} {}", text(&mut rng, spec.user_tokens))],
                max_tokens: spec.max_tokens,
            })
            .collect(),
        WorkloadKind::Unique => (0..spec.requests)
            .map(|i| Session {
                id: format!("u{i}"),
                system: None,
                user_turns: vec![format!("u{i} {}", text(&mut rng, spec.user_tokens))],
                max_tokens: spec.max_tokens,
            })
            .collect(),
    }
}

/// Total requests the sessions make.
pub fn request_count(sessions: &[Session]) -> usize {
    sessions.iter().map(|s| s.user_turns.len()).sum()
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
}
