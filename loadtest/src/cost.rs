//! The simulator's cost model: how long a request occupies a replica.
//!
//! Owns the arithmetic only (no sleeping, no scheduling). A request waits for one of
//! `max_running` slots (the engine does that), then pays:
//! - prefill: `base + uncached_prompt_tokens × prefill_per_token`; its end is the first token
//!   (vLLM samples the first output token in the prefill step), so TTFT = queueing + prefill;
//! - decode: `(output_tokens − 1) × decode_per_token` for the remaining tokens.
//!
//! Running requests do not slow each other down (a real GPU batches them with some slowdown;
//! the slot limit is what creates queueing here). Defaults are tiny so a test request finishes
//! in about a millisecond; `rolter-sim` and `rolter-load compare` take flags for realistic runs.

use std::time::Duration;

/// Default prefill cost per uncached prompt token (test speed: 2,000 tokens ≈ 2 ms).
pub const DEFAULT_PREFILL_PER_TOKEN: Duration = Duration::from_micros(1);
/// Default decode cost per output token after the first.
pub const DEFAULT_DECODE_PER_TOKEN: Duration = Duration::from_micros(50);
/// Default fixed cost of a prefill step.
pub const DEFAULT_BASE_LATENCY: Duration = Duration::ZERO;

/// Per-request cost parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CostModel {
    pub prefill_per_token: Duration,
    pub decode_per_token: Duration,
    pub base_latency: Duration,
}

impl Default for CostModel {
    fn default() -> Self {
        Self {
            prefill_per_token: DEFAULT_PREFILL_PER_TOKEN,
            decode_per_token: DEFAULT_DECODE_PER_TOKEN,
            base_latency: DEFAULT_BASE_LATENCY,
        }
    }
}

impl CostModel {
    /// Time from admission to the first output token.
    pub fn prefill(&self, prompt_tokens: usize, cached_tokens: usize) -> Duration {
        let uncached = prompt_tokens.saturating_sub(cached_tokens);
        self.base_latency + mul(self.prefill_per_token, uncached)
    }

    /// Offset of output token `i` (0-based) from the first output token.
    pub fn decode_offset(&self, i: usize) -> Duration {
        mul(self.decode_per_token, i)
    }

    /// Time from admission to the last of `output_tokens` tokens.
    pub fn total(
        &self,
        prompt_tokens: usize,
        cached_tokens: usize,
        output_tokens: usize,
    ) -> Duration {
        self.prefill(prompt_tokens, cached_tokens)
            + self.decode_offset(output_tokens.saturating_sub(1))
    }
}

fn mul(d: Duration, n: usize) -> Duration {
    d.saturating_mul(u32::try_from(n).unwrap_or(u32::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_charges_uncached_tokens_only() {
        let m = CostModel {
            prefill_per_token: Duration::from_micros(10),
            decode_per_token: Duration::from_millis(1),
            base_latency: Duration::from_millis(2),
        };
        assert_eq!(m.prefill(1000, 0), Duration::from_millis(12));
        assert_eq!(m.prefill(1000, 992), Duration::from_micros(2080));
        assert_eq!(m.prefill(10, 20), Duration::from_millis(2));
        assert_eq!(m.decode_offset(0), Duration::ZERO);
        assert_eq!(m.total(1000, 0, 5), Duration::from_millis(16));
        assert_eq!(m.total(1000, 0, 0), Duration::from_millis(12));
    }

    #[test]
    fn defaults_are_test_fast() {
        let m = CostModel::default();
        assert!(m.total(2000, 0, 16) < Duration::from_millis(5));
    }
}
