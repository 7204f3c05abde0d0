//! Chat prompts through the checkpoint's own chat template (`chat_template` in
//! tokenizer_config.json, Jinja), rendered with minijinja configured the way transformers'
//! `apply_chat_template` configures Jinja2: `trim_blocks`, `lstrip_blocks`, loop controls,
//! `raise_exception`, a Python-compatible `tojson`, and the Python string and dict methods HF
//! templates call (`.strip()`, `.startswith()`, `.items()`, ...).

use std::path::{Path, PathBuf};

use minijinja::value::{from_args, Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State};
use serde::Serialize;

/// One chat turn.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("cannot read {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not valid JSON")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{origin} has no chat template (no `chat_template` entry)")]
    NoTemplate { origin: String },
    #[error(
        "{origin}: `chat_template` must be a string or a list of {{name, template}}, found {found}"
    )]
    BadTemplateField { origin: String, found: String },
    #[error("the chat template from {origin} does not parse: {detail}")]
    Syntax { origin: String, detail: String },
    #[error("rendering the chat template from {origin} failed: {detail}")]
    Render { origin: String, detail: String },
}

const TEMPLATE_NAME: &str = "chat_template";
/// Template instructions one rendering may execute. Real chat templates render a
/// conversation in a few thousand; a million leaves room for long conversations and stops
/// a hostile loop within a second.
pub const MAX_TEMPLATE_FUEL: u64 = 1_000_000;
/// Largest tokenizer_config.json read (real ones are a few kB to a few hundred kB).
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// A compiled chat template plus the special tokens it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    origin: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

impl ChatTemplate {
    /// Compile `source`; `origin` names where it came from in error messages.
    pub fn new(
        source: &str,
        origin: &str,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| ChatError::Syntax {
                origin: origin.into(),
                detail: e.to_string(),
            })?;
        env.set_syntax(syntax);
        // A template is input: one that loops for ever (nested `range(100000)`) runs out of
        // fuel instead of spinning the CPU.
        env.set_fuel(Some(MAX_TEMPLATE_FUEL));
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.set_unknown_method_callback(python_method);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| ChatError::Syntax {
                origin: origin.into(),
                detail: describe(&e),
            })?;
        Ok(ChatTemplate {
            env,
            origin: origin.into(),
            bos_token,
            eos_token,
        })
    }

    /// The template and special tokens of a tokenizer_config.json file.
    pub fn from_tokenizer_config(path: &Path) -> Result<Self, ChatError> {
        let text = crate::fsutil::read_input_text(path, MAX_CONFIG_BYTES).map_err(|source| {
            ChatError::Io {
                path: path.into(),
                source,
            }
        })?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|source| ChatError::Json {
                path: path.into(),
                source,
            })?;
        Self::from_tokenizer_config_json(&json, &path.display().to_string())
    }

    /// Like [`from_tokenizer_config`](Self::from_tokenizer_config), from parsed JSON.
    pub fn from_tokenizer_config_json(
        config: &serde_json::Value,
        origin: &str,
    ) -> Result<Self, ChatError> {
        let source = match config.get("chat_template") {
            None | Some(serde_json::Value::Null) => {
                return Err(ChatError::NoTemplate {
                    origin: origin.into(),
                })
            }
            Some(serde_json::Value::String(s)) => s.clone(),
            // Newer checkpoints list named templates; "default" is the one for plain chat.
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template")?.as_str())
                .map(str::to_string)
                .ok_or_else(|| ChatError::NoTemplate {
                    origin: format!("{origin} (no template named \"default\")"),
                })?,
            Some(other) => {
                return Err(ChatError::BadTemplateField {
                    origin: origin.into(),
                    found: json_kind(other).into(),
                })
            }
        };
        Self::new(
            &source,
            origin,
            special_token(config, "bos_token"),
            special_token(config, "eos_token"),
        )
    }

    /// The prompt text for `messages`; with `add_generation_prompt` it ends where the
    /// assistant's reply begins. Encode it without adding special tokens: the template has
    /// already written them.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        let render_err = |e: Error| ChatError::Render {
            origin: self.origin.clone(),
            detail: describe(&e),
        };
        let template = self.env.get_template(TEMPLATE_NAME).map_err(render_err)?;
        let ctx = minijinja::context! {
            messages => Value::from(minijinja::value::Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
        };
        template.render(ctx).map_err(render_err)
    }
}

/// The error and the chain of causes minijinja attaches (the template line is in the detail).
fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cause = c.source();
    }
    s
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "a list",
        serde_json::Value::Object(_) => "an object",
    }
}

/// `bos_token` and friends are either a string or an AddedToken object with `content`.
fn special_token(config: &serde_json::Value, key: &str) -> Option<String> {
    match config.get(key)? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// Templates call this to reject conversations they cannot format (e.g. roles that do not
/// alternate); the message reaches the user.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// Python's `json.dumps(value, ensure_ascii=False, indent=indent)`, which transformers
/// installs as `tojson`: `", "` / `": "` separators, or newlines plus `indent` spaces.
fn tojson(value: Value, indent: Option<usize>, kwargs: Kwargs) -> Result<Value, Error> {
    // Accept and ignore sort_keys/separators only when they match what we produce.
    kwargs.assert_all_used()?;
    let mut out = Vec::new();
    let result = match indent {
        Some(n) => {
            let pad = " ".repeat(n);
            let fmt = serde_json::ser::PrettyFormatter::with_indent(pad.as_bytes());
            let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
            value.serialize(&mut ser)
        }
        None => {
            let mut ser = serde_json::Serializer::with_formatter(&mut out, PythonFormatter);
            value.serialize(&mut ser)
        }
    };
    result.map_err(|e| Error::new(ErrorKind::InvalidOperation, "tojson failed").with_source(e))?;
    let text = String::from_utf8(out).map_err(|e| {
        Error::new(ErrorKind::InvalidOperation, "tojson produced invalid UTF-8").with_source(e)
    })?;
    Ok(Value::from_safe_string(text))
}

/// Compact JSON with Python's default separators.
struct PythonFormatter;

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

/// The Python `str` and `dict` methods chat templates call, which Jinja2 gets for free from
/// Python objects.
fn python_method(
    _state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    match value.kind() {
        ValueKind::String => string_method(value.as_str().unwrap_or_default(), method, args),
        ValueKind::Map => map_method(value, method, args),
        _ => Err(Error::from(ErrorKind::UnknownMethod)),
    }
}

fn string_method(s: &str, method: &str, args: &[Value]) -> Result<Value, Error> {
    let strip_set = |chars: Option<&str>| -> Box<dyn Fn(char) -> bool> {
        match chars {
            Some(set) => {
                let set: Vec<char> = set.chars().collect();
                Box::new(move |c| set.contains(&c))
            }
            None => Box::new(char::is_whitespace),
        }
    };
    Ok(match method {
        "strip" => {
            let (chars,): (Option<&str>,) = from_args(args)?;
            Value::from(s.trim_matches(|c| strip_set(chars)(c)))
        }
        "lstrip" => {
            let (chars,): (Option<&str>,) = from_args(args)?;
            Value::from(s.trim_start_matches(|c| strip_set(chars)(c)))
        }
        "rstrip" => {
            let (chars,): (Option<&str>,) = from_args(args)?;
            Value::from(s.trim_end_matches(|c| strip_set(chars)(c)))
        }
        "startswith" | "endswith" => {
            let (arg,): (Value,) = from_args(args)?;
            // Python accepts one prefix or a tuple of them.
            let options: Vec<String> = if arg.kind() == ValueKind::Seq {
                arg.try_iter()?
                    .filter_map(|v| v.as_str().map(str::to_string))
                    .collect()
            } else {
                vec![arg.as_str().unwrap_or_default().to_string()]
            };
            let hit = options.iter().any(|o| {
                if method == "startswith" {
                    s.starts_with(o.as_str())
                } else {
                    s.ends_with(o.as_str())
                }
            });
            Value::from(hit)
        }
        "upper" => {
            let () = from_args(args)?;
            Value::from(s.to_uppercase())
        }
        "lower" => {
            let () = from_args(args)?;
            Value::from(s.to_lowercase())
        }
        "title" | "capitalize" => {
            let () = from_args(args)?;
            let mut out = String::with_capacity(s.len());
            let mut start = true;
            for c in s.chars() {
                if start {
                    out.extend(c.to_uppercase());
                } else {
                    out.extend(c.to_lowercase());
                }
                start = if method == "title" {
                    !c.is_alphanumeric()
                } else {
                    false
                };
            }
            Value::from(out)
        }
        "replace" => {
            let (old, new): (&str, &str) = from_args(args)?;
            Value::from(s.replace(old, new))
        }
        "split" => {
            let (sep, maxsplit): (Option<&str>, Option<i64>) = from_args(args)?;
            let max = maxsplit.filter(|&m| m >= 0).map(|m| m as usize + 1);
            let parts: Vec<Value> = match (sep, max) {
                (Some(sep), Some(n)) => s.splitn(n, sep).map(Value::from).collect(),
                (Some(sep), None) => s.split(sep).map(Value::from).collect(),
                // Python's split() without a separator splits on runs of whitespace.
                (None, _) => s.split_whitespace().map(Value::from).collect(),
            };
            Value::from(parts)
        }
        _ => return Err(Error::from(ErrorKind::UnknownMethod)),
    })
}

fn map_method(value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    Ok(match method {
        "items" => {
            let () = from_args(args)?;
            let mut out = Vec::new();
            for k in value.try_iter()? {
                let v = value.get_item(&k)?;
                out.push(Value::from(vec![k, v]));
            }
            Value::from(out)
        }
        "keys" => {
            let () = from_args(args)?;
            Value::from(value.try_iter()?.collect::<Vec<_>>())
        }
        "values" => {
            let () = from_args(args)?;
            let mut out = Vec::new();
            for k in value.try_iter()? {
                out.push(value.get_item(&k)?);
            }
            Value::from(out)
        }
        "get" => {
            let (key, default): (Value, Option<Value>) = from_args(args)?;
            let v = value.get_item(&key)?;
            if v.is_undefined() {
                default.unwrap_or(Value::from(()))
            } else {
                v
            }
        }
        _ => return Err(Error::from(ErrorKind::UnknownMethod)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, messages: &[Message]) -> Result<String, ChatError> {
        ChatTemplate::new(src, "test", Some("<s>".into()), Some("</s>".into()))?
            .render(messages, true)
    }

    #[test]
    fn an_endless_template_runs_out_of_fuel_within_a_second() {
        let started = std::time::Instant::now();
        let src =
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";
        let err = render(src, &[]).unwrap_err();
        assert!(err.to_string().contains("fuel"), "{err}");
        assert!(
            started.elapsed().as_secs_f64() < 1.0,
            "{:?}",
            started.elapsed()
        );
        // A real conversation renders well within the fuel.
        let msgs: Vec<Message> = (0..200)
            .map(|i| Message {
                role: if i % 2 == 0 { "user" } else { "assistant" }.into(),
                content: "hello there".into(),
            })
            .collect();
        let chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}";
        assert!(render(chatml, &msgs).is_ok());
    }

    #[test]
    fn python_string_methods() {
        let t = "{{ m.content.strip() }}|{{ m.content.lstrip() }}|{{ 'xxhixx'.strip('x') }}|\
                 {{ m.content.startswith('  he') }}|{{ 'a.b'.endswith(('.b', '.c')) }}|\
                 {{ 'a b  c'.split() | length }}|{{ 'a,b,c'.split(',', 1)[1] }}|\
                 {{ 'hello world'.title() }}|{{ 'X'.lower() }}{{ 'y'.upper() }}|\
                 {{ 'aXa'.replace('X', 'b') }}";
        let src = format!("{{% set m = messages[0] %}}{t}");
        let out = render(&src, &[Message::new("user", "  hello ")]).unwrap();
        assert_eq!(out, "hello|hello |hi|True|True|3|b,c|Hello World|xY|aba");
    }

    #[test]
    fn dict_methods_and_tojson() {
        let src = "{% for k, v in {'a': 1, 'b': [1, 'x']}.items() %}{{ k }}={{ v | tojson }};{% endfor %}\
                   {{ {'a': 1}.get('z', 'dflt') }}|{{ {'k': 'é\"'} | tojson }}";
        let out = render(src, &[]).unwrap();
        assert_eq!(out, "a=1;b=[1, \"x\"];dflt|{\"k\": \"é\\\"\"}");
    }

    #[test]
    fn raise_exception_reaches_the_error() {
        let src = "{% if messages[0].role != 'system' %}{{ raise_exception('Conversation roles must alternate') }}{% endif %}";
        match render(src, &[Message::new("user", "x")]) {
            Err(ChatError::Render { detail, .. }) => {
                assert!(
                    detail.contains("Conversation roles must alternate"),
                    "{detail}"
                )
            }
            other => panic!("expected a render error, got {other:?}"),
        }
    }

    #[test]
    fn syntax_errors_are_typed() {
        assert!(matches!(
            ChatTemplate::new("{% for %}", "cfg.json", None, None),
            Err(ChatError::Syntax { .. })
        ));
    }

    #[test]
    fn tokenizer_config_variants() {
        let cfg = serde_json::json!({
            "chat_template": [
                {"name": "tool_use", "template": "TOOLS"},
                {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"}
            ],
            "bos_token": {"content": "<B>", "lstrip": false},
            "eos_token": "<E>",
        });
        let t = ChatTemplate::from_tokenizer_config_json(&cfg, "cfg").unwrap();
        assert_eq!(
            t.render(&[Message::new("user", "x")], false).unwrap(),
            "<B>x<E>"
        );
        let none = serde_json::json!({"bos_token": "<s>"});
        assert!(matches!(
            ChatTemplate::from_tokenizer_config_json(&none, "cfg"),
            Err(ChatError::NoTemplate { .. })
        ));
        let bad = serde_json::json!({"chat_template": 3});
        assert!(matches!(
            ChatTemplate::from_tokenizer_config_json(&bad, "cfg"),
            Err(ChatError::BadTemplateField { .. })
        ));
    }
}
