//! One op's kernel, picked by its MIL op: the table from [`Op`] to the functions of [`ops`]
//! (and `slice_update` of [`states`]), each refused first when its result would pass the
//! declared output ([`limits::guard`]). The ops that are computed when the program loads, and
//! the state ops the run loop executes itself, are refused by name.

use super::ops::{self, Args};
use super::tensor::{Data, Tensor};
use super::{limits, states};
use crate::mil::{DType, Op};

/// Run the kernel of one op that is computed per step.
pub(crate) fn run_op(op: Op, args: &Args) -> ops::OpResult<Vec<Tensor>> {
    use Op::*;
    limits::guard(op, args)?;
    let one = |r: ops::OpResult<Tensor>| r.map(|t| vec![t]);
    let x = || args.get("x");
    let y = || args.get("y");
    match op {
        Add | Sub | Mul | RealDiv | Pow | Maximum | Minimum | FloorDiv | Mod => {
            one(x().and_then(|x| ops::binary(op, x, y()?)))
        }
        Less | LessEqual | Greater | GreaterEqual | Equal | NotEqual => {
            one(x().and_then(|x| ops::compare(op, x, y()?)))
        }
        LogicalAnd | LogicalOr | LogicalXor => one(x().and_then(|x| ops::logical(op, x, y()?))),
        Rsqrt | Sqrt | Inverse | Exp | Exp2 | Log | Sin | Cos | Tanh | Sigmoid | Silu | Relu
        | Abs | Square | Floor | Ceil | Round | Sign | Erf | Clip | LogicalNot => {
            one(ops::unary(op, args))
        }
        ReduceMean | ReduceSum | ReduceMax | ReduceMin | ReduceProd | ReduceSumSquare => {
            one(ops::reduce(op, args))
        }
        Softmax => one(ops::softmax(args)),
        LayerNorm => one(ops::layer_norm(args)),
        Reshape | ExpandDims | Squeeze | Identity => {
            one(x().and_then(|x| ops::reshaped(x, &args.out(0)?.shape)))
        }
        Transpose => one(ops::transpose(args)),
        Concat => one(ops::concat(args)),
        Split => ops::split(args),
        SliceByIndex => one(ops::slice_by_index(args)),
        SliceBySize => one(ops::slice_by_size(args)),
        Tile => one(ops::tile(args)),
        Gather => one(ops::gather(args)),
        Select => one(ops::select(args)),
        Fill => one(ops::fill(args)),
        BandPart => one(ops::band_part(args)),
        Range1d => one(ops::range_1d(args)),
        Matmul => one(ops::matmul(args)),
        Linear => one(ops::linear(args)),
        Conv => one(ops::conv(args)),
        Cast => one(ops::cast(args)),
        Shape => one(x().map(|x| {
            let s: Vec<i64> = x.shape.iter().map(|&d| d as i64).collect();
            Tensor::new(DType::I32, vec![s.len()], Data::I(s))
        })),
        SliceUpdate => one(states::slice_update(args)),
        Const | ConstexprLutToDense | ConstexprBlockwiseShiftScale => {
            Err(format!("`{op}` is computed when the program loads").into())
        }
        ReadState | WriteState | CoremlUpdateState => {
            Err(format!("`{op}` reads or writes a state: the run loop executes it").into())
        }
    }
}
