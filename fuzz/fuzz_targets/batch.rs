#![no_main]
//! See hf2coreml::testing::fuzz::batch: the same function the regression tests replay.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    hf2coreml::testing::fuzz::batch(data);
});
