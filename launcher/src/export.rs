//! `mt-launch export CHECKPOINT OUT`: an HF model directory from a checkpoint, without
//! training.
//!
//! The source is a complete directory of this project (a `step-NNNNNNNN` checkpoint, a
//! `checkpoint.dir` meaning its newest, or an export), checked against its manifest
//! first. A resumable checkpoint gives its fp32 master weights (`optimizer.safetensors`),
//! read one block at a time, so the export holds one block, not the model; a model-only
//! one (or an export) gives its weight files' values. The rules are a training export's:
//! OUT may not be the source nor lie inside it; it may hold only what this project
//! wrote there unless `--overwrite-output-dir`; it is locked while written, a half-done
//! export a killed run left there is finished or undone first, and the new directory is
//! written aside and put in place atomically (`mt::checkpoint::export`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use mt::checkpoint::carried::{self, Carried};
use mt::checkpoint::export::ExportFiles;
use mt::checkpoint::lock::DirLock;
use mt::checkpoint::state::{self, Field, Saved, Tensors};
use mt::checkpoint::{ExportOptions, MasterMut, MasterRef, ownership};
use mt::config::DType;
use mt::config::hf::ModelSpec;
use mt::layout::Layout;

use crate::cli::ExportArgs;

/// What OUT's errors name it.
const KEY: &str = "OUT";
/// ... and the foreign-files refusal, which names the command too.
const KEY_NAMED: &str = "OUT (mt-launch export)";

pub fn export(args: &ExportArgs) -> Result<()> {
    let t = std::time::Instant::now();
    let source = source_dir(&args.checkpoint)?;
    // Absolute, so that a bare name has a parent to check, lock beside and write aside in.
    let out = &std::path::absolute(&args.out)
        .with_context(|| format!("{KEY} {}: not a usable path", args.out.display()))?;
    mt::checkpoint::check_writable(out, KEY).map_err(named)?;
    check_outside_source(out, &source)?;
    let _lock = DirLock::acquire(out, KEY).map_err(named)?;
    refuse_foreign(out, args.overwrite_output_dir, KEY_NAMED)?;
    mt::checkpoint::recover_export(out)?;
    if !args.no_verify {
        mt::checkpoint::verify(&source).with_context(|| {
            format!(
                "{} is damaged (--no-verify skips this check)",
                source.display()
            )
        })?;
    }
    let mut spec = ModelSpec::from_model_dir(&source)?;
    carried::resolve(&source, &mut spec)?;
    let layout = source_layout(&source, &spec)?;
    let dtype = match args.dtype.as_deref() {
        Some("float32") => DType::Float32,
        Some(_) => DType::Bfloat16,
        None => saved_dtype(&source)?,
    };
    let opts = ExportOptions {
        dtype,
        source: source.clone(),
        max_shard_bytes: args.max_shard_size.0,
        carried: Arc::new(Carried::read(&source, &layout)?),
        // The checkpoint's own chat_template.jinja (the one its run trained with) is
        // copied with its tokenizer files.
        chat_template: None,
    };
    let (files, from) = match state::resumable(&source) {
        true => (
            from_master(out, &source, &layout, &opts)?,
            "fp32 master weights",
        ),
        false => (from_weights(out, &source, &layout, &opts)?, "weights"),
    };
    let dtype = match dtype {
        DType::Float32 => "float32",
        DType::Bfloat16 => "bfloat16",
    };
    println!(
        "exported {} ({from}) to {} in {dtype}: {} files in {:.1}s",
        source.display(),
        out.display(),
        files.len(),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The layout `source` was trained with: the text model's, or with a vision tower's
/// trained tensors in the embedding block (`vlm.freeze_projector: false`,
/// `vlm.freeze_vision_encoder: false`, or both) where its
/// trainer state's layout fingerprint is that one's. A source without a trainer state (an
/// export) reads either way: the tensors outside the layout are carried from its files.
fn source_layout(source: &Path, spec: &ModelSpec) -> Result<Layout> {
    let layout = Layout::checked(spec, &source.join("config.json"))?;
    let Some(vision) = mt::config::vision::TowerSpec::from_model_dir(source)? else {
        return Ok(layout);
    };
    let Ok(saved) = state::read_state(source) else {
        return Ok(layout);
    };
    use mt::config::TowerTraining;
    let trained = [
        TowerTraining::Projector,
        TowerTraining::Encoder,
        TowerTraining::Whole,
    ]
    .into_iter()
    .map(|t| Layout::with_tower(spec, &vision, t))
    .find(|l| saved.layout == state::fingerprint(l));
    Ok(trained.unwrap_or(layout))
}

/// `e`, saying OUT where the library's error would say "config key `OUT`".
fn named(e: mt::Error) -> anyhow::Error {
    match e {
        mt::Error::InvalidValue { key, msg } => anyhow::anyhow!("{key} (mt-launch export): {msg}"),
        other => other.into(),
    }
}

/// The directory to export: `dir` itself when it is complete (a checkpoint or an export),
/// else the newest complete checkpoint under it.
fn source_dir(dir: &Path) -> Result<PathBuf> {
    if !dir.is_dir() {
        bail!(
            "CHECKPOINT {}: not a directory (expected checkpoint.dir/step-NNNNNNNN or a checkpoint.dir)",
            dir.display()
        );
    }
    let marked = [
        mt::checkpoint::manifest::CHECKPOINT_MARKER,
        mt::checkpoint::manifest::EXPORT_MARKER,
    ]
    .iter()
    .any(|m| dir.join(m).is_file());
    if marked {
        return Ok(dir.into());
    }
    match state::complete(dir)?.pop() {
        Some((_, newest)) => Ok(newest),
        None => bail!(
            "CHECKPOINT {}: neither a complete checkpoint (no {} there) nor a checkpoint.dir holding one",
            dir.display(),
            mt::checkpoint::manifest::CHECKPOINT_MARKER
        ),
    }
}

/// The dtype the source's weights were written in (its config.json `dtype`).
fn saved_dtype(source: &Path) -> Result<DType> {
    let path = source.join("config.json");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
    let cfg: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{}: not a valid config.json", path.display()))?;
    let named = cfg.get("dtype").or_else(|| cfg.get("torch_dtype"));
    match named.and_then(|v| v.as_str()) {
        Some("float32") => Ok(DType::Float32),
        Some("bfloat16") => Ok(DType::Bfloat16),
        other => bail!(
            "{}: `dtype` is {other:?}, not bfloat16 or float32: give --dtype",
            path.display()
        ),
    }
}

/// Refuses an OUT that is the source or lies inside it. One that contains it (the run's
/// output directory holding its `checkpoints/`) is a training export's place: the entries
/// that are not an export's are moved back into it, the source read whole before.
fn check_outside_source(out: &Path, source: &Path) -> Result<()> {
    let (o, s) = (ownership::resolved(out), ownership::resolved(source));
    if o.starts_with(&s) {
        let how = if o == s { "is" } else { "lies inside" };
        bail!(
            "{KEY} (mt-launch export): {} (resolved: {}) {how} the checkpoint {}: writing there would change the checkpoint being exported; give another directory",
            out.display(),
            o.display(),
            source.display()
        );
    }
    Ok(())
}

/// Refuses `out` (named `key` in the error) when it holds entries this project did not
/// write, unless `overwrite`.
pub fn refuse_foreign(out: &Path, overwrite: bool, key: &str) -> Result<()> {
    let foreign = ownership::foreign_in_output_dir(out)?;
    if foreign.is_empty() || overwrite {
        return Ok(());
    }
    let mut named = foreign[..foreign.len().min(ownership::NAMED)].join(", ");
    if foreign.len() > ownership::NAMED {
        named.push_str(&format!(" (and {} more)", foreign.len() - ownership::NAMED));
    }
    bail!(
        "{key}: {} holds files this project did not write: {named}; the export would replace this directory. Give an empty or new directory{}",
        out.display(),
        match key {
            KEY_NAMED =>
                ", or pass --overwrite-output-dir to write there anyway (another model's weight files are replaced, other files kept)",
            _ => "",
        }
    )
}

/// The export of a resumable checkpoint's fp32 master, one block in memory at a time.
fn from_master(
    out: &Path,
    source: &Path,
    layout: &Layout,
    opts: &ExportOptions,
) -> Result<Vec<PathBuf>> {
    let saved = Saved::open(source, layout)?;
    let files = ExportFiles::create(out, layout, opts)?;
    for (b, block) in layout.blocks.iter().enumerate() {
        let r = block.range();
        let mut values = vec![0f32; r.len()];
        saved.read(Field::Master, r.start, &mut MasterMut::F32(&mut values))?;
        files.write_block(b, &Tensors::master_only(MasterRef::F32(&values)))?;
    }
    Ok(files.finish()?)
}

/// The export of a model-only checkpoint (or an export): its weight files' values.
fn from_weights(
    out: &Path,
    source: &Path,
    layout: &Layout,
    opts: &ExportOptions,
) -> Result<Vec<PathBuf>> {
    let mut values = vec![0f32; layout.total];
    mt::checkpoint::load_pretrained(source, layout, &mut MasterMut::F32(&mut values))?;
    Ok(mt::checkpoint::save_hf(
        out,
        layout,
        MasterRef::F32(&values),
        opts,
    )?)
}
