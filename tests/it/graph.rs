//! The decoder step's graph as `graph::decoder::build` returns it, before any package is
//! written: its contract, its constants and what it refuses.

use std::collections::BTreeMap;

use half::f16;

use hf2coreml::arch::{self, mil_name};
use hf2coreml::checkpoint::Checkpoint;
use hf2coreml::graph::decoder::{build, dense_weights, StepOptions, MASK_VALUE};
use hf2coreml::graph::scaling::{ActivationRanges, Scaling};
use hf2coreml::graph::{var, Arg, ConstData, Graph, GraphError, Weight};
use hf2coreml::mil::{DType, Op};
use hf2coreml::quant::{PackedLut, QuantizedWeight};
use hf2coreml_testkit::TinyModel;

fn opts(scaling: Scaling) -> StepOptions {
    StepOptions {
        max_seq_len: 16,
        query_len: 2,
        float: DType::F16,
        scaling,
        target: Default::default(),
        layout: Default::default(),
        kv_cache: Default::default(),
        last_logits_only: false,
    }
}

fn weights(model: &TinyModel) -> (tempfile::TempDir, BTreeMap<String, Weight>) {
    let dir = model.write_temp().unwrap();
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let w = dense_weights(&ckpt).unwrap();
    (dir, w)
}

fn dense<'a>(g: &'a Graph, name: &str) -> &'a [f16] {
    match &g.consts.iter().find(|c| c.name == name).unwrap().data {
        ConstData::F16(v) => v,
        other => panic!("{name} is {other:?}"),
    }
}

#[test]
fn contract_io_and_weight_consts() {
    let model = TinyModel::llama();
    let spec = model.spec();
    let (_d, w) = weights(&model);
    let g = build(&spec, w, &opts(Scaling::identity("test"))).unwrap();
    let io: Vec<(&str, Vec<usize>)> = g
        .inputs
        .iter()
        .map(|i| (i.name.as_str(), i.shape.clone()))
        .collect();
    assert_eq!(
        io,
        [
            ("input_ids", vec![1, 2]),
            ("position", vec![1]),
            ("key_cache", vec![2, 2, 16, 16]),
            ("value_cache", vec![2, 2, 16, 16]),
        ]
    );
    assert_eq!(g.outputs, ["logits", "key_update", "value_update"]);
    // Tied: the embedding const feeds both the gather and the lm_head linear.
    assert!(g.consts.iter().all(|c| c.name != "lm_head_weight"));
    let head = g.ops.iter().find(|o| o.outputs[0] == "logits").unwrap();
    assert_eq!(head.args["weight"], var("model_embed_tokens_weight"));
    // One const per checkpoint tensor, named after it.
    for slot in arch::expected_tensors(&spec) {
        let c = g.consts.iter().find(|c| c.name == mil_name(&slot.name));
        assert_eq!(c.unwrap().source.as_deref(), Some(slot.name.as_str()));
    }
    assert_eq!(g.count_ops(Op::Softmax), spec.num_hidden_layers);
    // GQA 4/2 reads the unrepeated cache: the tiles are the cache mask's Q rows and, at
    // Q = 2, the mask's rows repeated for the two query heads of a group, once per step.
    assert_eq!(g.count_ops(Op::Tile), 2);
    assert!(g
        .ops
        .iter()
        .filter(|o| o.op == Op::Tile)
        .all(|o| o.outputs[0].starts_with("mask")));
}

#[test]
fn constants_fp16_cannot_hold_are_refused_by_name() {
    let model = TinyModel::llama();
    let mut spec = model.spec();
    spec.rms_norm_eps = 60000.0;
    let (_d, w) = weights(&model);
    let check = |opts: &StepOptions| build(&spec, w.clone(), opts).map(|_| ());
    let scaled = |alpha: f64| {
        opts(Scaling {
            residual_scale: alpha,
            measured_max_abs: None,
            source: "test".into(),
        })
    };
    assert!(check(&scaled(1.0)).is_ok());
    let err = check(&scaled(2.0)).unwrap_err().to_string();
    assert!(
        err.contains("rms_norm_eps (60000)") && err.contains("65504"),
        "{err}"
    );
    let fp32 = StepOptions {
        float: DType::F32,
        ..scaled(2.0)
    };
    assert!(check(&fp32).is_ok());
}

#[test]
fn mask_constants_are_finite() {
    let model = TinyModel::llama();
    let (_d, w) = weights(&model);
    let g = build(&model.spec(), w, &opts(Scaling::identity("test"))).unwrap();
    let causal = dense(&g, "mask_causal");
    assert_eq!(
        causal,
        &[f16::ZERO, f16::from_f32(MASK_VALUE), f16::ZERO, f16::ZERO]
    );
    assert!(dense(&g, "mask_closed").iter().all(|v| v.is_finite()));
}

#[test]
fn residual_scale_folds_into_o_and_down_and_epsilon() {
    let model = TinyModel::qwen2();
    let spec = model.spec();
    let (_d, w) = weights(&model);
    let plain = build(&spec, w.clone(), &opts(Scaling::identity("test"))).unwrap();
    let s = Scaling::choose(&ActivationRanges {
        residual_max_abs: vec![1000.0],
        source: "test".into(),
    });
    let alpha = s.residual_scale;
    assert_eq!(alpha, 0.125);
    let scaled = build(&spec, w, &opts(s)).unwrap();
    for name in [
        "model_layers_0_self_attn_o_proj_weight",
        "model_layers_1_mlp_down_proj_weight",
    ] {
        for (a, b) in dense(&plain, name).iter().zip(dense(&scaled, name)) {
            let exact = a.to_f64() * alpha;
            assert_eq!(*b, f16::from_f64(exact));
            // Power-of-two scaling is exact unless the result is subnormal.
            if exact.abs() >= f16::MIN_POSITIVE.to_f64() {
                assert_eq!(b.to_f64(), exact);
            }
        }
    }
    for name in [
        "model_embed_tokens_weight",
        "model_layers_0_self_attn_q_proj_weight",
        "lm_head_weight",
    ] {
        assert_eq!(dense(&plain, name), dense(&scaled, name));
    }
    assert_eq!(plain.count_ops(Op::Mul) + 1, scaled.count_ops(Op::Mul));
    let eps = |g: &Graph| match &g.ops.iter().find(|o| o.op == Op::Rsqrt).unwrap().args["epsilon"] {
        Arg::Float(e) => *e,
        other => panic!("{other:?}"),
    };
    assert_eq!(eps(&scaled), eps(&plain) * alpha * alpha);
}

#[test]
fn palettized_weights_become_lut_consts_with_scaled_luts() {
    let model = TinyModel::llama();
    let spec = model.spec();
    let (_d, mut w) = weights(&model);
    // A hand-made 2-bit palettization of o_proj: all indices 0..4 in turn.
    let name = "model.layers.0.self_attn.o_proj.weight";
    let n = spec.hidden_size * spec.q_dim();
    let lut: Vec<f16> = [-0.5f32, -0.25, 0.25, 0.5].map(f16::from_f32).to_vec();
    let packed = vec![0b11_10_01_00u8; n / 4];
    w.insert(
        name.into(),
        Weight::Quantized(QuantizedWeight::per_tensor(
            spec.hidden_size,
            PackedLut {
                nbits: 2,
                lut: lut.clone(),
                packed: packed.clone(),
            },
        )),
    );
    let s = Scaling {
        residual_scale: 0.5,
        measured_max_abs: None,
        source: "test".into(),
    };
    let g = build(&spec, w, &opts(s)).unwrap();
    let c = g.consts.iter().find(|c| c.name == mil_name(name)).unwrap();
    let ConstData::Lut(p) = &c.data else {
        panic!("o_proj should be palettized")
    };
    assert_eq!(p.packed, packed);
    let halves: Vec<f16> = lut
        .iter()
        .map(|x| f16::from_f32(x.to_f32() * 0.5))
        .collect();
    assert_eq!(p.lut, halves);
    assert_eq!(c.shape, vec![spec.hidden_size, spec.q_dim()]);
}

#[test]
fn missing_or_extra_weights_are_errors() {
    let model = TinyModel::llama();
    let spec = model.spec();
    let (_d, mut w) = weights(&model);
    let mut extra = w.clone();
    extra.insert("model.unused".into(), Weight::Dense(vec![]));
    assert!(build(&spec, extra, &opts(Scaling::identity("t"))).is_err());
    w.remove("model.norm.weight");
    let err = build(&spec, w, &opts(Scaling::identity("t"))).unwrap_err();
    assert!(err.to_string().contains("model.norm.weight"), "{err}");
}

#[test]
fn query_longer_than_cache_is_refused() {
    let model = TinyModel::llama();
    let (_d, w) = weights(&model);
    let mut o = opts(Scaling::identity("t"));
    o.query_len = 17;
    assert!(matches!(
        build(&model.spec(), w, &o),
        Err(GraphError::Unsupported(_))
    ));
}
