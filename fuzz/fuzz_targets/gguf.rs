#![no_main]
//! See hf2coreml_testkit::fuzz::gguf: the same function the regression tests replay.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    hf2coreml_testkit::fuzz::gguf(data);
});
