//! Execution, the interpreter's bottom layer: what runs once a program is compiled, over values
//! and arguments alone. Tensors and fp16 rounding ([`tensor`]); the op kernels, one function
//! per MIL op, over the numerics crate's [`kernels`] ([`ops`]), and the table that picks one
//! by its op ([`dispatch`]); weights read in place from the weight file ([`packed`]); the
//! values Core ML states keep between calls and `slice_update`'s window ([`states`]); large
//! copies across the thread pool ([`bulk`]); and the resource limits every size is checked
//! against ([`limits`]).
//!
//! Nothing here knows a program, a package or how either was loaded: the compiled program
//! (`super::compile`) calls down into these, never the other way.

pub mod bulk;
pub(super) mod dispatch;
pub mod limits;
pub mod ops;
pub mod packed;
pub(super) mod states;
pub mod tensor;

pub use hf2coreml_numerics::kernels;
