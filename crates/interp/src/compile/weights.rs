//! What a compiled program keeps of its constants: weights left packed where only `linear`,
//! `conv` and `gather` read them, fp16 `linear` weights held as fp16, constants nothing reads
//! dropped.

use std::collections::HashMap;
use std::sync::Arc;

use super::instr::{Arg, Instr, OpKind};
use super::loader::Loader;
use super::surface::RuntimeError;
use crate::exec::packed;
use crate::exec::tensor::{self, Data, Tensor};
use crate::mil::{DType, Op};

/// Keep packed the weights only `linear` and `conv` (as `weight`) and `gather` (as `x`,
/// along axis 0) read; decode the others, counted with the constants, as dense constants.
/// A packed weight nothing reads (a LUT a scale op was applied to) is dropped.
pub(super) fn settle_packed(
    ld: &mut Loader,
    instrs: &[Instr],
    outputs: &[(String, usize)],
    consts: &mut Vec<(usize, Arc<Tensor>)>,
) -> Result<HashMap<usize, Arc<packed::Packed>>, RuntimeError> {
    let mut kept = HashMap::new();
    for (s, p) in ld.take_packed() {
        let reads = |i: &&Instr| {
            i.inputs
                .iter()
                .any(|(_, a)| a.iter().any(|b| matches!(b, Arg::Slot(x) if *x == s)))
        };
        let readers: Vec<&Instr> = instrs.iter().filter(reads).collect();
        let output = outputs.iter().any(|(_, o)| *o == s);
        if readers.is_empty() && !output {
            continue;
        }
        let known = |slot: usize| {
            consts
                .iter()
                .find(|(c, _)| *c == slot)
                .map(|(_, t)| t.clone())
        };
        if !output && readers.iter().all(|i| reads_packed_in_place(i, s, &known)) {
            let linear = readers
                .iter()
                .any(|i| matches!(i.op, OpKind::Known(Op::Linear | Op::Conv)));
            let p = if linear && p.dtype == DType::F16 {
                let mut half = (*p).clone();
                half.gathers_half = true;
                Arc::new(half)
            } else {
                p
            };
            kept.insert(s, p);
            continue;
        }
        let t = ld.unpack(&p, "a weight read by other ops")?;
        consts.push((s, Arc::new(t)));
    }
    Ok(kept)
}

/// Whether `ins` reads slot `s` only where a packed weight can be read in place. A `gather`'s
/// `axis` and `batch_dims` must be 0, given inline or as constants (`known`: a constant slot's
/// value; coremltools writes them as named `const` ops).
fn reads_packed_in_place(
    ins: &Instr,
    s: usize,
    known: &dyn Fn(usize) -> Option<Arc<Tensor>>,
) -> bool {
    let key = match ins.op {
        OpKind::Known(Op::Linear | Op::Conv) => "weight",
        OpKind::Known(Op::Gather) => "x",
        _ => return false,
    };
    let is_zero = |t: &Tensor| t.as_i64().iter().all(|&v| v == 0);
    let zero = |k: &str| {
        ins.inputs.iter().all(|(n, a)| {
            n != k
                || match a.as_slice() {
                    [Arg::Const(t)] => is_zero(t),
                    [Arg::Slot(c)] => known(*c).is_some_and(|t| is_zero(&t)),
                    _ => false,
                }
        })
    };
    let gather_ok = key != "x" || (zero("axis") && zero("batch_dims"));
    gather_ok
        && ins.inputs.iter().all(|(k, a)| {
            let here = a.iter().any(|b| matches!(b, Arg::Slot(x) if *x == s));
            !here || (k == key && a.len() == 1)
        })
}

/// Constants no instruction reads and no output names (a LUT an iOS18 op consumed at load,
/// the dense weight a scale op was applied to) are not kept.
pub(super) fn drop_unread_constants(
    consts: &mut Vec<(usize, Arc<Tensor>)>,
    instrs: &[Instr],
    outputs: &[(String, usize)],
) {
    let read: std::collections::HashSet<usize> = instrs
        .iter()
        .flat_map(|i| i.inputs.iter().flat_map(|(_, a)| a.iter()))
        .filter_map(|a| match a {
            Arg::Slot(s) => Some(*s),
            Arg::Const(_) => None,
        })
        .chain(outputs.iter().map(|(_, s)| *s))
        .collect();
    consts.retain(|(s, _)| read.contains(s));
}

/// fp16 `linear` (and `conv`) weights stay fp16 in memory (they are exact there): a decode step is bound by
/// reading the weights, and half the bytes is nearly half the time. Every op reads fp16 data;
/// `linear` and `gather` (a tied embedding shares the lm_head's storage) read it without
/// widening the whole tensor.
pub(super) fn store_linear_weights_half(consts: &mut [(usize, Arc<Tensor>)], instrs: &[Instr]) {
    let weight_slots: std::collections::HashSet<usize> = instrs
        .iter()
        .filter(|ins| matches!(ins.op, OpKind::Known(Op::Linear | Op::Conv)))
        .flat_map(|ins| ins.inputs.iter().filter(|(k, _)| k == "weight"))
        .flat_map(|(_, a)| a.iter())
        .filter_map(|a| match a {
            Arg::Slot(s) => Some(*s),
            Arg::Const(_) => None,
        })
        .collect();
    // Storage shared between slots (deduplicated blobs) is converted once and stays shared.
    // The map holds the original too, so no address is freed and reused while it is a key.
    let mut converted: HashMap<*const Tensor, (Arc<Tensor>, Arc<Tensor>)> = HashMap::new();
    for (s, t) in consts.iter() {
        if !weight_slots.contains(s) || t.dtype != DType::F16 {
            continue;
        }
        let Data::F(v) = &t.data else { continue };
        converted.entry(Arc::as_ptr(t)).or_insert_with(|| {
            let half = Tensor::new(
                DType::F16,
                t.shape.clone(),
                Data::Half(tensor::f32_to_half(v)),
            );
            (t.clone(), Arc::new(half))
        });
    }
    for (_, t) in consts.iter_mut() {
        if let Some((_, h)) = converted.get(&Arc::as_ptr(t)) {
            *t = h.clone();
        }
    }
}
