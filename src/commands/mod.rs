//! One module per verb: its arguments, resolved into the library's settings; the library
//! call; the printing.

pub mod args;
pub mod batch;
pub mod budget;
pub mod chat;
pub mod convert;
pub mod import_gguf;
pub mod inspect;
pub mod inspect_asset;
pub mod inspect_package;
pub mod lint;
pub mod palettize;
mod per_layer_line;
pub mod recipes;
pub mod run;
pub mod run_args;
mod run_output;
pub mod validate;

/// The interpreter allocates and frees buffers of 0.1-32 MB every step (activations, the
/// KV cache widened to f32). glibc hands out blocks above its mmap threshold (128 KiB until a
/// block that large is freed) as fresh mappings: each is faulted in and zeroed page by page and
/// unmapped when freed. With the weights in place nothing large is freed at load, so the
/// threshold would never rise and every step would pay for those mappings. Fixing the
/// threshold at glibc's dynamic maximum (32 MiB) keeps those blocks in the heap. The trim
/// threshold is 512 MiB: a chain's step frees each part's copy of its caches (tens of MiB at
/// 8B) before the next part allocates its own, and at glibc's 64 MiB the heap top would go back
/// to the kernel and be faulted in again every part. What each costs, measured:
/// docs/design.md, "The runner's memory".
pub fn tune_allocator_for_the_runner() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; it is called before any thread starts
    // allocating these buffers, and an unaccepted value is reported (0), not undefined.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 512 << 20);
    }
}

/// Print `value` as pretty JSON on stdout.
pub fn print_json<T: serde::Serialize>(value: &T) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(value)?);
    Ok(())
}
