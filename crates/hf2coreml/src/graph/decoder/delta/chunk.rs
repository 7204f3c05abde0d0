//! The delta rule over a chunk of n tokens as matrix products (the WY form transformers'
//! `torch_chunk_gated_delta_rule` computes), per value head, from the state S₀ before it:
//!
//! - with Gᵢ = Σ_{s≤i} g_s, the decays D[i, j] = exp(Gᵢ − Gⱼ) for j ≤ i;
//! - the rows each token adds to the state, U = T·(βv − (βk ⊙ e^G)·S₀), where T = (I + N)⁻¹
//!   and N[i, j] = βᵢ (kᵢ·kⱼ) D[i, j] for j < i;
//! - the outputs (q ⊙ e^G)·S₀ + ((q·kᵀ) ⊙ D)·U, and the state e^{G_last}·S₀ + (k ⊙ e^{G_last − G})ᵀ·U.
//!
//! Gᵢ − Gⱼ is one matrix product, (g masked to s ≤ i)·[s > j], so each difference is summed
//! once and rounded once: a cumulative sum in fp16 followed by differences would lose the
//! small decays of a chunk whose sum is large. T comes from the blocked inverse of the unit
//! lower-triangular I + N: diagonal blocks of size 1, 2, 4, … are joined pairwise as
//! [[A⁻¹, 0], [−B⁻¹·C·A⁻¹, B⁻¹]], log₂ n levels of batched matmuls (a chunk is padded to a power
//! of two inside the inverse only). A padded token (g = 0, β = 0) has a zero row in N, a unit
//! row in T and a zero row in U, so it leaves the state exactly as the real tokens left it.

use half::f16;

use super::delta_ops::{Heads, Ops};
use crate::graph::{ints, var, Arg, Builder, ConstData, Op};

/// The most tokens one chunk takes: the chunked form's matrices are n × n per value head.
const CHUNK: usize = 64;

/// The fewest tokens a call takes before its DeltaNet blocks use the chunked form rather than
/// the per-token loop: ops per block, per-token 18·Q + 3 against chunked 53 (Q = 2), 74 (3),
/// 67 (4), 81 (8), 123 (64); the loop is smaller below 4 tokens and the chunked form past
/// them, with more of its work in matrix products.
pub(super) const CHUNKED_FROM: usize = 4;

/// The constants every block's chunks of `n` tokens share.
pub(super) struct ChunkConsts {
    n: usize,
    /// [n, n]: 1 where j ≤ i.
    on_or_below: String,
    /// [n, n]: 1 where j < i.
    below: String,
    /// Per level of the inverse (block size s = 1, 2, …): the flat indices of the blocks
    /// below the diagonal blocks being joined, in the padded [p, p] matrix.
    joins: Vec<String>,
}

/// The chunk lengths of a call of `q` tokens, in order.
fn chunk_lengths(q: usize) -> Vec<usize> {
    (0..q)
        .step_by(CHUNK)
        .map(|start| CHUNK.min(q - start))
        .collect()
}

/// The constants of every distinct chunk length of a call of `q` tokens.
pub(super) fn chunk_consts(b: &mut Builder, q: usize) -> Vec<ChunkConsts> {
    let mut lengths = chunk_lengths(q);
    lengths.dedup();
    lengths
        .into_iter()
        .map(|n| {
            let mask = |b: &mut Builder, what: &str, keep: fn(usize, usize) -> bool| {
                let v = (0..n * n)
                    .map(|at| f16::from_f32(f32::from(u8::from(keep(at / n, at % n)))))
                    .collect();
                b.constant(
                    &format!("delta_chunk{n}_{what}"),
                    vec![n, n],
                    ConstData::F16(v),
                    None,
                )
            };
            let on_or_below = mask(b, "on_or_below", |i, j| j <= i);
            let below = mask(b, "below", |i, j| j < i);
            let p = n.next_power_of_two();
            let joins = std::iter::successors(Some(1), |s| Some(s * 2))
                .take_while(|&s| s < p)
                .map(|s| {
                    let at = (0..p / (2 * s)).flat_map(|m| {
                        (0..s).flat_map(move |r| {
                            (0..s).map(move |c| (((2 * m + 1) * s + r) * p + 2 * m * s + c) as i32)
                        })
                    });
                    let idx = ConstData::I32(at.collect());
                    b.constant(
                        &format!("delta_chunk{n}_join{s}"),
                        vec![p * s / 2],
                        idx,
                        None,
                    )
                })
                .collect();
            ChunkConsts {
                n,
                on_or_below,
                below,
                joins,
            }
        })
        .collect()
}

/// One chunk's inputs, head first: q, k [Hv, Q, Dk], v [Hv, Q, Dv], g [Hv, 1, Q], β [Hv, Q, 1].
pub(super) struct HeadsFirst {
    q: String,
    k: String,
    v: String,
    g: String,
    beta: String,
}

impl Ops<'_> {
    /// The delta rule over the call's tokens chunk by chunk from state `s0` [Hv, Dk, Dv]: the
    /// outputs Sᵀq [Q, Hv, Dv] and the last state. q, k, v are [Q, Hv, D]; g (the log decay)
    /// and β [1, Q, Hv].
    pub(super) fn chunked(
        &mut self,
        s0: &str,
        (qn, kn, vh): (&str, &str, &str),
        (g, beta): (&str, &str),
        h: &Heads,
        consts: &[ChunkConsts],
    ) -> (String, String) {
        let mut transpose = |what: &str, x: &str, perm: &[i64]| {
            self.op(
                Op::Transpose,
                what,
                vec![("x", var(x)), ("perm", ints(perm))],
            )
        };
        let x = HeadsFirst {
            q: transpose("q_hq", qn, &[1, 0, 2]),
            k: transpose("k_hq", kn, &[1, 0, 2]),
            v: transpose("v_hq", vh, &[1, 0, 2]),
            g: transpose("g_hq", g, &[2, 0, 1]),
            beta: transpose("beta_hq", beta, &[2, 1, 0]),
        };
        let mut s = s0.to_string();
        let mut outs = Vec::new();
        let mut start = 0;
        for (c, n) in chunk_lengths(h.q as usize).into_iter().enumerate() {
            let Some(consts) = consts.iter().find(|k| k.n == n) else {
                continue;
            };
            let (out, next) = self.chunk(&format!("c{c}"), &s, &x, (start, h), consts);
            outs.push(out);
            s = next;
            start += n as i64;
        }
        (self.tokens_first(outs), s)
    }

    fn matmul_t(&mut self, what: &str, x: &str, y: &str, (tx, ty): (bool, bool)) -> String {
        self.op(
            Op::Matmul,
            what,
            vec![
                ("x", var(x)),
                ("y", var(y)),
                ("transpose_x", Arg::Bool(tx)),
                ("transpose_y", Arg::Bool(ty)),
            ],
        )
    }

    /// One chunk of `consts.n` tokens from `start`, from state `s` [Hv, Dk, Dv]: its outputs
    /// [Hv, n, Dv] and the state after it.
    fn chunk(
        &mut self,
        tag: &str,
        s: &str,
        x: &HeadsFirst,
        (start, h): (i64, &Heads),
        consts: &ChunkConsts,
    ) -> (String, String) {
        let Heads { hv, dk, dv, .. } = *h;
        let n = consts.n as i64;
        let name = |what: &str| format!("{tag}_{what}");
        let rows = |o: &mut Self, what: &str, x: &str, d: i64| {
            o.slice(&name(what), x, &[0, start, 0], &[hv, start + n, d])
        };
        let (qc, kc, vc) = (
            rows(self, "q", &x.q, dk),
            rows(self, "k", &x.k, dk),
            rows(self, "v", &x.v, dv),
        );
        let bc = rows(self, "beta", &x.beta, 1);
        let gc = self.slice(&name("g"), &x.g, &[0, 0, start], &[hv, 1, start + n]);
        // The decays: g_s for s ≤ i, then Gᵢ − Gⱼ = Σ_{j<s≤i} g_s as one product.
        let upto = self.binary(Op::Mul, &name("g_upto"), &gc, var(&consts.on_or_below));
        let dlog = self.matmul(&name("dlog"), &upto, &consts.below);
        let gcum = self.op(
            Op::ReduceSum,
            &name("gcum"),
            vec![
                ("x", var(&upto)),
                ("axes", ints(&[-1])),
                ("keep_dims", Arg::Bool(true)),
            ],
        );
        let eg = self.unary(Op::Exp, &name("eg"), &gcum);
        let tail = self.slice(&name("tail"), &dlog, &[0, n - 1, 0], &[hv, n, n]);
        let tail = self.reshape(&name("tail_col"), &tail, &[hv, n, 1]);
        let et = self.unary(Op::Exp, &name("et"), &tail);
        let elast = self.slice(&name("elast"), &eg, &[0, n - 1, 0], &[hv, n, 1]);
        let decay = self.unary(Op::Exp, &name("decay"), &dlog);
        let d_on = self.binary(Op::Mul, &name("d_on"), &decay, var(&consts.on_or_below));
        let d_below = self.binary(Op::Mul, &name("d_below"), &decay, var(&consts.below));
        // U = T·(βv − (βk ⊙ e^G)·S).
        let kb = self.binary(Op::Mul, &name("kb"), &kc, var(&bc));
        let vb = self.binary(Op::Mul, &name("vb"), &vc, var(&bc));
        let kk = self.matmul_t(&name("kk"), &kb, &kc, (false, true));
        let nm = self.binary(Op::Mul, &name("n"), &kk, var(&d_below));
        let t = self.unit_lower_inverse(&name("t"), &nm, consts, hv);
        let value = self.matmul(&name("value"), &t, &vb);
        let kbe = self.binary(Op::Mul, &name("kbe"), &kb, var(&eg));
        let kcd = self.matmul(&name("kcd"), &t, &kbe);
        let vs = self.matmul(&name("vs"), &kcd, s);
        let u = self.binary(Op::Sub, &name("u"), &value, var(&vs));
        // Outputs: (q ⊙ e^G)·S + ((q·kᵀ) ⊙ D)·U.
        let qe = self.binary(Op::Mul, &name("qe"), &qc, var(&eg));
        let inter = self.matmul(&name("inter"), &qe, s);
        let qk = self.matmul_t(&name("qk"), &qc, &kc, (false, true));
        let qkd = self.binary(Op::Mul, &name("qkd"), &qk, var(&d_on));
        let intra = self.matmul(&name("intra"), &qkd, &u);
        let out = self.binary(Op::Add, &name("out"), &inter, var(&intra));
        // The state: e^{G_last}·S + (k ⊙ e^{G_last − G})ᵀ·U.
        let ke = self.binary(Op::Mul, &name("ke"), &kc, var(&et));
        let added = self.matmul_t(&name("added"), &ke, &u, (true, false));
        let kept = self.binary(Op::Mul, &name("kept"), s, var(&elast));
        let next = self.binary(Op::Add, &name("state"), &kept, var(&added));
        (out, next)
    }

    /// (I + N)⁻¹ [Hv, n, n] for N [Hv, n, n] strictly lower triangular: blocks of size s joined
    /// pairwise into blocks of 2s, from s = 1 up to the chunk padded to p = 2^⌈log₂ n⌉.
    fn unit_lower_inverse(&mut self, tag: &str, nm: &str, consts: &ChunkConsts, hv: i64) -> String {
        let n = consts.n as i64;
        let p = consts.n.next_power_of_two() as i64;
        let name = |what: &str| format!("{tag}_{what}");
        let mut full = nm.to_string();
        if p > n {
            // Zero rows and columns to p: the inverse's top-left n × n block is (I + N)⁻¹.
            let cols = self.slice(&name("pad_c"), nm, &[0, 0, 0], &[hv, n, p - n]);
            let cols = self.binary(Op::Mul, &name("pad_c0"), &cols, Arg::Float(0.0));
            let wide = self.concat(&name("wide"), &[nm, &cols], 2);
            let rows = self.slice(&name("pad_r"), &wide, &[0, 0, 0], &[hv, p - n, p]);
            let rows = self.binary(Op::Mul, &name("pad_r0"), &rows, Arg::Float(0.0));
            full = self.concat(&name("padded"), &[&wide, &rows], 1);
        }
        let flat = self.reshape(&name("flat"), &full, &[hv, p * p]);
        let mut inv: Option<String> = None;
        for (level, join) in consts.joins.iter().enumerate() {
            let s = 1i64 << level;
            let m = p / (2 * s);
            let what = |w: &str| name(&format!("{w}{s}"));
            let below = self.op(
                Op::Gather,
                &what("below"),
                vec![
                    ("x", var(&flat)),
                    ("indices", var(join)),
                    ("axis", Arg::Int(1)),
                ],
            );
            let below = self.reshape(&what("below_b"), &below, &[hv, m, s, s]);
            let zeros = self.binary(Op::Mul, &what("zeros"), &below, Arg::Float(0.0));
            let (first, second) = match &inv {
                // Blocks of one: their inverses are 1.
                None => {
                    let ones = self.binary(Op::Add, &what("ones"), &zeros, Arg::Float(1.0));
                    (ones.clone(), ones)
                }
                Some(inv) => {
                    let pairs = self.reshape(&what("pairs"), inv, &[hv, m, 2, s, s]);
                    let half = |o: &mut Self, w: &str, i: i64| {
                        let x = o.slice(&what(w), &pairs, &[0, 0, i, 0, 0], &[hv, m, i + 1, s, s]);
                        o.reshape(&what(&format!("{w}_b")), &x, &[hv, m, s, s])
                    };
                    (half(self, "first", 0), half(self, "second", 1))
                }
            };
            let x = self.matmul(&what("x"), &below, &first);
            let x = self.matmul(&what("bx"), &second, &x);
            let x = self.binary(Op::Mul, &what("neg"), &x, Arg::Float(-1.0));
            let top = self.concat(&what("top"), &[&first, &zeros], 3);
            let bottom = self.concat(&what("bottom"), &[&x, &second], 3);
            inv = Some(self.concat(&what("joined"), &[&top, &bottom], 2));
        }
        let Some(inv) = inv else {
            // One token: T = I = N + 1 (N is [Hv, 1, 1] zeros).
            return self.binary(Op::Add, &name("one"), nm, Arg::Float(1.0));
        };
        let t = self.reshape(&name("square"), &inv, &[hv, p, p]);
        if p == n {
            return t;
        }
        self.slice(&name("cut"), &t, &[0, 0, 0], &[hv, n, n])
    }

    fn concat(&mut self, what: &str, xs: &[&str], axis: i64) -> String {
        self.op(
            Op::Concat,
            what,
            vec![
                (
                    "values",
                    Arg::Vars(xs.iter().map(|x| x.to_string()).collect()),
                ),
                ("axis", Arg::Int(axis)),
                ("interleave", Arg::Bool(false)),
            ],
        )
    }
}
