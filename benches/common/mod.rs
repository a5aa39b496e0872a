//! Workload shared by the benches: text-like random bytes and growing multi-turn chats
//! sharing a system prompt, plus a runner that splits ops over threads and accounts each
//! thread's time from Linux schedstat. Each bench includes it with `mod common;`, so an
//! item one of them does not use would warn there as dead code.
#![allow(dead_code)]

use std::time::{Duration, Instant};

pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// Text-like bytes: letters and spaces.
    pub fn text(&mut self, n: usize) -> Vec<u8> {
        (0..n)
            .map(|_| b"etaoinshrdlucmfwypvbgkqjxz      "[(self.next() % 32) as usize])
            .collect()
    }
}

/// System prompt shared by every chat (2 KiB).
pub const SYSTEM_BYTES: usize = 2048;
/// Bytes a turn adds (previous answer + next question).
pub const TURN_BYTES: usize = 600;
/// Turns per conversation before it restarts under a new id.
pub const TURNS: usize = 8;
/// Conversations each worker interleaves.
pub const CONVERSATIONS: usize = 32;

/// One worker's stream of chat prompts: op i serves turn `t` of conversation `i % C`; when a
/// conversation reaches its last turn it restarts under a fresh id (a new chat).
pub struct Chats {
    bufs: Vec<Vec<u8>>,
    /// Which worker this stream belongs to (its chats differ from every other worker's).
    pub worker: u64,
    next_id: u64,
    i: usize,
}

impl Chats {
    pub fn new(system: &[u8], worker: u64) -> Self {
        let mut rng = Rng(0x5eed + worker * 1_000_003);
        let bufs = (0..CONVERSATIONS)
            .map(|_| {
                let mut b = system.to_vec();
                b.extend([0u8; 16]);
                b.extend(rng.text(TURNS * TURN_BYTES));
                b
            })
            .collect();
        Chats {
            bufs,
            worker,
            next_id: 0,
            i: 0,
        }
    }

    pub fn next(&mut self) -> &[u8] {
        let c = self.i % CONVERSATIONS;
        let turn = (self.i / CONVERSATIONS) % TURNS + 1;
        self.i += 1;
        let b = &mut self.bufs[c];
        if turn == 1 {
            // A new chat: its first user message differs from every earlier one in the first
            // few letters (text fans out ~26 ways per byte, not 256).
            self.next_id += 1;
            let mut id = self.next_id;
            for x in &mut b[SYSTEM_BYTES..SYSTEM_BYTES + 15] {
                *x = b'a' + (id % 26) as u8;
                id /= 26;
            }
            b[SYSTEM_BYTES + 15] = b'0' + (self.worker % 10) as u8;
        }
        &b[..SYSTEM_BYTES + 16 + turn * TURN_BYTES]
    }
}

/// This thread's (on-CPU, waiting-for-a-CPU) nanoseconds, from Linux schedstat.
pub fn sched_ns() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let mut f = s.split_whitespace().map(|x| x.parse::<u64>().ok());
    Some((f.next()??, f.next()??))
}

/// Per-op time split, summed over workers: on CPU, runnable but preempted (other processes
/// on this shared machine), and blocked (sleeping on the trie's writer lock).
#[derive(Default, Clone, Copy)]
pub struct Split {
    pub cpu: u64,
    pub preempted: u64,
    pub blocked: u64,
}

/// Run `ops` ops split evenly across one thread per chat stream, each op `op(worker, chats)`;
/// wall time and the workers' summed time split (zeros where schedstat is unavailable).
pub fn run_accounted<F>(chats: &mut [Chats], ops: u64, op: F) -> (Duration, Split)
where
    F: Fn(usize, &mut Chats) + Sync,
{
    let per = ops / chats.len() as u64;
    let total = std::sync::Mutex::new(Split::default());
    let start = Instant::now();
    std::thread::scope(|s| {
        for (w, ch) in chats.iter_mut().enumerate() {
            let (op, total) = (&op, &total);
            s.spawn(move || {
                let t0 = Instant::now();
                let s0 = sched_ns();
                for _ in 0..per {
                    op(w, ch);
                }
                let (s1, wall) = (sched_ns(), t0.elapsed().as_nanos() as u64);
                if let (Some((c0, q0)), Some((c1, q1))) = (s0, s1) {
                    let mut tot = total.lock().unwrap();
                    tot.cpu += c1 - c0;
                    tot.preempted += q1 - q0;
                    tot.blocked += wall.saturating_sub((c1 - c0) + (q1 - q0));
                }
            });
        }
    });
    (start.elapsed(), total.into_inner().unwrap())
}
