//! How long each value lives: the instruction after which it is freed, the most bytes live at
//! once (checked against the limits before the program runs), and the `slice_update`s whose
//! input dies into the state they write back, which may then be made in place.
//!
//! A state's value lives in its input slot while a call runs: `read_state` shares it (no
//! copy), `write_state` replaces it. `slice_update` copies `x` with a window replaced, except
//! where the program reads a state, updates a window of what it read and writes the result
//! back before anything else reads that state: then the update is made in place in the state's
//! own storage ([`in_place_updates`]), which is what makes a stateful decode step cheaper than
//! passing the cache in and out.

use std::collections::HashMap;
use std::sync::Arc;

use super::instr::{Arg, Instr, OpKind};
use crate::exec::limits;
use crate::exec::tensor::Tensor;
use crate::mil::Op;
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

/// Mark each `slice_update` that may write into a state's storage: its `x` is the value a
/// `read_state` of state S returned, and the first instruction after it that names S writes
/// this update's result into S. Nothing can then observe S's old value after the update (the
/// run checks at the time that no other value shares the storage).
pub(super) fn in_place_updates(instrs: &mut [Instr], state_slots: &[usize]) {
    let slot_of = |ins: &Instr, key: &str| -> Option<usize> {
        match ins.inputs.iter().find(|(k, _)| k == key)?.1.as_slice() {
            [Arg::Slot(s)] => Some(*s),
            _ => None,
        }
    };
    let names = |ins: &Instr, s: usize| {
        ins.inputs
            .iter()
            .any(|(_, a)| a.iter().any(|b| matches!(b, Arg::Slot(x) if *x == s)))
    };
    for i in 0..instrs.len() {
        if instrs[i].op != OpKind::Known(Op::SliceUpdate) {
            continue;
        }
        let (Some(x), Some(&(out, _))) = (slot_of(&instrs[i], "x"), instrs[i].outputs.first())
        else {
            continue;
        };
        let Some(state) = instrs[..i].iter().find_map(|p| {
            let reads = p.op == OpKind::Known(Op::ReadState);
            let made_x = p.outputs.first().is_some_and(|(s, _)| *s == x);
            (reads && made_x)
                .then(|| slot_of(p, "input"))
                .flatten()
                .filter(|s| state_slots.contains(s))
        }) else {
            continue;
        };
        let next = instrs[i + 1..].iter().find(|n| names(n, state));
        let writes_back = next.is_some_and(|n| match &n.op {
            OpKind::Known(Op::WriteState) => {
                slot_of(n, "input") == Some(state) && slot_of(n, "data") == Some(out)
            }
            OpKind::Known(Op::CoremlUpdateState) => {
                slot_of(n, "state") == Some(state) && slot_of(n, "value") == Some(out)
            }
            _ => false,
        });
        if writes_back {
            instrs[i].in_place = Some(state);
        }
    }
}
