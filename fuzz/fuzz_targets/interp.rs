#![no_main]
//! See hf2coreml_testkit::fuzz::interp: the same function the regression tests replay.

use libfuzzer_sys::fuzz_target;

thread_local! {
    // One scratch directory per process, in memory when /dev/shm exists.
    static SCRATCH: tempfile::TempDir = {
        let shm = std::path::Path::new("/dev/shm");
        let mut b = tempfile::Builder::new();
        b.prefix("hf2coreml-fuzz-");
        let dir = if shm.is_dir() { b.tempdir_in(shm) } else { b.tempdir() };
        dir.expect("scratch directory")
    };
}

fuzz_target!(|data: &[u8]| {
    SCRATCH.with(|d| hf2coreml_testkit::fuzz::interp(data, d.path()));
});
