//! The README's claim that a chat template cannot touch the filesystem: a template is input
//! from a checkpoint, and `include`, `import`, `from ... import` and `extends` name files. Each
//! fails to render with an error, and nothing of the named file reaches the prompt.
//!
//! A test binary of its own, not a module of tests/it: to try a file by a relative name it
//! changes the process's working directory, which every other test's relative paths (and the
//! children they spawn) would see.

use hf2coreml::runtime::chat::{ChatTemplate, Message};

#[test]
fn templates_cannot_read_files() {
    let dir = tempfile::tempdir().unwrap();
    let secret = dir.path().join("secret.txt");
    std::fs::write(&secret, "SECRET-CONTENT").unwrap();
    let name = secret.to_str().unwrap();
    // The same file by a relative name too, from the directory the process runs in.
    std::env::set_current_dir(dir.path()).unwrap();
    for name in [name, "secret.txt"] {
        for template in [
            format!("{{% include '{name}' %}}"),
            format!("{{% import '{name}' as m %}}x"),
            format!("{{% from '{name}' import x %}}x"),
            format!("{{% extends '{name}' %}}"),
        ] {
            let config = serde_json::json!({ "chat_template": template });
            let rendered =
                ChatTemplate::from_tokenizer_config_json(&config, "tokenizer_config.json")
                    .and_then(|t| t.render(&[Message::new("user", "hi")], true));
            match rendered {
                Ok(text) => panic!("`{template}` rendered: {text:?}"),
                Err(e) => assert!(!e.to_string().contains("SECRET-CONTENT"), "{e}"),
            }
        }
    }
}
