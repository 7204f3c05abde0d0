//! GGUF files: import (every tensor type, tokenizers, K-quant layouts), `import-gguf` and
//! `convert` on a .gguf, and header-only `inspect` and `budget`.

mod cli;
mod dequant;
mod header;
mod import;
mod kquant;
mod roundtrip;
mod tokenizers;
mod transformers;
