use std::io::Write;

use clap::Parser;

mod cli;
mod commands;
mod printer;

use hf2coreml::checkpoint::CheckpointError;
use hf2coreml::error::{CheckFailed, EnvironmentError, ExitCode};
use hf2coreml::pipeline::batch::ExportError;
use hf2coreml::pipeline::job::JobError;
use hf2coreml::validate::run_checks::ValidateError;

fn main() {
    // Die quietly when stdout's reader goes away (`hf2coreml ... | head`), as Unix tools do,
    // instead of panicking on the next print.
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of one signal before any thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    crate::printer::exit_cleanly_on_stdout_errors();
    hf2coreml::fsutil::handle_interrupts();
    let cli = match cli::Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => help_or_usage_error(e),
    };
    crate::printer::set_output_mode(cli.quiet, cli.verbose);
    // A cap on the kernels' instruction set that names no level is refused before any work.
    let result = match hf2coreml::util::isa::from_env() {
        Ok(_) => cli.command.run(),
        Err(e) => Err(e.into()),
    };
    // An interrupted run exits with 128 + the signal, not with the error its cleanup caused.
    hf2coreml::fsutil::wait_if_interrupted();
    let code = match result {
        Ok(()) => ExitCode::Success,
        Err(err) if unwritten(&err).is_some() => {
            let io = unwritten(&err).expect("matched");
            // stderr may be full too; there is nothing left to tell then.
            let _ = writeln!(std::io::stderr(), "error: cannot write the results: {io}");
            ExitCode::Environment
        }
        Err(err) => {
            let code = match err.downcast_ref::<commands::batch::BatchFailed>() {
                Some(b) => b.0,
                None => exit_code_for(&err),
            };
            // A failed check already printed its report; say why in one line.
            let esc = |s: String| printer::escape_controls(&s).into_owned();
            eprintln!("error: {}", esc(err.to_string()));
            // A cause its error already spells out (`{path}: {source}`) is not said twice.
            let mut said = err.to_string();
            for cause in err.chain().skip(1) {
                let text = cause.to_string();
                if !said.ends_with(&text) {
                    eprintln!("  caused by: {}", esc(text.clone()));
                }
                said = text;
            }
            if let Some(hint) = hint_for(&err) {
                eprintln!("hint: {}", esc(hint));
            }
            code
        }
    };
    std::process::exit(code as i32);
}

/// `--help`, `--version` (exit 0 once written; a stdout that cannot take them is exit 3 with
/// one line, as for any result) or a usage error (clap's message, exit 2).
fn help_or_usage_error(e: clap::Error) -> ! {
    use clap::error::ErrorKind;
    if !matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
        e.exit();
    }
    let mut out = std::io::stdout().lock();
    // Styled on a terminal, plain text elsewhere, as clap prints it.
    let text = if std::io::IsTerminal::is_terminal(&out) {
        e.render().ansi().to_string()
    } else {
        e.render().to_string()
    };
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => std::process::exit(ExitCode::Success as i32),
        Err(io) => {
            let _ = writeln!(std::io::stderr(), "error: cannot write the results: {io}");
            std::process::exit(ExitCode::Environment as i32)
        }
    }
}

/// The stdout error in `err`'s chain, when writing a command's results failed.
fn unwritten(err: &anyhow::Error) -> Option<&std::io::Error> {
    err.chain().find_map(|cause| {
        if let Some(printer::Unwritten(io)) = cause.downcast_ref() {
            return Some(io);
        }
        match cause.downcast_ref() {
            Some(hf2coreml::runtime::text::TextError::Output(io)) => Some(io),
            _ => None,
        }
    })
}

/// Classify an error chain into an exit code: the first cause that says (a library error that
/// knows its class, or one of the markers) decides; everything else is bad input.
fn exit_code_for(err: &anyhow::Error) -> ExitCode {
    for cause in err.chain() {
        if let Some(e) = cause.downcast_ref::<JobError>() {
            return e.exit_code();
        }
        if let Some(e) = cause.downcast_ref::<ExportError>() {
            return e.exit_code();
        }
        if cause.downcast_ref::<EnvironmentError>().is_some() {
            return ExitCode::Environment;
        }
        if cause.downcast_ref::<CheckFailed>().is_some() {
            return ExitCode::CheckFailed;
        }
    }
    ExitCode::BadInput
}

/// A hint printed under the error, when the chain holds an error that has one.
fn hint_for(err: &anyhow::Error) -> Option<String> {
    for cause in err.chain() {
        if let Some(e) = cause.downcast_ref::<EnvironmentError>() {
            return Some(e.fix.clone());
        }
        let checkpoint = match cause.downcast_ref::<ValidateError>() {
            Some(ValidateError::Checkpoint(e)) => Some(e),
            _ => cause.downcast_ref::<CheckpointError>(),
        };
        if let Some(h) = checkpoint.and_then(|e| e.hint()) {
            return Some(h.to_string());
        }
    }
    None
}
