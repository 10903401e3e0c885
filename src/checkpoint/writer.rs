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
//! A state not held whole on this host (node 0 of a run with the state sharded across
//! nodes) is written from windows the step loop gathers and stages itself
//! ([`Writer::start_fed`], [`super::fed`]): training waits for the gathers, and for the
//! writer only where the staging area is full.
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

use super::area::Area;
use super::fed::Feed;
use super::staging::{self, Counts, Gate, Task, Unit};
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
    source: Source,
    /// Seconds the step loop waited for the previous write when this one started.
    waited_s: f64,
}

/// Where a write in flight takes its values and its staging pages are.
enum Source {
    /// The live state, or the copies the optimizer staged ([`Writer::start`]).
    Gate(Arc<Gate>),
    /// The windows the step loop staged ([`Writer::start_fed`]).
    Fed(Arc<Feed>),
}

impl Source {
    fn take_pages(&self) -> Vec<Vec<f32>> {
        match self {
            Source::Gate(g) => g.take_pages(),
            Source::Fed(f) => f.take_pages(),
        }
    }

    fn owner_s(&self) -> f64 {
        match self {
            Source::Gate(g) => g.owner_s(),
            Source::Fed(f) => f.owner_s(),
        }
    }

    fn counts(&self) -> Counts {
        match self {
            Source::Gate(g) => g.counts(),
            Source::Fed(f) => Counts {
                staged: f.blocks(),
                ..Counts::default()
            },
        }
    }
}

/// Where and how checkpoints are written.
pub struct Writer {
    job: Arc<Job>,
    /// The staging pages while no write is in flight (touched in the background).
    pages: Area,
    /// Elements per staging page, and pages.
    page: usize,
    page_count: usize,
    in_flight: Option<InFlight>,
}

impl Writer {
    /// A writer of checkpoints under `root`, with a staging area of at most
    /// `staging_bytes`, touched in the background from now on ([`Area`]).
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
            pages: Area::touch_in_background(
                staging::page_count(staging_bytes),
                staging::page_elems(staging_bytes),
            ),
            page: staging::page_elems(staging_bytes),
            page_count: staging::page_count(staging_bytes),
            in_flight: None,
        }
    }

    /// Starts writing checkpoint `state` holding `contents` from `live` on the writer
    /// thread, after waiting for the write in flight. Blocks `..moments_due_below` have
    /// their moments pass of this step still to run: the writer waits for each
    /// ([`Gate::ready`]). Returns the seconds waited, every write completed meanwhile, and
    /// the gate the trainer must pass before changing any block ([`Gate::before_change`])
    /// until the write is done.
    pub fn start(
        &mut self,
        state: TrainState,
        live: LentTensors,
        contents: CheckpointContents,
        moments_due_below: usize,
    ) -> Result<(f64, Vec<Written>, Arc<Gate>)> {
        let (waited_s, done, pages) = self.wait_previous()?;
        let moments = contents == CheckpointContents::Full;
        let gate = Arc::new(Gate::new(
            &self.job.layout,
            pages,
            moments,
            moments_due_below,
        ));
        let (job, g) = (Arc::clone(&self.job), Arc::clone(&gate));
        let write = move || job.write(&state, &live, &g, contents);
        self.spawn(write, Source::Gate(Arc::clone(&gate)), waited_s)
            .map_err(spawn_error)?;
        Ok((waited_s, done, gate))
    }

    /// Whether the staging area holds a window of `n` elements of a checkpoint (with
    /// `moments`, m and v too), as [`Writer::start_fed`] needs.
    pub fn can_feed(&self, n: usize, moments: bool) -> bool {
        self.page_count > 0 && Feed::pages_for(self.page, n, moments) <= self.page_count
    }

    /// Starts writing checkpoint `state` holding `contents` on the writer thread from the
    /// windows the caller stages in the returned [`Feed`] ([`Feed::stage`], then
    /// [`Feed::end`]), after waiting for the write in flight: for a state not held whole on
    /// this host (node 0 of a sharded run gathers it window by window). Returns the seconds
    /// waited and every write completed meanwhile. Windows must fit
    /// ([`Writer::can_feed`]).
    pub fn start_fed(
        &mut self,
        state: TrainState,
        contents: CheckpointContents,
    ) -> Result<(f64, Vec<Written>, Arc<Feed>)> {
        let (waited_s, done, pages) = self.wait_previous()?;
        let moments = contents == CheckpointContents::Full;
        let feed = Arc::new(Feed::new(pages, moments));
        let (job, f) = (Arc::clone(&self.job), Arc::clone(&feed));
        let write = move || job.write_fed(&state, &f, contents);
        if let Err(e) = self.spawn(write, Source::Fed(Arc::clone(&feed)), waited_s) {
            feed.close();
            feed.end(false, 0.0);
            self.pages.put(feed.take_pages());
            return Err(spawn_error(e));
        }
        Ok((waited_s, done, feed))
    }

    /// Waits for the write in flight and for the staging area to be touched: the seconds
    /// waited, what completed meanwhile, and the staging pages.
    fn wait_previous(&mut self) -> Result<(f64, Vec<Written>, Vec<Vec<f32>>)> {
        let t = Instant::now();
        let done: Vec<Written> = self.finish()?.into_iter().collect();
        let pages = self.pages.take();
        Ok((t.elapsed().as_secs_f64(), done, pages))
    }

    /// Starts `write` (timed) on the writer thread as the write in flight from `source`.
    fn spawn(
        &mut self,
        write: impl FnOnce() -> Result<PathBuf> + Send + 'static,
        source: Source,
        waited_s: f64,
    ) -> std::io::Result<()> {
        let handle = std::thread::Builder::new()
            .name("mt-checkpoint".into())
            .spawn(move || {
                let t = Instant::now();
                let dir = write()?;
                Ok((dir, t.elapsed().as_secs_f64()))
            })?;
        self.in_flight = Some(InFlight {
            handle,
            source,
            waited_s,
        });
        Ok(())
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
        self.pages.put(f.source.take_pages());
        let (dir, write_s) =
            r.map_err(|_| Error::Other("the checkpoint writer thread panicked".into()))??;
        Ok(Some(Written {
            bytes: dir_bytes(&dir)?,
            dir,
            write_s,
            stall_s: f.waited_s + f.source.owner_s(),
            blocks: f.source.counts(),
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

/// Closes the feed when the writer stops, however it stops.
struct ClosingFeed<'a>(&'a Feed);

impl Drop for ClosingFeed<'_> {
    fn drop(&mut self) {
        self.0.close();
    }
}

fn spawn_error(e: std::io::Error) -> Error {
    Error::Other(format!("start the checkpoint writer thread: {e}"))
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
            let block = |u: Unit| live.slice(layout.blocks[u.block].range());
            while let Some(task) = gate.next() {
                match task {
                    Task::Write(u, staged) => {
                        let r = files.write_unit(u, &staged);
                        gate.written(u, Some(staged));
                        r?;
                    }
                    Task::Copy(u, pages) => gate.copy(u, pages, &block(u)),
                    Task::Live(u) => {
                        let r = files.write_unit(u, &block(u));
                        gate.written(u, None);
                        r?;
                    }
                }
            }
            Ok(())
        })?;
        state::prune(&self.root, self.keep_last)?;
        Ok(dir)
    }

    /// Writes checkpoint `st` from the windows staged in `feed`, in their order.
    fn write_fed(
        &self,
        st: &TrainState,
        feed: &Feed,
        contents: CheckpointContents,
    ) -> Result<PathBuf> {
        let _closing = ClosingFeed(feed);
        let layout = &self.layout;
        let dir = state::save_with(&self.root, st, layout, &self.export, contents, |files| {
            while let Some((b, window, staged)) = feed.next()? {
                let r = files.write_window_alone(b, window, &staged);
                feed.written(staged);
                r?;
            }
            Ok(())
        })?;
        state::prune(&self.root, self.keep_last)?;
        Ok(dir)
    }
}

#[cfg(test)]
mod tests;
