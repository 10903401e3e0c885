//! The hand-over between a checkpoint written while training goes on and the optimizer.
//!
//! The writer thread writes checkpoint N a part of a block at a time ([`Part`]: a block's
//! weights, the fp32 master with its export; or its Adam moments, m and v), each from the
//! live state while the optimizer has not changed it since step N. The two parts change at
//! different times: an update's weights pass changes the master as the next forward needs
//! it, its moments pass changes m and v during the following backward (`launcher`'s
//! `HostState::defer_moments`). Before the optimizer changes a part the writer has not
//! written yet, [`Gate::before_change`] copies it into the staging area, and the writer
//! writes that copy instead; where the staging area has no room for it, the optimizer waits
//! for the writer. So the weights pass, which the GPUs wait for, copies 4 bytes per
//! parameter at most, and m and v wait for the writer until the moments pass a step later.
//! The staging area is a fixed set of pages allocated once (`checkpoint.staging_size`), so
//! the host peak is the training state plus that bound, not a second copy of the state.
//!
//! A checkpoint may start before its step's moments pass has run on every block: those
//! blocks' moments parts wait (`Waiting`: their checkpoint values do not exist yet) until
//! the pass marks them [`Gate::ready`].
//!
//! A part's state: `Waiting`, `Pending` (its checkpoint values are the live ones),
//! `Reading` (the writer reads it from the live state: the optimizer must not change it),
//! `Staging` (the optimizer copies it), `Staged` (its copy awaits the writer), `Done`
//! (written). The writer takes staged parts first, oldest first, which frees pages soonest;
//! then the pending weights in the order the optimizer updates them, then the pending
//! moments in the order the next moments pass changes them (last block first), copying each
//! into free pages before writing it when there is room, so that a slow disk holds up the
//! optimizer only when the staging area is full.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::ops::Range;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Instant;

use rayon::prelude::*;

use super::state::{BlockValues, Field, Tensors};
use crate::layout::Layout;

/// Staging bytes per parameter of a checkpoint: the fp32 master, and Adam's m and v where
/// it holds the optimizer state (`moments`).
pub fn bytes_per_param(moments: bool) -> u64 {
    if moments { 12 } else { 4 }
}

/// What of a block the writer writes, and the optimizer stages, as one unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// The fp32 master (and the export made from it).
    Weights,
    /// Adam's m and v.
    Moments,
}

impl Part {
    /// The checkpoint fields it holds.
    pub fn fields(self) -> &'static [Field] {
        match self {
            Part::Weights => &[Field::Master],
            Part::Moments => &[Field::M, Field::V],
        }
    }
}

/// The fields a checkpoint holds: the master, and m and v with `moments`.
pub fn fields(moments: bool) -> &'static [Field] {
    if moments {
        &[Field::Master, Field::M, Field::V]
    } else {
        &[Field::Master]
    }
}

/// The default staging area: two of the largest blocks, so that the optimizer can stage
/// one while the writer writes another.
pub fn default_bytes(layout: &Layout, moments: bool) -> u64 {
    2 * layout.max_block_len() as u64 * bytes_per_param(moments)
}

/// The default staging area of node 0 of a run whose state is sharded across nodes, which
/// gathers a checkpoint a window of `window` elements at a time and stages each window
/// ([`super::fed`]): two windows, so that it can gather one while the writer writes the
/// other, with each window's fields rounded up to whole pages.
pub fn window_bytes(window: usize, moments: bool) -> u64 {
    let mut bytes = 2 * window as u64 * bytes_per_param(moments);
    while page_count(bytes) < 2 * super::fed::Feed::pages_for(page_elems(bytes), window, moments) {
        // A page more; pages grow with the area, so fewer are needed per window.
        bytes += 4 * page_elems(bytes) as u64;
    }
    bytes
}

/// A staging area that holds every block at once, so that no checkpoint waits for the
/// writer: each block's fields (master, and m and v with `moments`) start on a page of their
/// own, so each may take up to one page more than its elements (the largest page, whatever
/// the area's size picks).
pub fn full_bytes(layout: &Layout, moments: bool) -> u64 {
    let fields = bytes_per_param(moments) / 4;
    let page = page_elems(u64::MAX) as u64;
    layout
        .blocks
        .iter()
        .map(|b| fields * 4 * (b.len as u64).div_ceil(page) * page)
        .sum::<u64>()
        .max(default_bytes(layout, moments))
}

/// Elements per page of a staging area of `bytes`: 4 MiB pages, smaller ones (down to 4
/// KiB) for a small area, so that it holds at least 16.
pub fn page_elems(bytes: u64) -> usize {
    ((bytes / 4 / 16) as usize).clamp(1 << 10, 1 << 20)
}

/// Whole pages in a staging area of `bytes`.
pub fn page_count(bytes: u64) -> usize {
    bytes as usize / (4 * page_elems(bytes))
}

/// Checkpoint values of a block (or of a window of one) copied into staging pages: some of
/// its fields (a [`Part`]'s, or all a checkpoint holds), each starting on a page of its own.
pub struct Staged {
    page: usize,
    /// By field (`Field as usize`): its pages, where staged.
    fields: [Option<Vec<Vec<f32>>>; 3],
}

impl Staged {
    /// Copies `fields` of `live` (one block's elements) into `pages` (in parallel).
    fn copy(pages: Vec<Vec<f32>>, live: &Tensors, fields: &[Field]) -> Staged {
        Staged::fill(
            pages,
            live.master.len(),
            fields,
            |field, r, out| match field {
                Field::Master => live.master.slice(r).read_into(out),
                Field::M => live.m.slice(r).read_into(out),
                Field::V => live.v.slice(r).read_into(out),
            },
        )
    }

    /// Copies elements `0..n` of `values` (a window of a block, wherever it is held) into
    /// `pages` (in parallel): the master, and the moments if `moments`.
    pub(super) fn from_values(
        pages: Vec<Vec<f32>>,
        values: &dyn BlockValues,
        n: usize,
        moments: bool,
    ) -> Staged {
        Staged::fill(pages, n, fields(moments), |field, r, out| {
            out.copy_from_slice(&values.values(field, r))
        })
    }

    /// `n` elements of each of `fields` into `pages`, each field from a page of its own,
    /// the pages in parallel: `read(field, r, out)` fills `out` with elements `r` of
    /// `field`.
    fn fill(
        mut pages: Vec<Vec<f32>>,
        n: usize,
        fields: &[Field],
        read: impl Fn(Field, Range<usize>, &mut [f32]) + Sync,
    ) -> Staged {
        let page = pages.first().map_or(1, Vec::len);
        let per_field = n.div_ceil(page);
        let mut staged: Vec<(Field, Vec<Vec<f32>>)> = fields
            .iter()
            .map(|&f| (f, pages.drain(..per_field).collect()))
            .collect();
        staged.par_iter_mut().for_each(|(field, f)| {
            f.par_iter_mut().enumerate().for_each(|(i, p)| {
                let r = i * page..((i + 1) * page).min(n);
                let len = r.len();
                read(*field, r, &mut p[..len]);
            })
        });
        let mut out = Staged {
            page,
            fields: [None, None, None],
        };
        for (field, f) in staged {
            out.fields[field as usize] = Some(f);
        }
        out
    }

    pub(super) fn into_pages(self) -> impl Iterator<Item = Vec<f32>> {
        self.fields.into_iter().flatten().flatten()
    }
}

impl BlockValues for Staged {
    fn values(&self, field: Field, r: Range<usize>) -> Cow<'_, [f32]> {
        let pages = self.fields[field as usize]
            .as_ref()
            .expect("only the staged fields are read");
        let (first, last) = (r.start / self.page, r.end.saturating_sub(1) / self.page);
        let at = r.start % self.page;
        if r.is_empty() || first == last {
            return Cow::Borrowed(&pages[first][at..at + r.len()]);
        }
        let mut out = Vec::with_capacity(r.len());
        for (p, page) in pages.iter().enumerate().take(last + 1).skip(first) {
            let lo = r.start.max(p * self.page) - p * self.page;
            let hi = r.end.min((p + 1) * self.page) - p * self.page;
            out.extend_from_slice(&page[lo..hi]);
        }
        Cow::Owned(out)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Waiting,
    Pending,
    Reading,
    Staging,
    Staged,
    Done,
}

/// A part of a block: what the writer writes and the optimizer stages as one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unit {
    pub block: usize,
    pub part: Part,
}

impl Unit {
    /// Its index in [`Inner::status`].
    fn index(self) -> usize {
        2 * self.block + self.part as usize
    }
}

struct Inner {
    /// By [`Unit::index`].
    status: Vec<Status>,
    /// Staged parts, oldest first, with their copies.
    queue: VecDeque<(Unit, Staged)>,
    free: Vec<Vec<f32>>,
    /// Parts not written yet.
    left: usize,
    /// The writer has stopped (done or failed): nothing is read from the live state.
    closed: bool,
    /// Seconds the optimizer spent in [`Gate::before_change`] (staging and waiting).
    owner_s: f64,
    counts: Counts,
}

impl Inner {
    fn status(&self, u: Unit) -> Status {
        self.status[u.index()]
    }

    fn set(&mut self, u: Unit, s: Status) {
        self.status[u.index()] = s;
    }

    /// The first pending `part` in the order its pass changes them: weights first block
    /// first, moments last block first.
    fn first_pending(&self, part: Part) -> Option<Unit> {
        let n = self.status.len() / 2;
        let unit = |block| Unit { block, part };
        let pending = |u: &Unit| self.status(*u) == Status::Pending;
        match part {
            Part::Weights => (0..n).map(unit).find(pending),
            Part::Moments => (0..n).rev().map(unit).find(pending),
        }
    }

    /// The next part the writer takes from the live state: the weights before the moments,
    /// as the passes change them.
    fn next_pending(&self) -> Option<Unit> {
        self.first_pending(Part::Weights)
            .or_else(|| self.first_pending(Part::Moments))
    }
}

/// How the parts of a checkpoint were written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// From a copy the optimizer staged before changing the part.
    pub staged: usize,
    /// From a copy the writer took (it had staging room) before writing the part.
    pub copied: usize,
    /// From the live state (no staging room).
    pub live: usize,
}

/// What the writer does next.
pub enum Task {
    /// Write a staged part and give its pages back ([`Gate::written`]).
    Write(Unit, Staged),
    /// Copy a part from the live state into these pages ([`Gate::copy`]).
    Copy(Unit, Vec<Vec<f32>>),
    /// Write a part from the live state (no room to stage it) ([`Gate::written`]).
    Live(Unit),
}

/// The state of every part of one checkpoint in flight, shared by the writer thread and
/// the optimizer.
pub struct Gate {
    inner: Mutex<Inner>,
    cv: Condvar,
    ranges: Vec<Range<usize>>,
    page: usize,
}

impl Gate {
    /// A checkpoint of `layout`'s blocks with staging `pages` (of equal length): their
    /// weights pending; with `moments` (it holds m and v) their moments pending too, except
    /// on blocks `..waiting_below`, whose moments pass of the checkpoint's step is still to
    /// run ([`Gate::ready`]).
    pub fn new(layout: &Layout, pages: Vec<Vec<f32>>, moments: bool, waiting_below: usize) -> Gate {
        let n = layout.blocks.len();
        let moments_status = |b: usize| match (moments, b < waiting_below) {
            (false, _) => Status::Done,
            (true, true) => Status::Waiting,
            (true, false) => Status::Pending,
        };
        let status = (0..n)
            .flat_map(|b| [Status::Pending, moments_status(b)])
            .collect();
        Gate {
            page: pages.first().map_or(1, Vec::len),
            inner: Mutex::new(Inner {
                status,
                queue: VecDeque::new(),
                free: pages,
                left: if moments { 2 * n } else { n },
                closed: false,
                owner_s: 0.0,
                counts: Counts::default(),
            }),
            cv: Condvar::new(),
            ranges: layout.blocks.iter().map(|b| b.range()).collect(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves plain data; the writer's panic is reported
        // by its join.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait<'a>(&self, g: MutexGuard<'a, Inner>) -> MutexGuard<'a, Inner> {
        self.cv.wait(g).unwrap_or_else(|e| e.into_inner())
    }

    /// Pages a staged copy of `u` takes.
    fn pages_for(&self, u: Unit) -> usize {
        self.ranges[u.block].len().div_ceil(self.page) * u.part.fields().len()
    }

    /// Must precede every change of `part` of block `b` while this checkpoint is in flight:
    /// unless the writer is done with it (or its checkpoint values are still to be made:
    /// `Waiting`), stages it from `live` (the whole model's live tensors), waiting for the
    /// writer while the staging area has no room or the writer reads it. Returns the
    /// seconds this took.
    pub fn before_change(&self, b: usize, part: Part, live: &Tensors) -> f64 {
        let u = Unit { block: b, part };
        let t = Instant::now();
        let mut g = self.lock();
        loop {
            if g.closed {
                break;
            }
            match g.status(u) {
                Status::Done | Status::Staged | Status::Waiting => break,
                Status::Staging => unreachable!("only the optimizer stages, one part at a time"),
                Status::Reading => g = self.wait(g),
                Status::Pending if self.pages_for(u) <= g.free.len() => {
                    g = self.stage(g, u, live);
                    break;
                }
                Status::Pending => g = self.wait(g),
            }
        }
        let s = t.elapsed().as_secs_f64();
        g.owner_s += s;
        s
    }

    /// Stages the weights of the first block whose weights the next weights pass would
    /// stage, where they fit the free pages now (the optimizer calls it while it has nothing
    /// else to do, so that the pass the GPUs wait for finds them staged); false where there
    /// was none to stage or no room.
    pub fn stage_ahead(&self, live: &Tensors) -> bool {
        let g = self.lock();
        let Some(u) = g.first_pending(Part::Weights) else {
            return false;
        };
        if g.closed || self.pages_for(u) > g.free.len() {
            return false;
        }
        drop(self.stage(g, u, live));
        true
    }

    /// Copies pending part `u` from `live` into free pages (there is room), the lock
    /// released meanwhile, and queues the copy for the writer.
    fn stage<'a>(
        &'a self,
        mut g: MutexGuard<'a, Inner>,
        u: Unit,
        live: &Tensors,
    ) -> MutexGuard<'a, Inner> {
        let at = g.free.len() - self.pages_for(u);
        let pages = g.free.split_off(at);
        g.set(u, Status::Staging);
        drop(g);
        let block = live.slice(self.ranges[u.block].clone());
        let staged = Staged::copy(pages, &block, u.part.fields());
        let mut g = self.lock();
        g.set(u, Status::Staged);
        g.counts.staged += 1;
        if g.closed {
            g.free.extend(staged.into_pages());
        } else {
            g.queue.push_back((u, staged));
        }
        self.cv.notify_all();
        g
    }

    /// Whether block `b`'s moments wait for the moments pass of the checkpoint's step.
    pub fn waiting(&self, b: usize) -> bool {
        let u = Unit {
            block: b,
            part: Part::Moments,
        };
        self.lock().status(u) == Status::Waiting
    }

    /// Block `b`'s moments pass of the checkpoint's step has run: its live m and v are the
    /// checkpoint's values.
    pub fn ready(&self, b: usize) {
        let u = Unit {
            block: b,
            part: Part::Moments,
        };
        let mut g = self.lock();
        if g.status(u) == Status::Waiting {
            g.set(u, Status::Pending);
            self.cv.notify_all();
        }
    }

    /// The writer's next task; None once every part is written.
    pub fn next(&self) -> Option<Task> {
        let mut g = self.lock();
        loop {
            if let Some((u, staged)) = g.queue.pop_front() {
                return Some(Task::Write(u, staged));
            }
            if let Some(u) = g.next_pending() {
                g.set(u, Status::Reading);
                let need = self.pages_for(u);
                if need <= g.free.len() {
                    let at = g.free.len() - need;
                    g.counts.copied += 1;
                    return Some(Task::Copy(u, g.free.split_off(at)));
                }
                g.counts.live += 1;
                return Some(Task::Live(u));
            }
            if g.left == 0 {
                return None;
            }
            // The optimizer is staging a part, or moments wait for their pass.
            g = self.wait(g);
        }
    }

    /// The writer copies part `u` (marked `Reading`) from `live` (the block's elements of
    /// the live tensors) into `pages`; it is written next.
    pub fn copy(&self, u: Unit, pages: Vec<Vec<f32>>, live: &Tensors) {
        let staged = Staged::copy(pages, live, u.part.fields());
        let mut g = self.lock();
        g.set(u, Status::Staged);
        g.queue.push_front((u, staged));
        self.cv.notify_all();
    }

    /// Part `u` is written (from `staged`, whose pages come back, or from the live state).
    pub fn written(&self, u: Unit, staged: Option<Staged>) {
        let mut g = self.lock();
        g.set(u, Status::Done);
        g.left -= 1;
        if let Some(s) = staged {
            g.free.extend(s.into_pages());
        }
        self.cv.notify_all();
    }

    /// The writer stops (done or failed): the optimizer no longer stages nor waits, and
    /// copies not written give their pages back.
    pub fn close(&self) {
        let mut g = self.lock();
        g.closed = true;
        while let Some((_, s)) = g.queue.pop_front() {
            g.free.extend(s.into_pages());
        }
        self.cv.notify_all();
    }

    /// The staging pages, once the writer has closed and the optimizer stages nothing.
    pub fn take_pages(&self) -> Vec<Vec<f32>> {
        let mut g = self.lock();
        assert!(g.closed, "the writer has stopped");
        std::mem::take(&mut g.free)
    }

    /// Seconds the optimizer has spent on this checkpoint.
    pub fn owner_s(&self) -> f64 {
        self.lock().owner_s
    }

    /// How its parts were written.
    pub fn counts(&self) -> Counts {
        self.lock().counts
    }
}

#[cfg(test)]
mod tests;
