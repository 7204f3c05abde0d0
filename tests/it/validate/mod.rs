//! `validate`: its gates on each tiny architecture and its contract check.

mod contract;
mod tiny;
