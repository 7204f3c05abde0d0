//! `run --chat` on the real model (SmolLM2-135M-Instruct from `make model`, one fp16 package):
//! a two-turn chat whose second turn feeds only what the cache lacks gives the tokens and logits, bit for bit, of a one-shot run of the same rendered conversation; the CLI's piped
//! session prints the same replies; a cache saved after turn 1 resumes turn 2 exactly.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use hf2coreml::runtime::chain_runner::Saved;
use hf2coreml::runtime::chat::ChatTemplate;
use hf2coreml::runtime::generate::{GenerateOptions, Generator};
use hf2coreml::runtime::kvfile::KvFile;
use hf2coreml::runtime::text::{beside_package, load_tokenizer, Conversation};
use hf2coreml_testkit::model_dir;

use crate::support::{convert, needs, Cli};

const SYSTEM: &str = "You answer in one short sentence.";
const TURNS: [&str; 2] = ["What is the capital of France?", "And of Italy?"];
const NEW: usize = 16;

fn convert_smollm2(root: &Path) -> PathBuf {
    let pkg = root.join("smol.mlpackage");
    convert(model_dir(), &pkg)
        // fp16: a model that answers (data-free 4-bit SmolLM2 does not keep the model).
        .args(["--max-seq-len", "160", "--keep-fp16", "*", "-q"])
        .ok();
    pkg
}

fn opts() -> GenerateOptions {
    GenerateOptions {
        max_new_tokens: NEW,
        record_logits: true,
        ..GenerateOptions::default()
    }
}

#[test]
fn a_two_turn_chat_reuses_the_cache_and_equals_a_one_shot_run() {
    needs!(Model, Python);
    let root = tempfile::tempdir().unwrap();
    let pkg = convert_smollm2(root.path());
    let tok = load_tokenizer(&beside_package(&pkg, "tokenizer.json")).unwrap();
    let template =
        ChatTemplate::from_tokenizer_config(&beside_package(&pkg, "tokenizer_config.json"))
            .unwrap();
    let mut g = Generator::new(Saved::load(&pkg, Default::default()).unwrap()).unwrap();
    let mut conv = Conversation::new(&tok, &template, Some(SYSTEM.into()));
    let mut text = Vec::new();
    let first = conv.turn(&mut g, TURNS[0], &opts(), &mut text).unwrap();
    let cached = g.cached_tokens().to_vec();
    assert_eq!(cached.len(), first.prompt.len() + first.tokens.len() - 1);
    // Saved here, to resume turn 2 in another generator below.
    let kv = KvFile::from_generator(&g, &cached, serde_json::to_string(&conv.messages).unwrap())
        .unwrap();
    let second = conv.turn(&mut g, TURNS[1], &opts(), &mut text).unwrap();

    // Turn 2 is the whole conversation rendered again; every cached token was a prefix of it
    // (the template renders turn 1 as it was generated), so only the rest was fed.
    assert!(second.prompt.starts_with(&cached));
    assert_eq!(
        second.timing.prompt_tokens,
        second.prompt.len() - cached.len()
    );
    assert!(second.timing.prompt_tokens < second.prompt.len() / 2);

    // A one-shot run of the same ids: the same reply, and the same logits for every position
    // turn 2 computed.
    let mut fresh = Generator::new(Saved::load(&pkg, Default::default()).unwrap()).unwrap();
    let once = fresh
        .generate(&second.prompt, &opts(), &mut |_| Ok(()))
        .unwrap();
    assert_eq!(once.tokens, second.tokens);
    let (a, b) = (second.logits.unwrap(), once.logits.unwrap());
    assert!(a.rows() > second.timing.prompt_tokens);
    assert!(a.data[..] == b.data[b.data.len() - a.data.len()..]);

    // The cache saved after turn 1, restored into another generator: turn 2 exactly.
    let mut resumed = Generator::new(Saved::load(&pkg, Default::default()).unwrap()).unwrap();
    kv.restore(&mut resumed).unwrap();
    let again = resumed
        .extend(&second.prompt, &opts(), &mut |_| Ok(()))
        .unwrap();
    assert_eq!(again.tokens, second.tokens);
    assert!(again.logits.unwrap().data == a.data);

    // The CLI's piped session prints the same two replies.
    let mut child = Cli::new()
        .arg("run")
        .arg(&pkg)
        .args(["--chat", "--system", SYSTEM])
        .args(["--max-new-tokens", &NEW.to_string()])
        .command()
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let input = format!("{}\n{}\n", TURNS[0], TURNS[1]);
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8(text).unwrap();
    assert_eq!(String::from_utf8(o.stdout).unwrap(), text);
}
