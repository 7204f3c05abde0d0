//! What `run` does around the token loop: prompts to ids (plain, chat, ids), streaming text
//! with incremental detokenization, and the logits file.

use hf2coreml::runtime::chat::ChatTemplate;
use hf2coreml::runtime::generate::{GenerateError, GenerateOptions, Generator};
use hf2coreml::runtime::sampling::SamplingParams;
use hf2coreml::runtime::text::{prompt_ids, stream_to, Prompt, TextError, TextStream};

use crate::support::toy::{byte_tokenizer, contract, reference_greedy, ToyModel};

/// Byte ids plus the two special tokens.
const V: usize = 258;

#[test]
fn multibyte_characters_split_across_tokens_come_out_whole() {
    let tok = byte_tokenizer();
    let text = "héllo 日本語 🎉!";
    let ids: Vec<u32> = text.bytes().map(u32::from).collect();
    let mut stream = TextStream::new(&tok, true);
    let mut pieces = Vec::new();
    for &id in &ids {
        if let Some(p) = stream.push(id).unwrap() {
            pieces.push(p);
        }
    }
    if let Some(p) = stream.finish().unwrap() {
        pieces.push(p);
    }
    assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
    assert_eq!(pieces.concat(), text);
    // The 4-byte emoji arrives as one piece, not four.
    assert!(pieces.iter().any(|p| p.contains('🎉')));
}

#[test]
fn an_incomplete_character_at_the_end_is_flushed() {
    let tok = byte_tokenizer();
    let mut stream = TextStream::new(&tok, true);
    assert_eq!(stream.push(b'a' as u32).unwrap().as_deref(), Some("a"));
    // First byte of "é" alone: held back, then flushed as a replacement character.
    assert_eq!(stream.push(0xC3).unwrap(), None);
    assert_eq!(stream.finish().unwrap().as_deref(), Some("\u{FFFD}"));
}

#[test]
fn streamed_text_equals_the_full_decode() {
    let tok = byte_tokenizer();
    let prompt: Vec<u32> = "Hi".bytes().map(u32::from).collect();
    let mut g = Generator::new(ToyModel::new(contract(64, 2, V, vec![]))).unwrap();
    let opts = GenerateOptions {
        max_new_tokens: 40,
        sampling: SamplingParams::greedy(),
        stop_at_eos: true,
        record_logits: true,
    };
    let mut out = Vec::new();
    let gen = stream_to(&mut g, &prompt, &opts, Some(&tok), &mut out).unwrap();
    assert_eq!(gen.tokens, reference_greedy(&prompt, 40, V));
    let full = tok.decode(&gen.tokens, true).unwrap();
    assert_eq!(String::from_utf8(out).unwrap(), format!("{full}\n"));

    // Without a tokenizer the ids themselves are streamed.
    let mut out = Vec::new();
    let gen = stream_to(&mut g, &prompt, &opts, None, &mut out).unwrap();
    let ids: Vec<String> = gen.tokens.iter().map(|t| t.to_string()).collect();
    assert_eq!(
        String::from_utf8(out).unwrap(),
        format!("{} \n", ids.join(" "))
    );
}

#[test]
fn prompts_become_ids() {
    let tok = byte_tokenizer();
    assert_eq!(
        prompt_ids(&Prompt::Text("é".into()), Some(&tok), None).unwrap(),
        vec![0xC3, 0xA9]
    );
    assert_eq!(
        prompt_ids(&Prompt::Ids(vec![5, 6]), None, None).unwrap(),
        vec![5, 6]
    );
    assert!(matches!(
        prompt_ids(&Prompt::Text("x".into()), None, None),
        Err(TextError::NoTokenizer)
    ));
    // Chat: the template's special tokens become their ids, not their characters.
    let cfg = serde_json::json!({
        "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>"
    });
    let t = ChatTemplate::from_tokenizer_config_json(&cfg, "cfg").unwrap();
    let ids = prompt_ids(&Prompt::Chat("Hi".into()), Some(&tok), Some(&t)).unwrap();
    let mut expect = vec![256];
    expect.extend("user\nHi".bytes().map(u32::from));
    expect.push(257);
    expect.push(b'\n' as u32);
    expect.push(256);
    expect.extend("assistant\n".bytes().map(u32::from));
    assert_eq!(ids, expect);
    assert!(prompt_ids(&Prompt::Chat("Hi".into()), Some(&tok), None).is_err());
}

#[test]
fn the_logits_file_is_numpy_readable_float32() {
    let prompt = [1u32, 2, 3];
    let mut g = Generator::new(ToyModel::new(contract(16, 1, 23, vec![]))).unwrap();
    let opts = GenerateOptions {
        max_new_tokens: 4,
        sampling: SamplingParams::greedy(),
        stop_at_eos: true,
        record_logits: true,
    };
    let mut out = Vec::new();
    let gen = stream_to(&mut g, &prompt, &opts, None, &mut out).unwrap();
    let rows = gen.logits.unwrap();
    assert_eq!(rows.rows(), 3 + 4 - 1);
    let npy = rows.to_npy();
    let hlen = u16::from_le_bytes([npy[8], npy[9]]) as usize;
    let header = std::str::from_utf8(&npy[10..10 + hlen]).unwrap();
    assert!(header.contains("'shape': (6, 23)"), "{header}");
    assert_eq!(npy.len(), 10 + hlen + 6 * 23 * 4);
}

#[test]
fn context_full_surfaces_through_the_stream() {
    let mut g = Generator::new(ToyModel::new(contract(4, 1, 23, vec![]))).unwrap();
    let opts = GenerateOptions {
        max_new_tokens: 10,
        ..GenerateOptions::default()
    };
    let mut out = Vec::new();
    let r = stream_to(&mut g, &[1, 2, 3], &opts, None, &mut out);
    assert!(matches!(
        r,
        Err(TextError::Generate(GenerateError::ContextFull { .. }))
    ));
    // The tokens generated before the limit were still written.
    assert_eq!(
        String::from_utf8(out).unwrap().split_whitespace().count(),
        2
    );
}
