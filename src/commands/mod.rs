//! One module per verb: its arguments, resolved into the library's settings; the library
//! call; the printing.

pub mod batch;
pub mod budget;
pub mod chat;
pub mod convert;
pub mod import_gguf;
pub mod inspect;
pub mod inspect_package;
pub mod lint;
pub mod palettize;
pub mod recipes;
pub mod run;
pub mod validate;

/// Print `value` as pretty JSON on stdout.
pub fn print_json<T: serde::Serialize>(value: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}
