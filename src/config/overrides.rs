//! `--set key.path=value` overrides of a parsed config, and the nearest valid key for an
//! unknown one.

use serde_yaml_ng::Value;

use crate::error::{Error, Result};

/// For serde's "unknown field `x`, expected one of `a`, `b`" (or "unknown variant"):
/// ", did you mean `a`?" naming the closest valid name, or nothing.
pub(super) fn did_you_mean(msg: &str) -> String {
    let quoted: Vec<&str> = msg.split('`').skip(1).step_by(2).collect();
    let Some((unknown, valid)) = quoted.split_first() else {
        return String::new();
    };
    valid
        .iter()
        .map(|v| (edit_distance(unknown, v), v))
        .filter(|(d, v)| *d <= v.len().max(unknown.len()) / 2 + 1)
        .min()
        .map(|(_, v)| format!(" (did you mean `{v}`?)"))
        .unwrap_or_default()
}

/// Levenshtein distance over chars.
pub(super) fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diag = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let next = (diag + usize::from(ca != cb))
                .min(row[j] + 1)
                .min(row[j + 1] + 1);
            diag = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

/// Applies one `key.path=value` override; the value is parsed as YAML (so `3`, `1e-4`,
/// `true`, `[1, 2]` get their natural types) and intermediate maps are created as needed.
pub fn apply_override(root: &mut Value, spec: &str) -> Result<()> {
    let (key, raw) = spec.split_once('=').ok_or_else(|| {
        Error::invalid(
            spec,
            "--set expects key.path=value (e.g. training.num_steps=3)",
        )
    })?;
    let key = key.trim();
    if key.is_empty() || key.split('.').any(str::is_empty) {
        return Err(Error::invalid(key, "--set key must be a dotted path"));
    }
    let value: Value = serde_yaml_ng::from_str(raw)
        .map_err(|e| Error::invalid(key, format!("--set value `{raw}` is not valid YAML: {e}")))?;
    let mut node = root;
    for part in key.split('.') {
        if node.is_null() {
            *node = Value::Mapping(Default::default());
        }
        let map = node.as_mapping_mut().ok_or_else(|| {
            Error::invalid(
                key,
                format!("cannot set `{part}`: its parent is not a mapping"),
            )
        })?;
        node = map
            .entry(Value::String(part.to_owned()))
            .or_insert(Value::Null);
    }
    *node = value;
    Ok(())
}
