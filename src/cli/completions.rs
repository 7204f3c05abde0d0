//! Shell completions and man pages, generated from the clap definitions so they never drift
//! from the real flags.

use std::path::PathBuf;

use anyhow::Context;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The shell to complete for.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

#[derive(Debug, clap::Args)]
pub struct ManArgs {
    /// Write hf2coreml.1 and one hf2coreml-VERB.1 per command into DIR instead of printing
    /// the main page.
    #[arg(long, value_name = "DIR")]
    pub out_dir: Option<PathBuf>,
}

/// The completion script of `cmd` (the whole command line's definition) for `args.shell`.
pub fn run(args: Args, mut cmd: clap::Command) -> anyhow::Result<()> {
    // Generated into memory, then written with the error returned (the generator itself
    // panics when its writer fails, e.g. a full stdout).
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut cmd, "hf2coreml", &mut script);
    std::io::Write::write_all(&mut std::io::stdout().lock(), &script)
        .and_then(|()| std::io::Write::flush(&mut std::io::stdout()))
        .map_err(crate::printer::Unwritten)?;
    Ok(())
}

/// The man pages of `cmd` (the whole command line's definition).
pub fn man(args: ManArgs, cmd: clap::Command) -> anyhow::Result<()> {
    let Some(dir) = args.out_dir else {
        // Rendered into memory, then written: the one write's error is the one reported.
        let mut page = Vec::new();
        clap_mangen::Man::new(cmd).render(&mut page)?;
        std::io::Write::write_all(&mut std::io::stdout().lock(), &page)
            .and_then(|()| std::io::Write::flush(&mut std::io::stdout()))
            .map_err(crate::printer::Unwritten)?;
        return Ok(());
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut pages = vec![("hf2coreml.1".to_string(), cmd.clone())];
    for sub in cmd.get_subcommands() {
        let name = format!("hf2coreml-{}", sub.get_name());
        pages.push((
            format!("{name}.1"),
            sub.clone()
                .name(name)
                .bin_name(format!("hf2coreml {}", sub.get_name())),
        ));
    }
    for (file, page) in pages {
        let mut bytes = Vec::new();
        clap_mangen::Man::new(page)
            .render(&mut bytes)
            .context("rendering a man page")?;
        let path = dir.join(&file);
        hf2coreml::fsutil::atomic_write(&path, &bytes)
            .with_context(|| format!("cannot write {}", path.display()))?;
        println!("{}", path.display());
    }
    Ok(())
}
