//! How long each value lives: the instruction after which it is freed, and the most bytes live
//! at once (checked against the limits before the program runs).

use std::collections::HashMap;
use std::sync::Arc;

use super::limits;
use super::program::{Arg, Instr};
use super::Tensor;
use crate::mlpackage::TensorTypeInfo;

/// Free each computed value after its last reader; outputs and constants are kept. A value
/// nobody reads is freed right after the instruction that made it.
pub(super) fn schedule_frees(
    instrs: &mut [Instr],
    outputs: &[(String, usize)],
    consts: &[(usize, Arc<Tensor>)],
) {
    let mut last: HashMap<usize, usize> = HashMap::new();
    for (i, ins) in instrs.iter().enumerate() {
        for (s, _) in &ins.outputs {
            last.entry(*s).or_insert(i);
        }
        for (_, a) in &ins.inputs {
            for b in a {
                if let Arg::Slot(s) = b {
                    last.insert(*s, i);
                }
            }
        }
    }
    let keep: std::collections::HashSet<usize> = outputs
        .iter()
        .map(|(_, s)| *s)
        .chain(consts.iter().map(|(s, _)| *s))
        .collect();
    for (s, i) in last {
        if !keep.contains(&s) && !instrs[i].frees.contains(&s) {
            instrs[i].frees.push(s);
        }
    }
}

/// The most bytes live at once while the program runs, from the declared types: constants,
/// inputs, and every value from the instruction that makes it to its last use (block
/// outputs to the end).
pub(super) fn peak_live_bytes(
    inputs: &[(String, usize, TensorTypeInfo)],
    instrs: &[Instr],
    const_bytes: u64,
) -> u64 {
    let mut size: HashMap<usize, u64> = HashMap::new();
    let mut live = inputs.iter().fold(const_bytes, |a, (_, _, t)| {
        a.saturating_add(limits::type_bytes(t))
    });
    let mut peak = live;
    for ins in instrs {
        for (s, ty) in &ins.outputs {
            let b = limits::type_bytes(ty);
            size.insert(*s, b);
            live = live.saturating_add(b);
        }
        peak = peak.max(live);
        for f in &ins.frees {
            live = live.saturating_sub(size.get(f).copied().unwrap_or(0));
        }
    }
    peak
}
