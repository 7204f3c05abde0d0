#![no_main]
//! See hf2coreml_testkit::fuzz::batch: the same function the regression tests replay.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    hf2coreml_testkit::fuzz::batch(data);
});
