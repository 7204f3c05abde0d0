//! The real model: SmolLM2-135M-Instruct as `make model` imports it from its GGUF
//! (`HF2COREML_MODEL_DIR`, `HF2COREML_GGUF`). Every test starts with `needs!(Model, ...)`: a
//! plain `cargo test` without the model skips them, `make test` runs them. `cargo test --test it
//! real::` runs only these.

mod chain;
mod chat;
mod convert;
mod coreai;
mod default_recipe;
mod gguf;
mod multifunction;
mod reference;
mod run;
mod state;
mod validate;
