//! Element types of MIL tensors (MIL.proto's DataType), shared by the graph builder, the
//! checkpoint reader, the package reader and the interpreter.

/// Element types of MIL tensors (MIL DataType), of blobs and of checkpoint tensors (a
/// safetensors checkpoint holds [`DType::BF16`], [`DType::F16`] or [`DType::F32`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    Bool,
    Str,
    F16,
    F32,
    F64,
    BF16,
    I4,
    I8,
    I16,
    I32,
    I64,
    U1,
    U2,
    U3,
    U4,
    U6,
    U8,
    U16,
    U32,
    U64,
}

impl DType {
    /// From MIL.proto's DataType enum.
    pub fn from_mil(code: i32) -> Option<Self> {
        use DType::*;
        Some(match code {
            1 => Bool,
            2 => Str,
            10 => F16,
            11 => F32,
            12 => F64,
            13 => BF16,
            21 => I8,
            22 => I16,
            23 => I32,
            24 => I64,
            25 => I4,
            31 => U8,
            32 => U16,
            33 => U32,
            34 => U64,
            35 => U4,
            36 => U2,
            37 => U1,
            38 => U6,
            39 => U3,
            _ => return None,
        })
    }

    /// MIL.proto's DataType number.
    pub fn mil_code(self) -> i32 {
        use DType::*;
        match self {
            Bool => 1,
            Str => 2,
            F16 => 10,
            F32 => 11,
            F64 => 12,
            BF16 => 13,
            I8 => 21,
            I16 => 22,
            I32 => 23,
            I64 => 24,
            I4 => 25,
            U8 => 31,
            U16 => 32,
            U32 => 33,
            U64 => 34,
            U4 => 35,
            U2 => 36,
            U1 => 37,
            U6 => 38,
            U3 => 39,
        }
    }

    /// The MIL spelling (`fp16`, `int32`, ...), as used by `cast(dtype=...)`.
    pub fn name(self) -> &'static str {
        use DType::*;
        match self {
            Bool => "bool",
            Str => "string",
            F16 => "fp16",
            F32 => "fp32",
            F64 => "fp64",
            BF16 => "bf16",
            I4 => "int4",
            I8 => "int8",
            I16 => "int16",
            I32 => "int32",
            I64 => "int64",
            U1 => "uint1",
            U2 => "uint2",
            U3 => "uint3",
            U4 => "uint4",
            U6 => "uint6",
            U8 => "uint8",
            U16 => "uint16",
            U32 => "uint32",
            U64 => "uint64",
        }
    }

    /// The short spelling of safetensors and of hf2coreml's inspect and import output
    /// (`bf16`, `f16`, `f32`, `i32`, `u8`), where [`DType::name`] gives MIL's (`fp16`, `int32`).
    pub fn short_name(self) -> &'static str {
        use DType::*;
        match self {
            Bool => "bool",
            Str => "string",
            F16 => "f16",
            F32 => "f32",
            F64 => "f64",
            BF16 => "bf16",
            I4 => "i4",
            I8 => "i8",
            I16 => "i16",
            I32 => "i32",
            I64 => "i64",
            U1 => "u1",
            U2 => "u2",
            U3 => "u3",
            U4 => "u4",
            U6 => "u6",
            U8 => "u8",
            U16 => "u16",
            U32 => "u32",
            U64 => "u64",
        }
    }

    /// Bytes per element in storage: sub-byte types round up to one, strings have none.
    pub fn size_bytes(self) -> usize {
        (self.bits() as usize).div_ceil(8)
    }

    pub fn from_name(name: &str) -> Option<Self> {
        use DType::*;
        [
            Bool, Str, F16, F32, F64, BF16, I4, I8, I16, I32, I64, U1, U2, U3, U4, U6, U8, U16,
            U32, U64,
        ]
        .into_iter()
        .find(|d| d.name() == name)
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F16 | DType::F32 | DType::F64 | DType::BF16)
    }

    pub fn is_int(self) -> bool {
        !self.is_float() && !matches!(self, DType::Bool | DType::Str)
    }

    /// Bits per element in storage (strings have none).
    pub fn bits(self) -> u32 {
        use DType::*;
        match self {
            U1 | Bool => {
                if self == Bool {
                    8
                } else {
                    1
                }
            }
            U2 => 2,
            U3 => 3,
            I4 | U4 => 4,
            U6 => 6,
            I8 | U8 => 8,
            F16 | BF16 | I16 | U16 => 16,
            F32 | I32 | U32 => 32,
            F64 | I64 | U64 => 64,
            Str => 0,
        }
    }

    /// Range of an integer type as (min, max).
    pub fn int_range(self) -> Option<(i64, i64)> {
        use DType::*;
        Some(match self {
            I4 => (-8, 7),
            I8 => (i8::MIN as i64, i8::MAX as i64),
            I16 => (i16::MIN as i64, i16::MAX as i64),
            I32 => (i32::MIN as i64, i32::MAX as i64),
            I64 => (i64::MIN, i64::MAX),
            U1 => (0, 1),
            U2 => (0, 3),
            U3 => (0, 7),
            U4 => (0, 15),
            U6 => (0, 63),
            U8 => (0, u8::MAX as i64),
            U16 => (0, u16::MAX as i64),
            U32 => (0, u32::MAX as i64),
            U64 => (0, i64::MAX),
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoint_spellings_and_sizes() {
        assert_eq!(DType::BF16.short_name(), "bf16");
        assert_eq!(DType::F16.short_name(), "f16");
        assert_eq!(DType::F32.short_name(), "f32");
        assert_eq!(DType::F16.name(), "fp16");
        assert_eq!(DType::BF16.size_bytes(), 2);
        assert_eq!(DType::F16.size_bytes(), 2);
        assert_eq!(DType::F32.size_bytes(), 4);
        assert_eq!(DType::U4.size_bytes(), 1);
        assert_eq!(DType::Str.size_bytes(), 0);
    }
}
