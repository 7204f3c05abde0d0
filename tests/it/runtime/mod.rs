//! The runtime around a package: the token loop against a strict toy model, chat templates,
//! prompts and streamed text, the logits file `run` writes, and the kernels' level.

mod chat;
mod generate;
mod isa;
mod logits;
mod stream;
