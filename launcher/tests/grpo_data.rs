//! Text rollouts (`training.stage: grpo`) against rows computed in Python
//! (scripts/make_data_fixtures.py): a prompt given as a string (one user turn) or as chat
//! messages with a system prompt, a completion as a string or as one assistant message,
//! each line one row equal token for token and label for label to transformers'
//! `apply_chat_template` labelled on the completion alone; rewards and groups as written.

use std::path::Path;

mod common;

use common::*;
use mt::config::{DatasetSection, Stage};
use mt::data::Dataset;

#[test]
fn text_rollouts_are_rows_equal_to_transformers() {
    let dir = data_fixtures("rollouts_text.jsonl");
    let yaml = format!(
        "{{path: {}, shuffle: false}}",
        dir.join("rollouts_text.jsonl").display()
    );
    let ds: DatasetSection = serde_yaml_ng::from_str(&yaml).unwrap();
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/tiny");
    let data = Dataset::load(&ds, Stage::Grpo, &tiny, 514, 0).unwrap();
    let want = expected_rows(&dir, "rollouts_text");
    assert_eq!((data.samples, want.len()), (36, 36));
    for (i, (row, (ids, labels))) in data.rows.iter().zip(&want).enumerate() {
        assert_eq!(&row.input_ids, ids, "row {i}: input ids");
        assert_eq!(&row.labels, labels, "row {i}: labels");
    }
    let r = data.rollouts.as_ref().unwrap();
    assert_eq!(&r.rewards[..3], [1.0, -0.25, -0.5]);
    let groups: Vec<usize> = (0..36).map(|i| i / 3).collect();
    assert_eq!(r.groups, groups);
}
