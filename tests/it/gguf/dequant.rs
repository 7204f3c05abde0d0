//! Every GGUF tensor type the importer reads dequantizes bit for bit like gguf-py, the `gguf`
//! package's independent numpy implementation (blocks and values written by
//! python/testgen/gguf_dequant.py through the test venv: quantized by gguf-py where it has a
//! quantizer, random valid blocks with extreme scales, all-zero and minimum-bit blocks
//! otherwise). A missing venv fails the test under `make test` with the command that makes it.

use std::path::Path;

use hf2coreml::checkpoint::gguf::dequant::GgmlType;
use hf2coreml::checkpoint::gguf::type_name;

use crate::support::needs;

#[derive(serde::Deserialize)]
struct Entry {
    name: String,
    id: u32,
    blocks: usize,
}

fn generate() -> tempfile::TempDir {
    let py = hf2coreml_testkit::python_env().join("bin/python");
    let dir = tempfile::tempdir().expect("temp dir");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/testgen/gguf_dequant.py");
    let out = std::process::Command::new(py)
        .args([script.as_os_str(), dir.path().as_os_str()])
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "gguf_dequant.py failed (is gguf-py in the venv? run `make setup`):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    dir
}

#[test]
fn every_type_matches_gguf_py_bit_for_bit() {
    needs!(Python);
    let dir = generate();
    let manifest: Vec<Entry> =
        serde_json::from_slice(&std::fs::read(dir.path().join("manifest.json")).unwrap()).unwrap();
    let covered: Vec<u32> = manifest.iter().map(|e| e.id).collect();
    for t in GgmlType::ALL {
        assert!(covered.contains(&t.id()), "{:?} has no gguf-py vectors", t);
    }
    for e in &manifest {
        let ty = GgmlType::from_id(e.id).unwrap_or_else(|| panic!("{} unsupported", e.name));
        assert_eq!(type_name(e.id), e.name);
        let blocks = std::fs::read(dir.path().join(format!("{}.bin", e.name))).unwrap();
        let want: Vec<u32> = std::fs::read(dir.path().join(format!("{}.f32", e.name)))
            .unwrap()
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let (elems, size) = ty.block();
        assert_eq!(blocks.len(), e.blocks * size, "{}", e.name);
        assert_eq!(want.len(), e.blocks * elems, "{}", e.name);
        let mut got = Vec::new();
        ty.dequantize(&blocks, &mut got);
        assert_eq!(got.len(), want.len(), "{}", e.name);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                g.to_bits() == *w,
                "{}: element {i} (block {}): ours {g:e} ({:#010x}), gguf-py {:e} ({w:#010x})",
                e.name,
                i / elems,
                g.to_bits(),
                f32::from_bits(*w)
            );
        }
    }
}
