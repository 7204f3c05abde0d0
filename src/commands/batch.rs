//! `hf2coreml batch FILE.toml`: run a batch file's exports through the same code path as
//! `convert` (+ `validate`), skip the up-to-date ones, report each, exit with the worst.

use std::path::{Path, PathBuf};

use crate::printer::{self, Bars};
use anyhow::Context;
use hf2coreml::error::ExitCode;
use hf2coreml::fsutil::atomic_write;
use hf2coreml::pipeline::batch::{
    self, render_list, render_summary, BatchFile, BatchSettings, Export, Shard,
};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The batch file: a [defaults] table and [[export]] entries (see configs/batch/).
    pub file: PathBuf,
    /// Exports to run at once; fewer when the machine's available memory would not hold them.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub jobs: usize,
    /// Run every export even after one fails (default: stop at the first failure).
    #[arg(long)]
    pub keep_going: bool,
    /// Run only the I-th of N slices (1-based; round-robin in file order), e.g. `--shard 2/4`
    /// on the second of four CI machines.
    #[arg(long, value_name = "I/N")]
    pub shard: Option<Shard>,
    /// Run only the export called NAME (repeatable; `--list` prints the names).
    #[arg(long, value_name = "NAME")]
    pub only: Vec<String>,
    /// Print the expanded exports (after --shard/--only) instead of running them.
    #[arg(long)]
    pub list: bool,
    /// JSON instead of text: the report (with --list, the exports as one JSON array) to FILE,
    /// or to stdout without FILE or with `-`.
    #[arg(long, value_name = "FILE", num_args = 0..=1, default_missing_value = "-")]
    pub json: Option<PathBuf>,
    /// Rebuild up-to-date packages too, and replace outputs that hf2coreml did not write.
    #[arg(long)]
    pub force: bool,
    /// Python environment holding coremltools (as for `convert`).
    #[arg(long)]
    pub python_env: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    if let Some(path) = args.json.as_deref().filter(|p| *p != Path::new("-")) {
        hf2coreml::fsutil::check_file_output(path)?;
    }
    let file = BatchFile::load(&args.file)?;
    let selected: Vec<Export> = file
        .select(args.shard, &args.only)?
        .into_iter()
        .cloned()
        .collect();
    if args.list {
        return list(&file, &selected, &args);
    }
    if args.jobs == 0 {
        anyhow::bail!("--jobs must be at least 1");
    }
    let progress = Bars::default();
    let jobs = batch::bounded_jobs(args.jobs, &selected, &progress);
    if jobs > 1 {
        printer::disable_progress_bars();
    }
    printer::info(format!(
        "{} export{} from {}{}{}",
        selected.len(),
        if selected.len() == 1 { "" } else { "s" },
        args.file.display(),
        args.shard.map_or(String::new(), |s| format!(", shard {s}")),
        if jobs > 1 {
            format!(", {jobs} at a time")
        } else {
            String::new()
        }
    ));
    let settings = BatchSettings {
        jobs,
        keep_going: args.keep_going,
        force: args.force,
        python_env: args.python_env.clone(),
    };
    let report = batch::runner::run(&args.file, args.shard, &selected, &settings, &progress);
    match args.json.as_deref() {
        Some(p) if p == Path::new("-") => super::print_json(&report)?,
        Some(p) => {
            let text = serde_json::to_string_pretty(&report)? + "\n";
            atomic_write(p, text.as_bytes())
                .with_context(|| format!("cannot write {}", p.display()))?;
            print!("{}", render_summary(&report));
        }
        None => print!("{}", render_summary(&report)),
    }
    match report.exit() {
        ExitCode::Success => Ok(()),
        exit => Err(BatchFailed(exit).into()),
    }
}

/// The batch's exit code, carried to `main` (which prints no further message for it: the
/// summary already said what failed).
#[derive(Debug)]
pub struct BatchFailed(pub ExitCode);

impl std::fmt::Display for BatchFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            ExitCode::CheckFailed => f.write_str("a check or gate failed (see the summary)"),
            ExitCode::Environment => {
                f.write_str("the environment is missing something (see the summary)")
            }
            _ => f.write_str("an export was invalid (see the summary)"),
        }
    }
}
impl std::error::Error for BatchFailed {}

fn list(file: &BatchFile, selected: &[Export], args: &Args) -> anyhow::Result<()> {
    file.check_models(selected)?;
    match args.json.as_deref() {
        // One line: ready for `echo "exports=$(...)" >> $GITHUB_OUTPUT` and fromJSON().
        Some(p) if p == Path::new("-") => println!("{}", serde_json::to_string(selected)?),
        Some(p) => {
            let text = serde_json::to_string(selected)? + "\n";
            atomic_write(p, text.as_bytes())
                .with_context(|| format!("cannot write {}", p.display()))?;
        }
        None => print!("{}", render_list(file, selected)),
    }
    Ok(())
}
