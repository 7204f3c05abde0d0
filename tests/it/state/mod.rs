//! Stateful packages (`--kv-cache state`): tiny conversions, and a program coremltools wrote.

mod foreign;
mod tiny;
