//! Hostile and broken GGUF files, through `import-gguf` (which would write out/ckpt) and
//! `convert`, and a FIFO where a GGUF file or a device table is expected: exit 2 naming the file
//! and the problem, at once, nothing written.

use std::path::{Path, PathBuf};
use std::time::Duration;

use hf2coreml_testkit::gguf::{Meta, TinyGguf};
use hf2coreml_testkit::TinyModel;

use super::{convert_refused, expect, expect_bad, mkfifo, os, Scratch};

fn import(s: &Scratch, gguf: &Path, needles: &[&str]) {
    let dest = s.out().join("ckpt");
    expect_bad(
        s,
        &[
            "import-gguf".as_ref(),
            gguf.as_os_str(),
            "-o".as_ref(),
            dest.as_os_str(),
        ],
        needles,
    );
}

fn gguf_bytes() -> Vec<u8> {
    TinyGguf::llama().build().writer.to_bytes()
}

fn write_gguf(s: &Scratch, bytes: &[u8]) -> PathBuf {
    let p = s.path().join("m.gguf");
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn gguf_truncated_inside_the_header() {
    let s = Scratch::new();
    let bytes = gguf_bytes();
    let p = write_gguf(&s, &bytes[..200]);
    import(&s, &p, &["m.gguf", "file ends inside the header"]);
}

#[test]
fn gguf_truncated_inside_the_tensor_data() {
    let s = Scratch::new();
    let bytes = gguf_bytes();
    let p = write_gguf(&s, &bytes[..bytes.len() - 10]);
    import(&s, &p, &["m.gguf", "truncated", "needs bytes"]);
}

#[test]
fn gguf_bad_magic() {
    let s = Scratch::new();
    let mut bytes = gguf_bytes();
    bytes[..4].copy_from_slice(b"GGML");
    let p = write_gguf(&s, &bytes);
    import(&s, &p, &["m.gguf", "are not `GGUF`"]);
}

#[test]
fn gguf_unsupported_version() {
    let s = Scratch::new();
    let mut bytes = gguf_bytes();
    bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
    let p = write_gguf(&s, &bytes);
    import(&s, &p, &["m.gguf", "GGUF version 1"]);
}

#[test]
fn gguf_huge_tensor_count() {
    let s = Scratch::new();
    let mut bytes = gguf_bytes();
    bytes[8..16].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let p = write_gguf(&s, &bytes);
    import(&s, &p, &["m.gguf", "tensors declared"]);
}

#[test]
fn gguf_huge_metadata_count() {
    let s = Scratch::new();
    let mut bytes = gguf_bytes();
    bytes[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    let p = write_gguf(&s, &bytes);
    import(&s, &p, &["m.gguf", "the declared entries"]);
}

#[test]
fn gguf_unknown_metadata_value_type() {
    let s = Scratch::new();
    let mut bytes = gguf_bytes();
    // The first key follows the 24-byte preamble: u64 length, the key, then its u32 type.
    let key_len = u64::from_le_bytes(bytes[24..32].try_into().unwrap()) as usize;
    let at = 32 + key_len;
    bytes[at..at + 4].copy_from_slice(&77u32.to_le_bytes());
    let p = write_gguf(&s, &bytes);
    import(&s, &p, &["m.gguf", "unknown value type 77"]);
}

#[test]
fn gguf_unknown_tensor_type_through_convert() {
    let s = Scratch::new();
    let mut w = TinyGguf::llama().build().writer;
    let name = "blk.0.ffn_down.weight";
    let t = w.tensors.iter_mut().find(|t| t.name == name).unwrap();
    t.type_id = 99;
    let p = s.path().join("m.gguf");
    w.write(&p).unwrap();
    convert_refused(&s, &p, &["m.gguf", name, "type 99"]);
}

#[test]
fn gguf_too_many_dimensions() {
    let s = Scratch::new();
    let mut w = TinyGguf::llama().build().writer;
    w.meta("general.alignment", Meta::U32(32));
    let name = "output_norm.weight";
    let t = w.tensors.iter_mut().find(|t| t.name == name).unwrap();
    t.shape = vec![2, 2, 2, 2, 4];
    let p = write_gguf(&s, &w.to_bytes());
    import(&s, &p, &["m.gguf", name, "5 dimensions"]);
}

#[cfg(unix)]
#[test]
fn a_fifo_gguf_or_device_table_is_refused_at_once() {
    let root = tempfile::tempdir().unwrap();
    let fifo = root.path().join("m.gguf");
    mkfifo(&fifo);
    let out = root.path().join("ckpt");
    let o = expect(
        root.path(),
        &[
            os("import-gguf"),
            fifo.as_os_str(),
            os("-o"),
            out.as_os_str(),
        ],
        2,
        &["m.gguf", "not a regular file"],
    );
    assert!(o.elapsed < Duration::from_secs(10), "{:?}", o.elapsed);
    let o = expect(
        root.path(),
        &[os("inspect"), fifo.as_os_str()],
        2,
        &["m.gguf"],
    );
    assert!(o.elapsed < Duration::from_secs(10), "{:?}", o.elapsed);

    let ckpt = root.path().join("tiny");
    std::fs::create_dir(&ckpt).unwrap();
    TinyModel::llama().write(&ckpt).unwrap();
    let table = root.path().join("devices.toml");
    mkfifo(&table);
    let o = expect(
        root.path(),
        &[
            os("budget"),
            ckpt.as_os_str(),
            os("--devices"),
            table.as_os_str(),
            os("--device"),
            os("x"),
        ],
        2,
        &["devices.toml", "not a regular file"],
    );
    assert!(o.elapsed < Duration::from_secs(10), "{:?}", o.elapsed);
}

/// A SentencePiece vocabulary (no merges stored) with `pieces` after the specials and the byte
/// pieces, over the tiny llama GGUF's weights.
fn sentencepiece_gguf(s: &Scratch, pieces: &[&[u8]]) -> PathBuf {
    use candle_core::quantized::gguf_file::Value as V;
    let mut w = TinyGguf::llama().build().writer;
    w.metadata.retain(|(k, _)| !k.starts_with("tokenizer."));
    let mut tokens: Vec<Vec<u8>> = vec![b"<unk>".to_vec(), b"<s>".to_vec(), b"</s>".to_vec()];
    let mut types = vec![2, 3, 3];
    tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>").into_bytes()));
    types.extend([6; 256]);
    tokens.extend(pieces.iter().map(|p| p.to_vec()));
    types.extend(vec![1; pieces.len()]);
    let scores = (0..tokens.len()).map(|i| V::F32(-(i as f32))).collect();
    w.meta("tokenizer.ggml.model", Meta::Str("llama".into()))
        .meta("tokenizer.ggml.tokens", Meta::BytesArray(tokens))
        .meta("tokenizer.ggml.scores", Meta::Value(V::Array(scores)))
        .meta("tokenizer.ggml.token_type", Meta::I32Array(types))
        .meta("tokenizer.ggml.bos_token_id", Meta::U32(1))
        .meta("tokenizer.ggml.eos_token_id", Meta::U32(2))
        .meta("tokenizer.ggml.unknown_token_id", Meta::U32(0));
    write_gguf(s, &w.to_bytes())
}

/// One 1 MiB SentencePiece piece, with pieces that split it: the merges recovered from the
/// vocabulary cost time linear in the file (the square of the piece's length was minutes).
#[test]
fn a_one_mib_sentencepiece_piece_imports_in_linear_time() {
    let s = Scratch::new();
    let long = vec![b'a'; 1 << 20];
    let gguf = sentencepiece_gguf(&s, &[b"\xe2\x96\x81", b"a", &long[1..], &long]);
    let dest = s.path().join("ckpt");
    let o = super::run_bin(
        &[
            os("import-gguf"),
            gguf.as_os_str(),
            os("-o"),
            dest.as_os_str(),
        ],
        None,
    );
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    assert!(o.elapsed < Duration::from_secs(20), "{:?}", o.elapsed);
    assert!(o.max_rss < 1 << 30, "peak RSS {} MiB", o.max_rss >> 20);
    // Both long pieces in the vocabulary, and their merge.
    let tokenizer = std::fs::metadata(dest.join("tokenizer.json"))
        .unwrap()
        .len();
    assert!(tokenizer > 3 << 20, "tokenizer.json is {tokenizer} bytes");
}

/// A vocabulary SentencePiece could not have written: a piece twice (only one of its ids
/// could ever come out), a piece that is not UTF-8 (it would become U+FFFD, another piece).
#[test]
fn sentencepiece_duplicates_and_pieces_not_utf8_are_refused() {
    let s = Scratch::new();
    let gguf = sentencepiece_gguf(&s, &[b"\xe2\x96\x81", b"ab", b"cd", b"ab"]);
    import(
        &s,
        &gguf,
        &["m.gguf", "\"ab\" appears twice", "ids 260 and 262"],
    );
    let gguf = sentencepiece_gguf(&s, &[b"\xe2\x96\x81", b"a\xffb"]);
    import(
        &s,
        &gguf,
        &[
            "m.gguf",
            "`tokenizer.ggml.tokens` holds a string that is not UTF-8",
        ],
    );
}
