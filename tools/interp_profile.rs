//! Where a decode step of the interpreter spends its time: runs N steps of a saved package
//! (host static cache, as `run` does) and prints wall time per op kind.
//!
//! cargo run --release -p hf2coreml-tools --bin interp_profile -- PKG [STEPS]

use std::time::Instant;

use half::f16;
use hf2coreml::runtime::interp::{Options, Package, Stats};
use hf2coreml::runtime::StepModel;

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .expect("usage: interp_profile PKG [STEPS] [START_POSITION]");
    let steps: usize = args.next().map_or(16, |s| s.parse().expect("STEPS"));
    let start: usize = args
        .next()
        .map_or(0, |s| s.parse().expect("START_POSITION"));
    let pkg = Package::load(std::path::Path::new(&path), Options::default()).expect("load");
    let c = pkg.contract().clone();
    let (l, hkv, s, d) = (c.num_layers, c.num_kv_heads, c.max_seq_len, c.head_dim);
    let mut kc = vec![f16::from_f32(0.01); l * hkv * s * d];
    let mut vc = kc.clone();
    let mut stats = Stats::default();
    let t = Instant::now();
    for i in 0..steps {
        let p = start + i;
        let out = pkg
            .step_with_stats(&[(100 + 37 * i) as i32], p, &kc, &vc, Some(&mut stats))
            .expect("step");
        for (cache, upd) in [(&mut kc, &out.key_update), (&mut vc, &out.value_update)] {
            for row in 0..l * hkv {
                let dst = (row * s + p) * d;
                cache[dst..dst + d].copy_from_slice(&upd[row * d..(row + 1) * d]);
            }
        }
    }
    let wall = t.elapsed().as_secs_f64();
    let t2 = Instant::now();
    for i in 0..steps {
        pkg.step_with_stats(&[(100 + 37 * i) as i32], start + i, &kc, &vc, None)
            .expect("step");
    }
    println!(
        "without stats: {:.1} ms/step",
        t2.elapsed().as_secs_f64() * 1e3 / steps as f64
    );
    let in_ops: u64 = stats.ops.values().map(|o| o.nanos).sum();
    println!(
        "{steps} steps: {:.1} ms/step, ops {:.1} ms/step",
        wall * 1e3 / steps as f64,
        in_ops as f64 / 1e6 / steps as f64
    );
    let mut rows: Vec<_> = stats.ops.iter().collect();
    rows.sort_by_key(|(_, o)| std::cmp::Reverse(o.nanos));
    for (name, o) in rows {
        println!(
            "  {name:<24} {:>8.2} ms/step {:>6} calls/step",
            o.nanos as f64 / 1e6 / steps as f64,
            o.count / steps as u64
        );
    }
}
