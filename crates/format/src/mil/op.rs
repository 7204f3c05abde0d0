//! The MIL operations hf2coreml builds and interprets, by the names MIL gives them. The graph
//! builder emits these, the coremltools bridge calls `mb.<name>` with them, and the interpreter
//! resolves a saved program's op names to them once, at load.

/// Declares [`Op`] with each variant's MIL name, so the two cannot drift apart.
macro_rules! ops {
    ($($(#[$doc:meta])* $variant:ident = $name:literal,)*) => {
        /// One MIL operation type.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Op {
            $($(#[$doc])* $variant,)*
        }

        impl Op {
            /// Every operation, in declaration order.
            pub const ALL: &'static [Op] = &[$(Op::$variant,)*];

            /// The operation's MIL name (`linear`, `constexpr_lut_to_dense`).
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Op::$variant => $name,)*
                }
            }

            /// The operation named `name` in MIL, if it is one of ours.
            pub fn from_name(name: &str) -> Option<Op> {
                match name {
                    $($name => Some(Op::$variant),)*
                    _ => None,
                }
            }
        }
    };
}

ops! {
    // Constants.
    Const = "const",
    /// A palettized weight: indices into a lookup table, expanded when the program loads.
    ConstexprLutToDense = "constexpr_lut_to_dense",
    /// iOS18: `scale · (data − offset)` per block of a constant (per-channel scales of a
    /// palettized weight, or of its LUT).
    ConstexprBlockwiseShiftScale = "constexpr_blockwise_shift_scale",
    // Element-wise with two inputs.
    Add = "add",
    Sub = "sub",
    Mul = "mul",
    RealDiv = "real_div",
    Pow = "pow",
    Maximum = "maximum",
    Minimum = "minimum",
    FloorDiv = "floor_div",
    Mod = "mod",
    Less = "less",
    LessEqual = "less_equal",
    Greater = "greater",
    GreaterEqual = "greater_equal",
    Equal = "equal",
    NotEqual = "not_equal",
    LogicalAnd = "logical_and",
    LogicalOr = "logical_or",
    LogicalXor = "logical_xor",
    // Element-wise with one input.
    Rsqrt = "rsqrt",
    Sqrt = "sqrt",
    Inverse = "inverse",
    Exp = "exp",
    Exp2 = "exp2",
    Log = "log",
    Sin = "sin",
    Cos = "cos",
    Tanh = "tanh",
    Sigmoid = "sigmoid",
    Silu = "silu",
    Relu = "relu",
    Abs = "abs",
    Square = "square",
    Floor = "floor",
    Ceil = "ceil",
    Round = "round",
    Sign = "sign",
    Erf = "erf",
    Clip = "clip",
    LogicalNot = "logical_not",
    Cast = "cast",
    // Reductions and normalisations.
    ReduceMean = "reduce_mean",
    ReduceSum = "reduce_sum",
    ReduceMax = "reduce_max",
    ReduceMin = "reduce_min",
    ReduceProd = "reduce_prod",
    ReduceSumSquare = "reduce_sum_square",
    Softmax = "softmax",
    LayerNorm = "layer_norm",
    // Shapes and data movement.
    Reshape = "reshape",
    ExpandDims = "expand_dims",
    Squeeze = "squeeze",
    Identity = "identity",
    Transpose = "transpose",
    Concat = "concat",
    Split = "split",
    SliceByIndex = "slice_by_index",
    SliceBySize = "slice_by_size",
    Tile = "tile",
    Gather = "gather",
    Select = "select",
    Fill = "fill",
    BandPart = "band_part",
    Range1d = "range_1d",
    Shape = "shape",
    // Linear algebra.
    Matmul = "matmul",
    Linear = "linear",
    /// A convolution; the `--layout ane` projections are 1×1 ones over (B, C, 1, S).
    Conv = "conv",
    // States (iOS18): a Core ML state read, written, and a window of a tensor replaced.
    /// iOS18: the current value of a state (`input`).
    ReadState = "read_state",
    /// iOS18: `data` becomes the state's (`input`) value; no outputs.
    WriteState = "write_state",
    /// The builder's spelling of `write_state` (coremltools' `coreml_update_state`, saved as
    /// `write_state` and, when its result is read, a `read_state`).
    CoremlUpdateState = "coreml_update_state",
    /// iOS18: `x` with the window `begin..end` (slice_by_index's arguments) replaced by `update`.
    SliceUpdate = "slice_update",
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_are_unique() {
        let mut seen = std::collections::BTreeSet::new();
        for &op in Op::ALL {
            assert_eq!(Op::from_name(op.as_str()), Some(op));
            assert!(seen.insert(op.as_str()), "{op} declared twice");
        }
        assert_eq!(Op::from_name("conv"), Some(Op::Conv));
        assert_eq!(Op::from_name("conv_transpose"), None);
    }
}
