//! Where a dataset's records come from: the files of `dataset.path` or of registry entries
//! (`dataset.name`, `eval_name`), each with the schema its records are read with, and the
//! checks that the configured `training.stage` can train on them.

use std::path::PathBuf;

use super::ChatTokenizer;
use super::files;
use super::records::Schema;
use super::registry::{self, Columns};
use crate::config::{DatasetFormat, DatasetSection, Stage};
use crate::error::{Error, Result};

/// Whether reading `ds` for `stage` needs the model's tokenizer (any of its sources,
/// training or eval, is text).
pub fn needs_tokenizer(ds: &DatasetSection, stage: Stage) -> Result<bool> {
    let (train, eval) = train_and_eval_sources(ds, stage)?;
    Ok(train.iter().chain(&eval).any(|s| s.schema.is_some()))
}

/// The files the training set of `ds` is read from, in order, found without reading them
/// (what a checkpoint fingerprints: [`crate::checkpoint::settings`]).
pub fn training_files(ds: &DatasetSection, stage: Stage) -> Result<Vec<PathBuf>> {
    let (train, _) = train_and_eval_sources(ds, stage)?;
    Ok(train.into_iter().flat_map(|s| s.files).collect())
}

/// The sources of the training set and of the eval set (none without one).
pub(super) fn train_and_eval_sources(
    ds: &DatasetSection,
    stage: Stage,
) -> Result<(Vec<Source>, Vec<Source>)> {
    let train = sources(
        ds,
        stage,
        ds.path.as_ref(),
        ds.name.as_deref(),
        "dataset.name",
    )?;
    let eval = sources(
        ds,
        stage,
        ds.eval_path.as_ref(),
        ds.eval_name.as_deref(),
        "dataset.eval_name",
    )?;
    Ok((train, eval))
}

/// One registry entry or file to read, and how.
pub(super) struct Source {
    /// The registry name or the file, for messages.
    pub name: String,
    pub files: Vec<PathBuf>,
    /// None: tokenized.
    pub schema: Option<Schema>,
    pub limit: Option<usize>,
}

/// A dataset with tool definitions needs a template that renders them (not under `pt`,
/// which reads no conversation).
pub(super) fn check_tools<'a>(
    srcs: impl Iterator<Item = &'a Source>,
    chat: &ChatTokenizer,
    stage: Stage,
) -> Result<()> {
    for src in srcs {
        let tools_col = src.schema.as_ref().and_then(|s| s.columns.tools.as_deref());
        if let (Some(col), false, true) = (tools_col, chat.supports_tools(), stage != Stage::Pt) {
            return Err(chat.template.error(format!(
                "dataset `{}` has tool definitions (column `{col}`), but this chat template has no tool support (it reads no `tools` variable or writes no `tool_calls`): use a model whose template renders tools, or leave the `tools` column out of the dataset",
                src.name
            )));
        }
    }
    Ok(())
}

/// The sources of a `path` or `name` (a list of registry names; `key` names it in errors),
/// with their schemas; none when neither is given. Each must suit `stage`.
fn sources(
    ds: &DatasetSection,
    stage: Stage,
    path: Option<&PathBuf>,
    names: Option<&str>,
    key: &str,
) -> Result<Vec<Source>> {
    let text_schema = |format, columns, tags, media_dir: PathBuf| match format {
        DatasetFormat::Tokenized => None,
        _ => Some(Schema {
            format,
            columns,
            tags,
            default_system: ds.system_prompt.clone(),
            media_dir,
        }),
    };
    if let Some(path) = path {
        let format = ds.format.unwrap_or(DatasetFormat::Alpaca);
        let mut columns = Columns::defaults(format);
        if stage == Stage::Pt {
            // A plain-text corpus names its column `text` (`datasets`' text loader too).
            columns.prompt = "text".into();
            columns.query = None;
        }
        if let Some(q) = &ds.query_field {
            columns.prompt = q.clone();
        }
        if let Some(r) = &ds.response_field {
            columns.response = r.clone();
        }
        let key = if key == "dataset.name" {
            "dataset.path"
        } else {
            "dataset.eval_path"
        };
        let name = path.display().to_string();
        // A file given by path is read as `dpo` reads it: its records are pairs.
        let ranking = stage == Stage::Dpo;
        check_stage(
            stage,
            key,
            &name,
            format,
            ranking,
            std::slice::from_ref(path),
        )?;
        return Ok(vec![Source {
            name,
            files: vec![path.clone()],
            schema: text_schema(format, columns, Default::default(), ds.dataset_dir.clone()),
            limit: None,
        }]);
    }
    names
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(|n| {
            let r = registry::lookup(&ds.dataset_dir, n, key)?;
            check_stage(stage, key, n, r.format, r.ranking, &r.files)?;
            Ok(Source {
                name: n.to_owned(),
                files: r.files,
                schema: text_schema(r.format, r.columns, r.tags, ds.dataset_dir.clone()),
                limit: r.num_samples,
            })
        })
        .collect()
}

/// Refuses a dataset that `stage` cannot train on, naming it and the key that gave it.
fn check_stage(
    stage: Stage,
    key: &str,
    name: &str,
    format: DatasetFormat,
    ranking: bool,
    files: &[PathBuf],
) -> Result<()> {
    let stage_name = stage.as_str();
    if ranking && stage != Stage::Dpo {
        return Err(Error::invalid(
            key,
            format!(
                "dataset `{name}` is a ranking dataset (`ranking: true`: chosen/rejected preference pairs, for training.stage: dpo), which training.stage: {stage_name} cannot train on: give a supervised dataset"
            ),
        ));
    }
    if stage == Stage::Dpo && !ranking {
        return Err(Error::invalid(
            key,
            format!(
                "dataset `{name}` is not a ranking dataset: training.stage: dpo trains on chosen/rejected preference pairs, registered with `\"ranking\": true` in dataset_info.json (LlamaFactory's format; columns `chosen` and `rejected`)"
            ),
        ));
    }
    if stage == Stage::Pt && format == DatasetFormat::Sharegpt {
        return Err(Error::invalid(
            key,
            format!(
                "dataset `{name}` is sharegpt conversations; training.stage: pt reads plain text: alpaca-format records with the document in the `prompt` column (`columns: {{prompt: text}}` in dataset_info.json), .txt files, or tokenized rows"
            ),
        ));
    }
    if let Some(txt) = files.iter().find(|f| files::is_plain_text(f))
        && stage != Stage::Pt
    {
        return Err(Error::invalid(
            key,
            format!(
                "dataset `{name}` is plain text ({}: one document per line), which is read with training.stage: pt, not {stage_name}",
                txt.display()
            ),
        ));
    }
    Ok(())
}
