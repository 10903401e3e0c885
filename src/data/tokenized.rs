//! The tokenized format: JSONL, one object per line with `input_ids` and optional `labels`
//! (aligned with `input_ids`, -100 = ignored; absent = `input_ids`); preference pairs hold
//! two such rows ([`super::pairs`]).

use serde::Deserialize;

use super::records::{BadRecord, RawRecord};
use super::{Example, IGNORE_INDEX};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenizedRow {
    input_ids: Vec<i64>,
    #[serde(default)]
    labels: Option<Vec<i64>>,
    #[serde(default, rename = "attention_mask")]
    _attention_mask: Option<serde_json::Value>,
}

/// One record; every id must be in `0..vocab`, every label too or -100.
pub fn example(rec: &RawRecord, vocab: usize) -> Result<Example, BadRecord> {
    let row: TokenizedRow = serde_json::from_str(rec.json)
        .map_err(|e| BadRecord::new(rec.line, "", format!("not a tokenized record: {e}")))?;
    from_ids(row.input_ids, row.labels, vocab)
        .map_err(|(field, why)| BadRecord::new(rec.line, field, why))
}

/// A row of `ids` and `labels` (absent: the ids), checked; an error names the field
/// (`input_ids` or `labels`) and why.
pub fn from_ids(
    ids: Vec<i64>,
    labels: Option<Vec<i64>>,
    vocab: usize,
) -> Result<Example, (&'static str, String)> {
    if ids.is_empty() {
        return Err(("input_ids", "empty".into()));
    }
    let ids = check_ids(&ids, vocab, false).map_err(|m| ("input_ids", m))?;
    let labels = match labels {
        None => ids.clone(),
        Some(l) if l.len() != ids.len() => {
            return Err((
                "labels",
                format!("has {} entries, `input_ids` has {}", l.len(), ids.len()),
            ));
        }
        Some(l) => check_ids(&l, vocab, true).map_err(|m| ("labels", m))?,
    };
    Ok(Example {
        input_ids: ids,
        labels,
        position_ids: Vec::new(),
        images: Vec::new(),
    })
}

fn check_ids(v: &[i64], vocab: usize, allow_ignore: bool) -> Result<Vec<i32>, String> {
    v.iter()
        .enumerate()
        .map(|(j, &x)| {
            if (0..vocab as i64).contains(&x) || (allow_ignore && x == IGNORE_INDEX as i64) {
                Ok(x as i32)
            } else {
                Err(format!(
                    "entry {j} is {x}, outside the vocabulary 0..{vocab}"
                ))
            }
        })
        .collect()
}
