//! What the tests share: the binary and its environment ([`cli`]), the prerequisites some tests
//! need beyond the repository ([`need`]), and a toy step model with its byte-level tokenizer
//! ([`toy`]), the generators' JSON arrays ([`json`]), logits against a reference's
//! ([`logits`]). Fixtures of the product itself (tiny checkpoints, GGUF files, packages) live in
//! the test kit, `hf2coreml_testkit`.

pub mod cli;
pub mod json;
pub mod logits;
pub mod need;
pub mod toy;

pub use cli::{assert_refused, cli, convert, copy_dir, hf2coreml, stderr, stdout, Cli};
pub(crate) use need::needs;
