use clap::Parser;

mod cli;
mod commands;

use hf2coreml::error::{exit_code_for, hint_for, ExitCode};

fn main() {
    // Die quietly when stdout's reader goes away (`hf2coreml ... | head`), as Unix tools do,
    // instead of panicking on the next print.
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of one signal before any thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = cli::Cli::parse();
    hf2coreml::util::set_output_mode(cli.quiet, cli.verbose);
    let code = match cli.command.run() {
        Ok(()) => ExitCode::Success,
        Err(err) => {
            let code = match err.downcast_ref::<commands::batch::BatchFailed>() {
                Some(b) => b.0,
                None => exit_code_for(&err),
            };
            // A failed check already printed its report; say why in one line.
            eprintln!("error: {err}");
            for cause in err.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            if let Some(hint) = hint_for(&err) {
                eprintln!("hint: {hint}");
            }
            code
        }
    };
    std::process::exit(code as i32);
}
