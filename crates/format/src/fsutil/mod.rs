//! Files and the process: outputs written atomically, input files read safely, cleanup when
//! the process is interrupted, and handing freed memory back. One idea a file; the rest of the
//! crate uses the re-exports below.

mod input;
mod interrupt;
mod memory;
mod output;
mod staged;
mod tree;

pub use input::{open_input, read_input, read_input_text, sha256_file};
pub use interrupt::{
    ctrl_c_pending, handle_interrupts, is_ctrl_c, keep_on_interrupt, reassert_interrupt_handlers,
    remove_on_interrupt, scratch_dir, take_ctrl_c, wait_if_interrupted, CtrlC, CtrlCStdin,
};
pub use memory::release_free_memory;
pub use output::{
    atomic_write, check_file_output, check_replaceable, check_writable, free_bytes,
    refuse_output_over_input, resolved, AtomicDir,
};
pub use staged::Staged;
pub use tree::{copy_tree, dir_bytes};

use std::path::Path;

fn parent_dir(p: &Path) -> &Path {
    match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".into())
}
