//! Conversations to token rows: the model directory's chat template (`chat_template.jinja`,
//! or `chat_template` in `tokenizer_config.json`) rendered by minijinja with Python-style
//! string methods (HF templates call `.strip()`, `.startswith()`, …) and jinja2's
//! `trim_blocks` / `lstrip_blocks` as transformers sets them, then `tokenizer.json` through
//! the `tokenizers` crate, without added special tokens (the template writes them), as
//! `apply_chat_template` does.
//!
//! Labels: the whole conversation is rendered and tokenized once (the exact text inference
//! sees). Assistant turn i spans the characters between the render of turns `..i` with the
//! generation prompt and the render of turns `..=i`; a token is trained on when it starts
//! inside such a span (every token with `train_on_prompt`).

use std::path::{Path, PathBuf};

use minijinja::{Environment, ErrorKind, context};
use serde::Deserialize;

use super::records::{Message, Role};
use super::{Example, IGNORE_INDEX};
use crate::error::{Error, Result};

const TEMPLATE: &str = "chat";

/// Token ids and each token's byte span in the text.
type Encoded = (Vec<u32>, Vec<(usize, usize)>);

pub struct ChatTokenizer {
    tokenizer: tokenizers::Tokenizer,
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// Where the template came from (for error messages).
    pub template_path: PathBuf,
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
    /// Loads `tokenizer.json`, `tokenizer_config.json` and the chat template of `dir`.
    pub fn from_model_dir(dir: &Path) -> Result<ChatTokenizer> {
        let tok_path = dir.join("tokenizer.json");
        if !tok_path.is_file() {
            return Err(Error::ModelConfig {
                path: tok_path,
                msg: "missing: text datasets are tokenized with the model's tokenizer.json".into(),
            });
        }
        let tokenizer =
            tokenizers::Tokenizer::from_file(&tok_path).map_err(|e| Error::ModelConfig {
                path: tok_path.clone(),
                msg: format!("not a tokenizers file: {e}"),
            })?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: TokenizerConfig = match std::fs::read_to_string(&cfg_path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| Error::ModelConfig {
                path: cfg_path.clone(),
                msg: format!("malformed: {e}"),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => TokenizerConfig {
                chat_template: None,
                bos_token: None,
                eos_token: None,
            },
            Err(e) => return Err(Error::io(&cfg_path, e)),
        };
        let jinja_path = dir.join("chat_template.jinja");
        let (source, template_path) = if jinja_path.is_file() {
            let s = std::fs::read_to_string(&jinja_path).map_err(|e| Error::io(&jinja_path, e))?;
            (s, jinja_path)
        } else {
            let s = match cfg.chat_template {
                Some(TemplateField::One(s)) => Some(s),
                Some(TemplateField::Named(list)) => list
                    .into_iter()
                    .find(|t| t.name == "default")
                    .map(|t| t.template),
                None => None,
            };
            let s = s.ok_or_else(|| Error::ModelConfig {
                path: cfg_path.clone(),
                msg: "no chat template (neither chat_template.jinja nor a `chat_template` key): \
                      alpaca and sharegpt data need one; use a tokenized dataset otherwise"
                    .into(),
            })?;
            (s, cfg_path.clone())
        };
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .expect("the default delimiters are valid");
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_template_owned(TEMPLATE, source)
            .map_err(|e| Error::ModelConfig {
                path: template_path.clone(),
                msg: format!("chat template does not parse: {e}"),
            })?;
        Ok(ChatTokenizer {
            tokenizer,
            env,
            bos_token: cfg.bos_token.map(TokenText::text).unwrap_or_default(),
            eos_token: cfg.eos_token.map(TokenText::text).unwrap_or_default(),
            template_path,
        })
    }

    /// The template's text for `msgs`, with the assistant generation prompt appended when asked.
    pub fn render(
        &self,
        msgs: &[Message],
        add_generation_prompt: bool,
    ) -> std::result::Result<String, String> {
        let messages: Vec<_> = msgs
            .iter()
            .map(|m| context! { role => m.role.as_str(), content => &m.content })
            .collect();
        let tmpl = self.env.get_template(TEMPLATE).map_err(|e| e.to_string())?;
        // As transformers renders: `tools` and `documents` are none (templates test them
        // with `is not none`). `strftime_now` is deliberately not defined, so templates use
        // their fixed fallback date and the token rows do not change from day to day.
        tmpl.render(context! {
            messages,
            add_generation_prompt,
            tools => (),
            documents => (),
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
        .map_err(|e| format!("chat template ({}): {e}", self.template_path.display()))
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
        msgs: &[Message],
        train_on_prompt: bool,
    ) -> std::result::Result<Example, String> {
        let full = self.render(msgs, false)?;
        let mut spans = Vec::new();
        for (i, m) in msgs.iter().enumerate() {
            if m.role != Role::Assistant {
                continue;
            }
            let prompt = self.render(&msgs[..i], true)?;
            let turn = self.render(&msgs[..=i], false)?;
            if !turn.starts_with(&prompt) || !full.starts_with(&turn) {
                return Err(format!(
                    "the chat template does not render the conversation up to message {i} as a prefix of the whole, so its answer cannot be located"
                ));
            }
            spans.push(prompt.len()..turn.len());
        }
        let (ids, offsets) = self.encode(&full)?;
        let labels = ids
            .iter()
            .zip(&offsets)
            .map(|(&id, &(start, _))| {
                if train_on_prompt || spans.iter().any(|s| s.contains(&start)) {
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
        })
    }
}
