//! The four input sites of a decoder block, each an input its projections share (q/k/v; o;
//! gate/up; down): the Gram matrix XᵀX collected at each ([`Grams`]), and the fit of the
//! projections reading one, which share its rotation and GPTQ factor ([`SiteFit`]).

use candle_core::Tensor;

use super::linear::{
    gptq_factor, quantize_linear_factored, GptqFactor, LinearMethod, QuantizedLinear,
};
use crate::arch::{Role, TensorSlot};
use crate::model::calibrate::Gram;
use crate::model::plain::{Observer, Point};
use crate::quant::rotation::Rotation;
use crate::quant::QuantError;

/// The four projection inputs of a block and the projections reading each.
pub(super) const SITES: [(Point, &[Role]); 4] = [
    (Point::AttentionInput, &[Role::Q, Role::K, Role::V]),
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

/// One input site's Gram matrix and what the projections reading it (q/k/v, gate/up) share:
/// the matrix rotated once under [`LinearMethod::rotate`], and GPTQ's factor once per
/// (rotation, act order, damping).
pub(super) struct SiteFit<'a> {
    gram: &'a [f64],
    cols: usize,
    rotated: Option<(Rotation, Vec<f64>)>,
    factors: Vec<((bool, bool, u64), GptqFactor)>,
}

impl<'a> SiteFit<'a> {
    pub(super) fn new(gram: &'a [f64], cols: usize) -> Self {
        SiteFit {
            gram,
            cols,
            rotated: None,
            factors: Vec::new(),
        }
    }

    /// Palettize a [rows, cols] projection reading this site; returns it and the f32 weights
    /// the float model should compute with from now on (its dequantized values, rotated back
    /// under [`LinearMethod::rotate`]).
    pub(super) fn fit(
        &mut self,
        w: &[f32],
        rows: usize,
        method: &LinearMethod,
        row_bits: Option<&[u8]>,
    ) -> Result<(QuantizedLinear, Vec<f32>), QuantError> {
        let cols = self.cols;
        if method.rotate && self.rotated.is_none() {
            let r = Rotation::new(cols);
            let g = r.rotate_gram(self.gram);
            self.rotated = Some((r, g));
        }
        let (rotation, gram) = match &self.rotated {
            Some((r, g)) if method.rotate => (Some(r), g.as_slice()),
            _ => (None, self.gram),
        };
        let factor = if method.gptq {
            let key = (method.rotate, method.act_order, method.damp.to_bits());
            let at = match self.factors.iter().position(|(k, _)| *k == key) {
                Some(i) => i,
                None => {
                    self.factors.push((key, gptq_factor(gram, cols, method)?));
                    self.factors.len() - 1
                }
            };
            Some(&self.factors[at].1)
        } else {
            None
        };
        let Some(r) = rotation else {
            let q = quantize_linear_factored(w, rows, cols, Some(gram), method, row_bits, factor)?;
            let d = q.dequantize();
            return Ok((q, d));
        };
        let mut wr = w.to_vec();
        r.rotate_rows(&mut wr);
        let mut q =
            quantize_linear_factored(&wr, rows, cols, Some(gram), method, row_bits, factor)?;
        q.rotated = true;
        let mut d = q.dequantize();
        r.unrotate_rows(&mut d);
        Ok((q, d))
    }
}
