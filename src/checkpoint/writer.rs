//! Checkpoints written while training goes on, without a copy of the training state.
//!
//! At a step boundary the trainer starts a write ([`Writer::start`]) and goes on at once. A
//! writer thread writes the checkpoint's files block by block at their offsets
//! ([`super::state::Files`]), each block from the live state as long as the optimizer has
//! not changed it, else from the copy the optimizer staged before changing it
//! ([`super::staging`]): the checkpoint, HF export included, holds the state of its step
//! exactly, and the host holds at most the staging area (`checkpoint.staging_size`) besides
//! the training state. The optimizer waits only where the staging area is full, for the
//! writer to free a page; that wait, and the staging copies, are the only stall, reported
//! per step (`checkpoint_wait_s`) and per checkpoint.
//!
//! At most one write is in flight: the next one first waits for it. A failed write comes
//! back as an error from the next `poll`, `start` or `finish`, after the writer has removed
//! its temporary directory, so the previous complete checkpoint is untouched; a process
//! killed mid-write leaves only a temporary directory, which no resume picks and the next
//! run removes ([`super::state`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use half::bf16;

use super::staging::{self, Counts, Gate, Task};
use super::state::{self, Tensors, TrainState};
use super::{ExportOptions, MasterRef};
use crate::config::CheckpointContents;
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::shm::lent::Lent;

/// The master weights as the writer thread reads them (see [`Lent`]); Adam's m and v too,
/// as `F32` or `Bf16` (`memory.moments_dtype`).
pub enum LentMaster {
    F32(Lent<f32>),
    Split { hi: Lent<bf16>, lo: Lent<u16> },
    Bf16(Lent<bf16>),
}

impl LentMaster {
    /// Elements `r` (none of an empty one: the moments of a model-only checkpoint).
    fn slice(&self, r: std::ops::Range<usize>) -> MasterRef<'_> {
        match self {
            LentMaster::F32(x) if x.is_empty() => MasterRef::F32(&[]),
            LentMaster::F32(x) => MasterRef::F32(x.get(r)),
            LentMaster::Split { hi, lo } => MasterRef::Split {
                hi: hi.get(r.clone()),
                lo: lo.get(r),
            },
            LentMaster::Bf16(x) if x.is_empty() => MasterRef::Bf16(&[]),
            LentMaster::Bf16(x) => MasterRef::Bf16(x.get(r)),
        }
    }
}

/// The trainer's host tensors lent to the writer thread: it reads a block only while the
/// block's [`Gate`] state lets it (the trainer changes a block only after
/// [`Gate::before_change`]).
pub struct LentTensors {
    pub master: LentMaster,
    pub m: LentMaster,
    pub v: LentMaster,
}

impl LentTensors {
    /// Elements `r` of each (of the master only where the moments are not lent).
    fn slice(&self, r: std::ops::Range<usize>) -> Tensors<'_> {
        Tensors {
            master: self.master.slice(r.clone()),
            m: self.m.slice(r.clone()),
            v: self.v.slice(r),
        }
    }
}

/// A checkpoint that was written.
#[derive(Debug)]
pub struct Written {
    pub dir: PathBuf,
    /// Seconds from the start of the write to its rename.
    pub write_s: f64,
    /// Bytes of its files.
    pub bytes: u64,
    /// Seconds the optimizer spent on it (staging blocks, waiting for the writer), and
    /// the step loop waited for the write before it.
    pub stall_s: f64,
    /// How its blocks were written.
    pub blocks: Counts,
}

struct InFlight {
    handle: JoinHandle<Result<(PathBuf, f64)>>,
    gate: Arc<Gate>,
    /// Seconds the step loop waited for the previous write when this one started.
    waited_s: f64,
}

/// Where and how checkpoints are written.
pub struct Writer {
    job: Arc<Job>,
    /// The staging pages while no write is in flight.
    pages: Vec<Vec<f32>>,
    in_flight: Option<InFlight>,
}

impl Writer {
    /// A writer of checkpoints under `root`, with a staging area of at most
    /// `staging_bytes`, allocated now ([`staging::pages`]).
    pub fn new(
        root: PathBuf,
        keep_last: usize,
        layout: Layout,
        export: ExportOptions,
        staging_bytes: u64,
    ) -> Writer {
        Writer {
            job: Arc::new(Job {
                root,
                keep_last,
                layout,
                export,
            }),
            pages: staging::pages(staging_bytes),
            in_flight: None,
        }
    }

    /// Starts writing checkpoint `state` holding `contents` from `live` on the writer
    /// thread, after waiting for the write in flight. Returns the seconds waited, every
    /// write completed meanwhile, and the gate the trainer must pass before changing any
    /// block ([`Gate::before_change`]) until the write is done.
    pub fn start(
        &mut self,
        state: TrainState,
        live: LentTensors,
        contents: CheckpointContents,
    ) -> Result<(f64, Vec<Written>, Arc<Gate>)> {
        let t = Instant::now();
        let done: Vec<Written> = self.finish()?.into_iter().collect();
        let waited_s = t.elapsed().as_secs_f64();
        let moments = contents == CheckpointContents::Full;
        let pages = std::mem::take(&mut self.pages);
        let gate = Arc::new(Gate::new(&self.job.layout, pages, moments));
        let (job, g) = (Arc::clone(&self.job), Arc::clone(&gate));
        let handle = std::thread::Builder::new()
            .name("mt-checkpoint".into())
            .spawn(move || {
                let t = Instant::now();
                let dir = job.write(&state, &live, &g, contents)?;
                Ok((dir, t.elapsed().as_secs_f64()))
            })
            .map_err(|e| Error::Other(format!("start the checkpoint writer thread: {e}")))?;
        self.in_flight = Some(InFlight {
            handle,
            gate: Arc::clone(&gate),
            waited_s,
        });
        Ok((waited_s, done, gate))
    }

    /// The write in flight, if it has completed (its error, if it failed).
    pub fn poll(&mut self) -> Result<Option<Written>> {
        match &self.in_flight {
            Some(f) if f.handle.is_finished() => self.finish(),
            _ => Ok(None),
        }
    }

    /// Waits for the write in flight, if any.
    pub fn finish(&mut self) -> Result<Option<Written>> {
        let Some(f) = self.in_flight.take() else {
            return Ok(None);
        };
        let r = f.handle.join();
        // The thread closed the gate on its way out, panic included.
        self.pages = f.gate.take_pages();
        let (dir, write_s) =
            r.map_err(|_| Error::Other("the checkpoint writer thread panicked".into()))??;
        Ok(Some(Written {
            bytes: dir_bytes(&dir)?,
            dir,
            write_s,
            stall_s: f.waited_s + f.gate.owner_s(),
            blocks: f.gate.counts(),
        }))
    }

    /// Writes checkpoint `state` holding `contents` now, on this thread, after waiting for
    /// the write in flight: `fill` writes every block ([`state::save_with`]), for a state
    /// not held whole on this host (gathered block by block across nodes); then prunes as a
    /// background write does. Returns the writes completed meanwhile, this one last.
    pub fn write_now(
        &mut self,
        state: &TrainState,
        contents: CheckpointContents,
        fill: impl FnOnce(&state::Files) -> Result<()>,
    ) -> Result<Vec<Written>> {
        let t = Instant::now();
        let mut done: Vec<Written> = self.finish()?.into_iter().collect();
        let job = &self.job;
        let dir = state::save_with(&job.root, state, &job.layout, &job.export, contents, fill)?;
        state::prune(&job.root, job.keep_last)?;
        let write_s = t.elapsed().as_secs_f64();
        done.push(Written {
            bytes: dir_bytes(&dir)?,
            dir,
            write_s,
            stall_s: write_s,
            blocks: Counts {
                live: job.layout.blocks.len(),
                ..Counts::default()
            },
        });
        Ok(done)
    }

    pub fn root(&self) -> &Path {
        &self.job.root
    }
}

/// Bytes of the files in `dir`.
fn dir_bytes(dir: &Path) -> Result<u64> {
    Ok(std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.len())
        .sum())
}

impl Drop for Writer {
    /// A run that fails still lets the write in flight complete (it holds a consistent
    /// state), so that it is not left behind half written.
    fn drop(&mut self) {
        if self.in_flight.is_some() {
            tracing::info!("waiting for the checkpoint write in flight");
            if let Err(e) = self.finish() {
                tracing::error!("checkpoint write failed: {e}");
            }
        }
    }
}

/// Closes the gate when the writer stops, however it stops.
struct Closing<'a>(&'a Gate);

impl Drop for Closing<'_> {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// One checkpoint write: save, then prune.
struct Job {
    root: PathBuf,
    keep_last: usize,
    layout: Layout,
    export: ExportOptions,
}

impl Job {
    fn write(
        &self,
        st: &TrainState,
        live: &LentTensors,
        gate: &Gate,
        contents: CheckpointContents,
    ) -> Result<PathBuf> {
        let _closing = Closing(gate);
        let layout = &self.layout;
        let dir = state::save_with(&self.root, st, layout, &self.export, contents, |files| {
            while let Some(task) = gate.next() {
                match task {
                    Task::Write(b, staged) => {
                        let r = files.write_block(b, &staged);
                        gate.written(b, Some(staged));
                        r?;
                    }
                    Task::Copy(b, pages) => {
                        gate.copy(b, pages, &live.slice(layout.blocks[b].range()))
                    }
                    Task::Live(b) => {
                        let r = files.write_block(b, &live.slice(layout.blocks[b].range()));
                        gate.written(b, None);
                        r?;
                    }
                }
            }
            Ok(())
        })?;
        state::prune(&self.root, self.keep_last)?;
        Ok(dir)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::MasterMut;
    use crate::config::DType;
    use crate::config::hf::{HfConfig, ModelSpec};
    use crate::shm::lent::Buf;

    fn layout() -> Layout {
        let hf: HfConfig = serde_json::from_str(
            r#"{"model_type":"llama","vocab_size":37,"hidden_size":24,"intermediate_size":40,
            "num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2}"#,
        )
        .unwrap();
        Layout::new(&ModelSpec::from_hf(&hf, Path::new("config.json")).unwrap())
    }

    fn state(step: u64, layout: &Layout) -> TrainState {
        TrainState {
            format: state::FORMAT,
            step,
            updates: step,
            nan_run: 0,
            layout: state::fingerprint(layout),
            schedule: None,
            extra: Vec::new(),
        }
    }

    fn scratch(name: &str) -> (PathBuf, ExportOptions) {
        let dir = std::env::temp_dir().join(format!("mt-writer-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let src = dir.join("src");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(src.join("config.json"), "{}").unwrap();
        let export = ExportOptions {
            dtype: DType::Float32,
            source: src,
            max_shard_bytes: 1 << 30,
            carried: Default::default(),
        };
        (dir, export)
    }

    fn lend(master: &Buf<f32>, m: &Buf<f32>, v: &Buf<f32>) -> LentTensors {
        LentTensors {
            master: LentMaster::F32(master.lend()),
            m: LentMaster::F32(m.lend()),
            v: LentMaster::F32(v.lend()),
        }
    }

    fn buf(n: usize, f: impl Fn(usize) -> f32) -> Buf<f32> {
        let mut b = Buf::zeroed(n);
        b.as_mut_slice()
            .iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = f(i));
        b
    }

    /// While the writer writes the checkpoint of step 1, the "optimizer" changes every
    /// block twice, each after `before_change`: without staging (it waits for each block),
    /// with a staging area smaller than a block (the same), and with room for several
    /// blocks. The checkpoint, export included, holds step 1's values, and the staging
    /// pages all come back.
    #[test]
    fn staged_writes_hold_their_step_while_training_changes_the_state() {
        let l = layout();
        let n = l.total;
        let val = |i: usize, k: u32| (i as f32 * 0.37 + k as f32).sin();
        for staging in [0, 4 << 10, 1 << 20] {
            let (dir, export) = scratch(&format!("staged-{staging}"));
            let mut w = Writer::new(dir.join("ck"), 2, l.clone(), export, staging);
            let pages = w.pages.len();
            let mut master = buf(n, |i| val(i, 1));
            let mut m = buf(n, |i| val(i, 2));
            let mut v = buf(n, |i| val(i, 3).abs());
            let want = (
                master.as_slice().to_vec(),
                m.as_slice().to_vec(),
                v.as_slice().to_vec(),
            );
            // Every change below follows `before_change` of its block.
            let lent = lend(&master, &m, &v);
            let (_, _, gate) = w
                .start(state(1, &l), lent, CheckpointContents::Full)
                .unwrap();
            for _ in 0..2 {
                for (b, block) in l.blocks.iter().enumerate() {
                    let live = Tensors {
                        master: MasterRef::F32(master.as_slice()),
                        m: MasterRef::F32(m.as_slice()),
                        v: MasterRef::F32(v.as_slice()),
                    };
                    gate.before_change(b, &live);
                    for x in [&mut master, &mut m, &mut v] {
                        x.range_mut(block.range())
                            .iter_mut()
                            .for_each(|x| *x += 1.0);
                    }
                }
            }
            let written = w.finish().unwrap().expect("a write was in flight");
            assert_eq!(w.pages.len(), pages, "every staging page is back");
            // Without room for a block's copy, every block is written from the live state.
            let c = written.blocks;
            assert_eq!(c.staged + c.copied + c.live, l.blocks.len(), "{c:?}");
            assert_eq!(c.live == l.blocks.len(), staging < 1 << 20, "{c:?}");
            assert!(written.dir.ends_with("step-00000001"));
            assert!(written.bytes as usize > 12 * n, "{written:?}");
            let (mut a, mut b, mut c) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
            let (mb, mc) = (MasterMut::F32(&mut b), MasterMut::F32(&mut c));
            state::load(&written.dir, &l, MasterMut::F32(&mut a), mb, mc).unwrap();
            assert!(
                (&a, &b, &c) == (&want.0, &want.1, &want.2),
                "staging {staging}"
            );
            let mut exported = vec![0.0; n];
            crate::checkpoint::load_pretrained(
                &written.dir,
                &l,
                &mut MasterMut::F32(&mut exported),
            )
            .unwrap();
            for (b, t) in l.tensors() {
                let r = Layout::global_range(b, t);
                assert!(
                    exported[r.clone()] == want.0[r],
                    "the export holds step 1's master"
                );
            }
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    #[test]
    fn a_failed_write_is_reported_and_leaves_the_previous_checkpoint() {
        let (dir, export) = scratch("fail");
        let src = export.source.clone();
        let l = layout();
        let root = dir.join("ck");
        let mut w = Writer::new(root.clone(), 1, l.clone(), export, 1 << 20);
        let z = buf(l.total, |_| 0.5);
        for step in [1, 2] {
            let lent = lend(&z, &z, &z);
            w.start(state(step, &l), lent, CheckpointContents::Full)
                .unwrap();
            if step == 1 {
                w.finish().unwrap();
                // The next write cannot read the source config: it fails after the weights.
                std::fs::remove_file(src.join("config.json")).unwrap();
            }
        }
        let e = w.finish().unwrap_err().to_string();
        assert!(e.contains("config.json"), "{e}");
        let left: Vec<String> = std::fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into())
            .collect();
        assert_eq!(left, ["step-00000001"], "nothing partial is left");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
