//! Handing memory the allocator holds but no longer uses back to the system, between stages.

/// Give the memory the allocator holds but no longer uses back to the system.
///
/// glibc keeps freed blocks below its (self-raising) mmap threshold in its heaps, one heap per
/// thread that allocated, and returns only the top of each. A stage that churns through
/// tensors of a few MiB (a forward pass over calibration text) leaves tens of MiB there that
/// the next stage, holding every palettized weight, would otherwise add to. Called between
/// stages; elsewhere it does nothing.
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks glibc's own heaps; it is thread-safe and has no
    // preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
}
