//! Re-quantize a GGUF with the test fixtures' reference quantizers, as llama.cpp lays the
//! types out: `gguf_requantize IN.gguf OUT.gguf q4_k_m|q6_k`. For docs/quality.md's
//! measurement of what palettizing a K-quant source costs (SmolLM2 ships only as Q4_1).

use hf2coreml::checkpoint::gguf::GgufFile;
use hf2coreml_testkit::gguf::{q4_k_m_type, q6_k_type, requantize};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, input, output, layout] = args.as_slice() else {
        return Err("usage: gguf_requantize IN.gguf OUT.gguf q4_k_m|q6_k".into());
    };
    let mut g = GgufFile::open(std::path::Path::new(input))?;
    let w = match layout.as_str() {
        "q4_k_m" => requantize(&mut g, q4_k_m_type)?,
        "q6_k" => requantize(&mut g, q6_k_type)?,
        other => return Err(format!("unknown layout {other} (q4_k_m, q6_k)").into()),
    };
    w.write(std::path::Path::new(output))?;
    let mut types: std::collections::BTreeMap<u32, usize> = Default::default();
    for t in &w.tensors {
        *types.entry(t.type_id).or_default() += 1;
    }
    println!("wrote {output}: {types:?} (type id: tensors)");
    Ok(())
}
