//! Qwen3.5's Gated DeltaNet block in f32, written from transformers' `Qwen3_5GatedDeltaNet`
//! and its per-token `torch_recurrent_gated_delta_rule` (the chunked prefill transformers runs
//! computes the same state; the fixtures' logits come from it). Shares nothing with
//! `src/graph/`, so the graph's lowering is checked against an independent statement.

use candle_core::{Device, Tensor};

use crate::arch::GatedDelta;

/// One DeltaNet block's weights, before `out_proj`.
pub(super) struct DeltaWeights {
    pub(super) shape: GatedDelta,
    /// `in_proj_qkv` [C, H], C = 2·Hk·Dk + Hv·Dv.
    pub(super) qkv: Tensor,
    /// `in_proj_z` [Hv·Dv, H].
    pub(super) z: Tensor,
    /// `in_proj_b`, `in_proj_a` [Hv, H].
    pub(super) b: Tensor,
    pub(super) a: Tensor,
    /// The depthwise taps [K, C], oldest input first.
    pub(super) taps: Tensor,
    /// −exp(A_log) [Hv], and `dt_bias` [Hv].
    pub(super) neg_a: Vec<f32>,
    pub(super) dt_bias: Vec<f32>,
    /// The gated output norm's weight [Dv] (plain: x·w, not 1 + w).
    pub(super) norm: Vec<f32>,
    pub(super) eps: f64,
}

/// What a DeltaNet block carries from one call to the next: its last K − 1 conv inputs
/// [K − 1, C] and its state S per value head [Hv, Dk, Dv], row-major.
#[derive(Clone)]
pub(super) struct DeltaCarry {
    pub(super) conv: Vec<f32>,
    pub(super) state: Vec<f32>,
}

impl DeltaCarry {
    pub(super) fn zeros(g: &GatedDelta) -> Self {
        DeltaCarry {
            conv: vec![0.0; (g.kernel - 1) * g.conv_channels()],
            state: vec![0.0; g.value_heads * g.key_dim * g.value_dim],
        }
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn softplus(x: f32) -> f32 {
    // torch's softplus (β 1, threshold 20): x itself past the threshold.
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// x · rsqrt(Σx² + 1e-6): transformers' `l2norm` (FLA's), in place.
fn l2norm(x: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let inv = 1.0 / (ss + 1e-6).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// The block on its normalised input h [T, H]: the out_proj input [T, Hv·Dv]. `carry` (when
/// given) is continued and left holding the state after the T tokens; without it the block
/// starts from zeros (a fresh sequence).
pub(super) fn gated_delta(
    w: &DeltaWeights,
    h: &Tensor,
    carry: Option<&mut Option<DeltaCarry>>,
) -> candle_core::Result<Tensor> {
    let g = &w.shape;
    let (t, _) = h.dims2()?;
    let c = g.conv_channels();
    let (hk, hv, dk, dv, k) = (g.key_heads, g.value_heads, g.key_dim, g.value_dim, g.kernel);
    let flat = |x: Tensor| -> candle_core::Result<Vec<f32>> { x.flatten_all()?.to_vec1() };
    let qkv = flat(h.matmul(&w.qkv.t()?)?)?;
    let z = flat(h.matmul(&w.z.t()?)?)?;
    let b = flat(h.matmul(&w.b.t()?)?)?;
    let a = flat(h.matmul(&w.a.t()?)?)?;
    let taps = flat(w.taps.clone())?;
    let mut start = match carry.as_deref() {
        Some(Some(s)) => s.clone(),
        _ => DeltaCarry::zeros(g),
    };
    // Row i + K − 1 of `seq` is input i: the causal convolution reads rows i .. i + K − 1.
    let mut seq = std::mem::take(&mut start.conv);
    seq.extend_from_slice(&qkv);
    let mut mixed = vec![0f32; t * c];
    for i in 0..t {
        for ch in 0..c {
            let y: f32 = (0..k)
                .map(|j| taps[j * c + ch] * seq[(i + j) * c + ch])
                .sum();
            mixed[i * c + ch] = silu(y);
        }
    }
    let conv_state = seq[t * c..(t + k - 1) * c].to_vec();
    let s = &mut start.state;
    let group = hv / hk;
    let scale = 1.0 / (dk as f32).sqrt();
    let mut out = vec![0f32; t * hv * dv];
    for i in 0..t {
        let row = &mixed[i * c..(i + 1) * c];
        let mut q = row[..hk * dk].to_vec();
        let mut kk = row[hk * dk..2 * hk * dk].to_vec();
        let v = &row[2 * hk * dk..];
        for head in 0..hk {
            l2norm(&mut q[head * dk..(head + 1) * dk]);
            l2norm(&mut kk[head * dk..(head + 1) * dk]);
        }
        q.iter_mut().for_each(|x| *x *= scale);
        for head in 0..hv {
            let kh = head / group;
            let (qh, khv) = (&q[kh * dk..(kh + 1) * dk], &kk[kh * dk..(kh + 1) * dk]);
            let vh = &v[head * dv..(head + 1) * dv];
            let decay = (w.neg_a[head] * softplus(a[i * hv + head] + w.dt_bias[head])).exp();
            let beta = 1.0 / (1.0 + (-b[i * hv + head]).exp());
            let sh = &mut s[head * dk * dv..(head + 1) * dk * dv];
            sh.iter_mut().for_each(|x| *x *= decay);
            // kv_mem = Sᵀk; S += k ⊗ β(v − kv_mem); o = Sᵀq.
            let mut delta = vec![0f32; dv];
            for (e, d) in delta.iter_mut().enumerate() {
                let mem: f32 = (0..dk).map(|r| sh[r * dv + e] * khv[r]).sum();
                *d = (vh[e] - mem) * beta;
            }
            for r in 0..dk {
                for e in 0..dv {
                    sh[r * dv + e] += khv[r] * delta[e];
                }
            }
            let o = &mut out[(i * hv + head) * dv..(i * hv + head + 1) * dv];
            for (e, oe) in o.iter_mut().enumerate() {
                *oe = (0..dk).map(|r| sh[r * dv + e] * qh[r]).sum();
            }
            // The gated RMSNorm over the head's Dv values: norm, weight, times silu(z).
            let ms: f32 = o.iter().map(|x| x * x).sum::<f32>() / dv as f32;
            let inv = 1.0 / (ms + w.eps as f32).sqrt();
            let zh = &z[(i * hv + head) * dv..(i * hv + head + 1) * dv];
            for e in 0..dv {
                o[e] = o[e] * inv * w.norm[e] * silu(zh[e]);
            }
        }
    }
    if let Some(carry) = carry {
        start.conv = conv_state;
        *carry = Some(start);
    }
    Tensor::from_vec(out, (t, hv * dv), &Device::Cpu)
}
