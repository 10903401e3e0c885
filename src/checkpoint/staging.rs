//! The hand-over between a checkpoint written while training goes on and the optimizer.
//!
//! The writer thread writes checkpoint N block by block, each from the live state while the
//! optimizer has not changed it since step N. Before the optimizer changes a block the
//! writer has not written yet, [`Gate::before_change`] copies it (fp32 master, with m and v
//! where the checkpoint holds them) into the staging area, and the writer writes that copy
//! instead; where the staging area has no room for it, the optimizer waits for the writer.
//! The staging area is a fixed set of pages allocated once (`checkpoint.staging_size`), so
//! the host peak is the training state plus that bound, not a second copy of the state.
//!
//! A block's state: `Pending` (its checkpoint values are the live ones), `Reading` (the
//! writer reads it from the live state: the optimizer must not change it), `Staging` (the
//! optimizer copies it), `Staged` (its copy awaits the writer), `Done` (written). The writer
//! takes staged blocks first, oldest first, which frees pages soonest; then the pending
//! blocks in the order the optimizer updates them, copying each into free pages before
//! writing it when there is room, so that a slow disk holds up the optimizer only when the
//! staging area is full.

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

/// The pages of a staging area of at most `bytes`, allocated and touched now, so that a
/// checkpoint costs no page faults and a host short of memory fails at start-up.
pub fn pages(bytes: u64) -> Vec<Vec<f32>> {
    let page = page_elems(bytes);
    (0..page_count(bytes))
        .into_par_iter()
        .map(|_| crate::shm::huge::zeroed(page))
        .collect()
}

/// A block's checkpoint values copied into staging pages: the master, then m and v where
/// held, each starting on a page of its own.
pub struct Staged {
    page: usize,
    fields: Vec<Vec<Vec<f32>>>,
}

impl Staged {
    /// Copies `live` (one block's elements) into `pages` (in parallel): the master, and the
    /// moments if `moments`.
    fn copy(pages: Vec<Vec<f32>>, live: &Tensors, moments: bool) -> Staged {
        Staged::fill(
            pages,
            live.master.len(),
            moments,
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
        Staged::fill(pages, n, moments, |field, r, out| {
            out.copy_from_slice(&values.values(field, r))
        })
    }

    /// `n` elements of each field (the master, and m and v if `moments`) into `pages`, each
    /// field from a page of its own, the pages in parallel: `read(field, r, out)` fills
    /// `out` with elements `r` of `field`.
    fn fill(
        mut pages: Vec<Vec<f32>>,
        n: usize,
        moments: bool,
        read: impl Fn(Field, Range<usize>, &mut [f32]) + Sync,
    ) -> Staged {
        let page = pages.first().map_or(1, Vec::len);
        let per_field = n.div_ceil(page);
        let mut fields: Vec<Vec<Vec<f32>>> = (0..if moments { 3 } else { 1 })
            .map(|_| pages.drain(..per_field).collect())
            .collect();
        let of = [Field::Master, Field::M, Field::V];
        fields.par_iter_mut().zip(of).for_each(|(f, field)| {
            f.par_iter_mut().enumerate().for_each(|(i, p)| {
                let r = i * page..((i + 1) * page).min(n);
                let len = r.len();
                read(field, r, &mut p[..len]);
            })
        });
        Staged { page, fields }
    }

    pub(super) fn into_pages(self) -> impl Iterator<Item = Vec<f32>> {
        self.fields.into_iter().flatten()
    }
}

impl BlockValues for Staged {
    fn values(&self, field: Field, r: Range<usize>) -> Cow<'_, [f32]> {
        let pages = &self.fields[field as usize];
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
    Pending,
    Reading,
    Staging,
    Staged,
    Done,
}

struct Inner {
    status: Vec<Status>,
    /// Staged blocks, oldest first, with their copies.
    queue: VecDeque<(usize, Staged)>,
    free: Vec<Vec<f32>>,
    /// Blocks not written yet.
    left: usize,
    /// No block before this one is pending.
    cursor: usize,
    /// The writer has stopped (done or failed): nothing is read from the live state.
    closed: bool,
    /// Seconds the optimizer spent in [`Gate::before_change`] (staging and waiting).
    owner_s: f64,
    counts: Counts,
}

/// How the blocks of a checkpoint were written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// From a copy the optimizer staged before changing the block.
    pub staged: usize,
    /// From a copy the writer took (it had staging room) before writing the block.
    pub copied: usize,
    /// From the live state (no staging room).
    pub live: usize,
}

/// What the writer does next.
pub enum Task {
    /// Write a staged block and give its pages back ([`Gate::written`]).
    Write(usize, Staged),
    /// Copy a block from the live state into these pages ([`Gate::copy`]).
    Copy(usize, Vec<Vec<f32>>),
    /// Write a block from the live state (no room to stage it) ([`Gate::written`]).
    Live(usize),
}

/// The state of every block of one checkpoint in flight, shared by the writer thread and
/// the optimizer.
pub struct Gate {
    inner: Mutex<Inner>,
    cv: Condvar,
    ranges: Vec<Range<usize>>,
    page: usize,
    moments: bool,
}

impl Gate {
    /// A checkpoint of `layout`'s blocks, all pending, with staging `pages` (of equal
    /// length); `moments`: it holds m and v.
    pub fn new(layout: &Layout, pages: Vec<Vec<f32>>, moments: bool) -> Gate {
        let n = layout.blocks.len();
        Gate {
            page: pages.first().map_or(1, Vec::len),
            inner: Mutex::new(Inner {
                status: vec![Status::Pending; n],
                queue: VecDeque::new(),
                free: pages,
                left: n,
                cursor: 0,
                closed: false,
                owner_s: 0.0,
                counts: Counts::default(),
            }),
            cv: Condvar::new(),
            ranges: layout.blocks.iter().map(|b| b.range()).collect(),
            moments,
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

    /// Pages a staged copy of block `b` takes.
    fn pages_for(&self, b: usize) -> usize {
        self.ranges[b].len().div_ceil(self.page) * if self.moments { 3 } else { 1 }
    }

    /// Must precede every change of block `b`'s master, m or v while this checkpoint is in
    /// flight: unless the writer is done with the block, stages it from `live` (the whole
    /// model's live tensors), waiting for the writer while the staging area has no room or
    /// the writer reads the block. Returns the seconds this took.
    pub fn before_change(&self, b: usize, live: &Tensors) -> f64 {
        let t = Instant::now();
        let mut g = self.lock();
        loop {
            if g.closed {
                break;
            }
            match g.status[b] {
                Status::Done | Status::Staged => break,
                Status::Staging => unreachable!("only the optimizer stages, one block at a time"),
                Status::Reading => g = self.wait(g),
                Status::Pending if self.pages_for(b) <= g.free.len() => {
                    let at = g.free.len() - self.pages_for(b);
                    let pages = g.free.split_off(at);
                    g.status[b] = Status::Staging;
                    drop(g);
                    let staged =
                        Staged::copy(pages, &live.slice(self.ranges[b].clone()), self.moments);
                    g = self.lock();
                    g.status[b] = Status::Staged;
                    g.counts.staged += 1;
                    if g.closed {
                        g.free.extend(staged.into_pages());
                    } else {
                        g.queue.push_back((b, staged));
                    }
                    self.cv.notify_all();
                    break;
                }
                Status::Pending => g = self.wait(g),
            }
        }
        let s = t.elapsed().as_secs_f64();
        g.owner_s += s;
        s
    }

    /// The writer's next task; None once every block is written.
    pub fn next(&self) -> Option<Task> {
        let mut g = self.lock();
        loop {
            if let Some((b, staged)) = g.queue.pop_front() {
                return Some(Task::Write(b, staged));
            }
            let n = g.status.len();
            while g.cursor < n && g.status[g.cursor] != Status::Pending {
                g.cursor += 1;
            }
            if g.cursor < n {
                let b = g.cursor;
                g.status[b] = Status::Reading;
                let need = self.pages_for(b);
                if need <= g.free.len() {
                    let at = g.free.len() - need;
                    g.counts.copied += 1;
                    return Some(Task::Copy(b, g.free.split_off(at)));
                }
                g.counts.live += 1;
                return Some(Task::Live(b));
            }
            if g.left == 0 {
                return None;
            }
            // The optimizer is staging a block.
            g = self.wait(g);
        }
    }

    /// The writer copies block `b` (marked `Reading`) from `live` (the block's elements of
    /// the live tensors) into `pages`; it is written next.
    pub fn copy(&self, b: usize, pages: Vec<Vec<f32>>, live: &Tensors) {
        let staged = Staged::copy(pages, live, self.moments);
        let mut g = self.lock();
        g.status[b] = Status::Staged;
        g.queue.push_front((b, staged));
        self.cv.notify_all();
    }

    /// Block `b` is written (from `staged`, whose pages come back, or from the live state).
    pub fn written(&self, b: usize, staged: Option<Staged>) {
        let mut g = self.lock();
        g.status[b] = Status::Done;
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

    /// How its blocks were written.
    pub fn counts(&self) -> Counts {
        self.lock().counts
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::MasterRef;

    /// The area `full_bytes` sizes holds every block's copy at once (the pages `Gate`
    /// asks for each), for a model whose blocks span many 4 MiB pages and for a tiny one
    /// whose area has small pages, with and without the moments.
    #[test]
    fn the_full_area_stages_every_block_at_once() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
        for model in ["qwen2.5-0.5b", "tiny"] {
            let spec = crate::config::hf::ModelSpec::from_model_dir(&root.join(model)).unwrap();
            let layout = Layout::new(&spec);
            for moments in [true, false] {
                let bytes = full_bytes(&layout, moments);
                let page = page_elems(bytes);
                let fields = if moments { 3 } else { 1 };
                let needed: usize = layout
                    .blocks
                    .iter()
                    .map(|b| b.len.div_ceil(page) * fields)
                    .sum();
                assert!(
                    page_count(bytes) >= needed,
                    "{model}: {} pages of {page} elements for {needed}",
                    page_count(bytes)
                );
                // Not much more than the values themselves: a page per field per block.
                let values = 4 * fields as u64 * layout.total as u64;
                let slack = 4 * (fields * layout.blocks.len()) as u64 * (1 << 20);
                assert!(bytes <= values.max(default_bytes(&layout, moments)) + slack);
            }
        }
    }

    /// Node 0's default area holds two windows however the pages round them (`Feed`
    /// asks for each field's pages), for windows from one page's worth to the full 2^24, with
    /// and without the moments; and it costs at most a page per field per window more than
    /// the values.
    #[test]
    fn the_window_area_holds_two_windows() {
        use super::super::fed::Feed;
        for window in [1, 1000, 1024, 1025, 70_000, 3_000_000, 5_555_555, 1 << 24] {
            for moments in [true, false] {
                let bytes = window_bytes(window, moments);
                let page = page_elems(bytes);
                let per = Feed::pages_for(page, window, moments);
                assert!(
                    page_count(bytes) >= 2 * per,
                    "window {window}: {} pages of {page} for 2 x {per}",
                    page_count(bytes)
                );
                let fields = if moments { 3 } else { 1 };
                let values = 2 * bytes_per_param(moments) * window as u64;
                // The pages of the smallest areas are 1024 elements at least; the area
                // holds at least 16 of them.
                let slack = (2 * fields * 4 * page as u64).max(16 * 4 * 1024);
                assert!(bytes <= values + slack, "window {window}: {bytes} B");
            }
        }
    }

    /// A staged copy gives back every range of each field, within a page or across pages,
    /// and a split master comes back joined (its fp32 values, which move exact bf16 ties by
    /// one ulp: `optim::bits`).
    #[test]
    fn staged_values_read_back_across_pages() {
        let n = 3000;
        let master: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 + 1.0).collect();
        let m: Vec<f32> = (0..n).map(|i| -(i as f32)).collect();
        let v: Vec<f32> = (0..n).map(|i| i as f32 * 3.0).collect();
        let (mut hi, mut lo) = (vec![half::bf16::ZERO; n], vec![0u16; n]);
        crate::optim::bits::split_slice(&master, &mut hi, &mut lo);
        let sources = [
            MasterRef::F32(&master),
            MasterRef::Split { hi: &hi, lo: &lo },
        ];
        for src in sources {
            let want = src.values();
            let live = Tensors {
                master: src,
                m: MasterRef::F32(&m),
                v: MasterRef::F32(&v),
            };
            let pages = (0..9).map(|_| vec![0.0f32; 1024]).collect();
            let s = Staged::copy(pages, &live, true);
            for r in [0..10, 1000..1030, 500..2900, 2990..3000, 0..3000, 7..7] {
                assert_eq!(*s.values(Field::Master, r.clone()), want[r.clone()]);
                assert_eq!(*s.values(Field::M, r.clone()), m[r.clone()]);
                assert_eq!(*s.values(Field::V, r.clone()), v[r.clone()]);
            }
            assert_eq!(s.into_pages().count(), 9);
        }
    }
}
