//! Text records (alpaca, sharegpt) read from JSON or JSONL files and turned into
//! conversations, following LlamaFactory's conventions; a record that cannot become one is
//! a `BadRecord` naming its line and field.

use std::path::Path;

use serde_json::Value;
use serde_json::value::RawValue;

use super::registry::{Columns, Tags};
use crate::config::DatasetFormat;
use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    System,
    User,
    Assistant,
    /// A tool's answer (sharegpt `observation`): context, never trained on.
    Tool,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub role: Role,
    pub content: String,
}

/// A string field of a record: absent (None) or the bad record it makes.
type FieldText = std::result::Result<Option<String>, BadRecord>;

/// Why one record was left out: its 1-based line and the field at fault.
#[derive(Debug, Clone, PartialEq)]
pub struct BadRecord {
    pub line: usize,
    pub field: String,
    pub reason: String,
}

impl BadRecord {
    pub fn new(line: usize, field: &str, reason: impl Into<String>) -> BadRecord {
        BadRecord {
            line,
            field: field.into(),
            reason: reason.into(),
        }
    }

    pub fn into_error(self, path: &Path) -> Error {
        Error::Dataset {
            path: path.into(),
            line: self.line,
            msg: format!("field `{}`: {}", self.field, self.reason),
        }
    }
}

/// A record of a file: its 1-based line and its JSON text.
pub struct RawRecord<'a> {
    pub line: usize,
    pub json: &'a str,
}

/// Splits a file into records: a JSON array of objects, or JSONL (one object per line).
pub fn split_records<'a>(path: &Path, text: &'a str) -> Result<Vec<RawRecord<'a>>> {
    if !text.trim_start().starts_with('[') {
        return Ok(text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, json)| RawRecord { line: i + 1, json })
            .collect());
    }
    let items: Vec<&RawValue> = serde_json::from_str(text).map_err(|e| Error::Dataset {
        path: path.into(),
        line: e.line(),
        msg: format!("not a JSON array of records: {e}"),
    })?;
    Ok(items
        .into_iter()
        .map(|raw| {
            let json = raw.get();
            let offset = json.as_ptr() as usize - text.as_ptr() as usize;
            let line = 1 + text.as_bytes()[..offset]
                .iter()
                .filter(|&&b| b == b'\n')
                .count();
            RawRecord { line, json }
        })
        .collect())
}

/// How records of one dataset become conversations.
pub struct Schema {
    pub format: DatasetFormat,
    pub columns: Columns,
    pub tags: Tags,
    /// Used when a record has no system prompt of its own.
    pub default_system: Option<String>,
}

impl Schema {
    /// The record's conversation: an optional system prompt and the turns in order.
    pub fn conversation(&self, rec: &RawRecord) -> std::result::Result<Vec<Message>, BadRecord> {
        let bad = |field: &str, reason: &str| BadRecord::new(rec.line, field, reason);
        let obj: Value = serde_json::from_str(rec.json)
            .map_err(|e| bad("", &format!("not a JSON object: {e}")))?;
        let Value::Object(obj) = obj else {
            return Err(bad("", "not a JSON object"));
        };
        let text = |col: &str, required: bool| -> FieldText {
            match obj.get(col) {
                None | Some(Value::Null) if required => Err(bad(col, "missing")),
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(other) => Err(bad(
                    col,
                    &format!("expected a string, found {}", kind(other)),
                )),
            }
        };
        let system = match &self.columns.system {
            Some(col) => text(col, false)?,
            None => None,
        }
        .filter(|s| !s.is_empty())
        .or_else(|| self.default_system.clone());
        let mut msgs: Vec<Message> = system
            .map(|content| Message {
                role: Role::System,
                content,
            })
            .into_iter()
            .collect();
        match self.format {
            DatasetFormat::Alpaca => self.alpaca(&obj, rec.line, &text, &mut msgs)?,
            DatasetFormat::Sharegpt => self.sharegpt(&obj, rec.line, &mut msgs)?,
            DatasetFormat::Tokenized => unreachable!("tokenized files are not text records"),
        }
        Ok(msgs)
    }

    fn alpaca(
        &self,
        obj: &serde_json::Map<String, Value>,
        line: usize,
        text: &dyn Fn(&str, bool) -> FieldText,
        msgs: &mut Vec<Message>,
    ) -> std::result::Result<(), BadRecord> {
        let c = &self.columns;
        let prompt = text(&c.prompt, true)?.unwrap_or_default();
        let query = match &c.query {
            Some(col) => text(col, false)?.unwrap_or_default(),
            None => String::new(),
        };
        let response = text(&c.response, true)?.unwrap_or_default();
        if let Some(col) = &c.history {
            match obj.get(col) {
                None | Some(Value::Null) => {}
                Some(Value::Array(turns)) => {
                    for (i, t) in turns.iter().enumerate() {
                        let pair = t.as_array().filter(|p| p.len() == 2);
                        let strs = pair.and_then(|p| Some((p[0].as_str()?, p[1].as_str()?)));
                        let Some((q, a)) = strs else {
                            return Err(BadRecord::new(
                                line,
                                &format!("{col}[{i}]"),
                                "expected a [prompt, response] pair of strings",
                            ));
                        };
                        push_turn(msgs, q.into(), a.into());
                    }
                }
                Some(other) => {
                    return Err(BadRecord::new(
                        line,
                        col,
                        format!("expected a list of pairs, found {}", kind(other)),
                    ));
                }
            }
        }
        let user: Vec<&str> = [prompt.as_str(), query.as_str()]
            .into_iter()
            .filter(|s| !s.is_empty())
            .collect();
        if user.is_empty() {
            return Err(BadRecord::new(line, &c.prompt, "empty prompt"));
        }
        if response.is_empty() {
            return Err(BadRecord::new(line, &c.response, "empty response"));
        }
        push_turn(msgs, user.join("\n"), response);
        Ok(())
    }

    fn sharegpt(
        &self,
        obj: &serde_json::Map<String, Value>,
        line: usize,
        msgs: &mut Vec<Message>,
    ) -> std::result::Result<(), BadRecord> {
        let col = &self.columns.messages;
        let turns = match obj.get(col) {
            None | Some(Value::Null) => return Err(BadRecord::new(line, col, "missing")),
            Some(Value::Array(t)) => t,
            Some(other) => {
                return Err(BadRecord::new(
                    line,
                    col,
                    format!("expected a list of messages, found {}", kind(other)),
                ));
            }
        };
        let t = &self.tags;
        for (i, m) in turns.iter().enumerate() {
            let field = |tag: &str| format!("{col}[{i}].{tag}");
            let get = |tag: &str| -> std::result::Result<&str, BadRecord> {
                match m.get(tag) {
                    Some(Value::String(s)) => Ok(s),
                    None | Some(Value::Null) => Err(BadRecord::new(line, &field(tag), "missing")),
                    Some(other) => Err(BadRecord::new(
                        line,
                        &field(tag),
                        format!("expected a string, found {}", kind(other)),
                    )),
                }
            };
            let role_name = get(&t.role_tag)?;
            let role = match role_name {
                r if r == t.user_tag => Role::User,
                r if r == t.assistant_tag || r == t.function_tag => Role::Assistant,
                r if r == t.observation_tag => Role::Tool,
                r if r == t.system_tag && i == 0 => Role::System,
                r => {
                    return Err(BadRecord::new(
                        line,
                        &field(&t.role_tag),
                        format!(
                            "unknown role `{r}` (expected {}, {}, {}, {}, or {} first)",
                            t.user_tag,
                            t.assistant_tag,
                            t.observation_tag,
                            t.function_tag,
                            t.system_tag
                        ),
                    ));
                }
            };
            let content = get(&t.content_tag)?.to_owned();
            if role == Role::System {
                msgs.retain(|m| m.role != Role::System);
                msgs.insert(0, Message { role, content });
            } else {
                msgs.push(Message { role, content });
            }
        }
        if !msgs.iter().any(|m| m.role == Role::Assistant) {
            let why = if turns.is_empty() {
                "empty conversation"
            } else {
                "no assistant message"
            };
            return Err(BadRecord::new(line, col, why));
        }
        Ok(())
    }
}

fn push_turn(msgs: &mut Vec<Message>, user: String, assistant: String) {
    msgs.push(Message {
        role: Role::User,
        content: user,
    });
    msgs.push(Message {
        role: Role::Assistant,
        content: assistant,
    });
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema(format: DatasetFormat) -> Schema {
        Schema {
            format,
            columns: Columns::defaults(format),
            tags: Tags::default(),
            default_system: Some("be brief".into()),
        }
    }

    fn conv(format: DatasetFormat, json: &str) -> std::result::Result<Vec<Message>, BadRecord> {
        schema(format).conversation(&RawRecord { line: 7, json })
    }

    #[test]
    fn alpaca_joins_instruction_and_input_and_adds_history() {
        let m = conv(
            DatasetFormat::Alpaca,
            r#"{"instruction": "Add", "input": "1 2", "output": "3", "history": [["hi", "hello"]]}"#,
        )
        .unwrap();
        let roles: Vec<_> = m.iter().map(|m| m.role).collect();
        use Role::*;
        assert_eq!(roles, [System, User, Assistant, User, Assistant]);
        assert_eq!(m[0].content, "be brief");
        assert_eq!(m[3].content, "Add\n1 2");
        assert_eq!(m[4].content, "3");
    }

    #[test]
    fn bad_records_name_line_and_field() {
        let e = conv(DatasetFormat::Alpaca, r#"{"instruction": "x"}"#).unwrap_err();
        assert_eq!(
            (e.line, e.field.as_str(), e.reason.as_str()),
            (7, "output", "missing")
        );
        let e = conv(
            DatasetFormat::Alpaca,
            r#"{"instruction": 3, "output": "y"}"#,
        )
        .unwrap_err();
        assert_eq!(e.field, "instruction");
        assert!(e.reason.contains("expected a string, found a number"));
        let e = conv(DatasetFormat::Sharegpt, r#"{"conversations": []}"#).unwrap_err();
        assert_eq!(e.reason, "empty conversation");
        let e = conv(
            DatasetFormat::Sharegpt,
            r#"{"conversations": [{"from": "human", "value": "a"}, {"from": "bot", "value": "b"}]}"#,
        )
        .unwrap_err();
        assert_eq!(e.field, "conversations[1].from");
    }

    #[test]
    fn sharegpt_system_message_replaces_the_default() {
        let m = conv(
            DatasetFormat::Sharegpt,
            r#"{"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}"#,
        )
        .unwrap();
        assert_eq!(m.len(), 3);
        assert_eq!((m[0].role, m[0].content.as_str()), (Role::System, "S"));
    }

    #[test]
    fn json_arrays_keep_line_numbers() {
        let text = "[\n  {\"a\": 1},\n\n  {\"a\": 2}\n]\n";
        let r = split_records(Path::new("x.json"), text).unwrap();
        assert_eq!(r.iter().map(|r| r.line).collect::<Vec<_>>(), [2, 4]);
        let r = split_records(Path::new("x.jsonl"), "{}\n\n{}\n").unwrap();
        assert_eq!(r.iter().map(|r| r.line).collect::<Vec<_>>(), [1, 3]);
    }
}
