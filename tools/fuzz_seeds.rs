//! Write the fuzz targets' seed corpora (`make fuzz`): `fuzz_seeds OUT_DIR` fills
//! OUT_DIR/{checkpoint,gguf,mlpackage}/ from the in-code fixtures.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::env::args().nth(1).ok_or("usage: fuzz_seeds OUT_DIR")?;
    let n = hf2coreml_testkit::fuzz::write_seeds(std::path::Path::new(&out))?;
    println!("wrote {n} seeds under {out}");
    Ok(())
}
