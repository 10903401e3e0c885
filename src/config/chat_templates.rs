//! Built-in chat templates (`dataset.chat_template: qwen`, LlamaFactory's `template: qwen`):
//! Jinja templates shipped in `chat_templates/`, rendered by the same renderer and bounds as a
//! model's own template (`crate::data::chat`). They live in config, which checks the names a
//! config gives, below the data that renders them. Each renders a conversation as LlamaFactory's template of the same
//! name does (src/llamafactory/data/template.py, `register_template(name=...)`): the same
//! text, the answers (`content` and the turn's end) where LlamaFactory puts its targets.
//! They render system, user and assistant messages; tool calls need a template that renders
//! them (the model's own, or a file).
//!
//! The template text writes special tokens (`<|im_start|>`, `<|eot_id|>`, ...); a tokenizer
//! without them would split them into pieces and train on garbage, so each is checked to
//! be a token of the tokenizer's added vocabulary, as are the bos_token / eos_token a
//! template writes.

/// One built-in template.
pub struct Builtin {
    pub name: &'static str,
    pub source: &'static str,
    /// Tokens the template text writes, which the tokenizer must have as added tokens.
    pub tokens: &'static [&'static str],
    /// The template writes `eos_token` (which must then be set and an added token).
    pub eos: bool,
}

/// Every built-in template, in the order the docs and errors list them.
pub const BUILTINS: &[Builtin] = &[
    Builtin {
        name: "qwen",
        source: include_str!("chat_templates/qwen.jinja"),
        tokens: &["<|im_start|>", "<|im_end|>"],
        eos: false,
    },
    Builtin {
        name: "chatml",
        source: include_str!("chat_templates/chatml.jinja"),
        tokens: &["<|im_start|>", "<|im_end|>"],
        eos: false,
    },
    Builtin {
        name: "llama3",
        source: include_str!("chat_templates/llama3.jinja"),
        tokens: &["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        eos: false,
    },
    Builtin {
        name: "mistral",
        source: include_str!("chat_templates/mistral.jinja"),
        tokens: &["[INST]", "[/INST]"],
        eos: true,
    },
    Builtin {
        name: "gemma",
        source: include_str!("chat_templates/gemma.jinja"),
        tokens: &["<start_of_turn>", "<end_of_turn>"],
        eos: false,
    },
    Builtin {
        name: "alpaca",
        source: include_str!("chat_templates/alpaca.jinja"),
        tokens: &[],
        eos: true,
    },
    Builtin {
        name: "default",
        source: include_str!("chat_templates/default.jinja"),
        tokens: &[],
        eos: true,
    },
];

/// The built-in template a `dataset.chat_template` value names, if it is one (else it is
/// a file).
pub fn named(value: &std::path::Path) -> Option<&'static Builtin> {
    value.to_str().and_then(find)
}

/// The text of the template a `dataset.chat_template` value names: a built-in's, or the
/// file's.
pub fn chosen_text(value: &std::path::Path) -> crate::error::Result<String> {
    match named(value) {
        Some(b) => Ok(b.source.to_string()),
        None => crate::bounded::read_text(value, crate::bounded::SMALL_JSON, "chat template"),
    }
}

/// The built-in template called `name`.
pub fn find(name: &str) -> Option<&'static Builtin> {
    BUILTINS.iter().find(|b| b.name == name)
}

/// The built-in names, comma-separated, for messages.
pub fn names() -> String {
    BUILTINS
        .iter()
        .map(|b| b.name)
        .collect::<Vec<_>>()
        .join(", ")
}

impl Builtin {
    /// Checks that `tok` has every token this template writes (`bos` / `eos`: the
    /// tokenizer config's bos_token / eos_token, "" when unset); the error names the first
    /// one missing.
    pub fn check_tokens(
        &self,
        tok: &tokenizers::Tokenizer,
        bos: &str,
        eos: &str,
    ) -> Result<(), String> {
        let added: Vec<String> = tok
            .get_added_tokens_decoder()
            .into_values()
            .map(|t| t.content)
            .collect();
        let has = |t: &str| added.iter().any(|a| a == t);
        if self.eos && eos.is_empty() {
            return Err(format!(
                "the built-in template `{}` ends each answer with the tokenizer's eos_token, which tokenizer_config.json does not set",
                self.name
            ));
        }
        let writes_bos = self.source.contains("bos_token") && !bos.is_empty();
        let eos = self.eos.then_some(eos);
        let missing = self
            .tokens
            .iter()
            .copied()
            .chain(writes_bos.then_some(bos))
            .chain(eos)
            .find(|t| !has(t));
        match missing {
            None => Ok(()),
            Some(t) => Err(format!(
                "the built-in template `{}` writes `{t}`, which is not a special token of this tokenizer (tokenizer.json): the template is for another model family; choose the one of this model ({}) or give a template file",
                self.name,
                names()
            )),
        }
    }
}
