//! Choosing the next token from a row of logits: greedy, or temperature sampling restricted by
//! top-k and top-p, from a seeded generator so that the same seed gives the same text on every
//! run and every machine.

use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

/// How to pick tokens. `temperature == 0` means greedy (top-k and top-p are then irrelevant).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Keep only the k most likely tokens (`None` or 0: no limit).
    pub top_k: Option<usize>,
    /// Keep the smallest set of most likely tokens whose probability reaches p (`None`: 1.0).
    pub top_p: Option<f32>,
    pub seed: u64,
}

impl SamplingParams {
    /// Argmax decoding.
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            seed: 0,
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Reject settings that have no meaning, naming the flag's value.
    pub fn validate(&self) -> Result<(), SamplingError> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(SamplingError::BadParam(format!(
                "temperature must be a finite number >= 0, got {}",
                self.temperature
            )));
        }
        if let Some(p) = self.top_p {
            // p = 0 would keep nothing; the loop always keeps the top token anyway, but a user
            // asking for 0 almost certainly meant something else.
            if !(p > 0.0 && p <= 1.0) {
                return Err(SamplingError::BadParam(format!(
                    "top_p must be in (0, 1], got {p}"
                )));
            }
        }
        Ok(())
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self::greedy()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SamplingError {
    #[error("invalid sampling setting: {0}")]
    BadParam(String),
    #[error("empty logits row")]
    Empty,
    /// The model produced NaN or ±inf (in an fp16 package this is an overflow upstream).
    #[error("logit {index} is {value}: the model produced a non-finite value")]
    NonFinite { index: usize, value: f32 },
}

/// Draws tokens; owns its random generator so successive draws continue one stream.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    // Xoshiro256++ is one of rand's named portable generators: the stream for a seed is fixed
    // across platforms and rand releases, unlike StdRng.
    rng: Xoshiro256PlusPlus,
    candidates: Vec<(u32, f32)>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self, SamplingError> {
        params.validate()?;
        let rng = Xoshiro256PlusPlus::seed_from_u64(params.seed);
        Ok(Sampler {
            params,
            rng,
            candidates: Vec::new(),
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The next token id for one row of logits (length V).
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32, SamplingError> {
        if logits.is_empty() {
            return Err(SamplingError::Empty);
        }
        if let Some((index, &value)) = logits.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(SamplingError::NonFinite { index, value });
        }
        if self.params.is_greedy() {
            return Ok(argmax(logits));
        }
        let t = self.params.temperature;
        self.candidates.clear();
        self.candidates
            .extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l / t)));
        // Descending logit, ties by ascending id: a total order, so the kept set and the
        // cumulative sums (hence the draw) never depend on the sort algorithm.
        let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let k = match self.params.top_k {
            Some(k) if k > 0 && k < self.candidates.len() => k,
            _ => self.candidates.len(),
        };
        if k < self.candidates.len() {
            self.candidates.select_nth_unstable_by(k - 1, order);
            self.candidates.truncate(k);
        }
        let top_p = self.params.top_p.unwrap_or(1.0);
        if top_p < 1.0 {
            self.candidates.sort_unstable_by(order);
        }
        let max = self
            .candidates
            .iter()
            .map(|c| c.1)
            .fold(f32::NEG_INFINITY, f32::max);
        // Softmax in f64: with V ~ 50k terms, f32 sums lose the tail that top-p looks at.
        let weights: Vec<f64> = self
            .candidates
            .iter()
            .map(|c| f64::from(c.1 - max).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        let mut keep = weights.len();
        if top_p < 1.0 {
            let target = f64::from(top_p) * total;
            let mut acc = 0.0;
            for (i, w) in weights.iter().enumerate() {
                acc += w;
                if acc >= target {
                    keep = i + 1;
                    break;
                }
            }
        }
        let kept_total: f64 = weights[..keep].iter().sum();
        let u: f64 = self.rng.random::<f64>() * kept_total;
        let mut acc = 0.0;
        for (c, w) in self.candidates[..keep].iter().zip(&weights) {
            acc += w;
            if u < acc {
                return Ok(c.0);
            }
        }
        // Rounding can leave u a hair above the last partial sum.
        Ok(self.candidates[keep - 1].0)
    }
}

/// Index of the largest logit; the lowest index wins ties (as torch.argmax does).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn params(temperature: f32, top_k: Option<usize>, top_p: Option<f32>, seed: u64) -> Sampler {
        Sampler::new(SamplingParams {
            temperature,
            top_k,
            top_p,
            seed,
        })
        .unwrap()
    }

    #[test]
    fn greedy_picks_the_first_maximum() {
        let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
        assert_eq!(s.sample(&[0.1, 3.0, -2.0, 3.0]).unwrap(), 1);
    }

    #[test]
    fn non_finite_logits_are_an_error_naming_the_index() {
        let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
        match s.sample(&[0.0, f32::NAN]) {
            Err(SamplingError::NonFinite { index: 1, .. }) => {}
            other => panic!("expected NonFinite at 1, got {other:?}"),
        }
        assert!(matches!(
            s.sample(&[f32::INFINITY]),
            Err(SamplingError::NonFinite { index: 0, .. })
        ));
        assert!(matches!(s.sample(&[]), Err(SamplingError::Empty)));
    }

    #[test]
    fn bad_params_are_rejected() {
        for p in [
            SamplingParams {
                temperature: -1.0,
                ..SamplingParams::greedy()
            },
            SamplingParams {
                temperature: f32::NAN,
                ..SamplingParams::greedy()
            },
            SamplingParams {
                temperature: 1.0,
                top_p: Some(0.0),
                ..SamplingParams::greedy()
            },
            SamplingParams {
                temperature: 1.0,
                top_p: Some(1.5),
                ..SamplingParams::greedy()
            },
        ] {
            assert!(Sampler::new(p).is_err());
        }
    }

    #[test]
    fn top_k_one_is_greedy() {
        let logits = [0.5, 2.0, 1.9, -1.0];
        let mut s = params(5.0, Some(1), None, 9);
        for _ in 0..50 {
            assert_eq!(s.sample(&logits).unwrap(), 1);
        }
    }

    #[test]
    fn top_p_keeps_the_smallest_set_reaching_p() {
        // Probabilities ~ [0.665, 0.245, 0.09]: p = 0.6 keeps only the first token.
        let logits = [2.0, 1.0, 0.0];
        let mut s = params(1.0, None, Some(0.6), 3);
        for _ in 0..100 {
            assert_eq!(s.sample(&logits).unwrap(), 0);
        }
        // p = 0.9 keeps two, never the third.
        let mut s = params(1.0, None, Some(0.9), 3);
        let mut seen = [0usize; 3];
        for _ in 0..2000 {
            seen[s.sample(&logits).unwrap() as usize] += 1;
        }
        assert_eq!(seen[2], 0);
        assert!(seen[1] > 0);
    }

    /// Frequency tolerance: with 20,000 draws the standard error of a frequency is at most
    /// 0.0036, so 0.02 is more than five standard errors.
    const FREQ_TOL: f64 = 0.02;

    #[test]
    fn temperature_sampling_follows_the_softmax() {
        let logits = [1.0f32, 0.0, -1.0, 0.5];
        let t = 0.7f32;
        let z: f64 = logits.iter().map(|&l| f64::from(l / t).exp()).sum();
        let expect: Vec<f64> = logits.iter().map(|&l| f64::from(l / t).exp() / z).collect();
        let mut s = params(t, None, None, 11);
        let n = 20_000;
        let mut seen = [0usize; 4];
        for _ in 0..n {
            seen[s.sample(&logits).unwrap() as usize] += 1;
        }
        for i in 0..4 {
            let f = seen[i] as f64 / n as f64;
            assert!(
                (f - expect[i]).abs() < FREQ_TOL,
                "token {i}: {f} vs {}",
                expect[i]
            );
        }
    }

    #[test]
    fn the_draw_sequence_for_a_seed_is_fixed() {
        // Pinned values: a change here means `--seed N` no longer reproduces earlier runs.
        let logits: Vec<f32> = (0..16).map(|i| ((i * 7) % 5) as f32 * 0.3).collect();
        let mut s = params(1.0, Some(8), Some(0.95), 42);
        let draws: Vec<u32> = (0..12).map(|_| s.sample(&logits).unwrap()).collect();
        assert_eq!(draws, vec![14, 12, 6, 9, 14, 4, 2, 9, 7, 6, 4, 1]);
        let mut again = params(1.0, Some(8), Some(0.95), 42);
        let redraw: Vec<u32> = (0..12).map(|_| again.sample(&logits).unwrap()).collect();
        assert_eq!(draws, redraw);
        let mut other = params(1.0, Some(8), Some(0.95), 43);
        let other: Vec<u32> = (0..12).map(|_| other.sample(&logits).unwrap()).collect();
        assert_ne!(draws, other);
    }

    proptest! {
        #[test]
        fn samples_stay_inside_the_top_k(
            logits in proptest::collection::vec(-20.0f32..20.0, 1..64),
            k in 1usize..8,
            seed in any::<u64>(),
            t in 0.05f32..3.0,
        ) {
            let mut sorted: Vec<(u32, f32)> =
                logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
            sorted.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let allowed: Vec<u32> = sorted.iter().take(k).map(|c| c.0).collect();
            let mut s = params(t, Some(k), None, seed);
            for _ in 0..8 {
                let tok = s.sample(&logits).unwrap();
                prop_assert!(allowed.contains(&tok));
            }
        }

        #[test]
        fn greedy_is_argmax(logits in proptest::collection::vec(-1e4f32..1e4, 1..128)) {
            let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
            let tok = s.sample(&logits).unwrap() as usize;
            prop_assert!(logits.iter().all(|&l| l <= logits[tok]));
        }
    }
}
