//! The instruction-set level every vector kernel runs at, chosen once per process: the best the
//! CPU has, capped by `HF2COREML_ISA` so that any machine can run (and measure, and test) the
//! slower paths.
//!
//! The interpreter's kernels and the palettizer's inner loops all ask [`selected`], so one
//! process never mixes levels; tests and benches call a kernel's `_at` variant with an explicit
//! [`Isa`] instead, after [`Isa::available`] says the CPU has it.

use std::sync::OnceLock;

/// The environment variable that caps the level.
pub const ENV: &str = "HF2COREML_ISA";

/// Instruction-set levels, lowest first: a level includes everything below it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Portable Rust for the compile target's baseline (SSE2 on x86-64), vectorized by the
    /// compiler.
    Scalar,
    /// x86-64 with AVX2, FMA and F16C: 256-bit fused multiply-adds, fp16 widened in registers.
    Avx2,
    /// AVX2 plus AVX-512 F, BW and VBMI (byte permutes): the LUT kernels' 16-wide lookups.
    Avx512Vbmi,
}

/// An `HF2COREML_ISA` value that names no level.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{ENV}={value:?} names no instruction-set level: expected one of avx512, avx2, scalar \
     (or unset: the best this CPU has, here {best})"
)]
pub struct IsaError {
    pub value: String,
    /// What the CPU would run without the cap.
    pub best: &'static str,
}

impl Isa {
    /// Every level, lowest first.
    pub const ALL: [Isa; 3] = [Isa::Scalar, Isa::Avx2, Isa::Avx512Vbmi];

    /// The name reports use (`run --json`'s `kernels`, `inspect PKG`).
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512Vbmi => "avx512-vbmi",
        }
    }

    /// The level an `HF2COREML_ISA` value names (`avx512` and `avx512-vbmi` are one level).
    pub fn parse(value: &str) -> Option<Isa> {
        match value.trim().to_ascii_lowercase().as_str() {
            "scalar" => Some(Isa::Scalar),
            "avx2" => Some(Isa::Avx2),
            "avx512" | "avx512-vbmi" => Some(Isa::Avx512Vbmi),
            _ => None,
        }
    }

    /// Whether this CPU can run kernels of this level.
    pub fn available(self) -> bool {
        self <= detected()
    }
}

impl std::fmt::Display for Isa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The best level this CPU has, detected once.
pub fn detected() -> Isa {
    static DETECTED: OnceLock<Isa> = OnceLock::new();
    *DETECTED.get_or_init(detect)
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Isa {
    use std::arch::is_x86_feature_detected as has;
    if !(has!("avx2") && has!("fma") && has!("f16c")) {
        return Isa::Scalar;
    }
    if has!("avx512f") && has!("avx512bw") && has!("avx512vbmi") {
        Isa::Avx512Vbmi
    } else {
        Isa::Avx2
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Isa {
    Isa::Scalar
}

/// The level a cap (an `HF2COREML_ISA` value, or `None` when unset or empty) leaves on a CPU
/// whose best is `best`: the cap's level or lower, never above what the CPU has.
pub fn resolve(cap: Option<&str>, best: Isa) -> Result<Isa, IsaError> {
    match cap.map(str::trim).filter(|v| !v.is_empty()) {
        None => Ok(best),
        Some(v) => match Isa::parse(v) {
            Some(level) => Ok(level.min(best)),
            None => Err(IsaError {
                value: v.to_string(),
                best: best.name(),
            }),
        },
    }
}

/// The level the environment selects, read once: the error when `HF2COREML_ISA` names no
/// level. The binary calls this before any command so the mistake is reported as an error.
pub fn from_env() -> Result<Isa, IsaError> {
    static SELECTED: OnceLock<Result<Isa, IsaError>> = OnceLock::new();
    SELECTED
        .get_or_init(|| {
            let cap = std::env::var(ENV).ok();
            resolve(cap.as_deref(), detected())
        })
        .clone()
}

/// The level the kernels run at.
///
/// # Panics
/// When `HF2COREML_ISA` names no level: the binary refuses that before any command runs, and a
/// library caller (a test, a bench) gets the same message rather than a guess.
#[inline]
pub fn selected() -> Isa {
    match from_env() {
        Ok(level) => level,
        Err(e) => panic!("{e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cap_never_raises_the_level() {
        for best in Isa::ALL {
            assert_eq!(resolve(None, best), Ok(best));
            assert_eq!(resolve(Some(""), best), Ok(best));
            assert_eq!(resolve(Some("scalar"), best), Ok(Isa::Scalar));
            assert_eq!(resolve(Some("avx2"), best), Ok(best.min(Isa::Avx2)));
            assert_eq!(resolve(Some(" AVX512 "), best), Ok(best));
            assert_eq!(resolve(Some("avx512-vbmi"), best), Ok(best));
        }
    }

    #[test]
    fn an_unknown_value_is_refused_by_name() {
        let e = resolve(Some("sse4"), Isa::Avx2).unwrap_err();
        let text = e.to_string();
        assert!(text.contains("HF2COREML_ISA=\"sse4\""), "{text}");
        assert!(text.contains("avx512, avx2, scalar"), "{text}");
        assert!(text.contains("here avx2"), "{text}");
    }

    #[test]
    fn names_parse_back_to_their_level() {
        for level in Isa::ALL {
            assert_eq!(Isa::parse(level.name()), Some(level));
        }
        assert!(Isa::Scalar.available());
        assert!(detected().available());
    }
}
