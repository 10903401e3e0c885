//! Preference pairs (`training.stage: dpo`): LlamaFactory's ranking records, each made into
//! two rows side by side in the dataset, the prompt + the chosen answer, then the prompt +
//! the rejected answer, rendered with the chat template as SFT rows are, labelled on the
//! answer alone (the prompt, earlier turns included, is -100): the rows whose summed
//! label log-probability DPO compares.
//!
//! - alpaca: `instruction` + `"\n"` + `input` (and `history`, `system`) is the prompt;
//!   the `chosen` and `rejected` columns hold the answers as strings;
//! - sharegpt: the `conversations` end with the prompt's user (or observation) turn;
//!   `chosen` and `rejected` each hold one assistant (or `function_call`) message in the
//!   dataset's tags;
//! - tokenized: `chosen_input_ids`, `chosen_labels`, `rejected_input_ids`,
//!   `rejected_labels` (the columns of LlamaFactory's pairwise processor; absent labels
//!   are the ids).
//!
//! `dataset.max_seq_len` applies to each row as to SFT rows (`overlong`); a pair one of
//! whose rows is skipped is skipped whole.

use serde::Deserialize;
use serde_json::Value;

use super::read::{Reader, fit, in_vocab, no_images, renders_tools, why_no_images};
use super::records::{
    BadRecord, Conversation, Message, RawRecord, Role, Schema, field_text, kind, object,
};
use super::sources::Source;
use super::tools::CallIds;
use super::{Example, tokenized};
use crate::config::DatasetFormat;

/// A record's two rows, chosen first.
pub(super) fn pair(
    src: &Source,
    rec: &RawRecord,
    reader: &Reader,
) -> std::result::Result<[Example; 2], BadRecord> {
    let text = src.schema.is_some();
    let rows = match (&src.schema, reader.chat) {
        (Some(schema), Some(chat)) => {
            let (prompt, answers) = schema.ranking(rec)?;
            let why = why_no_images(reader.images)
                .unwrap_or_else(|| "preference pairs with images are not trained yet".into());
            no_images(&prompt, rec, schema, &why)?;
            answers.map(|answer| {
                let mut conv = prompt.clone();
                conv.messages.push(answer);
                renders_tools(chat, &conv, rec, &schema.columns.messages)?;
                let ex = chat
                    .answer_example(&conv)
                    .map_err(|e| BadRecord::render(rec.line, "", e))?;
                in_vocab(ex, reader.vocab, rec.line)
            })
        }
        _ => tokenized_pair(rec, reader.vocab)?.map(Ok),
    };
    let [chosen, rejected] = rows;
    Ok([
        fit(chosen?, reader, rec.line, text)?,
        fit(rejected?, reader, rec.line, text)?,
    ])
}

impl Schema {
    /// A ranking record: its prompt (the conversation before the answers, with its tools)
    /// and its two answers, chosen first.
    pub fn ranking(
        &self,
        rec: &RawRecord,
    ) -> std::result::Result<(Conversation, [Message; 2]), BadRecord> {
        let (prompt, ids) = self.read(rec, false)?;
        let obj = object(rec)?;
        let cols = [&self.columns.chosen, &self.columns.rejected];
        let answers = match self.format {
            DatasetFormat::Sharegpt => {
                let last = prompt.messages.last().map(|m| m.role);
                if !matches!(last, Some(Role::User | Role::Tool)) {
                    let why = match last {
                        None | Some(Role::System) => "empty conversation".into(),
                        Some(_) => format!(
                            "a ranking conversation ends with the prompt (a user turn); its answers are in `{}` and `{}`",
                            cols[0], cols[1]
                        ),
                    };
                    return Err(BadRecord::new(rec.line, &self.columns.messages, why));
                }
                let answer = |col: &str| self.answer_message(&obj, col, rec.line, ids.clone());
                [answer(cols[0])?, answer(cols[1])?]
            }
            _ => {
                let answer = |col: &str| -> std::result::Result<Message, BadRecord> {
                    let text = field_text(&obj, col, true, rec.line)
                        .map_err(|e| ranking_hint(e, cols))?
                        .unwrap_or_default();
                    match text.is_empty() {
                        true => Err(BadRecord::new(rec.line, col, "empty answer")),
                        false => Ok(Message::new(Role::Assistant, text)),
                    }
                };
                [answer(cols[0])?, answer(cols[1])?]
            }
        };
        Ok((prompt, answers))
    }

    /// A sharegpt ranking answer: one message object in the dataset's tags, from the
    /// assistant (or a `function_call`, its calls numbered after the prompt's).
    fn answer_message(
        &self,
        obj: &serde_json::Map<String, Value>,
        col: &str,
        line: usize,
        mut ids: CallIds,
    ) -> std::result::Result<Message, BadRecord> {
        let t = &self.tags;
        let m = match obj.get(col) {
            Some(Value::Object(m)) => m,
            None | Some(Value::Null) => {
                let cols = [&self.columns.chosen, &self.columns.rejected];
                return Err(ranking_hint(BadRecord::new(line, col, "missing"), cols));
            }
            Some(other) => {
                return Err(BadRecord::new(
                    line,
                    col,
                    format!(
                        "expected one message ({{\"{}\": \"{}\", \"{}\": ...}}), found {}",
                        t.role_tag,
                        t.assistant_tag,
                        t.content_tag,
                        kind(other)
                    ),
                ));
            }
        };
        let field = |tag: &str| format!("{col}.{tag}");
        let get = |tag: &str| match m.get(tag) {
            Some(Value::String(s)) => Ok(s.as_str()),
            None | Some(Value::Null) => Err(BadRecord::new(line, &field(tag), "missing")),
            Some(other) => Err(BadRecord::new(
                line,
                &field(tag),
                format!("expected a string, found {}", kind(other)),
            )),
        };
        let role = get(&t.role_tag)?;
        let content = get(&t.content_tag)?;
        if role == t.function_tag {
            let mut msg = Message::new(Role::Assistant, "");
            msg.tool_calls = ids.calls(content, line, &field(&t.content_tag))?;
            return Ok(msg);
        }
        if role != t.assistant_tag {
            return Err(BadRecord::new(
                line,
                &field(&t.role_tag),
                format!(
                    "an answer's role is `{}` or `{}`, not `{role}`",
                    t.assistant_tag, t.function_tag
                ),
            ));
        }
        if content.is_empty() {
            return Err(BadRecord::new(line, &field(&t.content_tag), "empty answer"));
        }
        Ok(Message::new(Role::Assistant, content))
    }
}

/// A missing answer column, explained.
fn ranking_hint(mut e: BadRecord, cols: [&String; 2]) -> BadRecord {
    if e.reason == "missing" {
        e.reason = format!(
            "missing: a ranking record holds the preferred answer in `{}` and the other in `{}`",
            cols[0], cols[1]
        );
    }
    e
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenizedPair {
    chosen_input_ids: Vec<i64>,
    #[serde(default)]
    chosen_labels: Option<Vec<i64>>,
    rejected_input_ids: Vec<i64>,
    #[serde(default)]
    rejected_labels: Option<Vec<i64>>,
    #[serde(default, rename = "chosen_attention_mask")]
    _chosen_mask: Option<Value>,
    #[serde(default, rename = "rejected_attention_mask")]
    _rejected_mask: Option<Value>,
}

/// A tokenized pair's rows.
fn tokenized_pair(rec: &RawRecord, vocab: usize) -> std::result::Result<[Example; 2], BadRecord> {
    let p: TokenizedPair = serde_json::from_str(rec.json).map_err(|e| {
        BadRecord::new(
            rec.line,
            "",
            format!(
                "not a tokenized pair (chosen_input_ids, chosen_labels, rejected_input_ids, rejected_labels): {e}"
            ),
        )
    })?;
    let one = |prefix: &str, ids: Vec<i64>, labels: Option<Vec<i64>>| {
        tokenized::from_ids(ids, labels, vocab)
            .map_err(|(field, why)| BadRecord::new(rec.line, &format!("{prefix}_{field}"), why))
    };
    Ok([
        one("chosen", p.chosen_input_ids, p.chosen_labels)?,
        one("rejected", p.rejected_input_ids, p.rejected_labels)?,
    ])
}
