//! The numbers of a config that become arithmetic, computed before any work in the precision
//! they are computed in: RoPE's inverse frequencies and angles as transformers computes them
//! (float32: `base ** (arange(0, d, 2) / d)`, the scaling, `position × inv_freq`), and the
//! constants the package holds as fp16 can hold them. A value that makes any of them
//! non-finite, or zero where the model needs it not to be, is refused naming its field: a
//! config that parses is one whose package computes numbers.

use half::f16;

use super::raw_config::ConfigError;
use crate::arch::{ModelSpec, RopeScaling};

/// Where one RoPE table's numbers come from, by the config field that gave each (for the
/// messages: `rope_theta` or `rope_parameters.full_attention.rope_theta`, ...).
pub(super) struct RopeSource<'a> {
    pub theta: f64,
    pub theta_key: &'a str,
    pub scaling: &'a RopeScaling,
    /// The object the scaling was read from (`rope_scaling`, `rope_parameters`, ...).
    pub scaling_key: &'a str,
}

/// The config fields a spec's RoPE tables come from: the model's, and Gemma's sliding blocks'
/// base (no scaling).
pub(super) struct RopeKeys {
    pub theta: String,
    pub scaling: String,
    pub local_theta: &'static str,
}

/// Check every number of `spec` that becomes arithmetic (see the module header).
pub(super) fn check(spec: &ModelSpec, keys: &RopeKeys) -> Result<(), ConfigError> {
    let dim = spec.rotary_dim();
    let global = RopeSource {
        theta: spec.rope_theta,
        theta_key: &keys.theta,
        scaling: &spec.rope_scaling,
        scaling_key: &keys.scaling,
    };
    check_rope(&global, dim, spec.max_position_embeddings)?;
    if let Some(g) = &spec.gemma {
        let local = RopeSource {
            theta: g.local_rope_theta,
            theta_key: keys.local_theta,
            scaling: &RopeScaling::None,
            scaling_key: "",
        };
        check_rope(&local, dim, spec.max_position_embeddings)?;
        attention_scale(g.query_pre_attn_scalar)?;
    }
    Ok(())
}

/// `x` to 6 significant digits, trailing zeros dropped (1e-30, 1.5e15, 256): config values as
/// the user wrote them, not their nearest binary neighbour (9.999999999999999e-31).
pub(super) fn short(x: f64) -> String {
    if x != 0.0 && x.is_finite() && !(1e-4..1e7).contains(&x.abs()) {
        let s = format!("{x:.5e}");
        let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
        let mantissa = mantissa.trim_end_matches('0').trim_end_matches('.');
        return format!("{mantissa}e{exp}");
    }
    let s = format!("{x:.6}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    s.to_string()
}

fn field(key: impl Into<String>, message: String) -> ConfigError {
    ConfigError::Field {
        field: key.into(),
        message,
    }
}

/// A parameter as transformers holds it in a float32 tensor: finite there, or refused.
fn as_f32(value: f64, key: &str) -> Result<f32, ConfigError> {
    let x = value as f32;
    if !x.is_finite() {
        return Err(field(
            key,
            format!(
                "({}) overflows float32 (largest {}), where transformers computes RoPE's \
                 frequencies",
                short(value),
                short(f64::from(f32::MAX))
            ),
        ));
    }
    Ok(x)
}

/// The inverse frequencies of a head's `dim / 2` rotated pairs, as transformers computes them
/// in float32 (`_compute_default_rope_parameters` and the scaled variants), each with the
/// config field that can be blamed for it.
fn frequencies(
    src: &RopeSource<'_>,
    dim: usize,
    pair_positions: usize,
) -> Result<Vec<(f32, String, usize)>, ConfigError> {
    let theta = as_f32(src.theta, src.theta_key)?;
    // A base at or below 1 makes θ^(-2i/d) grow across the pairs (all equal at 1): no trained
    // model has one, and 1e-300 is 0 in float32, every frequency then infinite.
    if src.theta <= 1.0 || theta <= 1.0 {
        return Err(field(
            src.theta_key,
            format!(
                "({}) must be greater than 1: RoPE's frequencies θ^(-2i/d) fall across a \
                 head's pairs only above 1",
                short(src.theta)
            ),
        ));
    }
    let base: Vec<f32> = (0..dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f32 / dim as f32))
        .collect();
    let key = |k: &str| format!("{}.{k}", src.scaling_key);
    let blame = |k: &str| (key(k), pair_positions);
    Ok(match src.scaling {
        RopeScaling::None => base
            .into_iter()
            .map(|f| (f, src.theta_key.to_string(), pair_positions))
            .collect(),
        RopeScaling::Linear { factor } => {
            let factor = as_f32(*factor, &key("factor"))?;
            let (k, n) = blame("factor");
            base.into_iter()
                .map(|f| (f / factor, k.clone(), n))
                .collect()
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            let factor = as_f32(*factor, &key("factor"))?;
            let low = as_f32(*low_freq_factor, &key("low_freq_factor"))?;
            let high = as_f32(*high_freq_factor, &key("high_freq_factor"))?;
            // The band between the two wavelengths is interpolated over high − low.
            if high <= low {
                return Err(field(
                    key("high_freq_factor"),
                    format!(
                        "({}) must be greater than low_freq_factor ({}): llama3 scaling \
                         divides by their difference",
                        short(*high_freq_factor),
                        short(*low_freq_factor)
                    ),
                ));
            }
            let old = *original_max_position_embeddings as f32;
            let (k, n) = blame("factor");
            base.into_iter()
                .map(|f| (llama3(f, factor, low, high, old), k.clone(), n))
                .collect()
        }
        RopeScaling::LongRope {
            short_factor,
            long_factor,
            original_max_position_embeddings,
            ..
        } => {
            // The short factors below the original context (the package's), the long ones
            // beyond it (transformers' and the reference's).
            let short = original_max_position_embeddings.min(&pair_positions);
            let mut out = Vec::with_capacity(2 * base.len());
            for (name, factors, positions) in [
                ("short_factor", short_factor, *short),
                ("long_factor", long_factor, pair_positions),
            ] {
                for (i, (b, s)) in base.iter().zip(factors).enumerate() {
                    let k = format!("{}[{i}]", key(name));
                    let s = as_f32(*s, &k)?;
                    out.push((1.0 / (s * b), k, positions));
                }
            }
            out
        }
    })
}

/// transformers' `_compute_llama3_parameters` for one frequency, in float32.
fn llama3(f: f32, factor: f32, low: f32, high: f32, old: f32) -> f32 {
    let wavelen = 2.0 * std::f32::consts::PI / f;
    let (low_wavelen, high_wavelen) = (old / low, old / high);
    let scaled = if wavelen > low_wavelen { f / factor } else { f };
    if wavelen < high_wavelen || wavelen > low_wavelen {
        return scaled;
    }
    let smooth = (old / wavelen - low) / (high - low);
    (1.0 - smooth) * scaled / factor + smooth * scaled
}

/// Every frequency finite and positive in float32, and its angle at the last position
/// (`position × inv_freq`, float32 as transformers forms it) finite: else cos and sin are NaN,
/// or a pair carries no position.
fn check_rope(src: &RopeSource<'_>, dim: usize, positions: usize) -> Result<(), ConfigError> {
    for (pair, (f, key, n)) in frequencies(src, dim, positions)?.into_iter().enumerate() {
        let pair = pair % (dim / 2);
        let last = n.saturating_sub(1) as f32;
        if !f.is_finite() {
            return Err(field(
                key,
                format!(
                    "makes pair {pair}'s RoPE frequency {f} in float32, where transformers \
                     computes it: its cos and sin would be NaN"
                ),
            ));
        }
        if f <= 0.0 {
            return Err(field(
                key,
                format!(
                    "makes pair {pair}'s RoPE frequency 0 in float32, where transformers \
                     computes it: that pair would carry no position"
                ),
            ));
        }
        if !(last * f).is_finite() {
            let from = (f32::MAX / f).ceil();
            return Err(field(
                key,
                format!(
                    "makes pair {pair}'s RoPE frequency {}, whose angle (position × \
                     frequency, float32 as transformers forms it) overflows from position \
                     {from} on, within the context of {n}: cos and sin would be NaN",
                    short(f64::from(f))
                ),
            ));
        }
    }
    Ok(())
}

/// Gemma's `query_pre_attn_scalar`: q is multiplied by its inverse square root, a constant of
/// the package; outside fp16's normal range (6.1e-5 to 65504) it is infinite or flushed
/// toward 0 there, and no trained model has such a scale.
fn attention_scale(scalar: f64) -> Result<(), ConfigError> {
    let scale = 1.0 / scalar.sqrt();
    let held = f16::from_f64(scale);
    if !(scale.is_finite() && held.is_finite() && held.is_normal()) {
        return Err(field(
            "query_pre_attn_scalar",
            format!(
                "({}) gives the attention scale {} (its inverse square root), outside fp16's \
                 normal range ({} to {}), in which the package multiplies q by it",
                short(scalar),
                short(scale),
                short(f64::from(f16::MIN_POSITIVE)),
                f16::MAX
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source(theta: f64, scaling: &RopeScaling) -> RopeSource<'_> {
        RopeSource {
            theta,
            theta_key: "rope_theta",
            scaling,
            scaling_key: "rope_scaling",
        }
    }

    fn refusal(theta: f64, scaling: RopeScaling, positions: usize) -> String {
        check_rope(&source(theta, &scaling), 64, positions)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn numbers_are_shown_as_written() {
        let cases = [
            (9.999999999999999e-31, "1e-30"),
            (1.0000000000000001e15, "1e15"),
            (256.0, "256"),
            (0.5, "0.5"),
            (1e39, "1e39"),
            (f64::from(f32::MAX), "3.40282e38"),
            (6.103515625e-5, "6.10352e-5"),
        ];
        for (x, shown) in cases {
            assert_eq!(short(x), shown);
        }
    }

    #[test]
    fn frequencies_are_transformers_float32_ones() {
        let s = RopeScaling::None;
        let f = frequencies(&source(10_000.0, &s), 8, 16).unwrap();
        let expect = [1.0f32, 0.1, 0.01, 0.001];
        for ((f, key, _), e) in f.iter().zip(expect) {
            assert!((f - e).abs() <= e * f32::EPSILON * 4.0, "{f} vs {e}");
            assert_eq!(key, "rope_theta");
        }
        let l = RopeScaling::Linear { factor: 4.0 };
        let f = frequencies(&source(10_000.0, &l), 8, 16).unwrap();
        assert_eq!((f[0].0, f[0].1.as_str()), (0.25, "rope_scaling.factor"));
    }

    #[test]
    fn real_configs_pass() {
        let llama31 = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        check_rope(&source(500_000.0, &llama31), 128, 131_072).unwrap();
        check_rope(&source(1e6, &RopeScaling::None), 128, 1 << 24).unwrap();
        check_rope(
            &source(10_000.0, &RopeScaling::Linear { factor: 8.0 }),
            256,
            1 << 17,
        )
        .unwrap();
        attention_scale(256.0).unwrap();
        attention_scale(168.0).unwrap();
    }

    #[test]
    fn bases_that_compute_nothing_are_refused() {
        for theta in [1e-300, 0.5, 1.0] {
            let e = refusal(theta, RopeScaling::None, 4096);
            assert!(
                e.contains("`rope_theta`") && e.contains("greater than 1"),
                "{e}"
            );
        }
        let e = refusal(1e39, RopeScaling::None, 4096);
        assert!(
            e.contains("`rope_theta`") && e.contains("overflows float32"),
            "{e}"
        );
    }

    #[test]
    fn scalings_that_overflow_or_vanish_are_refused_naming_the_field() {
        let e = refusal(1e4, RopeScaling::Linear { factor: 1e-38 }, 4096);
        assert!(
            e.contains("`rope_scaling.factor`") && e.contains("overflows from position 4"),
            "{e}"
        );
        let e = refusal(1e4, RopeScaling::Linear { factor: 1e39 }, 4096);
        assert!(e.contains("overflows float32"), "{e}");
        let e = refusal(3e38, RopeScaling::Linear { factor: 3e38 }, 4096);
        assert!(e.contains("frequency 0"), "{e}");
        // A factor whose angles overflow only past the context is computable.
        check_rope(&source(1e4, &RopeScaling::Linear { factor: 1e-35 }), 64, 4).unwrap();
        let llama3 = |low, high| RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: low,
            high_freq_factor: high,
            original_max_position_embeddings: 8192,
        };
        let e = refusal(5e5, llama3(4.0, 4.0), 4096);
        assert!(e.contains("`rope_scaling.high_freq_factor`"), "{e}");
        let mut tiny = llama3(1.0, 4.0);
        if let RopeScaling::Llama3 { factor, .. } = &mut tiny {
            *factor = 1e-38;
        }
        let e = refusal(5e5, tiny, 4096);
        assert!(
            e.contains("`rope_scaling.factor`") && e.contains("overflows"),
            "{e}"
        );
    }

    #[test]
    fn longrope_factors_are_checked_one_by_one() {
        let long_rope = |short: f64, long: f64| RopeScaling::LongRope {
            short_factor: vec![1.0, 1.0, short, 1.0],
            long_factor: vec![long, 1.0, 1.0, 1.0],
            original_max_position_embeddings: 256,
            attention_factor: 1.0,
        };
        let check = |s| check_rope(&source(1e4, &s), 8, 1024).map_err(|e| e.to_string());
        check(long_rope(1.0, 2.0)).unwrap();
        let e = check(long_rope(1e-38, 2.0)).unwrap_err();
        assert!(e.contains("`rope_scaling.short_factor[2]`"), "{e}");
        let e = check(long_rope(1.0, 1e-38)).unwrap_err();
        assert!(e.contains("`rope_scaling.long_factor[0]`"), "{e}");
        let e = check(long_rope(1e39, 1.0)).unwrap_err();
        assert!(
            e.contains("short_factor[2]") && e.contains("overflows"),
            "{e}"
        );
    }

    #[test]
    fn attention_scales_fp16_cannot_hold_are_refused() {
        for bad in [1e-30, 1e-10, 1e10, 1e300] {
            let e = attention_scale(bad).unwrap_err().to_string();
            assert!(e.contains("`query_pre_attn_scalar`"), "{bad}: {e}");
        }
    }
}
