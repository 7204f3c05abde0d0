//! The subset of CoreML.Specification (Model.proto, MIL.proto) a reader needs to walk an ML
//! Program, as hand-written prost messages (docs/reference/mlpackage-format.md, "The protobuf
//! fields walked"). Fields not listed here are skipped by prost as unknown fields; dictionaries
//! (the `buildInfo` attribute) and list/tuple *types* are kept opaque on purpose.

use std::collections::HashMap;

#[derive(Clone, PartialEq, prost::Message)]
pub struct Model {
    #[prost(int32, tag = "1")]
    pub specification_version: i32,
    #[prost(message, optional, tag = "2")]
    pub description: Option<ModelDescription>,
    #[prost(message, optional, tag = "502")]
    pub ml_program: Option<Program>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ModelDescription {
    #[prost(message, repeated, tag = "1")]
    pub input: Vec<FeatureDescription>,
    #[prost(message, repeated, tag = "10")]
    pub output: Vec<FeatureDescription>,
    #[prost(message, repeated, tag = "13")]
    pub state: Vec<FeatureDescription>,
    #[prost(message, optional, tag = "100")]
    pub metadata: Option<Metadata>,
    /// A multifunction program's functions (iOS18); `input`/`output` are then empty.
    #[prost(message, repeated, tag = "20")]
    pub functions: Vec<FunctionDescription>,
    #[prost(string, tag = "21")]
    pub default_function_name: String,
}

/// One function of a multifunction model: its name and features.
#[derive(Clone, PartialEq, prost::Message)]
pub struct FunctionDescription {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(message, repeated, tag = "2")]
    pub input: Vec<FeatureDescription>,
    #[prost(message, repeated, tag = "3")]
    pub output: Vec<FeatureDescription>,
    #[prost(message, repeated, tag = "6")]
    pub state: Vec<FeatureDescription>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct FeatureDescription {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub short_description: String,
    #[prost(message, optional, tag = "3")]
    pub r#type: Option<FeatureType>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct FeatureType {
    #[prost(message, optional, tag = "5")]
    pub multi_array_type: Option<ArrayFeatureType>,
    #[prost(message, optional, tag = "8")]
    pub state_type: Option<StateFeatureType>,
    #[prost(bool, tag = "1000")]
    pub is_optional: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ArrayFeatureType {
    #[prost(int64, repeated, tag = "1")]
    pub shape: Vec<i64>,
    #[prost(int32, tag = "2")]
    pub data_type: i32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct StateFeatureType {
    #[prost(message, optional, tag = "1")]
    pub array_type: Option<ArrayFeatureType>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Metadata {
    #[prost(string, tag = "1")]
    pub short_description: String,
    #[prost(string, tag = "2")]
    pub version_string: String,
    #[prost(string, tag = "3")]
    pub author: String,
    #[prost(string, tag = "4")]
    pub license: String,
    #[prost(map = "string, string", tag = "100")]
    pub user_defined: HashMap<String, String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Program {
    #[prost(int64, tag = "1")]
    pub version: i64,
    #[prost(map = "string, message", tag = "2")]
    pub functions: HashMap<String, Function>,
    #[prost(string, tag = "3")]
    pub doc_string: String,
    #[prost(map = "string, message", tag = "4")]
    pub attributes: HashMap<String, Value>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Function {
    #[prost(message, repeated, tag = "1")]
    pub inputs: Vec<NamedValueType>,
    #[prost(string, tag = "2")]
    pub opset: String,
    #[prost(map = "string, message", tag = "3")]
    pub block_specializations: HashMap<String, Block>,
    #[prost(map = "string, message", tag = "4")]
    pub attributes: HashMap<String, Value>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Block {
    #[prost(message, repeated, tag = "1")]
    pub inputs: Vec<NamedValueType>,
    #[prost(string, repeated, tag = "2")]
    pub outputs: Vec<String>,
    #[prost(message, repeated, tag = "3")]
    pub operations: Vec<Operation>,
    #[prost(map = "string, message", tag = "4")]
    pub attributes: HashMap<String, Value>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Operation {
    #[prost(string, tag = "1")]
    pub r#type: String,
    #[prost(map = "string, message", tag = "2")]
    pub inputs: HashMap<String, Argument>,
    #[prost(message, repeated, tag = "3")]
    pub outputs: Vec<NamedValueType>,
    #[prost(message, repeated, tag = "4")]
    pub blocks: Vec<Block>,
    #[prost(map = "string, message", tag = "5")]
    pub attributes: HashMap<String, Value>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Argument {
    #[prost(message, repeated, tag = "1")]
    pub arguments: Vec<Binding>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Binding {
    #[prost(oneof = "binding::Binding", tags = "1, 2")]
    pub binding: Option<binding::Binding>,
}

pub mod binding {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Binding {
        #[prost(string, tag = "1")]
        Name(String),
        #[prost(message, tag = "2")]
        Value(super::Value),
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct NamedValueType {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(message, optional, tag = "2")]
    pub r#type: Option<ValueType>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ValueType {
    #[prost(oneof = "value_type::Type", tags = "1, 2, 3, 4, 5")]
    pub r#type: Option<value_type::Type>,
}

pub mod value_type {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Type {
        #[prost(message, tag = "1")]
        TensorType(super::TensorType),
        #[prost(message, tag = "2")]
        ListType(super::Opaque),
        #[prost(message, tag = "3")]
        TupleType(super::Opaque),
        #[prost(message, tag = "4")]
        DictionaryType(super::Opaque),
        #[prost(message, tag = "5")]
        StateType(Box<super::StateType>),
    }
}

/// A message whose content this reader does not need (its bytes are skipped).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Opaque {}

#[derive(Clone, PartialEq, prost::Message)]
pub struct StateType {
    #[prost(message, optional, tag = "1")]
    pub wrapped_type: Option<ValueType>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorType {
    #[prost(int32, tag = "1")]
    pub data_type: i32,
    #[prost(int64, tag = "2")]
    pub rank: i64,
    #[prost(message, repeated, tag = "3")]
    pub dimensions: Vec<Dimension>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Dimension {
    #[prost(oneof = "dimension::Dimension", tags = "1, 2")]
    pub dimension: Option<dimension::Dimension>,
}

pub mod dimension {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Dimension {
        #[prost(message, tag = "1")]
        Constant(super::ConstantDimension),
        #[prost(message, tag = "2")]
        Unknown(super::UnknownDimension),
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ConstantDimension {
    #[prost(uint64, tag = "1")]
    pub size: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct UnknownDimension {
    #[prost(bool, tag = "1")]
    pub variadic: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Value {
    #[prost(string, tag = "1")]
    pub doc_string: String,
    #[prost(message, optional, tag = "2")]
    pub r#type: Option<ValueType>,
    #[prost(oneof = "value::Value", tags = "3, 5")]
    pub value: Option<value::Value>,
}

pub mod value {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Value {
        #[prost(message, tag = "3")]
        ImmediateValue(super::ImmediateValue),
        #[prost(message, tag = "5")]
        BlobFileValue(super::BlobFileValue),
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ImmediateValue {
    #[prost(oneof = "immediate_value::Value", tags = "1, 2, 3, 4")]
    pub value: Option<immediate_value::Value>,
}

pub mod immediate_value {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Value {
        #[prost(message, tag = "1")]
        Tensor(super::TensorValue),
        #[prost(message, tag = "2")]
        Tuple(super::TupleValue),
        #[prost(message, tag = "3")]
        List(super::TupleValue),
        #[prost(message, tag = "4")]
        Dictionary(super::Opaque),
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct BlobFileValue {
    #[prost(string, tag = "1")]
    pub file_name: String,
    #[prost(uint64, tag = "2")]
    pub offset: u64,
}

/// TupleValue and ListValue have the same layout: `repeated Value values = 1`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TupleValue {
    #[prost(message, repeated, tag = "1")]
    pub values: Vec<Value>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorValue {
    #[prost(oneof = "tensor_value::Value", tags = "1, 2, 3, 4, 5, 6, 7")]
    pub value: Option<tensor_value::Value>,
}

pub mod tensor_value {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Value {
        #[prost(message, tag = "1")]
        Floats(super::RepeatedFloats),
        #[prost(message, tag = "2")]
        Ints(super::RepeatedInts),
        #[prost(message, tag = "3")]
        Bools(super::RepeatedBools),
        #[prost(message, tag = "4")]
        Strings(super::RepeatedStrings),
        #[prost(message, tag = "5")]
        LongInts(super::RepeatedLongInts),
        #[prost(message, tag = "6")]
        Doubles(super::RepeatedDoubles),
        #[prost(message, tag = "7")]
        Bytes(super::RepeatedBytes),
    }
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RepeatedFloats {
    #[prost(float, repeated, tag = "1")]
    pub values: Vec<f32>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RepeatedDoubles {
    #[prost(double, repeated, tag = "1")]
    pub values: Vec<f64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RepeatedInts {
    #[prost(int32, repeated, tag = "1")]
    pub values: Vec<i32>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RepeatedLongInts {
    #[prost(int64, repeated, tag = "1")]
    pub values: Vec<i64>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RepeatedBools {
    #[prost(bool, repeated, tag = "1")]
    pub values: Vec<bool>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RepeatedStrings {
    #[prost(string, repeated, tag = "1")]
    pub values: Vec<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct RepeatedBytes {
    #[prost(bytes = "vec", tag = "1")]
    pub values: Vec<u8>,
}
