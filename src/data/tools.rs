//! Tool-calling data (LlamaFactory's sharegpt `function_call` / `observation` turns and
//! `tools` column) in the form transformers' `apply_chat_template(messages, tools=...)`
//! hands to a template:
//!
//! - `tools`: a JSON list of function definitions (or a string holding one); a bare
//!   definition (`{"name", "description", "parameters"}`) is wrapped as
//!   `{"type": "function", "function": ...}`, as LlamaFactory does and templates expect.
//!   An empty list or string is no tools.
//! - a `function_call` turn: a JSON object `{"name", "arguments"}` or a list of them,
//!   becoming one assistant message with `tool_calls: [{"id", "type": "function",
//!   "function": {"name", "arguments"}}]` and empty content;
//! - an `observation` turn: a `tool` message answering the oldest unanswered call of the
//!   last tool-call turn (`tool_call_id`), or the last call when all are answered.
//!
//! Call ids are `call` + the call's 0-based number in the conversation, 5 digits
//! (`call00000`): 9 alphanumeric characters, the form Mistral's template requires;
//! other templates ignore them.
//!
//! JSON values are read into minijinja values directly, keeping key order as Python's
//! `json.loads` does (the template writes them back with `tojson`).

use std::collections::VecDeque;

use minijinja::Value;
use serde_json::value::RawValue;

use super::records::BadRecord;

/// One call of an assistant turn.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as written (an object, usually).
    pub arguments: Value,
}

/// Numbers the calls of one conversation and pairs observations with them.
#[derive(Clone, Default)]
pub struct CallIds {
    next: usize,
    pending: VecDeque<String>,
    last: Option<String>,
}

impl CallIds {
    /// The calls of a `function_call` turn's text.
    pub fn calls(
        &mut self,
        text: &str,
        line: usize,
        field: &str,
    ) -> Result<Vec<ToolCall>, BadRecord> {
        let bad = |why: String| BadRecord::new(line, field, why);
        let v: Value = serde_json::from_str(text).map_err(|e| {
            bad(format!(
                "a function_call turn holds a JSON object {{\"name\", \"arguments\"}} or a list of them: {e}"
            ))
        })?;
        let items: Vec<Value> = match v.kind() {
            minijinja::value::ValueKind::Seq => {
                v.try_iter().map_err(|e| bad(e.to_string()))?.collect()
            }
            _ => vec![v],
        };
        if items.is_empty() {
            return Err(bad(
                "a function_call turn with an empty list of calls".into()
            ));
        }
        self.pending.clear();
        items
            .iter()
            .enumerate()
            .map(|(k, call)| {
                let name = call
                    .get_attr("name")
                    .ok()
                    .and_then(|n| n.as_str().map(str::to_owned))
                    .ok_or_else(|| bad(format!("call {k} has no string `name`")))?;
                let arguments = match call.get_attr("arguments") {
                    Ok(a) if !a.is_undefined() => a,
                    _ => Value::from_pairs(Vec::<(String, Value)>::new()),
                };
                let id = format!("call{:05}", self.next);
                self.next += 1;
                self.pending.push_back(id.clone());
                self.last = Some(id.clone());
                Ok(ToolCall {
                    id,
                    name,
                    arguments,
                })
            })
            .collect()
    }

    /// The call an observation answers (None before any call).
    pub fn answer(&mut self) -> Option<String> {
        self.pending.pop_front().or_else(|| self.last.clone())
    }
}

/// The record's `tools` field: None when absent, null, empty or an empty list.
pub fn tools(raw: &RawValue, line: usize, field: &str) -> Result<Option<Value>, BadRecord> {
    let bad = |why: String| BadRecord::new(line, field, why);
    let v: Value = serde_json::from_str(raw.get()).map_err(|e| bad(e.to_string()))?;
    let v = match v.as_str() {
        Some("") => return Ok(None),
        Some(s) => serde_json::from_str(s)
            .map_err(|e| bad(format!("not a JSON list of function definitions: {e}")))?,
        None => v,
    };
    if v.is_none() {
        return Ok(None);
    }
    let list: Vec<Value> = match v.kind() {
        minijinja::value::ValueKind::Seq => v.try_iter().map_err(|e| bad(e.to_string()))?.collect(),
        minijinja::value::ValueKind::Map => vec![v],
        k => {
            return Err(bad(format!(
                "expected a list of function definitions, found {k}"
            )));
        }
    };
    if list.is_empty() {
        return Ok(None);
    }
    let wrapped = list
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            if t.kind() != minijinja::value::ValueKind::Map {
                return Err(bad(format!("tool {i} is not a JSON object")));
            }
            let typed = t
                .get_attr("type")
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned));
            Ok(match typed.as_deref() {
                Some("function") => t,
                _ => Value::from_pairs([("type", Value::from("function")), ("function", t)]),
            })
        })
        .collect::<Result<Vec<Value>, BadRecord>>()?;
    Ok(Some(Value::from(wrapped)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_are_numbered_and_observations_paired() {
        let mut ids = CallIds::default();
        let one = ids
            .calls(r#"{"name": "f", "arguments": {"b": 1, "a": 2}}"#, 3, "c")
            .unwrap();
        assert_eq!(
            (one[0].id.as_str(), one[0].name.as_str()),
            ("call00000", "f")
        );
        assert_eq!(
            one[0].arguments.to_string(),
            "{'b': 1, 'a': 2}",
            "key order kept"
        );
        let two = ids
            .calls(r#"[{"name": "g", "arguments": {}}, {"name": "h"}]"#, 3, "c")
            .unwrap();
        assert_eq!(two.len(), 2);
        assert_eq!(ids.answer().as_deref(), Some("call00001"));
        assert_eq!(ids.answer().as_deref(), Some("call00002"));
        assert_eq!(ids.answer().as_deref(), Some("call00002"));
        let e = ids
            .calls("{\"name\": ", 9, "conversations[1].value")
            .unwrap_err();
        assert_eq!((e.line, e.field.as_str()), (9, "conversations[1].value"));
        assert!(e.reason.contains("JSON object"), "{}", e.reason);
        let e = ids.calls(r#"{"arguments": {}}"#, 9, "x").unwrap_err();
        assert!(e.reason.contains("no string `name`"), "{}", e.reason);
    }

    #[test]
    fn bare_definitions_are_wrapped() {
        let raw = |s: &str| RawValue::from_string(s.to_owned()).unwrap();
        let t = tools(
            &raw(r#""[{\"name\": \"f\", \"parameters\": {}}]""#),
            1,
            "tools",
        )
        .unwrap()
        .unwrap();
        let first = t.get_item(&Value::from(0)).unwrap();
        assert_eq!(first.get_attr("type").unwrap().as_str(), Some("function"));
        assert_eq!(
            first
                .get_attr("function")
                .unwrap()
                .get_attr("name")
                .unwrap()
                .as_str(),
            Some("f")
        );
        assert!(tools(&raw(r#""""#), 1, "tools").unwrap().is_none());
        assert!(tools(&raw("[]"), 1, "tools").unwrap().is_none());
        assert!(tools(&raw("\"[oops\""), 1, "tools").is_err());
    }
}
