//! A background checkpoint whose values are handed to the writer thread window by window,
//! for a state this host does not hold whole: node 0 of a run with the state sharded across
//! nodes gathers every block at the step boundary, a window at a time, and copies each
//! window into the staging area ([`Feed::stage`]); the writer thread writes the windows in
//! order and gives their pages back ([`super::writer::Writer::start_fed`]). Training waits
//! for the gathers, and for the writer only where the staging area is full; the other nodes
//! only send. Unlike [`super::staging::Gate`], nothing is read from the live state: a
//! window's staged copy is the only one the writer sees, so the optimizer never waits on it
//! once the gathers are done.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::{Condvar, Mutex, MutexGuard};

use super::staging::Staged;
use super::state::BlockValues;
use crate::error::{Error, Result};

/// A window of a block staged for the writer: the block, the window within it, its values.
pub type Window = (usize, Range<usize>, Staged);

struct Inner {
    /// Staged windows, in the order they were gathered.
    queue: VecDeque<Window>,
    free: Vec<Vec<f32>>,
    /// Whether every window was handed in (`Some(true)`) or the gather stopped short.
    end: Option<bool>,
    /// The writer has stopped (done or failed): nothing more is staged.
    closed: bool,
    /// Seconds the step loop spent on the checkpoint (gathers, copies, waits for pages).
    owner_s: f64,
    /// Blocks whose first window was staged.
    blocks: usize,
}

/// The windows of one checkpoint in flight, shared by the step loop (which stages them) and
/// the writer thread (which writes them).
pub struct Feed {
    inner: Mutex<Inner>,
    cv: Condvar,
    /// Elements per staging page.
    page: usize,
    /// Pages of the staging area.
    pages: usize,
    /// Whether the checkpoint holds m and v besides the master.
    moments: bool,
}

impl Feed {
    /// A checkpoint staged in `pages` (of equal length); `moments`: it holds m and v.
    pub fn new(pages: Vec<Vec<f32>>, moments: bool) -> Feed {
        Feed {
            page: pages.first().map_or(1, Vec::len),
            pages: pages.len(),
            inner: Mutex::new(Inner {
                queue: VecDeque::new(),
                free: pages,
                end: None,
                closed: false,
                owner_s: 0.0,
                blocks: 0,
            }),
            cv: Condvar::new(),
            moments,
        }
    }

    /// Pages a window of `n` elements takes: each field on pages of its own.
    pub fn pages_for(page: usize, n: usize, moments: bool) -> usize {
        n.div_ceil(page.max(1)) * if moments { 3 } else { 1 }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait<'a>(&self, g: MutexGuard<'a, Inner>) -> MutexGuard<'a, Inner> {
        self.cv.wait(g).unwrap_or_else(|e| e.into_inner())
    }

    /// Copies elements `window` of block `b` from `values` (whose element 0 is the window's
    /// first) into free pages and queues them for the writer, first waiting for the writer
    /// to free pages while too few are free. Fails once the writer has stopped (its own
    /// error comes from [`super::writer::Writer::finish`]).
    pub fn stage(&self, b: usize, window: Range<usize>, values: &dyn BlockValues) -> Result<()> {
        let need = Self::pages_for(self.page, window.len(), self.moments);
        assert!(
            need <= self.pages,
            "the staging area ({} pages) holds a window ({need} pages)",
            self.pages
        );
        let mut g = self.lock();
        loop {
            if g.closed {
                return Err(Error::Other(
                    "the checkpoint writer stopped before every window was staged".into(),
                ));
            }
            if g.free.len() >= need {
                break;
            }
            g = self.wait(g);
        }
        let at = g.free.len() - need;
        let pages = g.free.split_off(at);
        drop(g);
        let staged = Staged::from_values(pages, values, window.len(), self.moments);
        let mut g = self.lock();
        if g.closed {
            g.free.extend(staged.into_pages());
            return Err(Error::Other(
                "the checkpoint writer stopped before every window was staged".into(),
            ));
        }
        g.blocks += usize::from(window.start == 0);
        g.queue.push_back((b, window, staged));
        self.cv.notify_all();
        Ok(())
    }

    /// The step loop is done with the checkpoint after `seconds`: `complete` if every
    /// window of every block was staged, else the writer fails it (nothing partial is kept).
    pub fn end(&self, complete: bool, seconds: f64) {
        let mut g = self.lock();
        g.end = Some(complete);
        g.owner_s += seconds;
        self.cv.notify_all();
    }

    /// The writer's next window, in the order they were staged; `None` once every window is
    /// written, an error where the gather stopped short.
    pub fn next(&self) -> Result<Option<Window>> {
        let mut g = self.lock();
        loop {
            if let Some(w) = g.queue.pop_front() {
                return Ok(Some(w));
            }
            match g.end {
                Some(true) => return Ok(None),
                Some(false) => {
                    return Err(Error::Other(
                        "the checkpoint's gather across nodes stopped before every block was staged".into(),
                    ));
                }
                None => g = self.wait(g),
            }
        }
    }

    /// A window is written: its pages come back.
    pub fn written(&self, staged: Staged) {
        let mut g = self.lock();
        g.free.extend(staged.into_pages());
        self.cv.notify_all();
    }

    /// The writer stops (done or failed): the step loop no longer waits, and windows not
    /// written give their pages back.
    pub fn close(&self) {
        let mut g = self.lock();
        g.closed = true;
        while let Some((_, _, s)) = g.queue.pop_front() {
            g.free.extend(s.into_pages());
        }
        self.cv.notify_all();
    }

    /// The staging pages, once the writer has closed and the step loop has ended.
    pub fn take_pages(&self) -> Vec<Vec<f32>> {
        let mut g = self.lock();
        assert!(g.closed, "the writer has stopped");
        while g.end.is_none() {
            g = self.wait(g);
        }
        std::mem::take(&mut g.free)
    }

    /// Seconds the step loop spent on this checkpoint.
    pub fn owner_s(&self) -> f64 {
        self.lock().owner_s
    }

    /// Blocks staged.
    pub fn blocks(&self) -> usize {
        self.lock().blocks
    }
}
