//! (b) Every checkpoint tensor decoded from the package and scored against the original, with
//! the scales the converter folded in factored out first.

use super::metrics::{ErrorSum, WeightError};
use super::validate_error::ValidateError;
use crate::checkpoint::{Checkpoint, TensorView};
use crate::mlpackage::{MlPackage, Values};

/// (b): every checkpoint tensor decoded from the package. Scales folded in by the converter
/// are factored out (the best least-squares scale: one per tensor for fp16 range safety, one
/// per input column for calibrated projections, whose input-channel scales live in the
/// preceding norm or projection), so SNR measures rounding and palettization only. A calibrated
/// projection is stored as row groups `NAME_g0, NAME_g1, ..` (or `NAME`) times `NAME_row_scale`.
/// Returns the fewest bits any palettized weight has.
pub(super) fn check_weights(
    pkgs: &[MlPackage],
    ckpt: &Checkpoint,
    programs: &[&crate::runtime::interp::Program],
) -> Result<(Vec<WeightError>, Option<u32>), ValidateError> {
    let mains = pkgs
        .iter()
        .map(|p| p.main_function().map(|m| (p, m)))
        .collect::<Result<Vec<_>, _>>()?;
    // A chain's parts hold different weights (a tied table twice: the first copy is checked).
    // The part holding `name`, by index (its program decodes iOS18 weights), and the op.
    let find_at = |name: &str| {
        mains.iter().enumerate().find_map(|(at, (_, main))| {
            main.block
                .operations
                .iter()
                .find(|op| op.outputs.first().is_some_and(|o| o.name == name))
                .map(|op| (at, op))
        })
    };
    let find_in = |name: &str| find_at(name).map(|(at, op)| (mains[at].0, op));
    let find = |name: &str| find_in(name).map(|(_, op)| op);
    let mut out = Vec::new();
    let mut min_bits: Option<u32> = None;
    for slot in ckpt.slots() {
        let name = crate::arch::mil_name(&slot.name);
        let cols = slot.shape.get(1).copied().unwrap_or(1).max(1);
        let parts: Vec<(String, usize)> = if find(&name).is_some() {
            vec![(name.clone(), slot.numel())]
        } else {
            let mut v = Vec::new();
            while let Some(op) = find(&format!("{name}_g{}", v.len())) {
                let n: usize = op
                    .outputs
                    .first()
                    .and_then(|o| crate::mlpackage::tensor_type(o.r#type.as_ref(), &name).ok())
                    .map_or(0, |t| t.shape.iter().product());
                v.push((format!("{name}_g{}", v.len()), n));
            }
            v
        };
        if parts.is_empty() {
            continue;
        }
        // The decoded weight, as segments in row order, read a piece at a time: an 8B's fp16
        // embedding is 2.1 GB in f32, and nothing here holds a whole tensor in f32.
        let mut segments: Vec<Segment> = Vec::new();
        let mut scaled18 = false;
        for (part, numel) in &parts {
            let Some((at, op)) = find_at(part) else {
                continue;
            };
            let pkg = &pkgs[at];
            let reader = programs.get(at).and_then(|p| p.constant_reader(part));
            if let Some(bits) = ios18_weight(op) {
                // iOS18 constexpr ops (grouped LUTs, per-row scales): read back as the
                // interpreter decodes them.
                let Some(reader) = reader else {
                    continue;
                };
                segments.push(Segment::Reader(reader));
                // A scale op reads the LUT op the bridge names `<part>_lut`.
                let bits = bits.or_else(|| {
                    find(&format!("{part}_lut")).and_then(|o| ios18_weight(o).flatten())
                });
                min_bits = bits.map_or(min_bits, |b| Some(min_bits.map_or(b, |m| m.min(b))));
                scaled18 |= op.r#type == "constexpr_blockwise_shift_scale";
                continue;
            }
            match op.r#type.as_str() {
                "const" => {
                    let Some(v) = op.attributes.get("val") else {
                        continue;
                    };
                    segments.push(match reader {
                        Some(r) => Segment::Reader(r),
                        None => Segment::Owned(floats(pkg.value(v, part)?.values)),
                    });
                }
                "constexpr_lut_to_dense" => {
                    let (Some(lut), Some(idx)) =
                        (op.attributes.get("lut"), op.attributes.get("indices"))
                    else {
                        continue;
                    };
                    let lut = floats(pkg.value(lut, part)?.values);
                    let nbits = lut.len().trailing_zeros();
                    min_bits = Some(min_bits.map_or(nbits, |m: u32| m.min(nbits)));
                    if let Some(r) = reader {
                        segments.push(Segment::Reader(r));
                        continue;
                    }
                    let idx = pkg.value(idx, part)?;
                    let bytes: Vec<u8> = match idx.values {
                        Values::Int(v) => v.iter().map(|&x| x as u8).collect(),
                        _ => continue,
                    };
                    segments.push(Segment::Owned(
                        crate::quant::pack::unpack_indices(&bytes, nbits as u8, *numel)
                            .into_iter()
                            .map(|i| lut.get(i as usize).copied().unwrap_or(f32::NAN))
                            .collect(),
                    ));
                }
                _ => continue,
            }
        }
        let scale_name = format!("{name}_row_scale");
        let calibrated = parts.len() > 1 || find(&scale_name).is_some() || scaled18;
        let row_scale = match find_in(&scale_name) {
            Some((pkg, op)) => match op.attributes.get("val") {
                Some(v) => Some(floats(pkg.value(v, &scale_name)?.values)),
                None => None,
            },
            None => None,
        };
        let decoded = Decoded {
            segments,
            row_scale,
            cols,
        };
        // The checkpoint's tensor is widened to f32 a piece at a time too ([`in_pieces`]).
        let original = ckpt.tensor(&slot.name)?;
        if decoded.numel() != original.numel() {
            return Err(ValidateError::WeightSize {
                package: name.to_string(),
                tensor: slot.name.clone(),
                got: decoded.numel(),
                expected: original.numel(),
            });
        }
        // Scales folded in by the converter: one per input column of a calibrated projection.
        let k = if calibrated { cols } else { 1 };
        out.push(score(&decoded, &original, k)?.finish(&slot.name));
    }
    Ok((out, min_bits))
}

/// For an iOS18 constexpr weight (operands as inputs, not attributes): `Some(bits)`, the
/// LUT index width when the op (or the LUT a scale op reads) says it.
fn ios18_weight(op: &crate::mlpackage::proto::Operation) -> Option<Option<u32>> {
    use crate::mlpackage::proto;
    let index_bits = |op: &proto::Operation| -> Option<u32> {
        let ty = op.inputs.get("indices")?.arguments.first()?;
        let Some(proto::binding::Binding::Value(v)) = &ty.binding else {
            return None;
        };
        let t = crate::mlpackage::tensor_type(v.r#type.as_ref(), "indices").ok()?;
        Some(t.dtype.bits())
    };
    match op.r#type.as_str() {
        "constexpr_lut_to_dense" if op.inputs.contains_key("indices") => Some(index_bits(op)),
        "constexpr_blockwise_shift_scale" => Some(None),
        _ => None,
    }
}

/// The error sums of `decoded` against `original`, with the scales the converter folded in
/// factored out first: one least-squares scale for each of `k` column classes (element i's is
/// i mod k: every input column of a calibrated projection, or one for the tensor).
fn score(decoded: &Decoded, original: &TensorView, k: usize) -> Result<ErrorSum, ValidateError> {
    let (mut dot, mut norm) = (vec![0.0f64; k], vec![0.0f64; k]);
    let mut buf = Vec::new();
    in_pieces(original, |at, w| {
        decoded.read(at, w.len(), &mut buf)?;
        for (i, (a, b)) in buf.iter().zip(w).enumerate() {
            let j = (at + i) % k;
            dot[j] += *a as f64 * *b as f64;
            norm[j] += (*a as f64).powi(2);
        }
        Ok::<_, ValidateError>(())
    })?;
    let factors: Vec<f64> = dot
        .iter()
        .zip(&norm)
        .map(|(d, n)| if *n > 0.0 { d / n } else { 1.0 })
        .collect();
    let mut sum = ErrorSum::default();
    in_pieces(original, |at, w| {
        decoded.read(at, w.len(), &mut buf)?;
        for (i, a) in buf.iter_mut().enumerate() {
            *a = (*a as f64 * factors[(at + i) % k]) as f32;
        }
        sum.add(w, &buf);
        Ok::<_, ValidateError>(())
    })?;
    Ok(sum)
}

/// Elements of a checkpoint tensor widened to f32 at a time by [`in_pieces`] (16 MiB).
const PIECE: usize = 1 << 22;

/// `f(offset, values)` over `view`'s elements in f32, in order, [`PIECE`] at a time.
fn in_pieces<E>(
    view: &TensorView,
    mut f: impl FnMut(usize, &[f32]) -> Result<(), E>,
) -> Result<(), E> {
    let n = view.numel();
    let width = view.data.len() / n.max(1);
    for at in (0..n).step_by(PIECE) {
        let len = PIECE.min(n - at);
        let shape = [len];
        let piece = TensorView {
            name: view.name,
            dtype: view.dtype,
            shape: &shape,
            data: &view.data[at * width..(at + len) * width],
        };
        f(at, &piece.to_f32())?;
    }
    Ok(())
}

/// One run of a weight's decoded values: read from a program, or decoded here.
enum Segment<'a> {
    Reader(crate::runtime::interp::ConstantReader<'a>),
    Owned(Vec<f32>),
}

impl Segment<'_> {
    fn numel(&self) -> usize {
        match self {
            Segment::Reader(r) => r.numel(),
            Segment::Owned(v) => v.len(),
        }
    }
}

/// A weight as the package stores it: its segments in row order, times its row scales.
struct Decoded<'a> {
    segments: Vec<Segment<'a>>,
    row_scale: Option<Vec<f32>>,
    cols: usize,
}

impl Decoded<'_> {
    fn numel(&self) -> usize {
        self.segments.iter().map(Segment::numel).sum()
    }

    /// Elements `at..at + len` into `out` (cleared first), row scales applied.
    fn read(&self, at: usize, len: usize, out: &mut Vec<f32>) -> Result<(), ValidateError> {
        out.clear();
        let (end, mut start) = (at + len, 0);
        let mut piece = Vec::new();
        for seg in &self.segments {
            let n = seg.numel();
            let (lo, hi) = (at.max(start), end.min(start + n));
            if lo < hi {
                match seg {
                    Segment::Reader(r) => {
                        r.read(lo - start, hi - lo, &mut piece)?;
                        out.extend_from_slice(&piece);
                    }
                    Segment::Owned(v) => out.extend_from_slice(&v[lo - start..hi - start]),
                }
            }
            start += n;
        }
        if let Some(s) = &self.row_scale {
            for (i, x) in out.iter_mut().enumerate() {
                *x *= s.get((at + i) / self.cols).copied().unwrap_or(f32::NAN);
            }
        }
        Ok(())
    }
}

fn floats(v: Values) -> Vec<f32> {
    match v {
        Values::Float(f) => f,
        Values::Int(i) => i.into_iter().map(|x| x as f32).collect(),
        _ => Vec::new(),
    }
}
