//! The runtime around a package: the token loop against a strict toy model, chat templates,
//! prompts and streamed text, and the logits file `run` writes.

mod chat;
mod generate;
mod logits;
mod stream;
