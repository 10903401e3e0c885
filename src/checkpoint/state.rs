//! Full training checkpoints: an HF model directory plus everything needed to resume
//! exactly (fp32 master weights, Adam moments, step and update counts).
//!
//! Layout of `checkpoint.dir/step-00000123/`: an HF model directory as `export` writes it
//! (config, weights in the run's dtype, sharded when large, tokenizer files; loadable by
//! transformers as is), `optimizer.safetensors` (`master`, `exp_avg`, `exp_avg_sq`, flat
//! f32 in layout order, whatever `memory.master_weights`; a split master is joined, a bf16
//! one widened, a chunk at a time), `trainer_state.json`, the state's extra files (DPO's
//! `dpo_reference.safetensors`), `.mt-owner.json` (who wrote it) and `COMPLETE`, the
//! manifest of every other file with its size and CRC32C ([`super::manifest`]). Every file
//! is created exclusively, never through a link ([`super::atomic`]), with its header, then
//! each block's values are written at their offsets ([`Files::write_block`]), so a block can
//! be written from the live state or from a staged copy ([`super::writer`]); a value that is
//! not finite fails the write (the previous checkpoints are kept). A checkpoint is written
//! into a fresh temporary directory `.mt-tmp-<random>` holding its owner record, every file
//! fsynced, the marker written last, then renamed into place without replacing (or, over
//! a checkpoint of the same step, exchanged with it); a directory without `COMPLETE` is
//! never loaded, and pruning never deletes the newest complete checkpoint. A failed write
//! removes its temporary directory; one left by a killed writer is removed by the next run
//! (`remove_stale`: only ours, only of writers known to be gone). Reading a checkpoint
//! back ([`Saved::read`]) refuses a value that is not finite, naming the tensor.

use std::borrow::Cow;
use std::ops::Range;
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use serde::{Deserialize, Serialize};

use super::atomic;
use super::export::{ExportFiles, check_finite};
use super::manifest::{self, Entry, Manifest};
use super::pieces::{self, Positioned};
pub use super::schedule::Schedule;
use super::staging;
use super::streams::{self, Shifted};
use super::{ExportOptions, MasterMut, MasterRef};
use crate::config::CheckpointContents;
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::shm::f32_bytes;

mod dirs;
pub use dirs::{complete, prune, remove_stale, resolve, resumable};

pub(crate) const MARKER: &str = manifest::CHECKPOINT_MARKER;
/// Prefix of the directories of writers of earlier versions (`.tmp-step-N-PID`).
const LEGACY_TMP_PREFIX: &str = ".tmp-";
const STATE: &str = "trainer_state.json";
const OPTIMIZER: &str = "optimizer.safetensors";
/// The trainer_state.json format this build writes and reads.
pub const FORMAT: u32 = 1;

/// Where training stands, besides the tensors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    pub format: u32,
    /// Optimizer steps completed (the data position: step k reads global batch k).
    pub step: u64,
    /// AdamW updates applied (differs from `step` when non-finite steps were skipped).
    pub updates: u64,
    /// Non-finite steps in a row at the time of the checkpoint.
    pub nan_run: u64,
    /// Identifies the parameter layout (names, shapes, offsets).
    pub layout: String,
    /// What the data order and the learning-rate schedule follow (absent in checkpoints of
    /// earlier builds).
    #[serde(default)]
    pub schedule: Option<Schedule>,
    /// Small files written beside `trainer_state.json` (name, bytes): DPO's reference
    /// log-probabilities ([`super::reference`]).
    #[serde(skip)]
    pub extra: Vec<(String, std::sync::Arc<Vec<u8>>)>,
}

/// The host tensors a checkpoint holds, all in layout order. Adam's m and v are held as
/// fp32 or bf16 (`memory.moments_dtype`), viewed as a master is ([`MasterRef::F32`] or
/// [`MasterRef::Bf16`], widened exactly); empty where the checkpoint holds no moments.
#[derive(Clone, Copy)]
pub struct Tensors<'a> {
    pub master: MasterRef<'a>,
    pub m: MasterRef<'a>,
    pub v: MasterRef<'a>,
}

impl<'a> Tensors<'a> {
    /// A master without moments (what an export reads).
    pub fn master_only(master: MasterRef<'a>) -> Tensors<'a> {
        Tensors {
            master,
            m: MasterRef::F32(&[]),
            v: MasterRef::F32(&[]),
        }
    }

    /// An fp32 master and moments held as plain slices (the tests' live state).
    #[cfg(test)]
    pub(crate) fn f32(master: &'a [f32], m: &'a [f32], v: &'a [f32]) -> Tensors<'a> {
        Tensors {
            master: MasterRef::F32(master),
            m: MasterRef::F32(m),
            v: MasterRef::F32(v),
        }
    }

    /// Elements `r` of each.
    pub fn slice(&self, r: Range<usize>) -> Tensors<'a> {
        let opt = |x: MasterRef<'a>| if x.is_empty() { x } else { x.slice(r.clone()) };
        Tensors {
            master: self.master.slice(r.clone()),
            m: opt(self.m),
            v: opt(self.v),
        }
    }
}

/// What a checkpoint holds of each parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    Master,
    M,
    V,
}

impl Field {
    /// Its tensor in `optimizer.safetensors`.
    pub fn name(self) -> &'static str {
        let (name, _) = OPTIMIZER_TENSORS
            .iter()
            .find(|(_, f)| *f == self)
            .expect("every field is saved");
        name
    }
}

/// One block's checkpointed values, wherever they are held (the live state, or a staged
/// copy: [`super::staging`]).
pub trait BlockValues: Sync {
    /// The fp32 values of `field` at elements `r` of the block.
    fn values(&self, field: Field, r: Range<usize>) -> Cow<'_, [f32]>;
}

/// A block's elements of the live tensors ([`Tensors::slice`]).
impl BlockValues for Tensors<'_> {
    fn values(&self, field: Field, r: Range<usize>) -> Cow<'_, [f32]> {
        match field {
            Field::Master => self.master.slice(r).values(),
            Field::M => self.m.slice(r).values(),
            Field::V => self.v.slice(r).values(),
        }
    }
}

/// Elements per positioned write (4 MiB of f32).
pub const WRITE_CHUNK: usize = 1 << 20;

/// FNV-1a over every tensor's name, shape and offset: equal layouts, equal fingerprints.
pub fn fingerprint(layout: &Layout) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (b, t) in layout.tensors() {
        for byte in format!("{}{:?}@{};", b.hf_name(t), t.shape, b.offset + t.offset).bytes() {
            h = (h ^ byte as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    format!("{h:016x}-{}", layout.total)
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |e| Error::io(path, e)
}

/// The HF name of the parameter at global element `i` of `layout`.
pub fn name_at(layout: &Layout, i: usize) -> String {
    layout
        .tensors()
        .find(|(b, t)| Layout::global_range(b, t).contains(&i))
        .map_or_else(|| format!("element {i}"), |(b, t)| b.hf_name(t))
}

/// Writes checkpoint `state.step` of `tensors` under `root` (block after block) and
/// returns its directory, as [`save_with`] does.
pub fn save(
    root: &Path,
    state: &TrainState,
    layout: &Layout,
    tensors: &Tensors,
    export: &ExportOptions,
    contents: CheckpointContents,
) -> Result<PathBuf> {
    // Blocks one after another, as `super::export::save_hf` writes them (why there).
    save_with(root, state, layout, export, contents, |files| {
        (0..layout.blocks.len())
            .try_for_each(|b| files.write_block(b, &tensors.slice(layout.blocks[b].range())))
    })
}

/// Writes checkpoint `state.step` under `root` and returns its directory: the HF model
/// directory and `trainer_state.json`, plus `optimizer.safetensors` for a `Full` one; the
/// tensors' values are written by `fill`, which must write every block. Nothing partial
/// survives a failure: the temporary directory is removed, and a complete checkpoint of
/// the same step is replaced only once the new one is complete.
pub fn save_with(
    root: &Path,
    state: &TrainState,
    layout: &Layout,
    export: &ExportOptions,
    contents: CheckpointContents,
    fill: impl FnOnce(&Files) -> Result<()>,
) -> Result<PathBuf> {
    let name = format!("step-{:08}", state.step);
    let tmp = atomic::temp_dir(root, "")?;
    let written = Files::create(&tmp, layout, export, contents)
        .and_then(|files| fill(&files).and_then(|()| files.finish(state)));
    if let Err(e) = written {
        let _ = atomic::remove_ours(&tmp);
        return Err(e);
    }
    let dst = root.join(&name);
    // Only a checkpoint of ours is replaced: anything else under its name (a file, a link,
    // a directory of someone else's) fails the write, naming it, and is left as it is.
    let ours = |d: &Path| {
        atomic::is_real_dir(d)
            && (atomic::exists(&d.join(MARKER)) || atomic::exists(&d.join(atomic::OWNER_FILE)))
    };
    let put = if !atomic::exists(&dst) {
        atomic::rename_noreplace(&tmp, &dst).map(|()| None)
    } else if !ours(&dst) {
        Err(Error::Weights {
            path: dst.clone(),
            msg: "exists and is not a checkpoint this project wrote: the checkpoint is not written over it".into(),
        })
    } else if atomic::exchange(&tmp, &dst)? {
        // An older checkpoint of the same step now holds the temporary name.
        Ok(Some(tmp.clone()))
    } else {
        let aside = root.join(atomic::temp_name(""));
        std::fs::rename(&dst, &aside)
            .map_err(io(&dst))
            .and_then(|()| atomic::rename_noreplace(&tmp, &dst))
            .map(|()| Some(aside))
    };
    let old = match put {
        Ok(old) => old,
        Err(e) => {
            let _ = atomic::remove_ours(&tmp);
            return Err(e);
        }
    };
    atomic::fsync(root)?;
    if let Some(old) = old {
        atomic::remove_ours(&old)?;
    }
    Ok(dst)
}

/// A checkpoint being written into its temporary directory: every file created, the
/// tensors' values to be written block by block, in any order ([`Files::write_block`]).
pub struct Files<'a> {
    dir: PathBuf,
    layout: &'a Layout,
    export: ExportFiles<'a>,
    /// `optimizer.safetensors` (`Full` checkpoints): `exp_avg`, `exp_avg_sq`, `master`,
    /// flat f32 in layout order, the bytes `safetensors::serialize` gives.
    optimizer: Option<Positioned>,
}

impl<'a> Files<'a> {
    fn create(
        dir: &Path,
        layout: &'a Layout,
        export: &'a ExportOptions,
        contents: CheckpointContents,
    ) -> Result<Files<'a>> {
        let export = ExportFiles::create_in(dir, layout, export)?;
        let optimizer = (contents == CheckpointContents::Full)
            .then(|| optimizer_file(&dir.join(OPTIMIZER), layout.total))
            .transpose()?;
        Ok(Files {
            dir: dir.into(),
            layout,
            export,
            optimizer,
        })
    }

    /// Whether the checkpoint holds the Adam moments (else only the master is read).
    pub fn holds_moments(&self) -> bool {
        self.optimizer.is_some()
    }

    /// Writes every value of block `b`: its export tensors and, in a `Full` checkpoint,
    /// its ranges of the optimizer file.
    pub fn write_block(&self, b: usize, values: &dyn BlockValues) -> Result<()> {
        self.write_window(b, 0..self.layout.blocks[b].len, values)
    }

    /// Writes elements `window` of block `b` (within the block) from `values`, whose
    /// element 0 is element `window.start` ([`ExportFiles::write_window`]): the same bytes
    /// at the same offsets as [`Files::write_block`] writes them, so a block written window
    /// by window (node 0 of a sharded run, which gathers it so) gives the same files.
    /// Several threads write parts of the window at once ([`streams`]).
    pub fn write_window(
        &self,
        b: usize,
        window: Range<usize>,
        values: &dyn BlockValues,
    ) -> Result<()> {
        self.write_window_fields(b, window, values, staging::fields(true))
    }

    /// [`Files::write_window`] of `fields` only: each thread's part of the window reads
    /// `values` from where that part starts.
    fn write_window_fields(
        &self,
        b: usize,
        window: Range<usize>,
        values: &dyn BlockValues,
        fields: &[Field],
    ) -> Result<()> {
        streams::in_streams(window.clone(), |part| {
            let by = part.start - window.start;
            self.write_fields(b, part, &Shifted { values, by }, fields)
        })
    }

    /// [`Files::write_window`] on this thread alone: node 0 of a sharded run writes its
    /// background checkpoint so while it gathers the next windows, which training waits
    /// for and more writing threads slowed (gathers of a 7B model's 4 layers: 16.6 s beside
    /// one thread, 26.6 s beside four; benches/results/checkpoint_qwen2.5-7b-4L_H200-16c_2026-11-24_streams.md).
    pub fn write_window_alone(
        &self,
        b: usize,
        window: Range<usize>,
        values: &dyn BlockValues,
    ) -> Result<()> {
        self.write_part(b, window, values)
    }

    /// Writes one part of block `b` from `values` (the block's elements): the weights (the
    /// export and the optimizer file's master) or the moments ([`staging::Part`]), as
    /// [`Files::write_block`] writes them, several threads at once ([`streams`]).
    pub fn write_unit(&self, u: staging::Unit, values: &dyn BlockValues) -> Result<()> {
        let window = 0..self.layout.blocks[u.block].len;
        self.write_window_fields(u.block, window, values, u.part.fields())
    }

    /// Elements `part` of block `b` from `values` (element 0 is element `part.start`).
    fn write_part(&self, b: usize, part: Range<usize>, values: &dyn BlockValues) -> Result<()> {
        self.write_fields(b, part, values, staging::fields(true))
    }

    /// [`Files::write_part`] of `fields` only (the export with the master).
    fn write_fields(
        &self,
        b: usize,
        part: Range<usize>,
        values: &dyn BlockValues,
        fields: &[Field],
    ) -> Result<()> {
        if fields.contains(&Field::Master) {
            self.export.write_range(b, part.clone(), values)?;
        }
        match &self.optimizer {
            Some(file) => {
                let at = self.layout.blocks[b].offset;
                write_flat(
                    file,
                    at + part.start..at + part.end,
                    values,
                    fields,
                    Some(self.layout),
                )
            }
            None => Ok(()),
        }
    }

    /// The export's other files, `trainer_state.json`, every file fsynced, the manifest
    /// last.
    fn finish(self, state: &TrainState) -> Result<()> {
        let tmp = &self.dir;
        let mut files: Vec<Entry> = self.export.finish_in()?;
        if let Some(opt) = self.optimizer {
            files.push(opt.finish()?);
        }
        let json = serde_json::to_string_pretty(state)
            .map_err(|e| Error::Other(format!("trainer state: {e}")))?;
        let crc = atomic::write_new(&tmp.join(STATE), json.as_bytes())?;
        files.push(Entry::new(STATE, json.len() as u64, crc));
        for (name, bytes) in &state.extra {
            let crc = atomic::write_new(&tmp.join(name), bytes)?;
            files.push(Entry::new(name, bytes.len() as u64, crc));
        }
        Manifest::new(files).write(tmp, MARKER)
    }
}

/// The tensors of `optimizer.safetensors` and what each holds.
const OPTIMIZER_TENSORS: [(&str, Field); 3] = [
    ("exp_avg", Field::M),
    ("exp_avg_sq", Field::V),
    ("master", Field::Master),
];

/// Creates `optimizer.safetensors` for `n` parameters (values still to be written).
fn optimizer_file(path: &Path, n: usize) -> Result<Positioned> {
    let flat = |name: &str| pieces::Meta {
        name: name.into(),
        dtype: Dtype::F32,
        shape: vec![n],
    };
    let names = OPTIMIZER_TENSORS.iter().map(|(n, _)| flat(n)).collect();
    Positioned::create(path, names, None)
}

/// Writes elements `r` of the optimizer file's tensors of `fields` from `values` (whose
/// element 0 is element `r.start`).
fn write_flat(
    file: &Positioned,
    r: Range<usize>,
    values: &dyn BlockValues,
    fields: &[Field],
    layout: Option<&Layout>,
) -> Result<()> {
    for (name, field) in OPTIMIZER_TENSORS
        .into_iter()
        .filter(|(_, f)| fields.contains(f))
    {
        for lo in (0..r.len()).step_by(WRITE_CHUNK) {
            let x = values.values(field, lo..(lo + WRITE_CHUNK).min(r.len()));
            if let Some(i) = x.iter().position(|v| !v.is_finite()) {
                let at = r.start + lo + i;
                let tensor = match layout {
                    Some(l) => format!("{name} of {}", name_at(l, at)),
                    None => name.to_string(),
                };
                check_finite(&x[i..=i], file.path(), &tensor, r.start + lo + i)?;
            }
            file.write(name, 4 * (r.start + lo), f32_bytes(&x))?;
        }
    }
    Ok(())
}

/// Loads checkpoint `dir` into the host tensors, which must match `layout` (bf16 moments
/// are given as [`MasterMut::Bf16`]: rounded to nearest even, exact for a checkpoint saved
/// with bf16 moments).
pub fn load(
    dir: &Path,
    layout: &Layout,
    master: MasterMut<'_>,
    m: MasterMut<'_>,
    v: MasterMut<'_>,
) -> Result<TrainState> {
    let saved = Saved::open(dir, layout)?;
    let n = layout.total;
    for (field, mut dst) in [(Field::Master, master), (Field::M, m), (Field::V, v)] {
        assert_eq!(dst.len(), n, "the host holds every element");
        saved.read(field, 0, &mut dst)?;
    }
    Ok(saved.state)
}

/// Checkpoint `dir`'s `trainer_state.json` (small: read before a resume loads anything).
pub fn read_state(dir: &Path) -> Result<TrainState> {
    let st = dir.join(STATE);
    let text = std::fs::read_to_string(&st).map_err(io(&st))?;
    let state: TrainState = serde_json::from_str(&text).map_err(|e| Error::Weights {
        path: st.clone(),
        msg: format!("malformed trainer state: {e}"),
    })?;
    if state.format != FORMAT {
        return Err(Error::Weights {
            path: st,
            msg: format!("format {} is not {FORMAT}", state.format),
        });
    }
    Ok(state)
}

/// Refuses checkpoint `dir` (whose state is `state`) unless it was saved for `layout`.
pub fn check_layout(dir: &Path, state: &TrainState, layout: &Layout) -> Result<()> {
    let ours = fingerprint(layout);
    if state.layout != ours {
        return Err(Error::Weights {
            path: dir.join(STATE),
            msg: format!(
                "saved for another model: layout {} does not match this model's {ours} (different architecture or config)",
                state.layout
            ),
        });
    }
    Ok(())
}

/// A resumable checkpoint opened for reading: its state, and its optimizer tensors read a
/// range at a time (a node of a sharded run reads its pieces only).
pub struct Saved {
    pub state: TrainState,
    reader: pieces::Reader,
    path: PathBuf,
    total: usize,
    layout: Layout,
}

impl Saved {
    /// Opens checkpoint `dir`, which must be resumable and saved for `layout`.
    pub fn open(dir: &Path, layout: &Layout) -> Result<Saved> {
        let state = read_state(dir)?;
        check_layout(dir, &state, layout)?;
        let opt = dir.join(OPTIMIZER);
        if !resumable(dir) {
            return Err(Error::Weights {
                path: dir.into(),
                msg: format!(
                    "a model-only checkpoint (no {OPTIMIZER}): it cannot be resumed; start a new run from its weights with model.path"
                ),
            });
        }
        let reader = pieces::Reader::open(&opt)?;
        let n = layout.total;
        for field in [Field::Master, Field::M, Field::V] {
            let name = field.name();
            let info = reader.tensor(name).ok_or_else(|| Error::Tensor {
                path: opt.clone(),
                tensor: name.to_string(),
                expected: format!("f32 [{n}]"),
                got: "missing".into(),
            })?;
            if info.dtype != Dtype::F32 || info.shape != [n] {
                return Err(Error::Tensor {
                    path: opt.clone(),
                    tensor: name.to_string(),
                    expected: format!("f32 [{n}]"),
                    got: format!("{:?} {:?}", info.dtype, info.shape),
                });
            }
        }
        Ok(Saved {
            state,
            reader,
            path: opt,
            total: n,
            layout: layout.clone(),
        })
    }

    /// Fills `dst` with `field`'s elements `at..at + dst.len()`; a value that is not
    /// finite is an error naming the parameter and the file.
    pub fn read(&self, field: Field, at: usize, dst: &mut MasterMut<'_>) -> Result<()> {
        let info = self.reader.tensor(field.name()).expect("checked by open");
        assert!(
            at + dst.len() <= self.total,
            "within {}",
            self.path.display()
        );
        dst.try_fill(0..dst.len(), |first, out| {
            let from = at + first;
            self.reader.read_f32(info, from..from + out.len(), out)?;
            match out.iter().position(|v| !v.is_finite()) {
                None => Ok(()),
                Some(i) => Err(Error::Tensor {
                    path: self.path.clone(),
                    tensor: format!("{} of {}", field.name(), name_at(&self.layout, from + i)),
                    expected: "finite values".into(),
                    got: format!("{} at element {} of the flat tensor", out[i], from + i),
                }),
            }
        })
    }
}

#[cfg(test)]
mod tests;
