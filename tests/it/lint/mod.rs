//! `lint`: every rule on packages coremltools builds, and packages that pass it by construction.

mod cases;
mod split;
