//! Architectures: checkpoints transformers wrote (Qwen3, SmolLM3, Phi-3, Gemma 3) against its
//! own logits, and config fields and tensors that are refused rather than ignored.

mod ane;
mod config;
mod gemma4;
mod hf;
mod multimodal;
mod qwen3_5;
