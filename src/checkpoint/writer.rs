//! Checkpoints written while training goes on. At a step boundary the trainer copies what
//! a checkpoint holds (fp32 master, joined if it is split, Adam m and v: 12 bytes per
//! parameter) into a snapshot buffer, in parallel, and a writer thread writes, fsyncs and renames the checkpoint from
//! it; the step loop waits only for the copy. At most one write is in flight: the next
//! snapshot first waits for the previous write, whose buffer it reuses. A failed write
//! comes back as an error from the next `poll`, `start` or `finish`, after the writer has
//! removed its partial files, so the previous complete checkpoint is untouched.
//!
//! The snapshot doubles the checkpointed state in host RAM (see [`snapshot_bytes`]);
//! `checkpoint.background: false` writes from the live state instead, while training waits.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use rayon::prelude::*;

use super::state::{self, Tensors, TrainState};
use super::{ExportOptions, MasterRef};
use crate::config::CheckpointContents;
use crate::error::{Error, Result};
use crate::layout::Layout;

/// Host bytes of the snapshot buffer a background writer holds for `layout`: the fp32
/// master, and the Adam moments where periodic checkpoints hold the optimizer state
/// (`optimizer`).
pub fn snapshot_bytes(layout: &Layout, optimizer: bool) -> u64 {
    layout.total as u64 * if optimizer { 12 } else { 4 }
}

/// A copy of the checkpointed host tensors.
struct Snapshot {
    master: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
}

impl Snapshot {
    /// Allocates and touches every page now, so that the first snapshot costs no page
    /// faults and a host short of memory fails at start-up, not at the first checkpoint.
    /// Without `optimizer` it holds the master only.
    fn new(n: usize, optimizer: bool) -> Snapshot {
        let touched = |n: usize| {
            let mut x = vec![0.0f32; n];
            x.par_chunks_mut(1 << 16).for_each(|c| c.fill(0.0));
            x
        };
        let moments = if optimizer { n } else { 0 };
        Snapshot {
            master: touched(n),
            m: touched(moments),
            v: touched(moments),
        }
    }

    /// Copies what a checkpoint of `contents` holds.
    fn fill(&mut self, src: &Tensors, contents: CheckpointContents) {
        src.master.read_into(&mut self.master);
        if contents == CheckpointContents::Full {
            MasterRef::F32(src.m).read_into(&mut self.m);
            MasterRef::F32(src.v).read_into(&mut self.v);
        }
    }

    fn tensors(&self) -> Tensors<'_> {
        Tensors {
            master: MasterRef::F32(&self.master),
            m: &self.m,
            v: &self.v,
        }
    }
}

/// A checkpoint that was written.
#[derive(Debug)]
pub struct Written {
    pub dir: PathBuf,
    /// Seconds from the start of the write (after the snapshot) to its rename.
    pub write_s: f64,
}

/// Where and how checkpoints are written.
pub struct Writer {
    job: Arc<Job>,
    background: bool,
    /// The snapshot buffer while no write is in flight.
    idle: Option<Snapshot>,
    in_flight: Option<JoinHandle<(Snapshot, Result<Written>)>>,
}

impl Writer {
    /// A writer of checkpoints under `root`; with `background`, it allocates its snapshot
    /// buffer ([`snapshot_bytes`]) now, with the moments if periodic checkpoints hold the
    /// optimizer state (`optimizer`).
    pub fn new(
        root: PathBuf,
        keep_last: usize,
        layout: Layout,
        export: ExportOptions,
        background: bool,
        optimizer: bool,
    ) -> Writer {
        let idle = background.then(|| Snapshot::new(layout.total, optimizer));
        Writer {
            job: Arc::new(Job {
                root,
                keep_last,
                layout,
                export,
            }),
            background,
            idle,
            in_flight: None,
        }
    }

    /// Starts checkpoint `state` of `live` holding `contents`: in the background from a
    /// snapshot (after waiting for the previous write), or in place. Returns the seconds
    /// the caller waited for the snapshot (or the whole write), and every write that
    /// completed meanwhile.
    pub fn start(
        &mut self,
        state: TrainState,
        live: &Tensors,
        contents: CheckpointContents,
    ) -> Result<(f64, Vec<Written>)> {
        let mut done: Vec<Written> = self.finish()?.into_iter().collect();
        let t = Instant::now();
        if !self.background {
            done.push(self.write_now(&state, live, contents)?);
            return Ok((t.elapsed().as_secs_f64(), done));
        }
        let mut snap = self
            .idle
            .take()
            .expect("the buffer is back once no write is in flight");
        snap.fill(live, contents);
        let snapshot_s = t.elapsed().as_secs_f64();
        let job = Arc::clone(&self.job);
        let handle = std::thread::Builder::new()
            .name("mt-checkpoint".into())
            .spawn(move || {
                let t = Instant::now();
                let r = job
                    .write(&state, &snap.tensors(), contents)
                    .map(|dir| Written {
                        dir,
                        write_s: t.elapsed().as_secs_f64(),
                    });
                (snap, r)
            })
            .map_err(|e| Error::Other(format!("start the checkpoint writer thread: {e}")))?;
        self.in_flight = Some(handle);
        Ok((snapshot_s, done))
    }

    /// Writes checkpoint `state` from `live` now (after the write in flight), for the end
    /// of a run when nothing runs alongside. Returns every write completed.
    pub fn write_final(
        &mut self,
        state: TrainState,
        live: &Tensors,
        contents: CheckpointContents,
    ) -> Result<Vec<Written>> {
        let mut done: Vec<Written> = self.finish()?.into_iter().collect();
        done.push(self.write_now(&state, live, contents)?);
        Ok(done)
    }

    /// The write in flight, if it has completed (its error, if it failed).
    pub fn poll(&mut self) -> Result<Option<Written>> {
        match &self.in_flight {
            Some(h) if h.is_finished() => self.finish(),
            _ => Ok(None),
        }
    }

    /// Waits for the write in flight, if any.
    pub fn finish(&mut self) -> Result<Option<Written>> {
        let Some(handle) = self.in_flight.take() else {
            return Ok(None);
        };
        let (snap, r) = handle
            .join()
            .map_err(|_| Error::Other("the checkpoint writer thread panicked".into()))?;
        self.idle = Some(snap);
        r.map(Some)
    }

    fn write_now(
        &self,
        state: &TrainState,
        live: &Tensors,
        contents: CheckpointContents,
    ) -> Result<Written> {
        let t = Instant::now();
        let dir = self.job.write(state, live, contents)?;
        Ok(Written {
            dir,
            write_s: t.elapsed().as_secs_f64(),
        })
    }

    pub fn root(&self) -> &Path {
        &self.job.root
    }
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
        tensors: &Tensors,
        contents: CheckpointContents,
    ) -> Result<PathBuf> {
        let dir = state::save(
            &self.root,
            st,
            &self.layout,
            tensors,
            &self.export,
            contents,
        )?;
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

    fn layout() -> Layout {
        let hf: HfConfig = serde_json::from_str(
            r#"{"model_type":"llama","vocab_size":37,"hidden_size":24,"intermediate_size":40,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2}"#,
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
        }
    }

    #[test]
    fn background_writes_hold_the_snapshot_not_the_live_state() {
        let dir = std::env::temp_dir().join(format!("mt-writer-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let src = dir.join("src");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(src.join("config.json"), "{}").unwrap();
        let l = layout();
        let export = ExportOptions {
            dtype: DType::Float32,
            source: src,
            max_shard_bytes: 1 << 30,
        };
        let mut w = Writer::new(dir.join("ck"), 2, l.clone(), export, true, true);
        let n = l.total;
        let (mut master, m, v) = (vec![1.0f32; n], vec![2.0f32; n], vec![3.0f32; n]);
        for step in 1..=3u64 {
            master.fill(step as f32);
            let live = Tensors {
                master: MasterRef::F32(&master),
                m: &m,
                v: &v,
            };
            w.start(state(step, &l), &live, CheckpointContents::Full)
                .unwrap();
            // Training goes on and changes the live state while the write runs.
            master.fill(-1.0);
        }
        let last = w.finish().unwrap().expect("a write was in flight");
        assert!(last.dir.ends_with("step-00000003"));
        let (mut a, mut b, mut c) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        let st = state::load(&last.dir, &l, MasterMut::F32(&mut a), &mut b, &mut c).unwrap();
        assert_eq!(st.step, 3);
        assert!(a.iter().all(|&x| x == 3.0) && b == m && c == v);
        let kept: Vec<u64> = state::complete(w.root())
            .unwrap()
            .iter()
            .map(|c| c.0)
            .collect();
        assert_eq!(kept, [2, 3]);
    }

    #[test]
    fn in_place_writes_are_done_when_start_returns() {
        let dir = std::env::temp_dir().join(format!("mt-writer-sync-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let src = dir.join("src");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(src.join("config.json"), "{}").unwrap();
        let l = layout();
        let export = ExportOptions {
            dtype: DType::Bfloat16,
            source: src,
            max_shard_bytes: 1 << 30,
        };
        let mut w = Writer::new(dir.join("ck"), 2, l.clone(), export, false, true);
        let z = vec![0.25f32; l.total];
        let live = Tensors {
            master: MasterRef::F32(&z),
            m: &z,
            v: &z,
        };
        let (_, done) = w
            .start(state(1, &l), &live, CheckpointContents::Full)
            .unwrap();
        assert_eq!(done.len(), 1);
        assert!(done[0].dir.join("COMPLETE").is_file());
        assert!(w.finish().unwrap().is_none(), "nothing in flight");
    }

    #[test]
    fn a_failed_write_is_reported_and_leaves_the_previous_checkpoint() {
        let dir = std::env::temp_dir().join(format!("mt-writer-fail-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let src = dir.join("src");
        std::fs::create_dir_all(&src).unwrap();
        std::fs::write(src.join("config.json"), "{}").unwrap();
        let l = layout();
        let export = ExportOptions {
            dtype: DType::Float32,
            source: src.clone(),
            max_shard_bytes: 1 << 30,
        };
        let root = dir.join("ck");
        let mut w = Writer::new(root.clone(), 1, l.clone(), export, true, true);
        let z = vec![0.5f32; l.total];
        let live = Tensors {
            master: MasterRef::F32(&z),
            m: &z,
            v: &z,
        };
        w.start(state(1, &l), &live, CheckpointContents::Full)
            .unwrap();
        w.finish().unwrap();
        // The next write cannot read the source config: it fails after writing weights.
        std::fs::remove_file(src.join("config.json")).unwrap();
        w.start(state(2, &l), &live, CheckpointContents::Full)
            .unwrap();
        let e = w.finish().unwrap_err().to_string();
        assert!(e.contains("config.json"), "{e}");
        let left: Vec<String> = std::fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into())
            .collect();
        assert_eq!(left, ["step-00000001"], "nothing partial is left");
    }
}
