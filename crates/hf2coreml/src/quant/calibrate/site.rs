//! The four input sites of a decoder block, each an input its projections share (q/k/v; o;
//! gate/up; down): the Gram matrix XᵀX collected at each ([`Grams`]), and the fit of the
//! projections reading one, which share its rotation and GPTQ factor ([`SiteFit`]).

use std::borrow::Cow;

use candle_core::Tensor;

use super::linear_fit::{
    gptq_factor, gram_diagonal, quantize_linear_prepared, GptqFactor, LinearMethod, QuantizedLinear,
};
use crate::arch::{Role, TensorSlot};
use crate::model::calibrate::Gram;
use crate::model::plain::{Observer, Point};
use crate::quant::rotation::Rotation;
use crate::quant::{NumericsError, QuantError};

/// The four projection inputs of a block and the projections reading each.
pub(super) const SITES: [(Point, &[Role]); 4] = [
    (
        Point::AttentionInput,
        &[Role::Q, Role::K, Role::V, Role::ConvIn, Role::OutputGate],
    ),
    (Point::OInput, &[Role::O]),
    (Point::MlpInput, &[Role::Gate, Role::Up]),
    (Point::SiluUp, &[Role::Down]),
];

/// A projection's method and (mixed precision) its rows' bit widths.
pub(super) type SlotMethod = (LinearMethod, Option<Vec<u8>>);

/// A projection of one input site, its method and (mixed precision) its rows' bit widths.
pub(super) type SiteProjection = (Role, TensorSlot, LinearMethod, Option<Vec<u8>>);

/// Collects XᵀX at the four input sites of one block.
pub(super) struct Grams {
    pub(super) layer: usize,
    pub(super) grams: Vec<Gram>,
    /// One segment's product, shared by the sites ([`Gram::accumulate_with`]).
    pub(super) scratch: Vec<f32>,
}

impl Observer for Grams {
    fn observe(
        &mut self,
        layer: Option<usize>,
        point: Point,
        x: &Tensor,
    ) -> candle_core::Result<()> {
        if layer == Some(self.layer) {
            if let Some(i) = SITES.iter().position(|(p, _)| *p == point) {
                self.grams[i].accumulate_with(x, &mut self.scratch)?;
            }
        }
        Ok(())
    }

    fn wants(&self, point: Point) -> bool {
        SITES.iter().any(|(p, _)| *p == point)
    }
}

/// What the projections reading one input site (q/k/v, gate/up) need of its Gram matrix,
/// computed once for all of them: its diagonal and GPTQ's factor per (act order, damping), of
/// the matrix as it is and, under [`LinearMethod::rotate`], rotated. The matrix itself is not
/// kept: at 8B down_proj's is 1.6 GB in f64, twice its factor.
pub(super) struct SiteFit {
    cols: usize,
    plain: Option<Prepared>,
    rotated: Option<(Rotation, Prepared)>,
}

/// A Gram matrix's diagonal and factors.
struct Prepared {
    diag: Vec<f64>,
    factors: Vec<((bool, u64), GptqFactor)>,
}

impl Prepared {
    fn new(gram: &[f64], cols: usize, methods: &[&LinearMethod]) -> Result<Self, QuantError> {
        let mut factors: Vec<((bool, u64), GptqFactor)> = Vec::new();
        for m in methods.iter().filter(|m| m.gptq) {
            let key = factor_key(m);
            if !factors.iter().any(|(k, _)| *k == key) {
                factors.push((key, gptq_factor(gram, cols, m)?));
            }
        }
        Ok(Prepared {
            diag: gram_diagonal(gram, cols),
            factors,
        })
    }
}

fn factor_key(m: &LinearMethod) -> (bool, u64) {
    (m.act_order, m.damp.to_bits())
}

impl SiteFit {
    /// Prepare `gram` [cols, cols] for projections palettized with `methods`. An owned matrix
    /// is rotated in place.
    pub(super) fn new(
        gram: Cow<'_, [f64]>,
        cols: usize,
        methods: &[&LinearMethod],
    ) -> Result<Self, QuantError> {
        if gram.len() != cols * cols {
            return Err(QuantError::from(NumericsError::WeightsLength {
                values: cols * cols,
                weights: gram.len(),
            }));
        }
        let (rotating, plain): (Vec<&LinearMethod>, Vec<&LinearMethod>) =
            methods.iter().copied().partition(|m| m.rotate);
        let plain = if plain.is_empty() {
            None
        } else {
            Some(Prepared::new(&gram, cols, &plain)?)
        };
        let rotated = if rotating.is_empty() {
            None
        } else {
            let r = Rotation::new(cols);
            let mut g = gram.into_owned();
            r.rotate_gram_in_place(&mut g);
            let prepared = Prepared::new(&g, cols, &rotating)?;
            Some((r, prepared))
        };
        Ok(SiteFit {
            cols,
            plain,
            rotated,
        })
    }

    /// Palettize a [rows, cols] projection reading this site with one of the methods it was
    /// prepared for; returns it and the f32 weights the float model should compute with from
    /// now on (its dequantized values, rotated back under [`LinearMethod::rotate`]).
    pub(super) fn fit(
        &self,
        w: &[f32],
        rows: usize,
        method: &LinearMethod,
        row_bits: Option<&[u8]>,
    ) -> Result<(QuantizedLinear, Vec<f32>), QuantError> {
        let cols = self.cols;
        let unprepared = || QuantError::Calibration {
            message: "the input site was not prepared for this method".into(),
        };
        let (rotation, prepared) = match (&self.rotated, &self.plain, method.rotate) {
            (Some((r, p)), _, true) => (Some(r), p),
            (_, Some(p), false) => (None, p),
            _ => return Err(unprepared()),
        };
        let factor = if method.gptq {
            let key = factor_key(method);
            let f = prepared.factors.iter().find(|(k, _)| *k == key);
            Some(&f.ok_or_else(unprepared)?.1)
        } else {
            None
        };
        let diag = Some(prepared.diag.as_slice());
        let Some(r) = rotation else {
            let q = quantize_linear_prepared(w, rows, cols, diag, method, row_bits, factor)?;
            let d = q.dequantize();
            return Ok((q, d));
        };
        let mut wr = w.to_vec();
        r.rotate_rows(&mut wr);
        let mut q = quantize_linear_prepared(&wr, rows, cols, diag, method, row_bits, factor)?;
        drop(wr);
        q.rotated = true;
        let mut d = q.dequantize();
        r.unrotate_rows(&mut d);
        Ok((q, d))
    }
}
