//! GGUF (llama.cpp) files → Hugging Face checkpoints.
