//! The DeltaNet block's op helper ([`Ops`]: every op named `{tag}_{what}`, reshapes, slices,
//! matmuls, the L2 norm, the outputs of successive tokens or chunks joined) and its head
//! sizes ([`Heads`]), shared by the per-token recurrence ([`super`]) and the chunked form
//! ([`super::chunk`]).

use crate::graph::{ints, var, Arg, Builder, Op};

/// A small helper over the builder: every op of the block named `{tag}_{what}`.
pub(super) struct Ops<'a> {
    pub(super) b: &'a mut Builder,
    pub(super) tag: String,
}

impl Ops<'_> {
    pub(super) fn op(&mut self, op: Op, what: &str, args: Vec<(&str, Arg)>) -> String {
        self.b.op(op, &format!("{}_{what}", self.tag), args)
    }

    pub(super) fn binary(&mut self, op: Op, what: &str, x: &str, y: Arg) -> String {
        self.op(op, what, vec![("x", var(x)), ("y", y)])
    }

    pub(super) fn unary(&mut self, op: Op, what: &str, x: &str) -> String {
        self.op(op, what, vec![("x", var(x))])
    }

    pub(super) fn reshape(&mut self, what: &str, x: &str, shape: &[i64]) -> String {
        self.op(
            Op::Reshape,
            what,
            vec![("x", var(x)), ("shape", ints(shape))],
        )
    }

    pub(super) fn slice(&mut self, what: &str, x: &str, begin: &[i64], end: &[i64]) -> String {
        self.op(
            Op::SliceByIndex,
            what,
            vec![("x", var(x)), ("begin", ints(begin)), ("end", ints(end))],
        )
    }

    pub(super) fn matmul(&mut self, what: &str, x: &str, y: &str) -> String {
        self.op(Op::Matmul, what, vec![("x", var(x)), ("y", var(y))])
    }

    /// x · rsqrt(Σx² + 1e-6) over the last axis (transformers' `l2norm`).
    pub(super) fn l2norm(&mut self, what: &str, x: &str) -> String {
        let sq = self.binary(Op::Mul, &format!("{what}_sq"), x, var(x));
        let sum = self.op(
            Op::ReduceSum,
            &format!("{what}_sum"),
            vec![
                ("x", var(&sq)),
                ("axes", ints(&[-1])),
                ("keep_dims", Arg::Bool(true)),
            ],
        );
        let inv = self.op(
            Op::Rsqrt,
            &format!("{what}_rsqrt"),
            vec![("x", var(&sum)), ("epsilon", Arg::Float(1e-6))],
        );
        self.binary(Op::Mul, what, x, var(&inv))
    }

    /// The outputs [Hv, n, Dv] of successive tokens or chunks joined into [Q, Hv, Dv].
    pub(super) fn tokens_first(&mut self, mut outs: Vec<String>) -> String {
        let joined = if outs.len() == 1 {
            outs.pop().unwrap_or_default()
        } else {
            self.op(
                Op::Concat,
                "outs",
                vec![
                    ("values", Arg::Vars(outs)),
                    ("axis", Arg::Int(1)),
                    ("interleave", Arg::Bool(false)),
                ],
            )
        };
        self.op(
            Op::Transpose,
            "core",
            vec![("x", var(&joined)), ("perm", ints(&[1, 0, 2]))],
        )
    }
}

/// Q and the DeltaNet's heads and head sizes.
pub(super) struct Heads {
    pub(super) q: i64,
    pub(super) hk: i64,
    pub(super) hv: i64,
    pub(super) dk: i64,
    pub(super) dv: i64,
}
