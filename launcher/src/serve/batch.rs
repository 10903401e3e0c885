//! A client's batch (docs/serve.md, "Batches") checked and cut as a run cuts its global
//! batch: every row checked against the model and the workers' sizing before anything is
//! sent (an error names the key, the row and what was expected), then split over the
//! workers in contiguous slices and each slice into equal micro-batches of at most the
//! configured rows.

use anyhow::{Result, bail};
use mt::config::GrpoParams;
use mt::data::{
    Dataset, Example, IGNORE_INDEX, RolloutTerms, Rollouts, StepPlan, plan_pairs, plan_rollouts,
    plan_step,
};
use mt::objective::Objective;
use serde_json::Value;

/// What a batch is checked against.
pub struct Limits {
    pub vocab: usize,
    pub max_seq_len: usize,
    pub world: usize,
    /// Rows per micro-batch the workers were sized for.
    pub rows_per_micro: usize,
    pub pad: i32,
    /// A vision-language model's processor and the id of its image tokens, which a row's
    /// `images` are read and checked with; None: the model reads no images.
    pub images: Option<(mt::data::ImageProcessor, i64)>,
}

/// The keys of a row (`rows`), a pair (`pairs`) and a rollout (`rollouts`).
const ROW_KEYS: &[&str] = &["input_ids", "labels", "images"];
const PAIR_KEYS: &[&str] = &[
    "chosen_input_ids",
    "chosen_labels",
    "rejected_input_ids",
    "rejected_labels",
    "ref_chosen_logps",
    "ref_rejected_logps",
    "images",
];
const ROLLOUT_KEYS: &[&str] = &[
    "prompt_ids",
    "completion_ids",
    "reward",
    "group",
    "advantage",
    "old_logps",
    "ref_logps",
    "images",
];

/// Refuses a key of the object `v` (at `at`) that is not one of `keys`: a misspelt key
/// (`label` for `labels`) would otherwise be ignored, and the row trained otherwise.
pub fn known_keys(v: &Value, at: &str, keys: &[&str]) -> Result<()> {
    let Some(map) = v.as_object() else {
        bail!("{at} must be an object ({})", keys.join(", "));
    };
    match map.keys().find(|k| !keys.contains(&k.as_str())) {
        Some(k) => bail!("{at}: unknown key `{k}` (it takes {})", keys.join(", ")),
        None => Ok(()),
    }
}

/// A batch ready for the workers: its plan and the micro-batches each worker runs.
pub struct Batch {
    pub plan: StepPlan,
    pub accum: usize,
}

/// `train_step`'s batch under `objective`.
pub fn train(req: &Value, objective: Objective, limits: &Limits) -> Result<Batch> {
    let (key, wrong) = match objective {
        Objective::Lm => ("rows", ["pairs", "rollouts"]),
        Objective::Dpo(_) => ("pairs", ["rows", "rollouts"]),
        Objective::Grpo(_) => ("rollouts", ["rows", "pairs"]),
    };
    if let Some(other) = wrong.iter().find(|k| req.get(**k).is_some()) {
        bail!(
            "train_step: `{other}` given to a server whose training.stage takes `{key}` ({})",
            stage_name(objective)
        );
    }
    let items = list(req, key, "train_step")?;
    match objective {
        Objective::Lm => {
            let rows = items
                .iter()
                .enumerate()
                .map(|(i, v)| lm_row(v, &format!("rows[{i}]"), limits))
                .collect::<Result<Vec<_>>>()?;
            let ds = dataset(rows, false, None);
            let accum = split(ds.rows.len(), limits.rows_per_micro, limits, "rows")?;
            let order: Vec<usize> = (0..ds.rows.len()).collect();
            let plan = plan_step(&ds, &order, limits.world, accum, limits.pad);
            nonempty(&plan)?;
            Ok(Batch { plan, accum })
        }
        Objective::Dpo(_) => {
            let (mut rows, mut refs) = (Vec::new(), Vec::new());
            for (i, v) in items.iter().enumerate() {
                let at = format!("pairs[{i}]");
                known_keys(v, &at, PAIR_KEYS)?;
                for side in ["chosen", "rejected"] {
                    let (ids, labels) = (format!("{side}_input_ids"), format!("{side}_labels"));
                    rows.push(row(v, &at, &ids, &labels, limits)?);
                    refs.push(number(v, &at, &format!("ref_{side}_logps"))?);
                }
            }
            let ds = dataset(rows, true, None);
            let per_micro = (limits.rows_per_micro / 2).max(1);
            let accum = split(items.len(), per_micro, limits, "pairs")?;
            let order: Vec<usize> = (0..items.len()).collect();
            let plan = plan_pairs(&ds, &order, limits.world, accum, limits.pad, &refs);
            nonempty(&plan)?;
            Ok(Batch { plan, accum })
        }
        Objective::Grpo(params) => rollouts(items, params, limits),
    }
}

/// `forward`'s rows.
pub fn forward(req: &Value, limits: &Limits) -> Result<Vec<Example>> {
    let items = list(req, "rows", "forward")?;
    let rows = items
        .iter()
        .enumerate()
        .map(|(i, v)| lm_row(v, &format!("rows[{i}]"), limits))
        .collect::<Result<Vec<_>>>()?;
    Ok(rows)
}

/// A row of `rows`: `input_ids` and, optionally, `labels`.
fn lm_row(v: &Value, at: &str, limits: &Limits) -> Result<Example> {
    known_keys(v, at, ROW_KEYS)?;
    row(v, at, "input_ids", "labels", limits)
}

fn stage_name(objective: Objective) -> &'static str {
    match objective {
        Objective::Lm => "pt or sft",
        Objective::Dpo(_) => "dpo",
        Objective::Grpo(_) => "grpo",
    }
}

fn list<'a>(req: &'a Value, key: &str, cmd: &str) -> Result<&'a Vec<Value>> {
    match req.get(key) {
        Some(Value::Array(items)) if !items.is_empty() => Ok(items),
        Some(Value::Array(_)) => bail!("{cmd}: `{key}` is empty"),
        Some(_) => bail!("{cmd}: `{key}` must be a list"),
        None => bail!("{cmd}: `{key}` is missing"),
    }
}

fn dataset(rows: Vec<Example>, pairs: bool, rollouts: Option<Rollouts>) -> Dataset {
    Dataset {
        samples: rows.len(),
        rows,
        pairs,
        rollouts,
        ..Dataset::default()
    }
}

/// Micro-batches per worker for `n` samples of at most `per_micro` each: the fewest
/// equal ones (each worker's share must split evenly, as a run's global batch does).
fn split(n: usize, per_micro: usize, limits: &Limits, what: &str) -> Result<usize> {
    let w = limits.world;
    if !n.is_multiple_of(w) {
        bail!("train_step: {n} {what} do not split over the {w} workers: send a multiple of {w}");
    }
    let share = n / w;
    let fewest = share.div_ceil(per_micro.max(1));
    Ok((fewest..=share)
        .find(|a| share.is_multiple_of(*a))
        .unwrap_or(share))
}

fn nonempty(plan: &StepPlan) -> Result<()> {
    if plan.tokens == 0 {
        bail!("train_step: the batch has no label tokens (every label is -100)");
    }
    Ok(())
}

/// One row: `ids_key` (token ids) and `labels_key` (unshifted labels, -100 where no loss
/// is taken; absent: every token is a label) of the object `v` at `at`.
fn row(v: &Value, at: &str, ids_key: &str, labels_key: &str, limits: &Limits) -> Result<Example> {
    let input_ids = ints(v, at, ids_key, false, limits)?
        .ok_or_else(|| anyhow::anyhow!("{at}.{ids_key} is missing"))?;
    let labels = match ints(v, at, labels_key, true, limits)? {
        Some(labels) if labels.len() != input_ids.len() => bail!(
            "{at}.{labels_key}: {} labels for {} input ids (one per token, -100 where no loss is taken)",
            labels.len(),
            input_ids.len()
        ),
        Some(labels) => labels,
        None => input_ids.clone(),
    };
    let images = row_images(v, at, &input_ids, limits)?;
    Ok(Example {
        input_ids,
        labels,
        position_ids: Vec::new(),
        images,
    })
}

/// The images of the row at `at` (`images`: absolute paths of image files, in the order of
/// their tokens in `ids`; absent: none), each file read whole and decoded here, so that a
/// missing or broken file is refused naming it before the workers see the batch, and the
/// row's image tokens checked against them (each image expanded to its count, as the
/// model's processor does). A text model takes none.
fn row_images(
    v: &Value,
    at: &str,
    ids: &[i32],
    limits: &Limits,
) -> Result<Vec<mt::data::RowImage>> {
    let given = match v.get("images") {
        None => &[][..],
        Some(Value::Array(paths)) => paths.as_slice(),
        Some(x) => bail!("{at}.images must be a list of image file paths, not {x}"),
    };
    let Some((processor, token_id)) = &limits.images else {
        if given.is_empty() {
            return Ok(Vec::new());
        }
        bail!(
            "{at}.images: this model reads no images (a text model, or a vision-language model whose directory has no preprocessor_config.json)"
        );
    };
    let images = given
        .iter()
        .enumerate()
        .map(|(j, p)| {
            let path = match p.as_str().map(std::path::Path::new) {
                Some(path) if path.is_absolute() => path,
                Some(_) => bail!(
                    "{at}.images[{j}]: {p} is a relative path: give it absolute (the server's working directory is not the client's; the Python client makes them absolute)"
                ),
                None => bail!("{at}.images[{j}]: {p} is not a file path"),
            };
            let image = processor
                .row_image(path)
                .map_err(|e| anyhow::anyhow!("{at}.images[{j}]: {}: {e}", path.display()))?;
            mt::data::image::decode(path).map_err(|e| anyhow::anyhow!("{at}.images[{j}]: {e}"))?;
            Ok(image)
        })
        .collect::<Result<Vec<_>>>()?;
    processor
        .check_row(ids, *token_id, &images)
        .map_err(|e| anyhow::anyhow!("{at}: {e}"))?;
    Ok(images)
}

/// The token ids at `v[key]` (`labels`: -100 allowed), each checked against the vocabulary
/// and the row length against the workers' sizing; `None` where the key is absent.
fn ints(v: &Value, at: &str, key: &str, labels: bool, limits: &Limits) -> Result<Option<Vec<i32>>> {
    let Some(x) = v.get(key) else {
        return Ok(None);
    };
    let Value::Array(items) = x else {
        bail!("{at}.{key} must be a list of token ids");
    };
    if items.is_empty() {
        bail!("{at}.{key} is empty");
    }
    if items.len() > limits.max_seq_len {
        bail!(
            "{at}.{key}: {} tokens, longer than the {} the workers were sized for (dataset.max_seq_len)",
            items.len(),
            limits.max_seq_len
        );
    }
    let vocab = limits.vocab as i64;
    items
        .iter()
        .enumerate()
        .map(|(j, t)| match t.as_i64() {
            Some(id) if (0..vocab).contains(&id) => Ok(id as i32),
            Some(id) if labels && id == IGNORE_INDEX as i64 => Ok(IGNORE_INDEX),
            _ => bail!(
                "{at}.{key}[{j}]: {t} is not a token id of this model (0..{vocab}{})",
                if labels { ", or -100" } else { "" }
            ),
        })
        .collect::<Result<Vec<i32>>>()
        .map(Some)
}

/// `v[key]`, a finite number. JSON has no NaN nor infinity: a client writes them as
/// strings ("NaN", "Infinity"), refused here by name.
fn number(v: &Value, at: &str, key: &str) -> Result<f64> {
    match v.get(key) {
        Some(x) => finite(x).map_err(|e| anyhow::anyhow!("{at}.{key}: {e}")),
        None => bail!("{at}.{key} is missing (a number)"),
    }
}

fn finite(x: &Value) -> Result<f64> {
    match x.as_f64() {
        Some(f) if f.is_finite() => Ok(f),
        _ => bail!("{x} is not a finite number"),
    }
}

fn floats(v: &Value, at: &str, key: &str, want: usize) -> Result<Option<Vec<f32>>> {
    let Some(x) = v.get(key) else {
        return Ok(None);
    };
    let Some(items) = x.as_array() else {
        bail!("{at}.{key} must be a list of numbers");
    };
    if items.len() != want {
        bail!(
            "{at}.{key}: {} values for {want} completion tokens (one each)",
            items.len()
        );
    }
    let values = (items.iter().enumerate()).map(|(j, x)| {
        finite(x)
            .map(|f| f as f32)
            .map_err(|e| anyhow::anyhow!("{at}.{key}[{j}]: {e}"))
    });
    values.collect::<Result<Vec<f32>>>().map(Some)
}

/// GRPO's rollouts: rows of prompt + completion labelled on the completion, their
/// advantages (given, or of their rewards within their groups as a run computes them), old
/// and reference log-probabilities where given.
fn rollouts(items: &[Value], params: GrpoParams, limits: &Limits) -> Result<Batch> {
    let n = items.len();
    let (mut rows, mut rewards, mut groups, mut given) = (vec![], vec![], vec![], vec![]);
    let (mut old, mut refs) = (Vec::new(), Vec::new());
    let mut names: Vec<String> = Vec::new();
    for (i, v) in items.iter().enumerate() {
        let at = format!("rollouts[{i}]");
        known_keys(v, &at, ROLLOUT_KEYS)?;
        let prompt = ints(v, &at, "prompt_ids", false, limits)?;
        let completion = ints(v, &at, "completion_ids", false, limits)?;
        let (Some(prompt), Some(completion)) = (prompt, completion) else {
            bail!("{at}: prompt_ids and completion_ids are both needed (token ids)");
        };
        let len = prompt.len() + completion.len();
        if len > limits.max_seq_len {
            bail!(
                "{at}: {len} tokens (prompt and completion), longer than the {} the workers were sized for (dataset.max_seq_len)",
                limits.max_seq_len
            );
        }
        let k = completion.len();
        let mut input_ids = prompt.clone();
        input_ids.extend_from_slice(&completion);
        let mut labels = vec![IGNORE_INDEX; prompt.len()];
        labels.extend_from_slice(&completion);
        let images = row_images(v, &at, &input_ids, limits)?;
        rows.push(Example {
            input_ids,
            labels,
            position_ids: Vec::new(),
            images,
        });
        match (v.get("advantage"), v.get("reward")) {
            (Some(_), Some(_)) => {
                bail!("{at}: give `advantage` or `reward` (with `group`), not both")
            }
            (Some(_), None) => given.push(number(v, &at, "advantage")?),
            (None, Some(_)) => {
                rewards.push(number(v, &at, "reward")?);
                let group = match v.get("group") {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Number(x)) => x.to_string(),
                    _ => bail!(
                        "{at}.group is missing: the rollouts sharing a prompt share a group (a string or a number)"
                    ),
                };
                let g = match names.iter().position(|n| *n == group) {
                    Some(g) => g,
                    None => {
                        names.push(group);
                        names.len() - 1
                    }
                };
                groups.push(g);
            }
            (None, None) => bail!("{at}: `reward` and `group`, or `advantage`, is needed"),
        }
        if let Some(o) = floats(v, &at, "old_logps", k)? {
            old.push(o);
        }
        if let Some(r) = floats(v, &at, "ref_logps", k)? {
            refs.push(r);
        }
    }
    let all_or_none = |count: usize, what: &str| -> Result<()> {
        match count {
            0 => Ok(()),
            c if c == n => Ok(()),
            c => bail!("rollouts: {c} of the {n} give {what}: give it for every rollout or none"),
        }
    };
    all_or_none(given.len(), "`advantage`")?;
    all_or_none(old.len(), "`old_logps`")?;
    all_or_none(refs.len(), "`ref_logps`")?;
    match (params.beta > 0.0, refs.is_empty()) {
        (true, true) => bail!(
            "rollouts: ref_logps is needed for every rollout: grpo.beta is {} (the KL term's reference log-probabilities, from `forward` under the reference model)",
            params.beta
        ),
        (false, false) => bail!("rollouts: ref_logps given but grpo.beta is 0 (no KL term)"),
        _ => {}
    }
    let (advantages, kept) = match given.is_empty() {
        true => {
            let a = mt::objective::grpo::advantages(&rewards, &groups, params.scale_rewards);
            (a, Some(Rollouts { rewards, groups }))
        }
        false => (given, None),
    };
    let ds = dataset(rows, false, kept);
    let accum = split(n, limits.rows_per_micro, limits, "rollouts")?;
    let order: Vec<usize> = (0..n).collect();
    let old: Vec<f32> = old.into_iter().flatten().collect();
    let terms = RolloutTerms {
        advantages: &advantages,
        old: (!old.is_empty()).then_some(&old[..]),
        refs: (!refs.is_empty()).then_some(&refs[..]),
    };
    let plan = plan_rollouts(&ds, &order, limits.world, accum, limits.pad, terms);
    nonempty(&plan)?;
    Ok(Batch { plan, accum })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn limits(world: usize) -> Limits {
        Limits {
            vocab: 100,
            max_seq_len: 8,
            world,
            rows_per_micro: 2,
            pad: 0,
            images: None,
        }
    }

    #[test]
    fn rows_split_over_workers_into_equal_micro_batches() {
        let rows: Vec<Value> = (0..12)
            .map(|i| json!({"input_ids": [1, 2, 3 + i]}))
            .collect();
        let b = train(&json!({"rows": rows}), Objective::Lm, &limits(2)).unwrap();
        // 6 rows per worker, at most 2 per micro-batch: 3 micro-batches of 2.
        assert_eq!(b.accum, 3);
        assert_eq!(b.plan.per_rank.len(), 2);
        assert!(b.plan.per_rank.iter().flatten().all(|m| m.rows == 2));
        // Every token after the first of each row is a label: 12 rows x 2.
        assert_eq!(b.plan.tokens, 24);
        // 5 rows per worker at 2 per micro-batch: 5 micro-batches of 1 (equal ones).
        let rows: Vec<Value> = (0..10).map(|_| json!({"input_ids": [1, 2]})).collect();
        let b = train(&json!({"rows": rows}), Objective::Lm, &limits(2)).unwrap();
        assert_eq!(b.accum, 5);
    }

    #[test]
    fn bad_rows_are_refused_naming_the_row_and_key() {
        let l = limits(2);
        let cases = [
            (
                json!({"rows": [{"input_ids": [1]}]}),
                "do not split over the 2 workers",
            ),
            (
                json!({"rows": [{"input_ids": [1, 100]}, {"input_ids": [1]}]}),
                "rows[0].input_ids[1]: 100 is not a token id",
            ),
            (
                json!({"rows": [{"input_ids": vec![1; 9]}, {"input_ids": [1]}]}),
                "rows[0].input_ids: 9 tokens, longer than the 8",
            ),
            (
                json!({"rows": [{"input_ids": [1, 2]}, {"input_ids": [1, 2], "labels": [1]}]}),
                "rows[1].labels: 1 labels for 2 input ids",
            ),
            (
                json!({"rows": [{"input_ids": [1, 2], "labels": [-100, -100]}, {"input_ids": [3], "labels": [-100]}]}),
                "no label tokens",
            ),
            (
                json!({"pairs": []}),
                "`pairs` given to a server whose training.stage takes `rows`",
            ),
            (json!({"rows": []}), "`rows` is empty"),
            (
                json!({"rows": [{"input_ids": [1, 2], "label": [1, 2]}, {"input_ids": [1]}]}),
                "rows[0]: unknown key `label` (it takes input_ids, labels, images)",
            ),
            (
                json!({"rows": [{"input_ids": [1, 2], "images": ["/a.png"]}, {"input_ids": [1]}]}),
                "rows[0].images: this model reads no images",
            ),
            (
                json!({"rows": [{"input_ids": [1, 2], "images": "/a.png"}, {"input_ids": [1]}]}),
                "rows[0].images must be a list of image file paths",
            ),
            (
                json!({"rows": [[1, 2], {"input_ids": [1]}]}),
                "rows[0] must be an object",
            ),
        ];
        for (req, want) in cases {
            let e = train(&req, Objective::Lm, &l).err().unwrap().to_string();
            assert!(e.contains(want), "{req}: {e}");
        }
    }

    /// configs/tiny_grpo.yaml's objective with `grpo.beta` set.
    fn grpo(beta: f64) -> Objective {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/tiny_grpo.yaml");
        let set = [format!("grpo.beta={beta}")];
        let cfg = mt::config::RunConfig::load(std::path::Path::new(path), &set).unwrap();
        Objective::of(&cfg).unwrap()
    }

    #[test]
    fn rollouts_carry_group_advantages_and_their_logps() {
        let r = |g: &str, reward: f64| json!({"prompt_ids": [5, 6], "completion_ids": [7, 8, 9], "reward": reward, "group": g, "old_logps": [-1.0, -2.0, -3.0]});
        let req = json!({"rollouts": [r("a", 1.0), r("a", 0.0), r("b", 1.0), r("b", 1.0)]});
        let b = train(&req, grpo(0.0), &limits(2)).unwrap();
        let mb: Vec<_> = b.plan.per_rank.iter().flatten().collect();
        let advantages: Vec<f64> = mb.iter().flat_map(|m| m.advantages.clone()).collect();
        let Objective::Grpo(p) = grpo(0.0) else {
            unreachable!()
        };
        let want =
            mt::objective::grpo::advantages(&[1.0, 0.0, 1.0, 1.0], &[0, 0, 1, 1], p.scale_rewards);
        assert_eq!(advantages, want);
        assert_eq!(b.plan.tokens, 12, "the completions' tokens are the labels");
        let old: Vec<f32> = mb.iter().flat_map(|m| m.old_logps.clone()).collect();
        assert_eq!(old, [-1.0, -2.0, -3.0].repeat(4));
        assert_eq!(b.plan.rewards, [1.0, 0.0, 1.0, 1.0]);
        // With a KL term each rollout needs its reference.
        let e = train(&req, grpo(0.1), &limits(2))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("ref_logps is needed"), "{e}");
        let bad = json!({"rollouts": [r("a", 1.0), {"prompt_ids": [5], "completion_ids": [7], "advantage": 0.5}]});
        let e = train(&bad, grpo(0.0), &limits(2))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("give it for every rollout or none"), "{e}");
    }
}
