//! One module per verb: argument types, running, printing.

pub mod batch;
pub mod budget;
pub mod convert;
pub mod import_gguf;
pub mod inspect;
pub mod palettize;
pub mod run;
pub mod validate;

/// Print `value` as pretty JSON on stdout.
pub fn print_json<T: serde::Serialize>(value: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}

/// The fixed shape of a plan: S and Q at least 1, S within the budget's cap, Q at most S.
pub fn check_shape(max_seq_len: usize, query_len: usize) -> anyhow::Result<()> {
    if max_seq_len == 0 || query_len == 0 {
        anyhow::bail!("--max-seq-len and --query-len must be at least 1");
    }
    if max_seq_len > hf2coreml::budget::MAX_SEQ_CAP {
        anyhow::bail!(
            "--max-seq-len {max_seq_len} exceeds the limit of {}",
            hf2coreml::budget::MAX_SEQ_CAP
        );
    }
    if query_len > max_seq_len {
        anyhow::bail!("--query-len ({query_len}) cannot exceed --max-seq-len ({max_seq_len})");
    }
    Ok(())
}

/// The evaluation text `validate` reads (the shipped passage by default) and its name.
pub fn evaluation_text(path: Option<&std::path::Path>) -> anyhow::Result<(String, String)> {
    use anyhow::Context;
    Ok(match path {
        Some(p) => (
            std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))?,
            p.display().to_string(),
        ),
        None => (
            hf2coreml::validate::run::EVALUATION_TEXT.to_string(),
            "fixtures/evaluation.txt".to_string(),
        ),
    })
}
