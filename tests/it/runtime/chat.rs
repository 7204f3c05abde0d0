//! Chat templates as real checkpoints ship them, rendered as transformers renders them.

use hf2coreml::runtime::chat::{ChatError, ChatTemplate, Message};

/// SmolLM2-Instruct's ChatML template, as in its tokenizer_config.json.
const SMOLLM2: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Llama-3-Instruct's template: bos_token, `| trim`, loop.index0.
const LLAMA3: &str = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

/// A Mistral-style template: block tags on their own lines (trim_blocks / lstrip_blocks
/// matter), role alternation enforced with raise_exception, loop.last, `.strip()`.
const MISTRAL_LIKE: &str = "{{ bos_token }}
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}
[INST] {{ message['content'].strip() }} [/INST]
    {% elif loop.last %}
{{ message['content'].strip() }}{{ eos_token }}
    {% else %}
{{ message['content'].strip() }}{{ eos_token }} 
    {% endif %}
{% endfor %}
";

fn config(template: &str, bos: &str, eos: &str) -> serde_json::Value {
    serde_json::json!({
        "chat_template": template,
        "bos_token": bos,
        "eos_token": {"content": eos, "special": true},
        "model_max_length": 8192,
    })
}

#[test]
fn smollm2_chatml_adds_the_default_system_prompt() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokenizer_config.json");
    std::fs::write(
        &path,
        config(SMOLLM2, "<|im_start|>", "<|im_end|>").to_string(),
    )
    .unwrap();
    let t = ChatTemplate::from_tokenizer_config(&path).unwrap();
    let out = t
        .render(
            &[Message::new("user", "What is the capital of France?")],
            true,
        )
        .unwrap();
    assert_eq!(
        out,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    );
    // An explicit system message replaces the default; no generation prompt when not asked.
    let out = t
        .render(
            &[
                Message::new("system", "Be terse."),
                Message::new("user", "Hi"),
            ],
            false,
        )
        .unwrap();
    assert_eq!(
        out,
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    );
}

#[test]
fn llama3_template_uses_bos_and_trims_content() {
    let t = ChatTemplate::from_tokenizer_config_json(
        &config(LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
        "llama3",
    )
    .unwrap();
    let out = t
        .render(
            &[
                Message::new("system", "  You are helpful.\n"),
                Message::new("user", "Hello!  "),
            ],
            true,
        )
        .unwrap();
    assert_eq!(
        out,
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are helpful.<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\n"
    );
}

#[test]
fn block_whitespace_is_trimmed_like_transformers() {
    let t = ChatTemplate::new(
        MISTRAL_LIKE,
        "mistral",
        Some("<s>".into()),
        Some("</s>".into()),
    )
    .unwrap();
    let out = t
        .render(
            &[
                Message::new("user", " Hi "),
                Message::new("assistant", "Hello."),
                Message::new("user", "Bye"),
            ],
            false,
        )
        .unwrap();
    assert_eq!(
        out,
        "<s>\n[INST] Hi [/INST]\nHello.</s> \n[INST] Bye [/INST]\n"
    );
}

#[test]
fn raise_exception_becomes_a_render_error_with_the_message() {
    let t = ChatTemplate::new(
        MISTRAL_LIKE,
        "mistral",
        Some("<s>".into()),
        Some("</s>".into()),
    )
    .unwrap();
    match t.render(&[Message::new("assistant", "x")], false) {
        Err(e @ ChatError::Render { .. }) => {
            let msg = e.to_string();
            assert!(
                msg.contains("roles must alternate") && msg.contains("mistral"),
                "{msg}"
            );
        }
        other => panic!("expected a render error, got {other:?}"),
    }
}

#[test]
fn unreadable_configs_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.json");
    let e = ChatTemplate::from_tokenizer_config(&missing).unwrap_err();
    assert!(matches!(e, ChatError::Io { .. }) && e.to_string().contains("nope.json"));
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "{ not json").unwrap();
    let e = ChatTemplate::from_tokenizer_config(&bad).unwrap_err();
    assert!(matches!(e, ChatError::Json { .. }) && e.to_string().contains("bad.json"));
}
