//! The bound on what a model.mlmodel decodes to (`mlpackage::wire`), checked before prost
//! allocates anything.

use hf2coreml::mlpackage::proto;
use hf2coreml::mlpackage::wire::{check_decoded_size, WireError, MAX_DECODED_BYTES};
use hf2coreml_testkit::mlpackage::tiny_program;
use prost::Message;

#[test]
fn a_real_program_is_estimated_above_its_decoded_size_and_far_below_the_limit() {
    let (model, _) = tiny_program();
    let bytes = model.encode_to_vec();
    let est = check_decoded_size(&bytes, MAX_DECODED_BYTES).unwrap();
    assert!(est >= bytes.len() as u64, "{est} for {} bytes", bytes.len());
    assert!(est < 64 * bytes.len() as u64 + 4096, "{est}");
}

#[test]
fn empty_entries_are_counted_as_the_structs_they_decode_to() {
    // Model.mlProgram { functions["main"] { blockSpecializations["x"] { operations: [{} × n] } } }
    let n = 1000;
    let block: Vec<u8> = std::iter::repeat_n([0x1a, 0x00], n).flatten().collect();
    let (model, _) = tiny_program();
    let mut bytes = model.encode_to_vec();
    // A second, hostile Model message merged in: Program with one empty-operation block.
    let mut entry = vec![0x0a, 0x01, b'x', 0x12];
    push_len(&mut entry, &block);
    let mut function = vec![0x1a];
    push_len(&mut function, &entry);
    let mut fentry = vec![0x0a, 0x04];
    fentry.extend_from_slice(b"main");
    fentry.push(0x12);
    push_len(&mut fentry, &function);
    let mut program = vec![0x12];
    push_len(&mut program, &fentry);
    bytes.extend_from_slice(&[0xb2, 0x1f]); // field 502, wire type 2
    push_len(&mut bytes, &program);
    assert!(proto::Model::decode(bytes.as_slice()).is_ok());
    let est = check_decoded_size(&bytes, u64::MAX).unwrap();
    assert!(est >= (n * size_of::<proto::Operation>()) as u64, "{est}");
    let err = check_decoded_size(&bytes, (n * 100) as u64).unwrap_err();
    assert!(matches!(err, WireError::TooLarge { .. }), "{err}");
}

fn push_len(out: &mut Vec<u8>, body: &[u8]) {
    let mut n = body.len();
    while n >= 0x80 {
        out.push((n as u8 & 0x7f) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
    out.extend_from_slice(body);
}

#[test]
fn truncated_bytes_are_malformed() {
    let (model, _) = tiny_program();
    let bytes = model.encode_to_vec();
    assert!(check_decoded_size(&bytes[..bytes.len() / 2], u64::MAX).is_err());
}
