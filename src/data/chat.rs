//! Conversations to token rows: the model directory's chat template (`chat_template.jinja`,
//! or `chat_template` in `tokenizer_config.json`) rendered by minijinja with Python-style
//! string methods (HF templates call `.strip()`, `.startswith()`, …) and jinja2's
//! `trim_blocks` / `lstrip_blocks` as transformers sets them, then `tokenizer.json` through
//! the `tokenizers` crate, without added special tokens (the template writes them), as
//! `apply_chat_template` does.
//!
//! Tool-calling conversations render as `apply_chat_template(messages, tools=...)` does
//! ([`super::tools`]): the `tools` variable, assistant messages with `tool_calls`, `tool`
//! messages; `tojson` is Python's `json.dumps` ([`super::pyjson`]). A dataset with tools
//! needs a template that reads `tools` and writes `tool_calls`.
//!
//! Labels: the whole conversation is rendered and tokenized once (the exact text inference
//! sees). Assistant turn i is the text that the render of turns `..=i` adds to the render of
//! turns `..i` with the generation prompt; it spans the same characters of the whole render
//! when the render of `..=i` is a prefix of it, else (templates that place the tool list
//! before the last user message, as Mistral's does) its first occurrence after the previous
//! turn. A token is trained on when it starts inside a turn (every token with
//! `train_on_prompt`); tool calls are assistant turns, tool answers are not.
//!
//! Documents (`training.stage: pt`) are tokenized as LlamaFactory's pretraining processor
//! does: `text + eos` without added special tokens, `bos + text + eos` unpacked when the
//! tokenizer adds a BOS ([`ChatTokenizer::bos`]); Llama 3's end-of-document token
//! `<|end_of_text|>` is the eos where the vocabulary has it (LlamaFactory's `llama3` rule,
//! whose chat eos is `<|eot_id|>`).
//!
//! Each render is bounded ([`limits`]): a number of template instructions (minijinja's
//! fuel) and a number of bytes written. A template past either fails the load naming the
//! template and the record, whatever `dataset.strict` says: every record would.

use std::path::{Path, PathBuf};

use minijinja::{Environment, ErrorKind, Value, context};
use serde::Deserialize;

pub use limits::RenderError;

use super::records::{Conversation, Message, Role};
use super::{Example, IGNORE_INDEX, pyjson};
use crate::bounded;
use crate::config::chat_templates as builtin;
use crate::error::{Error, Result};

mod limits;

const TEMPLATE: &str = "chat";

/// The config key that chooses a template.
const CHAT_TEMPLATE_KEY: &str = "dataset.chat_template";

/// Token ids and each token's byte span in the text.
type Encoded = (Vec<u32>, Vec<(usize, usize)>);

/// Llama 3's end-of-document token.
const LLAMA3_END_OF_TEXT: &str = "<|end_of_text|>";

pub struct ChatTokenizer {
    tokenizer: tokenizers::Tokenizer,
    /// None: the model has no chat template (documents only).
    env: Option<Environment<'static>>,
    bos_token: String,
    eos_token: String,
    /// The token the tokenizer puts first when asked for special tokens.
    bos: Option<(i32, String)>,
    /// The template reads `tools` and writes `tool_calls`.
    tools: bool,
    /// Where the template came from (for messages).
    pub template: Origin,
}

/// Where the chat template comes from; displayed as a path or the built-in's name.
#[derive(Debug, Clone)]
pub enum Origin {
    /// The model directory's own: chat_template.jinja or tokenizer_config.json (also the
    /// latter when there is none, for documents).
    Model(PathBuf),
    /// A file given by `dataset.chat_template`, and the model's own template it replaces.
    File(PathBuf, Option<PathBuf>),
    /// A built-in template given by `dataset.chat_template`, and the model's own it replaces.
    Builtin(&'static str, Option<PathBuf>),
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Origin::Model(p) | Origin::File(p, _) => write!(f, "{}", p.display()),
            Origin::Builtin(name, _) => write!(f, "built-in template `{name}`"),
        }
    }
}

impl Origin {
    /// An error about this template: the model's file, or the config key that chose it.
    pub fn error(&self, msg: String) -> Error {
        match self {
            Origin::Model(p) => Error::ModelConfig {
                path: p.clone(),
                msg,
            },
            _ => Error::invalid(CHAT_TEMPLATE_KEY, format!("{self}: {msg}")),
        }
    }
}

/// `bos_token` / `eos_token` in tokenizer_config.json: a string or an AddedToken object.
#[derive(Deserialize)]
#[serde(untagged)]
enum TokenText {
    Plain(String),
    Added { content: String },
}

#[derive(Deserialize)]
#[serde(untagged)]
enum TemplateField {
    One(String),
    Named(Vec<NamedTemplate>),
}

#[derive(Deserialize)]
struct NamedTemplate {
    name: String,
    template: String,
}

#[derive(Deserialize)]
struct TokenizerConfig {
    #[serde(default)]
    chat_template: Option<TemplateField>,
    #[serde(default)]
    bos_token: Option<TokenText>,
    #[serde(default)]
    eos_token: Option<TokenText>,
}

impl TokenText {
    fn text(self) -> String {
        match self {
            TokenText::Plain(s) | TokenText::Added { content: s } => s,
        }
    }
}

impl ChatTokenizer {
    /// Loads `tokenizer.json`, `tokenizer_config.json` and the chat template of `dir`;
    /// without `template`, a missing chat template is no error (documents need none).
    pub fn from_model_dir(dir: &Path, template: bool) -> Result<ChatTokenizer> {
        Self::load(dir, None, template)
    }

    /// [`Self::from_model_dir`] with `chosen` (`dataset.chat_template`: a built-in name or
    /// a Jinja file) rendering instead of the model's own template. Without either, `needed`
    /// makes it an error naming the key and the built-in names.
    pub fn load(dir: &Path, chosen: Option<&Path>, needed: bool) -> Result<ChatTokenizer> {
        let tok_path = dir.join("tokenizer.json");
        if !tok_path.is_file() {
            return Err(Error::ModelConfig {
                path: tok_path,
                msg: "missing: text datasets are tokenized with the model's tokenizer.json".into(),
            });
        }
        bounded::check_file(&tok_path, bounded::TOKENIZER, "tokenizer")?;
        let tokenizer =
            tokenizers::Tokenizer::from_file(&tok_path).map_err(|e| Error::ModelConfig {
                path: tok_path.clone(),
                msg: format!("not a tokenizers file: {e}"),
            })?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: TokenizerConfig =
            match bounded::read_text(&cfg_path, bounded::SMALL_JSON, "tokenizer config") {
                Ok(text) => serde_json::from_str(&text).map_err(|e| Error::ModelConfig {
                    path: cfg_path.clone(),
                    msg: format!("malformed: {e}"),
                })?,
                Err(Error::Io { cause, .. }) if cause.kind() == std::io::ErrorKind::NotFound => {
                    TokenizerConfig {
                        chat_template: None,
                        bos_token: None,
                        eos_token: None,
                    }
                }
                Err(e) => return Err(e),
            };
        let bos_token = cfg.bos_token.map(TokenText::text).unwrap_or_default();
        let eos_token = cfg.eos_token.map(TokenText::text).unwrap_or_default();
        let own = own_template(dir, cfg.chat_template)?;
        let (source, template) = match (chosen, own) {
            (Some(c), own) => {
                let overrides = own.map(|(_, p)| p);
                match builtin::named(c) {
                    Some(b) => {
                        if needed {
                            b.check_tokens(&tokenizer, &bos_token, &eos_token)
                                .map_err(|m| Error::invalid(CHAT_TEMPLATE_KEY, m))?;
                        }
                        (
                            Some(b.source.to_string()),
                            Origin::Builtin(b.name, overrides),
                        )
                    }
                    None => (
                        Some(builtin::chosen_text(c)?),
                        Origin::File(c.to_path_buf(), overrides),
                    ),
                }
            }
            (None, Some((s, p))) => (Some(s), Origin::Model(p)),
            (None, None) if !needed => (None, Origin::Model(cfg_path)),
            (None, None) => {
                return Err(Error::invalid(
                    CHAT_TEMPLATE_KEY,
                    format!(
                        "the model ({}) has no chat template (no chat_template.jinja, no `chat_template` in tokenizer_config.json), and alpaca and sharegpt data are rendered with one: give dataset.chat_template (LlamaFactory's `template`) as a built-in name ({}) or a Jinja file, or use a tokenized dataset",
                        dir.display(),
                        builtin::names()
                    ),
                ));
            }
        };
        let env = source.map(|s| template_env(s, &template)).transpose()?;
        let bos = first_added_token(&tokenizer);
        let tools = env.as_ref().is_some_and(|env| {
            let tmpl = env.get_template(TEMPLATE).expect("added above");
            tmpl.undeclared_variables(false).contains("tools")
                && tmpl.source().contains("tool_calls")
        });
        Ok(ChatTokenizer {
            tokenizer,
            env,
            tools,
            bos_token,
            eos_token,
            bos,
            template,
        })
    }

    /// The line saying which template renders the conversations, when `dataset.chat_template`
    /// chose it.
    pub fn note(&self) -> Option<String> {
        let over = |o: &Option<PathBuf>| match o {
            Some(p) => format!(", not the model's own ({})", p.display()),
            None => String::new(),
        };
        match &self.template {
            Origin::Model(_) => None,
            Origin::Builtin(name, o) => Some(format!(
                "chat template: the built-in `{name}` (dataset.chat_template) renders the conversations{}",
                over(o)
            )),
            Origin::File(p, o) => Some(format!(
                "chat template: {} (dataset.chat_template) renders the conversations{}",
                p.display(),
                over(o)
            )),
        }
    }

    /// Whether the template reads `tools` and writes `tool_calls`.
    pub fn supports_tools(&self) -> bool {
        self.tools
    }

    /// The template's text for the first `n` messages of `conv`, with the assistant
    /// generation prompt appended when asked.
    pub fn render(
        &self,
        conv: &Conversation,
        n: usize,
        add_generation_prompt: bool,
    ) -> std::result::Result<String, RenderError> {
        self.render_counted(conv, n, add_generation_prompt)
            .map(|(text, _)| text)
    }

    /// [`Self::render`] and the fuel (template instructions) it took.
    fn render_counted(
        &self,
        conv: &Conversation,
        n: usize,
        add_generation_prompt: bool,
    ) -> std::result::Result<(String, u64), RenderError> {
        let env = self.env.as_ref().ok_or_else(|| {
            format!(
                "the model has no chat template ({}): conversations need one",
                self.template
            )
        })?;
        let messages: Vec<Value> = conv.messages[..n].iter().map(message_value).collect();
        let tmpl = env.get_template(TEMPLATE).map_err(|e| e.to_string())?;
        // As transformers renders: `tools` is the list or none, `documents` none (templates
        // test them with `is not none`). `strftime_now` is deliberately not defined, so
        // templates use their fixed fallback date and the token rows do not change from day
        // to day.
        let ctx = context! {
            messages,
            add_generation_prompt,
            tools => conv.tools.clone().unwrap_or(Value::from(())),
            documents => (),
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        };
        let mut out = limits::Capped::new(limits::TEMPLATE_OUTPUT);
        match tmpl.render_captured_to(ctx, &mut out) {
            Ok(done) => {
                let fuel = done.state().fuel_levels().map_or(0, |(used, _)| used);
                Ok((out.into_text().map_err(|e| self.failed(e))?, fuel))
            }
            Err(e) => Err(limits::render_failure(e, &out, &self.template)),
        }
    }

    /// A render failure: the template's path and why.
    fn failed(&self, e: impl std::fmt::Display) -> RenderError {
        RenderError::Bad(format!("chat template ({}): {e}", self.template))
    }

    /// Token ids of `text`, without added special tokens, and each token's byte span.
    pub fn encode(&self, text: &str) -> std::result::Result<Encoded, String> {
        let enc = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| format!("tokenizer: {e}"))?;
        Ok((enc.get_ids().to_vec(), enc.get_offsets().to_vec()))
    }

    /// The token row of a conversation; labels on the assistant turns (or everywhere).
    pub fn example(
        &self,
        conv: &Conversation,
        train_on_prompt: bool,
    ) -> std::result::Result<Example, RenderError> {
        let (full, spans) = self.answer_spans(conv)?;
        Ok(self.labelled(&full, &spans, train_on_prompt)?)
    }

    /// The conversation's text and the byte spans of its assistant answers in it.
    pub fn answer_spans(
        &self,
        conv: &Conversation,
    ) -> std::result::Result<(String, Vec<std::ops::Range<usize>>), RenderError> {
        let full = self.render(conv, conv.messages.len(), false)?;
        let mut spans = Vec::new();
        let mut from = 0;
        for (i, m) in conv.messages.iter().enumerate() {
            if m.role != Role::Assistant {
                continue;
            }
            let prompt = self.render(conv, i, true)?;
            let turn = self.render(conv, i + 1, false)?;
            let answer = turn.strip_prefix(prompt.as_str()).ok_or_else(|| {
                RenderError::Bad(format!(
                    "the chat template does not render the conversation up to message {i} as a prefix of the conversation up to its answer, so the answer cannot be located"
                ))
            })?;
            let start = match full.starts_with(&turn) {
                true => prompt.len(),
                false => full[from..].find(answer).map(|p| from + p).ok_or_else(|| {
                    RenderError::Bad(format!("the chat template's answer to message {i} is not found in the whole conversation's text"))
                })?,
            };
            spans.push(start..start + answer.len());
            from = start + answer.len();
        }
        Ok((full, spans))
    }

    /// The token row of a conversation ending in an assistant answer, labelled on that
    /// answer alone: what the render of the whole conversation adds to the render of the
    /// turns before it with the generation prompt (a preference pair's row).
    pub fn answer_example(&self, conv: &Conversation) -> std::result::Result<Example, RenderError> {
        let n = conv.messages.len();
        assert!(
            conv.messages
                .last()
                .is_some_and(|m| m.role == Role::Assistant),
            "a conversation ending in an answer"
        );
        let prompt = self.render(conv, n - 1, true)?;
        let full = self.render(conv, n, false)?;
        if !full.starts_with(&prompt) {
            return Err(RenderError::Bad("the chat template does not render the prompt as a prefix of the conversation with its answer, so the answer cannot be located".into()));
        }
        let answer = prompt.len()..full.len();
        Ok(self.labelled(&full, std::slice::from_ref(&answer), false)?)
    }

    /// `text` tokenized, a token labelled when it starts inside one of `spans` (every
    /// token with `all`).
    pub fn labelled(
        &self,
        text: &str,
        spans: &[std::ops::Range<usize>],
        all: bool,
    ) -> std::result::Result<Example, String> {
        let (ids, offsets) = self.encode(text)?;
        let labels = ids
            .iter()
            .zip(&offsets)
            .map(|(&id, &(start, _))| {
                if all || spans.iter().any(|s| s.contains(&start)) {
                    id as i32
                } else {
                    IGNORE_INDEX
                }
            })
            .collect();
        Ok(Example {
            input_ids: ids.iter().map(|&i| i as i32).collect(),
            labels,
            position_ids: Vec::new(),
            images: Vec::new(),
        })
    }

    /// The id and text of the token the tokenizer adds in front of a text when asked for
    /// special tokens (transformers' `tokenizer(text)`), if any.
    pub fn bos(&self) -> Option<(i32, &str)> {
        self.bos.as_ref().map(|(id, s)| (*id, s.as_str()))
    }

    /// The token that ends each pretraining document.
    pub fn document_eos(&self) -> std::result::Result<&str, String> {
        if self.tokenizer.token_to_id(LLAMA3_END_OF_TEXT).is_some() {
            return Ok(LLAMA3_END_OF_TEXT);
        }
        match self.eos_token.as_str() {
            "" => Err(format!(
                "the tokenizer has no eos_token ({}): pretraining documents end with it",
                self.template
            )),
            eos => Ok(eos),
        }
    }

    /// A pretraining document's row: `text + eos` (`bos + text + eos` with `bos`),
    /// tokenized without added special tokens; loss on every token.
    pub fn document(&self, text: &str, bos: bool) -> std::result::Result<Example, String> {
        let mut s = String::with_capacity(text.len() + 32);
        if let (true, Some((_, b))) = (bos, self.bos()) {
            s.push_str(b);
        }
        s.push_str(text);
        s.push_str(self.document_eos()?);
        let (ids, _) = self.encode(&s)?;
        let ids: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
        Ok(Example {
            labels: ids.clone(),
            input_ids: ids,
            position_ids: Vec::new(),
            images: Vec::new(),
        })
    }
}

/// The model directory's own chat template and where it was read: chat_template.jinja, else
/// `field` (tokenizer_config.json's `chat_template`, the one named `default` of a list).
fn own_template(dir: &Path, field: Option<TemplateField>) -> Result<Option<(String, PathBuf)>> {
    let jinja_path = dir.join("chat_template.jinja");
    if jinja_path.is_file() {
        let s = bounded::read_text(&jinja_path, bounded::SMALL_JSON, "chat template")?;
        return Ok(Some((s, jinja_path)));
    }
    let s = match field {
        Some(TemplateField::One(s)) => Some(s),
        Some(TemplateField::Named(list)) => list
            .into_iter()
            .find(|t| t.name == "default")
            .map(|t| t.template),
        None => None,
    };
    Ok(s.map(|s| (s, dir.join("tokenizer_config.json"))))
}

/// The minijinja environment of a chat template, set up as transformers renders.
fn template_env(source: String, origin: &Origin) -> Result<Environment<'static>> {
    let mut env = Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .expect("the default delimiters are valid");
    env.set_syntax(syntax);
    env.set_fuel(Some(limits::TEMPLATE_FUEL));
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        },
    );
    env.add_filter("tojson", pyjson::tojson);
    env.add_test("iterable", pyjson::is_iterable);
    env.add_template_owned(TEMPLATE, source)
        .map_err(|e| origin.error(format!("chat template does not parse: {e}")))?;
    Ok(env)
}

/// The token a tokenizer's post-processor puts before a text, if any.
fn first_added_token(tok: &tokenizers::Tokenizer) -> Option<(i32, String)> {
    let with = tok.encode("a", true).ok()?;
    let without = tok.encode("a", false).ok()?;
    let added = with.get_ids().len() > without.get_ids().len()
        && with.get_special_tokens_mask().first() == Some(&1)
        && with.get_ids()[1..].starts_with(without.get_ids());
    added.then(|| (with.get_ids()[0] as i32, with.get_tokens()[0].clone()))
}

/// A message as transformers passes it to the template: `role` and `content`, plus
/// `tool_calls` on a tool-calling turn and `tool_call_id` on a tool's answer.
fn message_value(m: &Message) -> Value {
    let mut fields = vec![
        ("role", Value::from(m.role.as_str())),
        ("content", Value::from(m.content.as_str())),
    ];
    if !m.tool_calls.is_empty() {
        let calls = m.tool_calls.iter().map(|c| {
            let function = Value::from_pairs([
                ("name", Value::from(c.name.as_str())),
                ("arguments", c.arguments.clone()),
            ]);
            Value::from_pairs([
                ("id", Value::from(c.id.as_str())),
                ("type", Value::from("function")),
                ("function", function),
            ])
        });
        fields.push(("tool_calls", Value::from_iter(calls)));
    }
    if let Some(id) = &m.tool_call_id {
        fields.push(("tool_call_id", Value::from(id.as_str())));
    }
    Value::from_pairs(fields)
}

#[cfg(test)]
mod tests;
