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

/// Instruction-set levels, lowest first: on its architecture, a level includes everything
/// below it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Portable Rust for the compile target's baseline (SSE2 on x86-64, NEON on aarch64),
    /// vectorized by the compiler.
    Scalar,
    /// aarch64's NEON (every aarch64 CPU has it): the AVX2 kernels four lanes at a time, with
    /// byte-table lookups (`tbl`) for the LUT products.
    Neon,
    /// x86-64 with AVX2, FMA and F16C: 256-bit fused multiply-adds, fp16 widened in registers.
    Avx2,
    /// AVX2 plus AVX-512 F, BW and VBMI (byte permutes): the LUT kernels' 16-wide lookups.
    Avx512Vbmi,
}

/// An `HF2COREML_ISA` value that names no level of this CPU.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{ENV}={value:?} names no instruction-set level of this {arch} CPU: expected one of \
     {levels} (or unset: the best this CPU has, here {best})"
)]
pub struct IsaError {
    pub value: String,
    /// What the CPU would run without the cap.
    pub best: &'static str,
    /// The architecture the binary runs on.
    pub arch: &'static str,
    /// The levels of that architecture, highest first.
    pub levels: String,
}

impl Isa {
    /// Every level, lowest first.
    pub const ALL: [Isa; 4] = [Isa::Scalar, Isa::Neon, Isa::Avx2, Isa::Avx512Vbmi];

    /// The name reports use (`run --json`'s `kernels`, `inspect PKG`).
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Neon => "neon",
            Isa::Avx2 => "avx2",
            Isa::Avx512Vbmi => "avx512-vbmi",
        }
    }

    /// The level an `HF2COREML_ISA` value names (`avx512` and `avx512-vbmi` are one level).
    pub fn parse(value: &str) -> Option<Isa> {
        match value.trim().to_ascii_lowercase().as_str() {
            "scalar" => Some(Isa::Scalar),
            "neon" => Some(Isa::Neon),
            "avx2" => Some(Isa::Avx2),
            "avx512" | "avx512-vbmi" => Some(Isa::Avx512Vbmi),
            _ => None,
        }
    }

    /// The architecture (`std::env::consts::ARCH`) whose CPUs can have this level; `None`
    /// for `scalar`, which every one runs.
    pub fn arch(self) -> Option<&'static str> {
        match self {
            Isa::Scalar => None,
            Isa::Neon => Some("aarch64"),
            Isa::Avx2 | Isa::Avx512Vbmi => Some("x86_64"),
        }
    }

    /// Whether this CPU can run kernels of this level.
    pub fn available(self) -> bool {
        self.on(std::env::consts::ARCH) && self <= detected()
    }

    /// Whether this level belongs to architecture `arch`.
    fn on(self, arch: &str) -> bool {
        self.arch().is_none_or(|a| a == arch)
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

/// NEON is part of the aarch64 baseline: every such CPU (and the compile target) has it.
#[cfg(target_arch = "aarch64")]
fn detect() -> Isa {
    Isa::Neon
}

/// Whether this CPU runs a 256-bit byte shuffle as two 128-bit operations: AMD (and Hygon)
/// families up to 18h (Zen, Zen+, Zen 2), on which the AVX2 kernels keep every shuffle in 128
/// bits. Read once from `cpuid` (vendor string, then the family of leaf 1).
pub fn splits_256_bit_shuffles() -> bool {
    static SPLITS: OnceLock<bool> = OnceLock::new();
    *SPLITS.get_or_init(|| {
        let (vendor, family) = vendor_family();
        splits_by(&vendor, family)
    })
}

/// [`splits_256_bit_shuffles`] for a vendor string and a display family.
fn splits_by(vendor: &str, family: u32) -> bool {
    matches!(vendor, "AuthenticAMD" | "HygonGenuine") && family <= 0x18
}

#[cfg(target_arch = "x86_64")]
fn vendor_family() -> (String, u32) {
    use std::arch::x86_64::__cpuid;
    // Leaves 0 (vendor) and 1 (family) exist on every x86-64 CPU.
    let (l0, l1) = (__cpuid(0), __cpuid(1));
    let vendor: Vec<u8> = [l0.ebx, l0.edx, l0.ecx]
        .iter()
        .flat_map(|r| r.to_le_bytes())
        .collect();
    let base = (l1.eax >> 8) & 0xf;
    let family = if base == 0xf {
        base + ((l1.eax >> 20) & 0xff)
    } else {
        base
    };
    (String::from_utf8_lossy(&vendor).into_owned(), family)
}

#[cfg(not(target_arch = "x86_64"))]
fn vendor_family() -> (String, u32) {
    (String::new(), 0)
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn detect() -> Isa {
    Isa::Scalar
}

/// The level a cap (an `HF2COREML_ISA` value, or `None` when unset or empty) leaves on a CPU
/// of architecture `arch` whose best is `best`: the cap's level or lower, never above what the
/// CPU has. A level of another architecture is refused like an unknown name.
pub fn resolve(cap: Option<&str>, best: Isa, arch: &'static str) -> Result<Isa, IsaError> {
    match cap.map(str::trim).filter(|v| !v.is_empty()) {
        None => Ok(best),
        Some(v) => match Isa::parse(v).filter(|level| level.on(arch)) {
            Some(level) => Ok(level.min(best)),
            None => Err(IsaError {
                value: v.to_string(),
                best: best.name(),
                arch,
                levels: levels_of(arch),
            }),
        },
    }
}

/// The names `HF2COREML_ISA` takes on `arch`, highest first.
fn levels_of(arch: &str) -> String {
    let mut names: Vec<&str> = Isa::ALL
        .iter()
        .rev()
        .filter(|l| l.on(arch))
        .map(|l| match l {
            Isa::Avx512Vbmi => "avx512",
            l => l.name(),
        })
        .collect();
    names.dedup();
    names.join(", ")
}

/// The level the environment selects, read once: the error when `HF2COREML_ISA` names no
/// level. The binary calls this before any command so the mistake is reported as an error.
pub fn from_env() -> Result<Isa, IsaError> {
    static SELECTED: OnceLock<Result<Isa, IsaError>> = OnceLock::new();
    SELECTED
        .get_or_init(|| {
            let cap = std::env::var(ENV).ok();
            resolve(cap.as_deref(), detected(), std::env::consts::ARCH)
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
        for best in [Isa::Scalar, Isa::Avx2, Isa::Avx512Vbmi] {
            let x86 = |cap| resolve(cap, best, "x86_64");
            assert_eq!(x86(None), Ok(best));
            assert_eq!(x86(Some("")), Ok(best));
            assert_eq!(x86(Some("scalar")), Ok(Isa::Scalar));
            assert_eq!(x86(Some("avx2")), Ok(best.min(Isa::Avx2)));
            assert_eq!(x86(Some(" AVX512 ")), Ok(best));
            assert_eq!(x86(Some("avx512-vbmi")), Ok(best));
        }
        for best in [Isa::Scalar, Isa::Neon] {
            assert_eq!(resolve(None, best, "aarch64"), Ok(best));
            assert_eq!(resolve(Some("neon"), best, "aarch64"), Ok(best));
            assert_eq!(resolve(Some("scalar"), best, "aarch64"), Ok(Isa::Scalar));
        }
    }

    #[test]
    fn an_unknown_value_is_refused_by_name() {
        let e = resolve(Some("sse4"), Isa::Avx2, "x86_64").unwrap_err();
        let text = e.to_string();
        assert!(text.contains("HF2COREML_ISA=\"sse4\""), "{text}");
        assert!(text.contains("x86_64 CPU"), "{text}");
        assert!(text.contains("avx512, avx2, scalar"), "{text}");
        assert!(text.contains("here avx2"), "{text}");
    }

    #[test]
    fn a_level_of_another_architecture_is_refused() {
        let text = resolve(Some("avx2"), Isa::Neon, "aarch64")
            .unwrap_err()
            .to_string();
        assert!(
            text.contains("aarch64 CPU: expected one of neon, scalar"),
            "{text}"
        );
        let text = resolve(Some("neon"), Isa::Avx2, "x86_64")
            .unwrap_err()
            .to_string();
        assert!(
            text.contains("expected one of avx512, avx2, scalar"),
            "{text}"
        );
    }

    #[test]
    fn only_early_amd_families_split_256_bit_shuffles() {
        assert!(splits_by("AuthenticAMD", 0x17));
        assert!(splits_by("HygonGenuine", 0x18));
        assert!(!splits_by("AuthenticAMD", 0x19));
        assert!(!splits_by("AuthenticAMD", 0x1a));
        assert!(!splits_by("GenuineIntel", 6));
        let (vendor, _) = vendor_family();
        if cfg!(target_arch = "x86_64") {
            assert_eq!(vendor.len(), 12, "{vendor:?}");
        }
    }

    #[test]
    fn names_parse_back_to_their_level() {
        for level in Isa::ALL {
            assert_eq!(Isa::parse(level.name()), Some(level));
        }
        assert!(Isa::Scalar.available());
        assert!(detected().available());
        // Exactly one architecture's vector levels are here.
        assert!(!(Isa::Neon.available() && Isa::Avx2.available()));
    }
}
