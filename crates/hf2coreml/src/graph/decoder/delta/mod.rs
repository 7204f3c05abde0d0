//! Qwen3.5's Gated DeltaNet block: `in_proj_qkv` through the depthwise causal convolution
//! (the short-convolution block's, [`super::causal_conv`]) and SiLU, q and k L2-normalised
//! (q times Dk^-½, key heads repeated to the value heads), then per token and value head
//! S ← S·exp(g); S ← S + k ⊗ β(v − Sᵀk); o = Sᵀq, with g = −exp(A_log)·softplus(a + dt_bias)
//! and β = sigmoid(b); o through an RMSNorm gated by silu(z), then `out_proj`.
//!
//! A decode step (Q = 1) lowers the recurrence as batched matmuls over the value heads
//! ([Hv, 1, Dk] × [Hv, Dk, Dv]), and so does a call of 2 or 3 tokens, token by token; a call
//! of 4 or more takes them in chunks of up to 64 as matrix products ([`chunk`]), fewer ops. A padded token of a prefill call has g = 0 and β = 0, so it
//! leaves S exactly as it was: the state after the call is the state after its `valid_len`
//! real tokens.

mod chunk;
pub(super) mod delta_inputs;
mod delta_ops;

use super::linear::{Projections, Weights};
use super::lower::Lowering;
use super::norms::rms_norm_ranged;
use super::shared::Shared;
use crate::arch::{GatedDelta, LayerTensor, TensorId};
use crate::graph::{ints, var, Arg, Builder, GraphError, Op};
use delta_ops::{Heads, Ops};

/// What q is multiplied by beyond Dk^-½ (a power of two: exact), and so the output Sᵀq before
/// its RMSNorm, whose ε is scaled by its square. That output is small (rows of RMS 4e-5 to
/// 3e-3 in transformers' fixture): in fp16 its squares fall below the smallest normal number
/// and its smallest values lose bits; 64 lifts them while Sᵀq stays far below fp16's largest
/// value (|q| ≤ Dk^-½ · 64 and S stays of v's size under the delta rule). The norm also divides
/// each row by its largest |x| before squaring ([`super::norms::rms_norm_ranged`]).
const OUT_PRESCALE: f64 = 64.0;

/// What the block hands back: its output [1, Q, H] (times α, as o_proj's), its new conv state
/// [1, W, C] and its new DeltaNet state [1, Hv, Dk, Dv].
pub(super) struct DeltaOut {
    pub(super) out: String,
    pub(super) conv_state: String,
    pub(super) state: String,
}

impl Ops<'_> {
    /// q and k [Q, Hv, Dk] (L2-normalised, q scaled, key heads repeated to the value heads)
    /// and v [Q, Hv, Dv] out of the convolution's output [1, Q, C].
    fn qkv_heads(&mut self, mixed: &str, h: &Heads) -> (String, String, String) {
        let Heads { q, hk, hv, dk, dv } = *h;
        let heads = |o: &mut Self, what: &str, from: i64, n: i64, d: i64| {
            let part = o.slice(what, mixed, &[0, 0, from], &[1, q, from + n * d]);
            o.reshape(&format!("{what}_heads"), &part, &[q, n, d])
        };
        let qh = heads(self, "q", 0, hk, dk);
        let kh = heads(self, "k", hk * dk, hk, dk);
        let vh = heads(self, "v", 2 * hk * dk, hv, dv);
        let qn = self.l2norm("q_l2", &qh);
        let scale = Arg::Float(OUT_PRESCALE / (dk as f64).sqrt());
        let qn = self.binary(Op::Mul, "q_scaled", &qn, scale);
        let kn = self.l2norm("k_l2", &kh);
        let repeat = |o: &mut Self, what: &str, x: &str| {
            if hv == hk {
                return x.to_string();
            }
            let x4 = o.reshape(&format!("{what}_group"), x, &[q, hk, 1, dk]);
            let tiled = o.op(
                Op::Tile,
                &format!("{what}_tiled"),
                vec![("x", var(&x4)), ("reps", ints(&[1, 1, hv / hk, 1]))],
            );
            o.reshape(&format!("{what}_repeated"), &tiled, &[q, hv, dk])
        };
        let qn = repeat(self, "q", &qn);
        let kn = repeat(self, "k", &kn);
        (qn, kn, vh)
    }

    /// The log decay g and β [1, Q, Hv] from `in_proj_b`'s and `in_proj_a`'s outputs:
    /// β = sigmoid(b); g = −exp(A_log)·softplus(a + dt_bias), softplus(x) as
    /// max(x, 0) + log(1 + exp(−|x|)) so no exp overflows; padding (`real` 0) gets g = 0, β = 0.
    fn step_gates(
        &mut self,
        (b, a): (&str, &str),
        (dt_bias, a_log): (&str, &str),
        real: Option<&str>,
    ) -> (String, String) {
        let mut beta = self.unary(Op::Sigmoid, "beta", b);
        let x = self.binary(Op::Add, "a_dt", a, var(dt_bias));
        let ax = self.unary(Op::Abs, "a_abs", &x);
        let nax = self.binary(Op::Mul, "a_neg_abs", &ax, Arg::Float(-1.0));
        let e = self.unary(Op::Exp, "a_exp", &nax);
        let e1 = self.binary(Op::Add, "a_exp1", &e, Arg::Float(1.0));
        let lg = self.unary(Op::Log, "a_log1p", &e1);
        let rx = self.unary(Op::Relu, "a_relu", &x);
        let sp = self.binary(Op::Add, "softplus", &rx, var(&lg));
        let ea = self.unary(Op::Exp, "a_exp_log", a_log);
        let neg_a = self.binary(Op::Mul, "neg_a", &ea, Arg::Float(-1.0));
        let mut gate = self.binary(Op::Mul, "g", &sp, var(&neg_a));
        if let Some(real) = real {
            gate = self.binary(Op::Mul, "g_real", &gate, var(real));
            beta = self.binary(Op::Mul, "beta_real", &beta, var(real));
        }
        (gate, beta)
    }

    /// The delta rule token by token from state `s0` [Hv, Dk, Dv]: the outputs Sᵀq
    /// [Q, Hv, Dv] and the last state.
    fn recurrence(
        &mut self,
        s0: &str,
        (qn, kn, vh): (&str, &str, &str),
        (g, beta): (&str, &str),
        h: &Heads,
    ) -> (String, String) {
        let Heads { q, hv, dk, dv, .. } = *h;
        let decay = &self.unary(Op::Exp, "decay", g);
        let mut s = s0.to_string();
        let mut outs = Vec::with_capacity(q as usize);
        for i in 0..q {
            let t = format!("t{i}");
            let row = |o: &mut Self, what: &str, x: &str, d: i64, shape: &[i64]| {
                let r = o.slice(&format!("{t}_{what}"), x, &[i, 0, 0], &[i + 1, hv, d]);
                o.reshape(&format!("{t}_{what}_r"), &r, shape)
            };
            let k_col = row(self, "k_col", kn, dk, &[hv, dk, 1]);
            let k_row = self.reshape(&format!("{t}_k_row"), &k_col, &[hv, 1, dk]);
            let q_row = row(self, "q_row", qn, dk, &[hv, 1, dk]);
            let v_row = row(self, "v_row", vh, dv, &[hv, 1, dv]);
            let per_head = |o: &mut Self, what: &str, x: &str| {
                let r = o.slice(&format!("{t}_{what}"), x, &[0, i, 0], &[1, i + 1, hv]);
                o.reshape(&format!("{t}_{what}_r"), &r, &[hv, 1, 1])
            };
            let d_i = per_head(self, "decay", decay);
            let b_i = per_head(self, "beta", beta);
            let decayed = self.binary(Op::Mul, &format!("{t}_decayed"), &s, var(&d_i));
            let mem = self.matmul(&format!("{t}_mem"), &k_row, &decayed);
            let diff = self.binary(Op::Sub, &format!("{t}_diff"), &v_row, var(&mem));
            let step = self.binary(Op::Mul, &format!("{t}_delta"), &diff, var(&b_i));
            let outer = self.matmul(&format!("{t}_outer"), &k_col, &step);
            s = self.binary(Op::Add, &format!("{t}_state"), &decayed, var(&outer));
            outs.push(self.matmul(&format!("{t}_out"), &q_row, &s));
        }
        (self.tokens_first(outs), s)
    }
}

/// Block `l`'s Gated DeltaNet over its normed input `hn` (in the layout's hidden form); `slot`
/// is its index in the conv and DeltaNet state inputs. Its core runs on [1, Q, n] in every
/// layout: the Neural Engine's turns the input projections' outputs to it and the gated
/// result back.
pub(super) fn gated_delta(
    b: &mut Builder,
    weights: &mut Weights,
    proj: &mut Projections,
    lower: &Lowering,
    shared: &Shared,
    (l, slot, g): (usize, usize, &GatedDelta),
    hn: &str,
) -> Result<DeltaOut, GraphError> {
    let missing = || GraphError::Unsupported(format!("block {l} has no DeltaNet state input"));
    let conv = shared.conv.as_ref().ok_or_else(missing)?;
    let delta = shared.delta.as_ref().ok_or_else(missing)?;
    let q = shared.dims.q as i64;
    let (hk, hv, dk, dv) = (
        g.key_heads as i64,
        g.value_heads as i64,
        g.key_dim as i64,
        g.value_dim as i64,
    );
    let tag = format!("layers_{l}_delta");
    let id = |t| TensorId::Layer(l, t);
    // Each input projection as [1, Q, n] (the Neural Engine layout's turned to it).
    let mut project = |b: &mut Builder, t: LayerTensor, what: &str, n: i64| {
        let wt = weights.linear(b, id(t), 1.0)?;
        let y = lower.project(b, proj, wt, None, hn, &format!("{tag}_{what}"))?;
        let name = format!("{tag}_{what}_tokens");
        Ok::<_, GraphError>(lower.tokens(b, &y, n as usize, q as usize, &name))
    };
    let qkv = project(b, LayerTensor::DeltaQkv, "qkv", 2 * hk * dk + hv * dv)?;
    let z = project(b, LayerTensor::DeltaZ, "z", hv * dv)?;
    let beta_in = project(b, LayerTensor::DeltaB, "b", hv)?;
    let a = project(b, LayerTensor::DeltaA, "a", hv)?;
    // The convolution: the short-convolution block's, over [state; qkv], then SiLU.
    let taps = (slot, id(LayerTensor::DeltaConv));
    let conv_tag = format!("{tag}_conv");
    let (mixed, conv_state) = conv.convolve(b, weights, taps, (&qkv, q), &conv_tag)?;
    let slot = slot as i64;
    let norm_w = weights.single(b, id(LayerTensor::DeltaNorm))?;
    let dt_bias = weights.single(b, id(LayerTensor::DeltaDtBias))?;
    let a_log = weights.single(b, id(LayerTensor::DeltaALog))?;
    let w_out = weights.linear(b, id(LayerTensor::DeltaOut), shared.alpha)?;
    let mut o = Ops {
        b,
        tag: tag.clone(),
    };
    let mixed = o.unary(Op::Silu, "mixed", &mixed);
    let dims = Heads { q, hk, hv, dk, dv };
    let (qn, kn, vh) = o.qkv_heads(&mixed, &dims);
    let (g_log, beta) = o.step_gates((&beta_in, &a), (&dt_bias, &a_log), delta.real.as_deref());
    let s0 = o.slice(
        "state_in",
        &delta.state,
        &[slot, 0, 0, 0],
        &[slot + 1, hv, dk, dv],
    );
    let s0 = o.reshape("state_0", &s0, &[hv, dk, dv]);
    let (core, s) = if delta.chunks.is_empty() {
        o.recurrence(&s0, (&qn, &kn, &vh), (&g_log, &beta), &dims)
    } else {
        o.chunked(&s0, (&qn, &kn, &vh), (&g_log, &beta), &dims, &delta.chunks)
    };
    let eps = shared.plain_eps * OUT_PRESCALE * OUT_PRESCALE;
    let normed = rms_norm_ranged(o.b, &core, &norm_w, eps, -1, &format!("{tag}_norm"));
    let zh = o.reshape("z_heads", &z, &[q, hv, dv]);
    let zs = o.unary(Op::Silu, "z_silu", &zh);
    let gated = o.binary(Op::Mul, "gated", &normed, var(&zs));
    let flat = o.reshape("gated_flat", &gated, &[1, q, hv * dv]);
    let state = o.reshape("state_update", &s, &[1, hv, dk, dv]);
    let b = b_of(o);
    let flat = lower.hidden(
        b,
        &flat,
        (hv * dv) as usize,
        q as usize,
        &format!("{tag}_hidden"),
    );
    let out = lower.project(b, proj, w_out, None, &flat, &format!("{tag}_out"))?;
    Ok(DeltaOut {
        out,
        conv_state,
        state,
    })
}

fn b_of<'a>(o: Ops<'a>) -> &'a mut Builder {
    o.b
}
