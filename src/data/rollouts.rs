//! Rollouts (`training.stage: grpo`): a JSONL file any generator writes, one completion a
//! line, with its reward and the group of completions sampled for the same prompt:
//!
//! ```json
//! {"prompt": "What is 2 + 3?", "completion": "5", "reward": 1.0, "group": 0}
//! {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "completion": [{"role": "assistant", "content": "6"}], "reward": 0.0, "group": 0}
//! {"prompt_ids": [1, 17, 4], "completion_ids": [9, 2], "reward": 0.5, "group": "q7"}
//! ```
//!
//! - `prompt`: the user's text, or chat messages (`role`, `content`; TRL's conversational
//!   form); `completion`: the answer's text, or a list holding one assistant message. Text
//!   is rendered with the model's chat template as SFT rows are
//!   ([`super::ChatTokenizer::answer_example`]): the row is the prompt with the generation
//!   prompt, then the answer, labelled on the answer alone.
//! - `prompt_ids` and `completion_ids`: the tokens as generated (the row is their
//!   concatenation, labelled on the completion's).
//! - `reward`: a finite number; `group`: a string or an integer, the same for the
//!   completions of one prompt, each group two completions or more (its advantages are
//!   relative to its own mean).
//!
//! Each line is one row, in file order; a bad line is an error naming the file, the line
//! and the key (never skipped: it would change its group's advantages).
//! `dataset.max_seq_len` does not cut rollouts (a completion is scored whole).

use std::collections::HashMap;
use std::path::Path;

use serde_json::{Map, Value};

use super::{ChatTokenizer, Conversation, Example, IGNORE_INDEX, Message, Role};
use crate::error::{Error, Result};

/// The rollouts read with their rows (one per line): rewards and groups.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Rollouts {
    pub rewards: Vec<f64>,
    /// Each row's group, numbered 0.. in order of first appearance.
    pub groups: Vec<usize>,
}

impl Rollouts {
    /// (kept, held) by `held` (one flag per row, whole groups), each renumbering its
    /// groups 0.. in order of first appearance.
    pub fn split(&self, held: &[bool]) -> (Rollouts, Rollouts) {
        assert_eq!(held.len(), self.rewards.len());
        let part = |want: bool| {
            let mut out = Rollouts::default();
            let mut ids: HashMap<usize, usize> = HashMap::new();
            for ((&r, &g), _) in self
                .rewards
                .iter()
                .zip(&self.groups)
                .zip(held)
                .filter(|(_, h)| **h == want)
            {
                let next = ids.len();
                out.rewards.push(r);
                out.groups.push(*ids.entry(g).or_insert(next));
            }
            out
        };
        (part(false), part(true))
    }
}

/// A line's prompt and completion, before tokenizing.
enum Sample {
    Text(Conversation),
    Ids(Vec<i32>, Vec<i32>),
}

/// Reads a rollouts file: its rows and their rewards and groups, text rendered with the
/// model's chat template or `template` (`dataset.chat_template`), and the line saying
/// which when the latter.
pub fn read(
    path: &Path,
    model_dir: &Path,
    template: Option<&Path>,
    vocab: usize,
) -> Result<(Vec<Example>, Rollouts, Option<String>)> {
    let text =
        crate::bounded::read_text(path, crate::bounded::data_bound(), super::files::DATA_FILE)?;
    let bad = |line: usize, key: &str, msg: String| Error::Dataset {
        path: path.to_path_buf(),
        line,
        msg: match key {
            "" => msg,
            _ => format!("`{key}`: {msg}"),
        },
    };
    let mut samples = Vec::new();
    let mut out = Rollouts::default();
    let mut group_ids: HashMap<String, usize> = HashMap::new();
    let mut group_lines: Vec<(usize, usize)> = Vec::new(); // (first line, count)
    for (i, raw) in text.lines().enumerate() {
        crate::cancel::check(crate::cancel::DATA)?;
        let line = i + 1;
        if raw.trim().is_empty() {
            continue;
        }
        let obj: Map<String, Value> = match serde_json::from_str(raw) {
            Ok(Value::Object(o)) => o,
            Ok(_) => return Err(bad(line, "", "not a JSON object".into())),
            Err(e) => return Err(bad(line, "", format!("not JSON: {e}"))),
        };
        let reward = match obj.get("reward") {
            None | Some(Value::Null) => {
                return Err(bad(
                    line,
                    "reward",
                    "missing (every rollout needs its scalar reward)".into(),
                ));
            }
            Some(v) => match v.as_f64() {
                Some(r) if r.is_finite() => r,
                _ => return Err(bad(line, "reward", format!("not a finite number: {v}"))),
            },
        };
        let group = match obj.get("group") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Number(n)) if n.is_i64() || n.is_u64() => n.to_string(),
            None | Some(Value::Null) => {
                return Err(bad(
                    line,
                    "group",
                    "missing (the id shared by the completions of one prompt)".into(),
                ));
            }
            Some(v) => return Err(bad(line, "group", format!("not a string or integer: {v}"))),
        };
        let next = group_ids.len();
        let g = *group_ids.entry(group).or_insert(next);
        if g == group_lines.len() {
            group_lines.push((line, 0));
        }
        group_lines[g].1 += 1;
        samples.push((line, sample(&obj).map_err(|(k, m)| bad(line, k, m))?));
        out.rewards.push(reward);
        out.groups.push(g);
    }
    if samples.is_empty() {
        return Err(Error::DatasetFile {
            path: path.to_path_buf(),
            msg: "no rollouts (the file holds none)".into(),
        });
    }
    if let Some((name, (line, _))) = group_ids
        .iter()
        .map(|(name, &g)| (name, group_lines[g]))
        .filter(|(_, (_, n))| *n < 2)
        .min_by_key(|(_, (line, _))| *line)
    {
        return Err(bad(
            line,
            "group",
            format!(
                "group {name} has one completion: GRPO's advantages are relative to the other completions of the same prompt, so each group needs two or more"
            ),
        ));
    }
    let chat = match samples.iter().any(|(_, s)| matches!(s, Sample::Text(_))) {
        true => Some(ChatTokenizer::load(model_dir, template, true)?),
        false => None,
    };
    let rows = samples
        .into_iter()
        .map(|(line, s)| {
            let ex = match (s, &chat) {
                (Sample::Text(conv), Some(chat)) => chat
                    .answer_example(&conv)
                    .map_err(|e| bad(line, "completion", e.to_string()))?,
                (Sample::Ids(prompt, completion), _) => Example {
                    labels: std::iter::repeat_n(IGNORE_INDEX, prompt.len())
                        .chain(completion.iter().copied())
                        .collect(),
                    input_ids: [prompt, completion].concat(),
                    position_ids: Vec::new(),
                    images: Vec::new(),
                },
                (Sample::Text(_), None) => unreachable!("a tokenizer is loaded for text"),
            };
            match ex
                .input_ids
                .iter()
                .find(|&&id| id < 0 || id as usize >= vocab)
            {
                Some(id) => Err(bad(
                    line,
                    "",
                    format!("token id {id} is outside the model's vocabulary 0..{vocab}"),
                )),
                None if ex.label_tokens() == 0 => Err(bad(
                    line,
                    "completion",
                    "empty: no completion token to train on".into(),
                )),
                None => Ok(ex),
            }
        })
        .collect::<Result<Vec<_>>>()?;
    let note = chat.as_ref().and_then(ChatTokenizer::note);
    Ok((rows, out, note))
}

/// A line's prompt and completion, or the key at fault and why.
fn sample(obj: &Map<String, Value>) -> std::result::Result<Sample, (&'static str, String)> {
    let ids = |key: &'static str| -> std::result::Result<Vec<i32>, (&'static str, String)> {
        let list = obj.get(key).and_then(Value::as_array);
        list.and_then(|l| {
            l.iter()
                .map(|v| v.as_i64().and_then(|x| i32::try_from(x).ok()))
                .collect::<Option<Vec<i32>>>()
        })
        .ok_or((key, "not a list of token ids".into()))
    };
    if obj.contains_key("prompt_ids") || obj.contains_key("completion_ids") {
        return Ok(Sample::Ids(ids("prompt_ids")?, ids("completion_ids")?));
    }
    let mut conv = Conversation {
        messages: match obj.get("prompt") {
            Some(Value::String(s)) => vec![Message::new(Role::User, s.clone())],
            Some(Value::Array(m)) => messages(m).map_err(|e| ("prompt", e))?,
            None | Some(Value::Null) => {
                return Err((
                    "prompt",
                    "missing (give `prompt` and `completion`, or `prompt_ids` and `completion_ids`)"
                        .into(),
                ));
            }
            Some(_) => return Err(("prompt", "not a string or a list of messages".into())),
        },
        tools: None,
        images: Vec::new(),
    };
    let answer = match obj.get("completion") {
        Some(Value::String(s)) => Message::new(Role::Assistant, s.clone()),
        Some(Value::Array(m)) => match messages(m).map_err(|e| ("completion", e))?.as_slice() {
            [m] if m.role == Role::Assistant => m.clone(),
            _ => return Err(("completion", "not one assistant message".into())),
        },
        None | Some(Value::Null) => return Err(("completion", "missing".into())),
        Some(_) => return Err(("completion", "not a string or a list of messages".into())),
    };
    if conv
        .messages
        .last()
        .is_none_or(|m| m.role == Role::Assistant)
    {
        return Err(("prompt", "does not end with a user turn".into()));
    }
    conv.messages.push(answer);
    Ok(Sample::Text(conv))
}

/// Chat messages (`role`, `content` strings).
fn messages(list: &[Value]) -> std::result::Result<Vec<Message>, String> {
    list.iter()
        .map(|m| {
            let field = |k: &str| m.get(k).and_then(Value::as_str);
            let role = match field("role") {
                Some("system") => Role::System,
                Some("user") => Role::User,
                Some("assistant") => Role::Assistant,
                Some("tool") => Role::Tool,
                other => {
                    return Err(format!(
                        "a message's role is {other:?}, not system, user, assistant or tool"
                    ));
                }
            };
            let content = field("content").ok_or("a message without a string `content`")?;
            Ok(Message::new(role, content))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_renumbers_each_part_s_groups() {
        let r = Rollouts {
            rewards: vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
            groups: vec![0, 0, 1, 1, 2, 2],
        };
        let (kept, held) = r.split(&[false, false, true, true, false, false]);
        assert_eq!(
            (kept.rewards, kept.groups),
            (vec![1.0, 2.0, 5.0, 6.0], vec![0, 0, 1, 1])
        );
        assert_eq!((held.rewards, held.groups), (vec![3.0, 4.0], vec![0, 0]));
    }

    fn read_text(text: &str) -> Result<(Vec<Example>, Rollouts)> {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("mt-rollouts-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("r.jsonl");
        std::fs::write(&p, text).unwrap();
        read(&p, &dir, None, 100).map(|(rows, r, _)| (rows, r))
    }

    #[test]
    fn token_rollouts_are_rows_labelled_on_the_completion() {
        let (rows, r) = read_text(
            "{\"prompt_ids\": [1, 2], \"completion_ids\": [3], \"reward\": 1, \"group\": \"a\"}\n\n\
             {\"prompt_ids\": [1], \"completion_ids\": [4, 5], \"reward\": 0.5, \"group\": 7}\n\
             {\"prompt_ids\": [1, 2], \"completion_ids\": [6], \"reward\": 0, \"group\": \"a\"}\n\
             {\"prompt_ids\": [1], \"completion_ids\": [7], \"reward\": 2, \"group\": 7}\n",
        )
        .unwrap();
        assert_eq!(rows[0].input_ids, [1, 2, 3]);
        assert_eq!(rows[0].labels, [-100, -100, 3]);
        assert_eq!(rows[1].labels, [-100, 4, 5]);
        assert_eq!(r.rewards, [1.0, 0.5, 0.0, 2.0]);
        assert_eq!(r.groups, [0, 1, 0, 1]);
    }

    #[test]
    fn bad_lines_name_file_line_and_key() {
        let ok = "{\"prompt_ids\": [1], \"completion_ids\": [3], \"reward\": 1, \"group\": 0}\n";
        for (text, want) in [
            (
                format!("{ok}{{\"prompt_ids\": [1], \"completion_ids\": [3], \"group\": 0}}\n"),
                "line 2: `reward`: missing",
            ),
            (
                format!(
                    "{ok}{ok}{{\"prompt_ids\": [1], \"completion_ids\": [3], \"reward\": 1, \"group\": 9}}\n"
                ),
                "line 3: `group`: group 9 has one completion",
            ),
            (
                format!(
                    "{ok}{{\"prompt_ids\": [1], \"completion_ids\": [300], \"reward\": 1, \"group\": 0}}\n"
                ),
                "line 2: token id 300 is outside",
            ),
            (
                format!("{ok}{{\"completion\": \"x\", \"reward\": 1, \"group\": 0}}\n"),
                "line 2: `prompt`: missing",
            ),
            (
                format!("{ok}{{\"reward\": \"high\"}}\n"),
                "line 2: `reward`: not a finite",
            ),
            (format!("{ok}[1]\n"), "line 2: not a JSON object"),
        ] {
            let e = read_text(&text).unwrap_err().to_string();
            assert!(e.contains("r.jsonl") && e.contains(want), "{want}: {e}");
        }
    }
}
