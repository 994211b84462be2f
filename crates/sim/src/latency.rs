//! The simulated engine's latency model: time to first token grows with the prompt tokens that
//! must be prefilled and with the prefill work queued ahead; then each output token costs a fixed
//! decode time.
//!
//! The model prices one request; queueing is the scheduler's: the in-process fleet
//! (`fleet.rs`) adds it in simulated time, `sim-worker` (`engine.rs`) in real time by running one
//! prefill at a time (FIFO) behind a `--max-num-seqs` limit, so a request's TTFT is its wait plus
//! [`LatencyModel::prefill`], and each further token takes [`LatencyModel::decode_step`].

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Knobs of the latency model, in microseconds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LatencyModel {
    /// Fixed cost of scheduling a request before its prefill.
    pub base_us: u64,
    /// Prefill cost per uncached prompt token.
    pub prefill_us_per_token: f64,
    /// Cost per generated token.
    pub decode_us_per_token: u64,
}

impl Default for LatencyModel {
    fn default() -> Self {
        LatencyModel {
            base_us: 2_000,
            prefill_us_per_token: 40.0,
            decode_us_per_token: 5_000,
        }
    }
}

impl LatencyModel {
    /// Prefill time of a request with `uncached` prompt tokens.
    pub fn prefill_us(&self, uncached: usize) -> u64 {
        self.base_us + (self.prefill_us_per_token * uncached as f64) as u64
    }

    /// [`LatencyModel::prefill_us`] as a duration, for real-time sleeps.
    pub fn prefill(&self, uncached: usize) -> Duration {
        Duration::from_micros(self.prefill_us(uncached))
    }

    /// The time of one generated token after the first.
    pub fn decode_step(&self) -> Duration {
        Duration::from_micros(self.decode_us_per_token)
    }

    /// Decode time of `output` tokens after the first.
    pub fn decode_us(&self, output: u32) -> u64 {
        self.decode_us_per_token * u64::from(output.saturating_sub(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cached_tokens_make_prefill_cheaper() {
        let m = LatencyModel::default();
        assert!(m.prefill_us(100) < m.prefill_us(1000));
        assert_eq!(m.prefill_us(0), m.base_us);
        assert_eq!(m.decode_us(1), 0);
        assert_eq!(m.prefill(10), Duration::from_micros(m.prefill_us(10)));
        assert_eq!(m.decode_step() * 3, Duration::from_micros(m.decode_us(4)));
    }
}
