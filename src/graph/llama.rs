//! The contract-v1 decode/chunk step for the Llama family (Llama, Mistral, Qwen2).
//!
//! Inputs and outputs follow DESIGN.md's contract exactly. What the graph is made of follows
//! FORMAT.md, "Verified here": gathered RoPE tables, the cache mask from `less(arange(S),
//! position)` → `select` → `tile`, concatenated with a constant causal block; per-layer
//! `slice_by_index` of the caches; GQA by reshape → tile → reshape; rotate-half RoPE with
//! `split` + `concat`; the key/value updates as a `concat` of per-layer rows along axis 0.

use std::collections::BTreeMap;

use half::f16;

use super::scaling::Scaling;
use super::{ints, rope, var, Arg, Builder, ConstData, DType, Graph, GraphError, Palettized};
use crate::arch::ModelSpec;
use crate::arch::{self, mil_name, TensorSlot};
use crate::mil::contract;

/// Masked attention scores: large and finite, because -inf turns a fully masked row into NaN
/// and fp16 has no room for anything below -65,504 anyway.
pub const MASK_VALUE: f32 = -30_000.0;

/// A weight as the graph stores it.
#[derive(Debug, Clone, PartialEq)]
pub enum Weight {
    Dense(Vec<f16>),
    Palettized(Palettized),
    /// A calibrated projection (issue 7): row groups each palettized with its own LUT and bit
    /// width (one `constexpr_lut_to_dense` + `linear` per group, outputs concatenated, then a
    /// `gather` back to row order if the groups are not contiguous runs in order), then an
    /// optional fp16 per-row scale applied with one `mul` (before the bias, if any).
    Calibrated(CalibratedWeight),
}

/// See [`Weight::Calibrated`].
#[derive(Debug, Clone, PartialEq)]
pub struct CalibratedWeight {
    /// (rows, palettized rows) per group; rows sum to the tensor's rows.
    pub groups: Vec<(usize, Palettized)>,
    /// With groups that are not contiguous runs in row order: for each row, its position in
    /// the groups' concatenated outputs (a `gather` along the last axis restores row order).
    pub restore: Option<Vec<u32>>,
    pub row_scale: Option<Vec<f16>>,
    /// The stored weight is W·Q for the input rotation Q of its width
    /// ([`crate::quant::sequential::Rotation`]): the input is rotated (x·Q, factored: see
    /// `rotate_input`) first, with constants shared by every projection of that width.
    pub rotated: bool,
}

/// A projection weight as the graph references it.
#[derive(Debug, Clone, PartialEq)]
struct LinearWeight {
    /// One constant per row group (one for dense and plain palettized weights).
    parts: Vec<String>,
    /// The int32 positions that put the parts' concatenated outputs back in row order.
    restore: Option<String>,
    scale: Option<String>,
    /// The input rotation's constants, if the input must be rotated first.
    rotation: Option<RotationConsts>,
}

impl LinearWeight {
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

/// The constants of one input width's rotation ([`crate::quant::sequential::Rotation`]),
/// shared by every projection reading that width.
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
    let r = crate::quant::sequential::Rotation::new(n);
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

/// x·Q for x [1, q, n], factored: a `mul` by the signs, a `linear` by H_b/√b on [q, m, b]
/// (MIL's `linear` takes inputs of rank 3 at most), a `matmul` by Mᵀ (mixing the m blocks),
/// back to [1, q, n].
fn rotate_input(b: &mut Builder, x: &str, r: &RotationConsts, q: usize, name: &str) -> String {
    let (n, bs) = (r.n as i64, r.block as i64);
    let signed = b.op(
        "mul",
        &format!("{name}_signed"),
        vec![("x", var(x)), ("y", var(&r.signs))],
    );
    let blocks = b.op(
        "reshape",
        &format!("{name}_blocks"),
        vec![
            ("x", var(&signed)),
            ("shape", ints(&[q as i64, n / bs, bs])),
        ],
    );
    let mut z = b.op(
        "linear",
        &format!("{name}_hadamard"),
        vec![("x", var(&blocks)), ("weight", var(&r.hadamard))],
    );
    if let Some(mix) = &r.mix {
        z = b.op(
            "matmul",
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
        "reshape",
        name,
        vec![("x", var(&z)), ("shape", ints(&[1, q as i64, n]))],
    )
}

/// Fixed dimensions and numerics of one package.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOptions {
    /// S: cache rows.
    pub max_seq_len: usize,
    /// Q: tokens per step.
    pub query_len: usize,
    /// The float type the program computes in.
    pub float: DType,
    pub scaling: Scaling,
}

/// Build the step graph. `weights` holds every slot of [`arch::expected_tensors`], by checkpoint
/// name; they are moved into the graph.
pub fn build(
    spec: &ModelSpec,
    mut weights: BTreeMap<String, Weight>,
    opts: &StepOptions,
) -> Result<Graph, GraphError> {
    let s = opts.max_seq_len;
    let q = opts.query_len;
    let l_count = spec.num_hidden_layers;
    let h = spec.num_attention_heads;
    let hkv = spec.num_key_value_heads;
    let d = spec.head_dim;
    if s == 0 || q == 0 || q > s {
        return Err(GraphError::Unsupported(format!(
            "query length {q} and max sequence length {s}: need 1 <= Q <= S"
        )));
    }
    if d % 2 != 0 || h % hkv != 0 {
        return Err(GraphError::Unsupported(format!(
            "head_dim {d} must be even and {h} query heads a multiple of {hkv} key/value heads"
        )));
    }
    if !matches!(opts.float, DType::Fp16 | DType::Fp32) {
        return Err(GraphError::Unsupported(format!(
            "float type {} is not a float",
            opts.float.as_str()
        )));
    }
    let alpha = opts.scaling.residual_scale;
    let fl = opts.float;
    let mut b = Builder::new(fl);
    let slots: BTreeMap<String, TensorSlot> = arch::expected_tensors(spec)
        .into_iter()
        .map(|t| (t.name.clone(), t))
        .collect();

    // Inputs, in contract order.
    let input_ids = b.input(contract::INPUT_IDS, DType::Int32, vec![1, q]);
    let position = b.input(contract::POSITION, DType::Int32, vec![1]);
    let key_cache = b.input(contract::KEY_CACHE, fl, vec![l_count, hkv, s, d]);
    let value_cache = b.input(contract::VALUE_CACHE, fl, vec![l_count, hkv, s, d]);

    let mut rotations: BTreeMap<usize, RotationConsts> = BTreeMap::new();
    let mut weight =
        |b: &mut Builder, name: &str, scale: f64| -> Result<LinearWeight, GraphError> {
            let slot = slots
                .get(name)
                .ok_or_else(|| GraphError::Unsupported(format!("no tensor slot `{name}`")))?;
            let w = weights.remove(name).ok_or_else(|| {
                GraphError::Unsupported(format!("weight `{name}` was not provided"))
            })?;
            // k-means is scale-equivariant: scaling a LUT equals palettizing the scaled tensor.
            let scale_lut = |p: &mut Palettized| {
                if scale != 1.0 {
                    for x in &mut p.lut {
                        *x = f16::from_f64(x.to_f64() * scale);
                    }
                }
            };
            let one = |b: &mut Builder, data: ConstData| LinearWeight {
                parts: vec![b.constant(
                    &mil_name(name),
                    slot.shape.clone(),
                    data,
                    Some(name.to_string()),
                )],
                restore: None,
                scale: None,
                rotation: None,
            };
            Ok(match w {
                Weight::Dense(mut vals) => {
                    if scale != 1.0 {
                        for x in &mut vals {
                            *x = f16::from_f64(x.to_f64() * scale);
                        }
                    }
                    one(b, ConstData::F16(vals))
                }
                Weight::Palettized(mut p) => {
                    scale_lut(&mut p);
                    one(b, ConstData::Lut(p))
                }
                Weight::Calibrated(c) => {
                    let rows: usize = c.groups.iter().map(|(r, _)| r).sum();
                    if slot.shape.len() != 2 || rows != slot.shape[0] {
                        return Err(GraphError::Unsupported(format!(
                            "`{name}`: row groups cover {rows} rows of {:?}",
                            slot.shape
                        )));
                    }
                    let n = c.groups.len();
                    let mut parts = Vec::with_capacity(n);
                    for (g, (r, mut p)) in c.groups.into_iter().enumerate() {
                        scale_lut(&mut p);
                        let cname = if n == 1 {
                            mil_name(name)
                        } else {
                            format!("{}_g{g}", mil_name(name))
                        };
                        parts.push(b.constant(
                            &cname,
                            vec![r, slot.shape[1]],
                            ConstData::Lut(p),
                            Some(name.to_string()),
                        ));
                    }
                    let restore = match c.restore {
                        Some(at) => {
                            let mut seen = vec![false; rows];
                            for &i in &at {
                                match seen.get_mut(i as usize) {
                                    Some(s) if !*s => *s = true,
                                    _ => {
                                        return Err(GraphError::Unsupported(format!(
                                            "`{name}`: the row order of its groups is not a \
                                             permutation of its {rows} rows"
                                        )))
                                    }
                                }
                            }
                            if at.len() != rows {
                                return Err(GraphError::Unsupported(format!(
                                    "`{name}`: the row order of its groups has {} rows, not \
                                     {rows}",
                                    at.len()
                                )));
                            }
                            Some(b.constant(
                                &format!("{}_restore", mil_name(name)),
                                vec![rows],
                                ConstData::I32(at.into_iter().map(|i| i as i32).collect()),
                                Some(name.to_string()),
                            ))
                        }
                        None => None,
                    };
                    let scale = c.row_scale.map(|s| {
                        b.constant(
                            &format!("{}_row_scale", mil_name(name)),
                            vec![rows],
                            ConstData::F16(s),
                            Some(name.to_string()),
                        )
                    });
                    let rotation = c.rotated.then(|| {
                        let cols = slot.shape[1];
                        rotations
                            .entry(cols)
                            .or_insert_with(|| rotation_constants(b, cols))
                            .clone()
                    });
                    LinearWeight {
                        parts,
                        restore,
                        scale,
                        rotation,
                    }
                }
            })
        };

    // Shared constants: RoPE tables, position offsets, mask pieces.
    let inv = rope::inv_freq(d, spec.rope_theta, &spec.rope_scaling);
    let (cos_t, sin_t) = rope::tables(s, d, &inv);
    let to16 = |v: Vec<f64>| v.into_iter().map(f16::from_f64).collect::<Vec<_>>();
    let cos_table = b.constant("rope_cos", vec![s, d], ConstData::F16(to16(cos_t)), None);
    let sin_table = b.constant("rope_sin", vec![s, d], ConstData::F16(to16(sin_t)), None);
    let arange_q = b.constant(
        "arange_q",
        vec![q],
        ConstData::I32((0..q as i32).collect()),
        None,
    );
    let arange_s = b.constant(
        "arange_s",
        vec![s],
        ConstData::I32((0..s as i32).collect()),
        None,
    );
    let zeros_s = b.constant(
        "mask_open",
        vec![s],
        ConstData::F16(vec![f16::ZERO; s]),
        None,
    );
    let neg_s = b.constant(
        "mask_closed",
        vec![s],
        ConstData::F16(vec![f16::from_f32(MASK_VALUE); s]),
        None,
    );
    let causal: Vec<f16> = (0..q)
        .flat_map(|i| {
            (0..q).map(move |k| {
                if k <= i {
                    f16::ZERO
                } else {
                    f16::from_f32(MASK_VALUE)
                }
            })
        })
        .collect();
    let causal = b.constant("mask_causal", vec![q, q], ConstData::F16(causal), None);

    // Positions p .. p+Q-1 → cos/sin rows [Q, D].
    let pos_ids = b.op(
        "add",
        "position_ids",
        vec![("x", var(&position)), ("y", var(&arange_q))],
    );
    let cos = b.op(
        "gather",
        "rope_cos_rows",
        vec![
            ("x", var(&cos_table)),
            ("indices", var(&pos_ids)),
            ("axis", Arg::Int(0)),
        ],
    );
    let sin = b.op(
        "gather",
        "rope_sin_rows",
        vec![
            ("x", var(&sin_table)),
            ("indices", var(&pos_ids)),
            ("axis", Arg::Int(0)),
        ],
    );

    // Mask [Q, S+Q]: cache row j visible iff j < p; new token k visible from i iff k <= i.
    let visible = b.op(
        "less",
        "mask_cache_visible",
        vec![("x", var(&arange_s)), ("y", var(&position))],
    );
    let row = b.op(
        "select",
        "mask_cache_row",
        vec![
            ("cond", var(&visible)),
            ("a", var(&zeros_s)),
            ("b", var(&neg_s)),
        ],
    );
    let row = b.op(
        "reshape",
        "mask_cache_row_2d",
        vec![("x", var(&row)), ("shape", ints(&[1, s as i64]))],
    );
    let cache_mask = b.op(
        "tile",
        "mask_cache",
        vec![("x", var(&row)), ("reps", ints(&[q as i64, 1]))],
    );
    let mask = b.op(
        "concat",
        "mask",
        vec![
            ("values", Arg::Vars(vec![cache_mask, causal])),
            ("axis", Arg::Int(-1)),
            ("interleave", Arg::Bool(false)),
        ],
    );

    // Embedding. The table is not scaled in place: when tied it is also the lm_head.
    let embed_name = "model.embed_tokens.weight";
    let embed = weight(&mut b, embed_name, 1.0)?.single(embed_name)?;
    let mut x = b.op(
        "gather",
        "embed",
        vec![
            ("x", var(&embed)),
            ("indices", var(&input_ids)),
            ("axis", Arg::Int(0)),
        ],
    );
    if alpha != 1.0 {
        x = b.op(
            "mul",
            "embed_scaled",
            vec![("x", var(&x)), ("y", Arg::Float(alpha))],
        );
    }
    // RMSNorm(αx) with ε·α² equals RMSNorm(x) with ε.
    let eps = spec.rms_norm_eps * alpha * alpha;
    let q_scale = 1.0 / (d as f64).sqrt();

    let mut key_rows = Vec::with_capacity(l_count);
    let mut value_rows = Vec::with_capacity(l_count);
    for l in 0..l_count {
        let p = format!("model.layers.{l}");
        let tag = format!("layers_{l}");
        let n_in = format!("{p}.input_layernorm.weight");
        let nw = weight(&mut b, &n_in, 1.0)?.single(&n_in)?;
        let hn = rms_norm(&mut b, &x, &nw, eps, &format!("{tag}_input_norm"));

        // x·Q once per input: q/k/v and gate/up share their rotated input.
        let mut rotated_inputs: BTreeMap<(String, usize), String> = BTreeMap::new();
        let mut proj = |b: &mut Builder,
                        w: LinearWeight,
                        bias: Option<String>,
                        input: &str,
                        out: &str|
         -> String {
            // A rotated weight W·Q reads x·Q.
            let rotated;
            let input: &str = match &w.rotation {
                Some(r) => {
                    rotated = rotated_inputs
                        .entry((input.to_string(), r.n))
                        .or_insert_with(|| {
                            rotate_input(b, input, r, q, &format!("{out}_input_rotated"))
                        })
                        .clone();
                    &rotated
                }
                None => input,
            };
            let linear = |b: &mut Builder, wname: &str, bias: Option<&String>, name: &str| {
                let mut args = vec![("x", var(input)), ("weight", var(wname))];
                if let Some(bn) = bias {
                    args.push(("bias", var(bn)));
                }
                b.op("linear", name, args)
            };
            // The bias joins the linear only when nothing is applied after it.
            let plain = w.parts.len() == 1 && w.scale.is_none();
            let y_name = if plain {
                out.to_string()
            } else {
                format!("{out}_unscaled")
            };
            let y = if w.parts.len() == 1 {
                linear(b, &w.parts[0], bias.as_ref().filter(|_| plain), &y_name)
            } else {
                let outs: Vec<String> = w
                    .parts
                    .iter()
                    .enumerate()
                    .map(|(g, part)| linear(b, part, None, &format!("{out}_g{g}")))
                    .collect();
                let cat_name = match &w.restore {
                    Some(_) => format!("{out}_grouped"),
                    None => y_name.clone(),
                };
                let cat = b.op(
                    "concat",
                    &cat_name,
                    vec![
                        ("values", Arg::Vars(outs)),
                        ("axis", Arg::Int(-1)),
                        ("interleave", Arg::Bool(false)),
                    ],
                );
                match &w.restore {
                    Some(at) => b.op(
                        "gather",
                        &y_name,
                        vec![
                            ("x", var(&cat)),
                            ("indices", var(at)),
                            ("axis", Arg::Int(-1)),
                        ],
                    ),
                    None => cat,
                }
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
                Some(sc) => b.op("mul", &scaled_name, vec![("x", var(&y)), ("y", var(sc))]),
                None if bias.is_some() => y,
                None => b.op("identity", out, vec![("x", var(&y))]),
            };
            match bias {
                Some(bn) => b.op("add", out, vec![("x", var(&y)), ("y", var(&bn))]),
                None => y,
            }
        };
        let mut biases = [None, None, None];
        let wq = weight(&mut b, &format!("{p}.self_attn.q_proj.weight"), 1.0)?;
        let wk = weight(&mut b, &format!("{p}.self_attn.k_proj.weight"), 1.0)?;
        let wv = weight(&mut b, &format!("{p}.self_attn.v_proj.weight"), 1.0)?;
        if spec.attention_bias {
            for (i, n) in ["q", "k", "v"].iter().enumerate() {
                let bn = format!("{p}.self_attn.{n}_proj.bias");
                biases[i] = Some(weight(&mut b, &bn, 1.0)?.single(&bn)?);
            }
        }
        let [bq, bk, bv] = biases;
        let qp = proj(&mut b, wq, bq, &hn, &format!("{tag}_q"));
        let kp = proj(&mut b, wk, bk, &hn, &format!("{tag}_k"));
        let vp = proj(&mut b, wv, bv, &hn, &format!("{tag}_v"));

        let heads = |b: &mut Builder, t: &str, n: usize, name: &str| {
            let r = b.op(
                "reshape",
                &format!("{name}_heads"),
                vec![
                    ("x", var(t)),
                    ("shape", ints(&[1, q as i64, n as i64, d as i64])),
                ],
            );
            b.op(
                "transpose",
                &format!("{name}_bhqd"),
                vec![("x", var(&r)), ("perm", ints(&[0, 2, 1, 3]))],
            )
        };
        let qh = heads(&mut b, &qp, h, &format!("{tag}_q"));
        let kh = heads(&mut b, &kp, hkv, &format!("{tag}_k"));
        let vh = heads(&mut b, &vp, hkv, &format!("{tag}_v"));
        let qr = apply_rope(&mut b, &qh, &cos, &sin, &format!("{tag}_q_rope"));
        let kr = apply_rope(&mut b, &kh, &cos, &sin, &format!("{tag}_k_rope"));
        let qs = b.op(
            "mul",
            &format!("{tag}_q_scaled"),
            vec![("x", var(&qr)), ("y", Arg::Float(q_scale))],
        );
        key_rows.push(kr.clone());
        value_rows.push(vh.clone());

        let layer_cache = |b: &mut Builder, cache: &str, name: &str| {
            b.op(
                "slice_by_index",
                name,
                vec![
                    ("x", var(cache)),
                    ("begin", ints(&[l as i64, 0, 0, 0])),
                    ("end", ints(&[l as i64 + 1, hkv as i64, s as i64, d as i64])),
                ],
            )
        };
        let kc = layer_cache(&mut b, &key_cache, &format!("{tag}_key_cache"));
        let vc = layer_cache(&mut b, &value_cache, &format!("{tag}_value_cache"));
        let cat = |b: &mut Builder, a: &str, n: &str, name: &str| {
            b.op(
                "concat",
                name,
                vec![
                    ("values", Arg::Vars(vec![a.to_string(), n.to_string()])),
                    ("axis", Arg::Int(2)),
                    ("interleave", Arg::Bool(false)),
                ],
            )
        };
        let keys = cat(&mut b, &kc, &kr, &format!("{tag}_keys"));
        let values = cat(&mut b, &vc, &vh, &format!("{tag}_values"));
        let keys = expand_kv(
            &mut b,
            &keys,
            hkv,
            h / hkv,
            s + q,
            d,
            &format!("{tag}_keys"),
        );
        let values = expand_kv(
            &mut b,
            &values,
            hkv,
            h / hkv,
            s + q,
            d,
            &format!("{tag}_values"),
        );
        let scores = b.op(
            "matmul",
            &format!("{tag}_scores"),
            vec![
                ("x", var(&qs)),
                ("y", var(&keys)),
                ("transpose_x", Arg::Bool(false)),
                ("transpose_y", Arg::Bool(true)),
            ],
        );
        let scores = b.op(
            "add",
            &format!("{tag}_scores_masked"),
            vec![("x", var(&scores)), ("y", var(&mask))],
        );
        let probs = b.op(
            "softmax",
            &format!("{tag}_probs"),
            vec![("x", var(&scores)), ("axis", Arg::Int(-1))],
        );
        let ctx = b.op(
            "matmul",
            &format!("{tag}_context"),
            vec![
                ("x", var(&probs)),
                ("y", var(&values)),
                ("transpose_x", Arg::Bool(false)),
                ("transpose_y", Arg::Bool(false)),
            ],
        );
        let ctx = b.op(
            "transpose",
            &format!("{tag}_context_bqhd"),
            vec![("x", var(&ctx)), ("perm", ints(&[0, 2, 1, 3]))],
        );
        let ctx = b.op(
            "reshape",
            &format!("{tag}_context_flat"),
            vec![
                ("x", var(&ctx)),
                ("shape", ints(&[1, q as i64, (h * d) as i64])),
            ],
        );
        let wo = weight(&mut b, &format!("{p}.self_attn.o_proj.weight"), alpha)?;
        let attn = proj(&mut b, wo, None, &ctx, &format!("{tag}_attn_out"));
        x = b.op(
            "add",
            &format!("{tag}_residual_attn"),
            vec![("x", var(&x)), ("y", var(&attn))],
        );

        let n_post = format!("{p}.post_attention_layernorm.weight");
        let nw = weight(&mut b, &n_post, 1.0)?.single(&n_post)?;
        let hn = rms_norm(&mut b, &x, &nw, eps, &format!("{tag}_post_norm"));
        let wg = weight(&mut b, &format!("{p}.mlp.gate_proj.weight"), 1.0)?;
        let wu = weight(&mut b, &format!("{p}.mlp.up_proj.weight"), 1.0)?;
        let wd = weight(&mut b, &format!("{p}.mlp.down_proj.weight"), alpha)?;
        let g = proj(&mut b, wg, None, &hn, &format!("{tag}_gate"));
        let g = b.op("silu", &format!("{tag}_gate_act"), vec![("x", var(&g))]);
        let u = proj(&mut b, wu, None, &hn, &format!("{tag}_up"));
        let gu = b.op(
            "mul",
            &format!("{tag}_gate_up"),
            vec![("x", var(&g)), ("y", var(&u))],
        );
        let down = proj(&mut b, wd, None, &gu, &format!("{tag}_mlp_out"));
        x = b.op(
            "add",
            &format!("{tag}_residual_mlp"),
            vec![("x", var(&x)), ("y", var(&down))],
        );
    }

    let nw = weight(&mut b, "model.norm.weight", 1.0)?.single("model.norm.weight")?;
    let hn = rms_norm(&mut b, &x, &nw, eps, "final_norm");
    let head = if spec.tie_word_embeddings {
        embed
    } else {
        weight(&mut b, "lm_head.weight", 1.0)?.single("lm_head.weight")?
    };
    let logits = b.op(
        "linear",
        contract::LOGITS,
        vec![("x", var(&hn)), ("weight", var(&head))],
    );
    let stack = |b: &mut Builder, rows: Vec<String>, name: &str| {
        if rows.len() == 1 {
            b.op("identity", name, vec![("x", var(&rows[0]))])
        } else {
            b.op(
                "concat",
                name,
                vec![
                    ("values", Arg::Vars(rows)),
                    ("axis", Arg::Int(0)),
                    ("interleave", Arg::Bool(false)),
                ],
            )
        }
    };
    let ku = stack(&mut b, key_rows, contract::KEY_UPDATE);
    let vu = stack(&mut b, value_rows, contract::VALUE_UPDATE);
    if let Some(extra) = weights.keys().next() {
        return Err(GraphError::Unsupported(format!(
            "weight `{extra}` was provided but the architecture has no place for it"
        )));
    }
    b.finish(vec![logits, ku, vu])
}

/// x / sqrt(mean(x²) + ε) · w, the way Hugging Face computes it (ε inside the root).
fn rms_norm(b: &mut Builder, x: &str, w: &str, eps: f64, name: &str) -> String {
    let sq = b.op(
        "mul",
        &format!("{name}_sq"),
        vec![("x", var(x)), ("y", var(x))],
    );
    let ms = b.op(
        "reduce_mean",
        &format!("{name}_mean"),
        vec![
            ("x", var(&sq)),
            ("axes", ints(&[-1])),
            ("keep_dims", Arg::Bool(true)),
        ],
    );
    let r = b.op(
        "rsqrt",
        &format!("{name}_rsqrt"),
        vec![("x", var(&ms)), ("epsilon", Arg::Float(eps))],
    );
    let n = b.op(
        "mul",
        &format!("{name}_normed"),
        vec![("x", var(x)), ("y", var(&r))],
    );
    b.op("mul", name, vec![("x", var(&n)), ("y", var(w))])
}

/// x·cos + rotate_half(x)·sin with rotate_half([a, b]) = [-b, a] along the last axis.
fn apply_rope(b: &mut Builder, x: &str, cos: &str, sin: &str, name: &str) -> String {
    let halves = b.op_multi(
        "split",
        &[&format!("{name}_lo"), &format!("{name}_hi")],
        vec![
            ("x", var(x)),
            ("num_splits", Arg::Int(2)),
            ("axis", Arg::Int(-1)),
        ],
    );
    let neg_hi = b.op(
        "mul",
        &format!("{name}_neg_hi"),
        vec![("x", var(&halves[1])), ("y", Arg::Float(-1.0))],
    );
    let rot = b.op(
        "concat",
        &format!("{name}_rotated"),
        vec![
            ("values", Arg::Vars(vec![neg_hi, halves[0].clone()])),
            ("axis", Arg::Int(-1)),
            ("interleave", Arg::Bool(false)),
        ],
    );
    let xc = b.op(
        "mul",
        &format!("{name}_cos"),
        vec![("x", var(x)), ("y", var(cos))],
    );
    let rs = b.op(
        "mul",
        &format!("{name}_sin"),
        vec![("x", var(&rot)), ("y", var(sin))],
    );
    b.op("add", name, vec![("x", var(&xc)), ("y", var(&rs))])
}

/// [1, Hkv, N, D] → [1, Hkv·g, N, D], query head i reading key/value head i / g.
fn expand_kv(
    b: &mut Builder,
    x: &str,
    hkv: usize,
    groups: usize,
    n: usize,
    d: usize,
    name: &str,
) -> String {
    if groups == 1 {
        return x.to_string();
    }
    let r = b.op(
        "reshape",
        &format!("{name}_grouped"),
        vec![
            ("x", var(x)),
            ("shape", ints(&[1, hkv as i64, 1, n as i64, d as i64])),
        ],
    );
    let t = b.op(
        "tile",
        &format!("{name}_tiled"),
        vec![("x", var(&r)), ("reps", ints(&[1, 1, groups as i64, 1, 1]))],
    );
    b.op(
        "reshape",
        &format!("{name}_expanded"),
        vec![
            ("x", var(&t)),
            (
                "shape",
                ints(&[1, (hkv * groups) as i64, n as i64, d as i64]),
            ),
        ],
    )
}

/// Checkpoint tensors as dense fp16 weights (the all-fp16 recipe).
pub fn dense_weights(
    ckpt: &crate::checkpoint::Checkpoint,
) -> Result<BTreeMap<String, Weight>, crate::checkpoint::CheckpointError> {
    let mut out = BTreeMap::new();
    for slot in ckpt.slots() {
        let t = ckpt.tensor(&slot.name)?;
        out.insert(slot.name.clone(), Weight::Dense(t.to_f16()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::Checkpoint;
    use crate::graph::scaling::ActivationRanges;
    use crate::testing::TinyModel;

    fn opts(scaling: Scaling) -> StepOptions {
        StepOptions {
            max_seq_len: 16,
            query_len: 2,
            float: DType::Fp16,
            scaling,
        }
    }

    fn weights(model: &TinyModel) -> (tempfile::TempDir, BTreeMap<String, Weight>) {
        let dir = model.write_temp().unwrap();
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        let w = dense_weights(&ckpt).unwrap();
        (dir, w)
    }

    fn dense<'a>(g: &'a Graph, name: &str) -> &'a [f16] {
        match &g.consts.iter().find(|c| c.name == name).unwrap().data {
            ConstData::F16(v) => v,
            other => panic!("{name} is {other:?}"),
        }
    }

    #[test]
    fn contract_io_and_weight_consts() {
        let model = TinyModel::llama();
        let spec = model.spec();
        let (_d, w) = weights(&model);
        let g = build(&spec, w, &opts(Scaling::identity("test"))).unwrap();
        let io: Vec<(&str, Vec<usize>)> = g
            .inputs
            .iter()
            .map(|i| (i.name.as_str(), i.shape.clone()))
            .collect();
        assert_eq!(
            io,
            [
                ("input_ids", vec![1, 2]),
                ("position", vec![1]),
                ("key_cache", vec![2, 2, 16, 16]),
                ("value_cache", vec![2, 2, 16, 16]),
            ]
        );
        assert_eq!(g.outputs, ["logits", "key_update", "value_update"]);
        // Tied: the embedding const feeds both the gather and the lm_head linear.
        assert!(g.consts.iter().all(|c| c.name != "lm_head_weight"));
        let head = g.ops.iter().find(|o| o.outputs[0] == "logits").unwrap();
        assert_eq!(head.args["weight"], var("model_embed_tokens_weight"));
        // One const per checkpoint tensor, named after it.
        for slot in arch::expected_tensors(&spec) {
            let c = g.consts.iter().find(|c| c.name == mil_name(&slot.name));
            assert_eq!(c.unwrap().source.as_deref(), Some(slot.name.as_str()));
        }
        assert_eq!(g.count_ops("softmax"), spec.num_hidden_layers);
        // GQA 4/2: keys and values are expanded with a tile per layer; the mask tile is one more.
        assert_eq!(g.count_ops("tile"), 2 * spec.num_hidden_layers + 1);
    }

    #[test]
    fn mask_constants_are_finite() {
        let model = TinyModel::llama();
        let (_d, w) = weights(&model);
        let g = build(&model.spec(), w, &opts(Scaling::identity("test"))).unwrap();
        let causal = dense(&g, "mask_causal");
        assert_eq!(
            causal,
            &[f16::ZERO, f16::from_f32(MASK_VALUE), f16::ZERO, f16::ZERO]
        );
        assert!(dense(&g, "mask_closed").iter().all(|v| v.is_finite()));
    }

    #[test]
    fn residual_scale_folds_into_o_and_down_and_epsilon() {
        let model = TinyModel::qwen2();
        let spec = model.spec();
        let (_d, w) = weights(&model);
        let plain = build(&spec, w.clone(), &opts(Scaling::identity("test"))).unwrap();
        let s = Scaling::choose(&ActivationRanges {
            residual_max_abs: vec![1000.0],
            source: "test".into(),
        });
        let alpha = s.residual_scale;
        assert_eq!(alpha, 0.125);
        let scaled = build(&spec, w, &opts(s)).unwrap();
        for name in [
            "model_layers_0_self_attn_o_proj_weight",
            "model_layers_1_mlp_down_proj_weight",
        ] {
            for (a, b) in dense(&plain, name).iter().zip(dense(&scaled, name)) {
                let exact = a.to_f64() * alpha;
                assert_eq!(*b, f16::from_f64(exact));
                // Power-of-two scaling is exact unless the result is subnormal.
                if exact.abs() >= f16::MIN_POSITIVE.to_f64() {
                    assert_eq!(b.to_f64(), exact);
                }
            }
        }
        for name in [
            "model_embed_tokens_weight",
            "model_layers_0_self_attn_q_proj_weight",
            "lm_head_weight",
        ] {
            assert_eq!(dense(&plain, name), dense(&scaled, name));
        }
        assert_eq!(plain.count_ops("mul") + 1, scaled.count_ops("mul"));
        let eps = |g: &Graph| match &g.ops.iter().find(|o| o.op == "rsqrt").unwrap().args["epsilon"]
        {
            Arg::Float(e) => *e,
            other => panic!("{other:?}"),
        };
        assert_eq!(eps(&scaled), eps(&plain) * alpha * alpha);
    }

    #[test]
    fn palettized_weights_become_lut_consts_with_scaled_luts() {
        let model = TinyModel::llama();
        let spec = model.spec();
        let (_d, mut w) = weights(&model);
        // A hand-made 2-bit palettization of o_proj: all indices 0..4 in turn.
        let name = "model.layers.0.self_attn.o_proj.weight";
        let n = spec.hidden_size * spec.q_dim();
        let lut: Vec<f16> = [-0.5f32, -0.25, 0.25, 0.5].map(f16::from_f32).to_vec();
        let packed = vec![0b11_10_01_00u8; n / 4];
        w.insert(
            name.into(),
            Weight::Palettized(Palettized {
                nbits: 2,
                lut: lut.clone(),
                packed: packed.clone(),
            }),
        );
        let s = Scaling {
            residual_scale: 0.5,
            measured_max_abs: None,
            source: "test".into(),
        };
        let g = build(&spec, w, &opts(s)).unwrap();
        let c = g.consts.iter().find(|c| c.name == mil_name(name)).unwrap();
        let ConstData::Lut(p) = &c.data else {
            panic!("o_proj should be palettized")
        };
        assert_eq!(p.packed, packed);
        let halves: Vec<f16> = lut
            .iter()
            .map(|x| f16::from_f32(x.to_f32() * 0.5))
            .collect();
        assert_eq!(p.lut, halves);
        assert_eq!(c.shape, vec![spec.hidden_size, spec.q_dim()]);
    }

    #[test]
    fn missing_or_extra_weights_are_errors() {
        let model = TinyModel::llama();
        let spec = model.spec();
        let (_d, mut w) = weights(&model);
        let mut extra = w.clone();
        extra.insert("model.unused".into(), Weight::Dense(vec![]));
        assert!(build(&spec, extra, &opts(Scaling::identity("t"))).is_err());
        w.remove("model.norm.weight");
        let err = build(&spec, w, &opts(Scaling::identity("t"))).unwrap_err();
        assert!(err.to_string().contains("model.norm.weight"), "{err}");
    }

    #[test]
    fn query_longer_than_cache_is_refused() {
        let model = TinyModel::llama();
        let (_d, w) = weights(&model);
        let mut o = opts(Scaling::identity("t"));
        o.query_len = 17;
        assert!(matches!(
            build(&model.spec(), w, &o),
            Err(GraphError::Unsupported(_))
        ));
    }
}
