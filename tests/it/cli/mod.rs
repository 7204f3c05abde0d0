//! The command line as users and CI meet it: commands over checkpoints (`inspect`, `budget`),
//! over packages (`inspect`, `run`, `run --chat`), output conventions (JSON on stdout, quiet,
//! completions, man pages) and progress drawn on a terminal.

mod budget;
mod chat;
mod checkpoint;
mod ci;
mod hub;
mod inspect;
mod progress;
mod run;
