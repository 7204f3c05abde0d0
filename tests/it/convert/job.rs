//! One conversion as the commands run it (`pipeline::job::Job`), up to its plan: checked,
//! opened, planned against a device and fingerprinted, all without Python.

use std::path::Path;

use hf2coreml::error::ExitCode;
use hf2coreml::mil::PackageOptions;
use hf2coreml::pipeline::convert_error::ConvertError;
use hf2coreml::pipeline::job::{Job, JobError, ShapeError};
use hf2coreml::pipeline::options::ComputePrecision;
use hf2coreml::progress::Silent;
use hf2coreml::quant::Recipe;
use hf2coreml_testkit::TinyModel;

fn tiny_job(dir: &Path) -> Job {
    let source = dir.join("tiny");
    std::fs::create_dir_all(&source).unwrap();
    TinyModel::llama().write(&source).unwrap();
    Job {
        source,
        output: dir.join("out/tiny.mlpackage"),
        max_seq_len: 16,
        query_len: 1,
        recipe: Recipe::default(),
        package: PackageOptions::default(),
        calibration: None,
        compute_precision: ComputePrecision::Fp16,
        activation_ranges: None,
        no_range_scaling: false,
        device: None,
        increased_memory_limit: false,
        allow_over_budget: false,
        max_package_size: None,
        force: false,
        python_env: None,
    }
}

#[test]
fn a_job_plans_and_fingerprints_its_inputs_without_python() {
    let dir = tempfile::tempdir().unwrap();
    let job = tiny_job(dir.path());
    job.check().unwrap();
    let opened = job.open(&Silent).unwrap();
    let plan = job.plan(&opened.ckpt).unwrap();
    assert!(plan.predicted_weight_bytes > 0 && plan.budget.is_none());
    let on_device = Job {
        device: Some("iphone-15".into()),
        ..job.clone()
    };
    assert!(on_device.plan(&opened.ckpt).unwrap().budget.is_some());
    // A model no split fits is refused by the plan, before any expensive stage.
    let unsplittable = Job {
        max_package_size: Some(64),
        ..job.clone()
    };
    let err = unsplittable.plan(&opened.ckpt).unwrap_err();
    assert!(
        matches!(err, JobError::Convert(ConvertError::Chain { .. })),
        "{err}"
    );
    assert!(err.to_string().contains("cannot split"), "{err}");
    let inputs = job.inputs().unwrap();
    assert_eq!(inputs, job.inputs().unwrap());
    let longer = Job {
        max_seq_len: 32,
        ..job.clone()
    };
    assert_ne!(inputs.fingerprint, longer.inputs().unwrap().fingerprint);
    let bad = Job {
        query_len: 17,
        ..job
    };
    let err = bad.check().unwrap_err();
    assert!(matches!(
        err,
        JobError::Shape(ShapeError::QueryTooLong { .. })
    ));
    assert_eq!(
        err.to_string(),
        "--query-len (17) cannot exceed --max-seq-len (16)"
    );
    assert_eq!(err.exit_code(), ExitCode::BadInput);
}
