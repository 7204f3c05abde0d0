//! hf2coreml's numerics: the loops a conversion spends its time in, apart from the rest so
//! that they build at opt-level 3 in every profile and mutation testing rebuilds them alone.
//!
//! - [`kmeans`]: exact weighted 1-D k-means on 16-bit values (palettization);
//! - [`pack`]: LUT indices packed to their bit width, as Core ML stores them;
//! - [`nbits`]: the LUT widths Core ML accepts;
//! - [`linalg`]: the Cholesky factors and inverses calibrated quantization needs;
//! - [`dequant`]: ggml's block layouts (GGUF K-quants and legacy quants) to floats;
//! - [`kernels`]: the interpreter's dot products and LUT lookups, per instruction set;
//! - [`isa`]: the instruction-set level every vector kernel runs at;
//! - [`SplitMix64`]: deterministic random numbers.
//!
//! It depends on no other crate of the workspace.

pub mod dequant;
pub mod isa;
pub mod kernels;
pub mod kmeans;
pub mod linalg;
pub mod nbits;
pub mod pack;

use thiserror::Error;

/// What the numerics refuse; the library's `QuantError` carries it unchanged.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum NumericsError {
    #[error("nbits {nbits} is not supported (use {list})", list = nbits::nbits_list())]
    UnsupportedNbits { nbits: u8 },
    #[error("element {index} is {value}: NaN/Inf (or beyond the f16 range) cannot be palettized")]
    NonFinite { index: usize, value: f32 },
    #[error("{count} values are NaN/Inf (or beyond the f16 range): they cannot be palettized")]
    NonFiniteCounted { count: u64 },
    #[error("importance weight {index} is {weight}: weights must be finite and >= 0")]
    BadWeight { index: usize, weight: f32 },
    #[error("{weights} importance weights for {values} values")]
    WeightsLength { values: usize, weights: usize },
    #[error("{n} indices of {nbits} bits need {need} bytes, got {have}")]
    ShortPacked {
        n: usize,
        nbits: u8,
        need: usize,
        have: usize,
    },
}

/// A tiny deterministic generator (SplitMix64): the same numbers on every machine, for
/// test fixtures and for fixed random choices the output depends on (the input rotation of
/// calibrated palettization).
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = self.uniform().max(1e-7);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
    }
}
