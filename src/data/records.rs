//! Text records (alpaca, sharegpt) read from JSON or JSONL files and turned into
//! conversations (or, for `training.stage: pt`, documents), following LlamaFactory's
//! conventions; a record that cannot become one is a `BadRecord` naming its line and field.
//!
//! Multimodal records (LlamaFactory's `images` column, registered in `columns`): a list of
//! image paths (or one path), each relative to the dataset directory when a file is there
//! (else as written), and one `<image>` placeholder in the messages per image, in order.
//! Each image's size is read from its header ([`super::image`]) when the record is read,
//! so a missing, unreadable or non-image file is the record's error (`images[i]`), as is a
//! count of placeholders other than the count of images (`images`).

use std::path::{Path, PathBuf};

use serde_json::Value;
use serde_json::value::RawValue;

use super::registry::{Columns, Tags};
use super::tools::{self, CallIds, ToolCall};
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
    /// An assistant turn's tool calls (sharegpt `function_call`).
    pub tool_calls: Vec<ToolCall>,
    /// The call a `tool` message answers.
    pub tool_call_id: Option<String>,
}

impl Message {
    pub fn new(role: Role, content: impl Into<String>) -> Message {
        Message {
            role,
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
}

/// A record as the chat template sees it: the messages and the tools it may call.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Conversation {
    pub messages: Vec<Message>,
    /// The `tools` column, as `apply_chat_template(tools=...)` takes it; None without.
    pub tools: Option<minijinja::Value>,
    /// The `images` column: one image per `<image>` placeholder of the messages, in order;
    /// empty for a text record.
    pub images: Vec<Image>,
}

/// An image of a record: its file and its size read from the header.
#[derive(Debug, Clone, PartialEq)]
pub struct Image {
    pub path: PathBuf,
    pub size: super::image::ImageSize,
}

/// A string field of a record: absent (None) or the bad record it makes.
type FieldText = std::result::Result<Option<String>, BadRecord>;

/// Why one record was left out: its 1-based line and the field at fault.
#[derive(Debug, Clone, PartialEq)]
pub struct BadRecord {
    pub line: usize,
    pub field: String,
    pub reason: String,
    /// The chat template went past its bounds on this record: the load fails whatever
    /// `dataset.strict` says, as every record would ([`super::chat::RenderError::Limit`]).
    pub fatal: bool,
}

impl BadRecord {
    pub fn new(line: usize, field: &str, reason: impl Into<String>) -> BadRecord {
        BadRecord {
            line,
            field: field.into(),
            reason: reason.into(),
            fatal: false,
        }
    }

    /// The bad record a failed render makes; fatal past the template's bounds.
    pub fn render(line: usize, field: &str, e: super::chat::RenderError) -> BadRecord {
        let fatal = matches!(e, super::chat::RenderError::Limit(_));
        BadRecord {
            fatal,
            ..BadRecord::new(line, field, e.message())
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
    /// Where relative image paths are looked up first (LlamaFactory's `dataset_dir`).
    pub media_dir: PathBuf,
}

impl Schema {
    /// The record's conversation: an optional system prompt and the turns in order, and
    /// its tools.
    pub fn conversation(&self, rec: &RawRecord) -> std::result::Result<Conversation, BadRecord> {
        let (conv, _) = self.read(rec, true)?;
        Ok(conv)
    }

    /// The record's conversation up to its answers (with `answered`, to its last one: an
    /// alpaca record's `response`, a sharegpt record's assistant turns, which it must
    /// have), and the call ids its tool calls took (for a ranking record's answers).
    pub(super) fn read(
        &self,
        rec: &RawRecord,
        answered: bool,
    ) -> std::result::Result<(Conversation, CallIds), BadRecord> {
        let obj = object(rec)?;
        let text = |col: &str, required: bool| field_text(&obj, col, required, rec.line);
        let system = match &self.columns.system {
            Some(col) => text(col, false)?,
            None => None,
        }
        .filter(|s| !s.is_empty())
        .or_else(|| self.default_system.clone());
        let mut msgs: Vec<Message> = system
            .map(|content| Message::new(Role::System, content))
            .into_iter()
            .collect();
        let ids = match self.format {
            DatasetFormat::Alpaca => {
                self.alpaca(&obj, rec.line, &text, &mut msgs, answered)?;
                CallIds::default()
            }
            DatasetFormat::Sharegpt => {
                let ids = self.sharegpt(&obj, rec.line, &mut msgs)?;
                if answered && !msgs.iter().any(|m| m.role == Role::Assistant) {
                    let empty = matches!(obj.get(&self.columns.messages), Some(Value::Array(t)) if t.is_empty());
                    let why = match empty {
                        true => "empty conversation",
                        false => "no assistant message",
                    };
                    return Err(BadRecord::new(rec.line, &self.columns.messages, why));
                }
                ids
            }
            DatasetFormat::Tokenized => unreachable!("tokenized files are not text records"),
        };
        let tools = match &self.columns.tools {
            Some(col) if obj.contains_key(col) => {
                tools::tools(&raw_field(rec, col)?, rec.line, col)?
            }
            _ => None,
        };
        let images = match &self.columns.images {
            Some(col) => self.images(&obj, col, rec.line, &msgs)?,
            None => Vec::new(),
        };
        let conv = Conversation {
            messages: msgs,
            tools,
            images,
        };
        Ok((conv, ids))
    }

    /// A `pt` record's document: the `prompt` column, and the `query` column after a
    /// newline when it has one (LlamaFactory's first user turn of an alpaca record).
    pub fn document(&self, rec: &RawRecord) -> std::result::Result<String, BadRecord> {
        let obj = object(rec)?;
        let c = &self.columns;
        let prompt = field_text(&obj, &c.prompt, true, rec.line).map_err(|mut e| {
            if e.reason == "missing" {
                e.reason = "missing: training.stage: pt reads each document from the `prompt` column (`columns: {prompt: text}` in dataset_info.json, `text` for dataset.path)".into();
            }
            e
        })?;
        let query = match &c.query {
            Some(col) => field_text(&obj, col, false, rec.line)?,
            None => None,
        };
        let parts: Vec<String> = [prompt, query]
            .into_iter()
            .flatten()
            .filter(|s| !s.is_empty())
            .collect();
        if parts.is_empty() {
            return Err(BadRecord::new(rec.line, &c.prompt, "empty document"));
        }
        Ok(parts.join("\n"))
    }

    fn alpaca(
        &self,
        obj: &serde_json::Map<String, Value>,
        line: usize,
        text: &dyn Fn(&str, bool) -> FieldText,
        msgs: &mut Vec<Message>,
        answered: bool,
    ) -> std::result::Result<(), BadRecord> {
        let c = &self.columns;
        let prompt = text(&c.prompt, true)?.unwrap_or_default();
        let query = match &c.query {
            Some(col) => text(col, false)?.unwrap_or_default(),
            None => String::new(),
        };
        let response = match answered {
            true => text(&c.response, true)?.unwrap_or_default(),
            false => String::new(),
        };
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
        if !answered {
            msgs.push(Message::new(Role::User, user.join("\n")));
            return Ok(());
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
    ) -> std::result::Result<CallIds, BadRecord> {
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
        let mut ids = CallIds::default();
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
            let mut msg = Message::new(role, content);
            if role_name == t.function_tag {
                msg.tool_calls = ids.calls(&msg.content, line, &field(&t.content_tag))?;
                msg.content.clear();
            } else if role == Role::Tool {
                msg.tool_call_id = ids.answer();
            }
            if role == Role::System {
                msgs.retain(|m| m.role != Role::System);
                msgs.insert(0, msg);
            } else {
                msgs.push(msg);
            }
        }
        Ok(ids)
    }
}

impl Schema {
    /// The record's images (column `col`), each found and its size read, as many as the
    /// `<image>` placeholders of `msgs`.
    fn images(
        &self,
        obj: &serde_json::Map<String, Value>,
        col: &str,
        line: usize,
        msgs: &[Message],
    ) -> std::result::Result<Vec<Image>, BadRecord> {
        let paths: Vec<(String, &Value)> = match obj.get(col) {
            None | Some(Value::Null) => Vec::new(),
            Some(v @ Value::String(_)) => vec![(col.to_owned(), v)],
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(i, v)| (format!("{col}[{i}]"), v))
                .collect(),
            Some(other) => {
                return Err(BadRecord::new(
                    line,
                    col,
                    format!("expected a list of image paths, found {}", kind(other)),
                ));
            }
        };
        let mut images = Vec::with_capacity(paths.len());
        for (field, v) in paths {
            let Value::String(p) = v else {
                return Err(BadRecord::new(
                    line,
                    &field,
                    format!("expected an image path, found {}", kind(v)),
                ));
            };
            // LlamaFactory: joined to dataset_dir when that is a file, else as written.
            let joined = self.media_dir.join(p);
            let path = match joined.is_file() {
                true => joined,
                false => PathBuf::from(p),
            };
            if !path.exists() {
                return Err(BadRecord::new(
                    line,
                    &field,
                    format!(
                        "image `{p}` not found (in {} nor as written)",
                        self.media_dir.display()
                    ),
                ));
            }
            let size = super::image::read_size(&path)
                .map_err(|e| BadRecord::new(line, &field, format!("`{p}`: {e}")))?;
            images.push(Image { path, size });
        }
        let tags: usize = msgs
            .iter()
            .map(|m| super::qwen_vl::placeholders(&m.content))
            .sum();
        if tags != images.len() {
            return Err(BadRecord::new(
                line,
                col,
                format!(
                    "{} images, but {tags} `{}` placeholders in the messages (one per image, in order)",
                    images.len(),
                    super::qwen_vl::IMAGE_PLACEHOLDER
                ),
            ));
        }
        Ok(images)
    }
}

fn push_turn(msgs: &mut Vec<Message>, user: String, assistant: String) {
    msgs.push(Message::new(Role::User, user));
    msgs.push(Message::new(Role::Assistant, assistant));
}

/// The record as a JSON object.
pub(super) fn object(
    rec: &RawRecord,
) -> std::result::Result<serde_json::Map<String, Value>, BadRecord> {
    match serde_json::from_str(rec.json) {
        Ok(Value::Object(obj)) => Ok(obj),
        Ok(_) => Err(BadRecord::new(rec.line, "", "not a JSON object")),
        Err(e) => Err(BadRecord::new(
            rec.line,
            "",
            format!("not a JSON object: {e}"),
        )),
    }
}

/// A string field: absent or null (an error when `required`), or its text.
pub(super) fn field_text(
    obj: &serde_json::Map<String, Value>,
    col: &str,
    required: bool,
    line: usize,
) -> FieldText {
    match obj.get(col) {
        None | Some(Value::Null) if required => Err(BadRecord::new(line, col, "missing")),
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(BadRecord::new(
            line,
            col,
            format!("expected a string, found {}", kind(other)),
        )),
    }
}

/// A field's JSON text as written (serde_json's map would sort its keys).
pub(super) fn raw_field(
    rec: &RawRecord,
    col: &str,
) -> std::result::Result<Box<RawValue>, BadRecord> {
    let mut fields: std::collections::HashMap<String, Box<RawValue>> =
        serde_json::from_str(rec.json)
            .map_err(|e| BadRecord::new(rec.line, "", format!("not a JSON object: {e}")))?;
    fields
        .remove(col)
        .ok_or_else(|| BadRecord::new(rec.line, col, "missing"))
}

pub(super) fn kind(v: &Value) -> &'static str {
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
            media_dir: PathBuf::from("/nonexistent"),
        }
    }

    fn conv(format: DatasetFormat, json: &str) -> std::result::Result<Vec<Message>, BadRecord> {
        schema(format)
            .conversation(&RawRecord { line: 7, json })
            .map(|c| c.messages)
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

    #[test]
    fn function_calls_and_observations_become_tool_messages() {
        let m = conv(
            DatasetFormat::Sharegpt,
            r#"{"conversations": [{"from": "human", "value": "tip?"}, {"from": "function_call", "value": "{\"name\": \"tip\", \"arguments\": {\"bill\": 10}}"}, {"from": "observation", "value": "{\"tip\": 2}"}, {"from": "gpt", "value": "2"}]}"#,
        )
        .unwrap();
        let roles: Vec<_> = m.iter().map(|m| m.role).collect();
        use Role::*;
        assert_eq!(roles, [System, User, Assistant, Tool, Assistant]);
        assert_eq!((m[2].content.as_str(), m[2].tool_calls.len()), ("", 1));
        assert_eq!(m[2].tool_calls[0].name, "tip");
        assert_eq!(m[3].tool_call_id.as_deref(), Some("call00000"));
        let e = conv(
            DatasetFormat::Sharegpt,
            r#"{"conversations": [{"from": "human", "value": "a"}, {"from": "function_call", "value": "not json"}]}"#,
        )
        .unwrap_err();
        assert_eq!((e.line, e.field.as_str()), (7, "conversations[1].value"));
    }

    #[test]
    fn pt_documents_join_prompt_and_query() {
        let s = schema(DatasetFormat::Alpaca);
        let doc = |json| s.document(&RawRecord { line: 3, json });
        assert_eq!(
            doc(r#"{"instruction": "a", "input": "b"}"#).unwrap(),
            "a\nb"
        );
        let e = doc(r#"{"text": "a"}"#).unwrap_err();
        assert_eq!((e.line, e.field.as_str()), (3, "instruction"));
        assert!(e.reason.contains("training.stage: pt"), "{}", e.reason);
        assert_eq!(
            doc(r#"{"instruction": ""}"#).unwrap_err().reason,
            "empty document"
        );
    }
}
