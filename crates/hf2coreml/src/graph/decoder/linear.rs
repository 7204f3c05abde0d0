//! Weights as the graph references them: looked up by [`TensorId`], turned into constants
//! (dense, palettized, or a calibrated projection's row groups, row order, row scale and input
//! rotation), and the projection `x·Wᵀ (+ b)` built over them.

use std::collections::BTreeMap;

use half::f16;

use crate::arch::{mil_name, ModelSpec, TensorId};
use crate::graph::{ints, var, Arg, Builder, ConstData, GraphError, Op, Weight};
use crate::quant::rotation::Rotation;
use crate::quant::QuantizedWeight;

/// A projection weight as the graph references it.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct LinearWeight {
    /// One constant per row group (one for dense and plain palettized weights).
    parts: Vec<String>,
    /// The int32 positions that put the parts' concatenated outputs back in row order.
    restore: Option<String>,
    scale: Option<String>,
    /// The input rotation's constants, if the input must be rotated first.
    rotation: Option<RotationConsts>,
}

impl LinearWeight {
    /// Its constants, one per row group (the `--layout ane` builder lays them out as convs).
    pub(super) fn parts(&self) -> &[String] {
        &self.parts
    }

    /// The row order of its groups, its per-row scale, whether its input is rotated.
    pub(super) fn restore_and_scale(&self) -> (Option<&String>, Option<&String>, bool) {
        (
            self.restore.as_ref(),
            self.scale.as_ref(),
            self.rotation.is_some(),
        )
    }

    /// The single constant of a weight that must not be grouped or scaled (norms, biases,
    /// embeddings).
    fn single(self, name: &str) -> Result<String, GraphError> {
        match (
            self.parts.len(),
            self.scale.is_some() || self.rotation.is_some(),
        ) {
            (1, false) => Ok(self.parts.into_iter().next().unwrap_or_default()),
            _ => Err(GraphError::Unsupported(format!(
                "`{name}` is calibrated (row groups, row scales or a rotated input), which \
                 only projections can be"
            ))),
        }
    }
}

/// The constants of one input width's rotation ([`Rotation`]), shared by every projection
/// reading that width.
#[derive(Debug, Clone, PartialEq)]
struct RotationConsts {
    n: usize,
    block: usize,
    /// D's ±1 diagonal, [n].
    signs: String,
    /// H_b/√b, [b, b].
    hadamard: String,
    /// Mᵀ, [m, m]; none when one block spans all n channels.
    mix: Option<String>,
}

/// Add the constants of the input rotation of width `n`.
fn rotation_constants(b: &mut Builder, n: usize) -> RotationConsts {
    let r = Rotation::new(n);
    let to16 = |v: Vec<f32>| ConstData::F16(v.into_iter().map(f16::from_f32).collect());
    let block = r.block;
    let m = n / block;
    let signs = b.constant(
        &format!("input_rotation_{n}_signs"),
        vec![n],
        to16(r.signs.clone()),
        None,
    );
    let hadamard = b.constant(
        &format!("input_rotation_{n}_hadamard"),
        vec![block, block],
        to16(r.hadamard_matrix()),
        None,
    );
    let mix = (m > 1).then(|| {
        b.constant(
            &format!("input_rotation_{n}_mix"),
            vec![m, m],
            to16(r.mix_transpose()),
            None,
        )
    });
    RotationConsts {
        n,
        block,
        signs,
        hadamard,
        mix,
    }
}

/// The checkpoint's weights, handed out once each by [`TensorId`] as graph constants.
pub(super) struct Weights<'a> {
    spec: &'a ModelSpec,
    by_name: BTreeMap<String, Weight>,
    /// Rotation constants by input width, created on first use.
    rotations: BTreeMap<usize, RotationConsts>,
}

impl<'a> Weights<'a> {
    pub(super) fn new(spec: &'a ModelSpec, by_name: BTreeMap<String, Weight>) -> Self {
        Weights {
            spec,
            by_name,
            rotations: BTreeMap::new(),
        }
    }

    /// The constants of tensor `id`, every value multiplied by `scale` (the LUTs of a
    /// palettized one: k-means is scale-equivariant).
    pub(super) fn linear(
        &mut self,
        b: &mut Builder,
        id: TensorId,
        scale: f64,
    ) -> Result<LinearWeight, GraphError> {
        let name = id.hf_name();
        let shape = id.shape(self.spec);
        let w = self
            .by_name
            .remove(&name)
            .ok_or_else(|| GraphError::Unsupported(format!("weight `{name}` was not provided")))?;
        match w {
            Weight::Dense(mut vals) => {
                if scale != 1.0 {
                    for x in &mut vals {
                        *x = f16::from_f64(x.to_f64() * scale);
                    }
                }
                let c = b.constant(&mil_name(&name), shape, ConstData::F16(vals), Some(name));
                Ok(LinearWeight {
                    parts: vec![c],
                    restore: None,
                    scale: None,
                    rotation: None,
                })
            }
            Weight::Quantized(q) => self.quantized(b, &name, shape, q, scale),
        }
    }

    /// Tensor `id` as provided (its name and shape too), for a caller that lays it out itself
    /// (the embedding and lm_head, [`super::logits`]).
    pub(super) fn take(
        &mut self,
        id: TensorId,
    ) -> Result<(String, Vec<usize>, Weight), GraphError> {
        let name = id.hf_name();
        let w = self
            .by_name
            .remove(&name)
            .ok_or_else(|| GraphError::Unsupported(format!("weight `{name}` was not provided")))?;
        let shape = id.shape(self.spec);
        Ok((name, shape, w))
    }

    /// The single constant of tensor `id` (a norm, a bias, the embedding): an error if it is a
    /// calibrated projection.
    pub(super) fn single(&mut self, b: &mut Builder, id: TensorId) -> Result<String, GraphError> {
        self.linear(b, id, 1.0)?.single(&id.hf_name())
    }

    fn quantized(
        &mut self,
        b: &mut Builder,
        name: &str,
        shape: Vec<usize>,
        q: QuantizedWeight,
        scale: f64,
    ) -> Result<LinearWeight, GraphError> {
        let rows = q.rows();
        let cols = shape.get(1).copied().unwrap_or(1);
        if let Some(mut g) = (b.target().grouped_luts() && shape.len() == 2 && rows == shape[0])
            .then(|| q.grouped_lut(cols))
            .flatten()
        {
            g.scale(scale);
            let c = b.constant(
                &mil_name(name),
                shape,
                ConstData::GroupedLut(g),
                Some(name.to_string()),
            );
            return Ok(LinearWeight {
                parts: vec![c],
                restore: None,
                scale: None,
                rotation: self.rotation(b, q.rotated, cols),
            });
        }
        let n = q.groups.len();
        if (!q.is_plain() && shape.len() != 2) || shape.first() != Some(&rows) {
            return Err(GraphError::Unsupported(format!(
                "`{name}`: row groups cover {rows} rows of {shape:?}"
            )));
        }
        let source = Some(name.to_string());
        let mut parts = Vec::with_capacity(n);
        for (g, mut group) in q.groups.into_iter().enumerate() {
            group.lut.scale(scale);
            let (cname, cshape) = if n == 1 {
                (mil_name(name), shape.clone())
            } else {
                (
                    format!("{}_g{g}", mil_name(name)),
                    vec![group.rows, shape[1]],
                )
            };
            parts.push(b.constant(&cname, cshape, ConstData::Lut(group.lut), source.clone()));
        }
        let restore = match q.restore {
            Some(at) => {
                check_permutation(name, &at, rows)?;
                Some(b.constant(
                    &format!("{}_restore", mil_name(name)),
                    vec![rows],
                    ConstData::I32(at.into_iter().map(|i| i as i32).collect()),
                    source.clone(),
                ))
            }
            None => None,
        };
        let scale = q.row_scale.map(|s| {
            b.constant(
                &format!("{}_row_scale", mil_name(name)),
                vec![rows],
                ConstData::F16(s),
                source.clone(),
            )
        });
        let rotation = self.rotation(b, q.rotated, cols);
        Ok(LinearWeight {
            parts,
            restore,
            scale,
            rotation,
        })
    }

    /// The input rotation of width `cols`, if the weight was stored rotated.
    fn rotation(&mut self, b: &mut Builder, rotated: bool, cols: usize) -> Option<RotationConsts> {
        rotated.then(|| {
            self.rotations
                .entry(cols)
                .or_insert_with(|| rotation_constants(b, cols))
                .clone()
        })
    }

    /// Every weight has been placed: one left over has no place in the architecture.
    pub(super) fn finish(self) -> Result<(), GraphError> {
        match self.by_name.keys().next() {
            Some(extra) => Err(GraphError::Unsupported(format!(
                "weight `{extra}` was provided but the architecture has no place for it"
            ))),
            None => Ok(()),
        }
    }
}

/// `at` must put each of `rows` rows somewhere, once.
fn check_permutation(name: &str, at: &[u32], rows: usize) -> Result<(), GraphError> {
    let mut seen = vec![false; rows];
    for &i in at {
        match seen.get_mut(i as usize) {
            Some(s) if !*s => *s = true,
            _ => {
                return Err(GraphError::Unsupported(format!(
                    "`{name}`: the row order of its groups is not a permutation of its {rows} \
                     rows"
                )))
            }
        }
    }
    if at.len() != rows {
        return Err(GraphError::Unsupported(format!(
            "`{name}`: the row order of its groups has {} rows, not {rows}",
            at.len()
        )));
    }
    Ok(())
}

/// Builds one block's projections; q/k/v and gate/up share their rotated input (x·Q once per
/// input).
pub(super) struct Projections {
    /// Q: tokens per step.
    q: usize,
    rotated_inputs: BTreeMap<(String, usize), String>,
}

impl Projections {
    pub(super) fn new(q: usize) -> Self {
        Projections {
            q,
            rotated_inputs: BTreeMap::new(),
        }
    }

    /// `out = input·Wᵀ (+ bias)` for a dense, palettized or calibrated `w`.
    pub(super) fn apply(
        &mut self,
        b: &mut Builder,
        w: LinearWeight,
        bias: Option<String>,
        input: &str,
        out: &str,
    ) -> String {
        // A rotated weight W·Q reads x·Q.
        let q = self.q;
        let input = match &w.rotation {
            Some(r) => self
                .rotated_inputs
                .entry((input.to_string(), r.n))
                .or_insert_with(|| rotate_input(b, input, r, q, &format!("{out}_input_rotated")))
                .clone(),
            None => input.to_string(),
        };
        // The bias joins the linear only when nothing is applied after it.
        let plain = w.parts.len() == 1 && w.scale.is_none();
        let y_name = if plain {
            out.to_string()
        } else {
            format!("{out}_unscaled")
        };
        let y = if w.parts.len() == 1 {
            linear(
                b,
                &input,
                &w.parts[0],
                bias.as_ref().filter(|_| plain),
                &y_name,
            )
        } else {
            grouped(b, &input, &w, out, &y_name)
        };
        if plain {
            return y;
        }
        let scaled_name = if bias.is_some() {
            format!("{out}_scaled")
        } else {
            out.to_string()
        };
        let y = match &w.scale {
            Some(sc) => b.op(Op::Mul, &scaled_name, vec![("x", var(&y)), ("y", var(sc))]),
            None if bias.is_some() => y,
            None => b.op(Op::Identity, out, vec![("x", var(&y))]),
        };
        match bias {
            Some(bn) => b.op(Op::Add, out, vec![("x", var(&y)), ("y", var(&bn))]),
            None => y,
        }
    }
}

fn linear(b: &mut Builder, x: &str, w: &str, bias: Option<&String>, name: &str) -> String {
    let mut args = vec![("x", var(x)), ("weight", var(w))];
    if let Some(bn) = bias {
        args.push(("bias", var(bn)));
    }
    b.op(Op::Linear, name, args)
}

/// One linear per row group, outputs concatenated, then gathered back to row order if needed.
fn grouped(b: &mut Builder, x: &str, w: &LinearWeight, out: &str, y_name: &str) -> String {
    let outs: Vec<String> = w
        .parts
        .iter()
        .enumerate()
        .map(|(g, part)| linear(b, x, part, None, &format!("{out}_g{g}")))
        .collect();
    let cat_name = match &w.restore {
        Some(_) => format!("{out}_grouped"),
        None => y_name.to_string(),
    };
    let cat = b.op(
        Op::Concat,
        &cat_name,
        vec![
            ("values", Arg::Vars(outs)),
            ("axis", Arg::Int(-1)),
            ("interleave", Arg::Bool(false)),
        ],
    );
    match &w.restore {
        Some(at) => b.op(
            Op::Gather,
            y_name,
            vec![
                ("x", var(&cat)),
                ("indices", var(at)),
                ("axis", Arg::Int(-1)),
            ],
        ),
        None => cat,
    }
}

/// x·Q for x [1, q, n], factored: a `mul` by the signs, a `linear` by H_b/√b on [q, m, b]
/// (MIL's `linear` takes inputs of rank 3 at most), a `matmul` by Mᵀ (mixing the m blocks),
/// back to [1, q, n].
fn rotate_input(b: &mut Builder, x: &str, r: &RotationConsts, q: usize, name: &str) -> String {
    let (n, bs) = (r.n as i64, r.block as i64);
    let signed = b.op(
        Op::Mul,
        &format!("{name}_signed"),
        vec![("x", var(x)), ("y", var(&r.signs))],
    );
    let blocks = b.op(
        Op::Reshape,
        &format!("{name}_blocks"),
        vec![
            ("x", var(&signed)),
            ("shape", ints(&[q as i64, n / bs, bs])),
        ],
    );
    let mut z = b.op(
        Op::Linear,
        &format!("{name}_hadamard"),
        vec![("x", var(&blocks)), ("weight", var(&r.hadamard))],
    );
    if let Some(mix) = &r.mix {
        z = b.op(
            Op::Matmul,
            &format!("{name}_mixed"),
            vec![
                ("x", var(mix)),
                ("y", var(&z)),
                ("transpose_x", Arg::Bool(false)),
                ("transpose_y", Arg::Bool(false)),
            ],
        );
    }
    b.op(
        Op::Reshape,
        name,
        vec![("x", var(&z)), ("shape", ints(&[1, q as i64, n]))],
    )
}
