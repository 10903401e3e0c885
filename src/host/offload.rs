//! The host state's passes with the optimizer's state on the drives
//! (`memory.optimizer_offload: nvme`, [`super::nvme`]): the fresh master written to the
//! drives, a checkpoint read onto them, the update streamed through windows, and the
//! state read back a window at a time for a checkpoint or the export (the path a sharded
//! state takes, [`super::shard`], so the launcher writes both alike).

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use half::bf16;

use crate::checkpoint::state::{Field, Saved, Tensors, TrainState};
use crate::checkpoint::{MasterMut, MasterRef};
use crate::elem::bits;
use crate::layout::Layout;
use crate::optim::{AdamWStep, Moments, StoreOut};
use crate::{Error, Result};

use super::nvme::{BUFFERS, Drives, READ_AHEAD, Slot, WinBuf, Window};
use super::passes::{MasterSlice, MomentSlices, Run, update_slices};
use super::shard::{Store as StripedStore, Striped, WriteWindow};
use super::{AdamMoments, Grad, HostState, Master, store_bf16};

impl HostState {
    /// The drives holding the optimizer's state, if it is there.
    pub fn drives(&self) -> Option<&Drives> {
        self.drives.as_deref()
    }

    /// Whether checkpoints and the export read the master and moments a window at a time
    /// ([`HostState::gather_blocks`]): sharded over nodes, or on the drives.
    pub fn windowed(&self) -> bool {
        self.shards.is_some() || self.drives.is_some()
    }

    /// The bytes moved to and from the drives and the time the update waited for them since
    /// the last call (None with the state in RAM).
    pub fn take_drive_io(&mut self) -> Option<super::nvme::DriveIo> {
        self.drives.as_deref().map(Drives::take_io)
    }

    /// [`HostState::init_master`] with the state on the drives: `fill` makes the master a
    /// piece at a time ([`MasterMut::Sink`]); each piece goes into the store and onto the
    /// drives (a split master's low halves), and the moments stay the zeros the files were
    /// created with. No whole copy is held.
    pub(super) fn init_master_drives(
        &mut self,
        fill: impl FnOnce(&Layout, &mut MasterMut) -> crate::Result<()>,
    ) -> Result<()> {
        let n = self.layout.total;
        if let Master::Bf16 { .. } = self.master {
            let rounded = AtomicU64::new(0);
            let p = store_bf16(&mut self.store, 0..n);
            return fill(
                &self.layout,
                &mut MasterMut::Bf16 {
                    p,
                    rounded: &rounded,
                },
            );
        }
        let split = matches!(self.master, Master::Split(_));
        let drives = self.drives.as_ref().expect("on the drives");
        let layout = &self.layout;
        let failed: Mutex<Option<Error>> = Mutex::new(None);
        let store = match self.store.out_mut(0..n) {
            StoreOut::F32(s) => StripedStore::F32(Striped::new(s)),
            StoreOut::Bf16(s) => StripedStore::Bf16(Striped::new(s)),
        };
        let put = |first: usize, x: &[f32]| {
            let r = first..first + x.len();
            match &store {
                StripedStore::F32(s) => s.write(r.clone(), |d, i| d.copy_from_slice(&x[i])),
                StripedStore::Bf16(s) => s.write(r.clone(), |d, i| {
                    for (d, x) in d.iter_mut().zip(&x[i]) {
                        *d = match split {
                            true => bits::split(*x).0,
                            false => bf16::from_f32(*x),
                        };
                    }
                }),
            }
            for (pos, within) in drives.positions(layout, r) {
                let x = &x[within];
                let bytes: Vec<u8> = match split {
                    true => x
                        .iter()
                        .flat_map(|v| bits::split(*v).1.to_le_bytes())
                        .collect(),
                    false => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
                };
                if let Err(e) = drives.put(Slot::Master, pos, &bytes) {
                    failed.lock().expect("a writer panicked").get_or_insert(e);
                }
            }
        };
        fill(layout, &mut MasterMut::Sink { len: n, put: &put })?;
        if let Some(e) = failed.into_inner().expect("a writer panicked") {
            return Err(e);
        }
        drives.sync_all()
    }

    /// [`HostState::restore`] with the state on the drives: each window of each block of
    /// the checkpoint's master and moments is read into a window's buffers (the store's
    /// part of the master into the store) and written to the drives.
    pub(super) fn restore_drives(&mut self, dir: &std::path::Path) -> Result<TrainState> {
        let saved = Saved::open(dir, &self.layout)?;
        let drives = self.drives.clone().expect("on the drives");
        let mut stream = std::mem::take(&mut self.stream);
        let restored = stream
            .settle(&drives)
            .and_then(|()| self.restore_windows(&saved, &drives, &mut stream));
        self.stream = stream;
        let rounded = restored?;
        if rounded != (0, 0) {
            tracing::warn!(
                master = rounded.0,
                moments = rounded.1,
                "{}: values of the checkpoint are not bf16 values and were rounded to nearest even for the bfloat16 master or moments: the run does not continue exactly as the saved one would have",
                dir.display(),
            );
        }
        self.updates = saved.state.updates;
        Ok(saved.state)
    }

    /// [`HostState::restore_drives`]' windows; the values rounded (master, moments).
    fn restore_windows(
        &mut self,
        saved: &Saved,
        drives: &Drives,
        stream: &mut Stream,
    ) -> Result<(u64, u64)> {
        let (rounded, moments_rounded) = (AtomicU64::new(0), AtomicU64::new(0));
        let mut win = stream.buffer(drives)?;
        let slots = slots(drives, true);
        for b in 0..self.layout.blocks.len() {
            let offset = self.layout.blocks[b].offset;
            for w in drives.windows(&self.layout, b) {
                let (g, len) = (offset + w.start..offset + w.end, w.len());
                let mut master = match (&self.master, win.master.as_mut()) {
                    (Master::F32(_), Some(WinBuf::F32(x))) => {
                        MasterMut::F32(&mut x.as_mut_slice()[..len])
                    }
                    (Master::Split(_), Some(WinBuf::U16(lo))) => MasterMut::Split {
                        hi: store_bf16(&mut self.store, g.clone()),
                        lo: &mut lo.as_mut_slice()[..len],
                    },
                    (Master::Bf16 { .. }, None) => MasterMut::Bf16 {
                        p: store_bf16(&mut self.store, g.clone()),
                        rounded: &rounded,
                    },
                    _ => unreachable!("the window holds the master's fields"),
                };
                saved.read(Field::Master, g.start, &mut master)?;
                if let Some(WinBuf::F32(x)) = &win.master {
                    let x = &x.as_slice()[..len];
                    match self.store.out_mut(g.clone()) {
                        StoreOut::F32(s) => s.copy_from_slice(x),
                        StoreOut::Bf16(s) => s
                            .iter_mut()
                            .zip(x)
                            .for_each(|(d, x)| *d = bf16::from_f32(*x)),
                    }
                }
                for (field, buf) in [(Field::M, &mut win.m), (Field::V, &mut win.v)] {
                    let mut dst = match buf {
                        WinBuf::F32(x) => MasterMut::F32(&mut x.as_mut_slice()[..len]),
                        WinBuf::Bf16(x) => MasterMut::Bf16 {
                            p: &mut x.as_mut_slice()[..len],
                            rounded: &moments_rounded,
                        },
                        WinBuf::U16(_) => unreachable!("moments are f32 or bf16"),
                    };
                    saved.read(field, g.start, &mut dst)?;
                }
                drives.write(b, w, &mut win, &slots)?;
            }
        }
        stream.spare.push(win);
        drives.sync()?;
        Ok((rounded.into_inner(), moments_rounded.into_inner()))
    }

    /// [`HostState::update_block`] with the state on the drives: the block's windows read,
    /// updated and written back, windows ahead read (the next blocks' too) and the last
    /// ones written while one is computed ([`Stream`]). The moments are written with the
    /// weights whatever `Moments` says.
    pub(super) fn update_block_drives(&mut self, block: usize, hp: &AdamWStep) -> Result<()> {
        let drives = self.drives.clone().expect("on the drives");
        let mut stream = std::mem::take(&mut self.stream);
        let updated = self.update_windows(&drives, &mut stream, block, hp);
        if updated.is_err() {
            // Nothing left in flight behind a failed update.
            let _ = stream.settle(&drives);
        }
        self.stream = stream;
        updated
    }

    fn update_windows(
        &mut self,
        drives: &Arc<Drives>,
        stream: &mut Stream,
        block: usize,
        hp: &AdamWStep,
    ) -> Result<()> {
        let across = crate::switches::get().nvme_read_ahead;
        let ahead = if across { READ_AHEAD } else { 1 };
        let layout = &self.layout;
        let windows = drives.windows(layout, block);
        // The windows this call computes, then those of the next blocks it reads ahead.
        let mut seq: Vec<(usize, Range<usize>)> =
            windows.iter().map(|r| (block, r.clone())).collect();
        let mut next = block + 1;
        while across && seq.len() < windows.len() + ahead && next < layout.blocks.len() {
            seq.extend(drives.windows(layout, next).into_iter().map(|r| (next, r)));
            next += 1;
        }
        let last = match across {
            true => seq.len(),
            false => windows.len(),
        };
        stream.expect(drives, &seq);
        let runs = self.runs(block);
        let offset = self.layout.blocks[block].offset;
        let slots = slots(drives, true);
        // A test's failing drive: the step's first write of each block.
        let mut eio = crate::switches::testing::drive_eio_at(hp.step);
        for (i, r) in windows.iter().enumerate() {
            // Windows i ..= i + ahead read or being read.
            while i + stream.ahead.len() < (i + ahead + 1).min(last) {
                let (b, r) = seq[i + stream.ahead.len()].clone();
                let win = stream.buffer(drives)?;
                stream.read(drives, b, r, win, &slots);
            }
            let read = stream.ahead.pop_front().expect("read ahead");
            let win = stream.join(drives, read.done)?;
            let mut win = win;
            self.update_window(&mut win, &runs, offset + r.start..offset + r.end, hp);
            let fail = std::mem::take(&mut eio);
            stream.write(drives, block, r.clone(), win, &slots, fail);
        }
        // The last block's writes (each block's without the read-ahead) waited for here;
        // the others' finish during the next block's.
        if !across || block + 1 == self.layout.blocks.len() {
            stream.settle(drives)?;
            drives.sync()?;
        }
        Ok(())
    }

    /// AdamW on the runs' elements within layout range `g`, whose master and moments are
    /// `win`'s first elements.
    fn update_window(&mut self, win: &mut Window, runs: &[Run], g: Range<usize>, hp: &AdamWStep) {
        for run in runs {
            let (lo, hi) = (run.range.start.max(g.start), run.range.end.min(g.end));
            if lo >= hi {
                continue;
            }
            let w = lo - g.start..hi - g.start;
            let p = match (&self.master, win.master.as_mut()) {
                (Master::F32(_), Some(WinBuf::F32(x))) => {
                    MasterSlice::F32(&mut x.as_mut_slice()[w.clone()])
                }
                (Master::Split(_), Some(WinBuf::U16(x))) => {
                    MasterSlice::Split(&mut x.as_mut_slice()[w.clone()])
                }
                (Master::Bf16 { seed }, None) => MasterSlice::Bf16 { seed: *seed },
                _ => unreachable!("the window holds the master's fields"),
            };
            let adam = match (&self.moments, &mut win.m, &mut win.v) {
                (AdamMoments::F32 { .. }, WinBuf::F32(m), WinBuf::F32(v)) => MomentSlices::F32 {
                    m: &mut m.as_mut_slice()[w.clone()],
                    v: &mut v.as_mut_slice()[w],
                },
                (AdamMoments::Bf16 { seed, .. }, WinBuf::Bf16(m), WinBuf::Bf16(v)) => {
                    MomentSlices::Bf16 {
                        m: &mut m.as_mut_slice()[w.clone()],
                        v: &mut v.as_mut_slice()[w],
                        seed: *seed,
                    }
                }
                _ => unreachable!("the window holds the moments' dtype"),
            };
            let store = &mut self.store;
            let mw = Moments::Write;
            match &self.grad {
                Grad::F32(gr) => update_slices(p, store, adam, &gr[lo..hi], lo, hp, run.decay, mw),
                Grad::Bf16(gr) => update_slices(p, store, adam, &gr[lo..hi], lo, hp, run.decay, mw),
            }
        }
    }

    /// [`HostState::gather_blocks`] with the state on the drives: every block's master
    /// (and with `moments`, m and v) read a window at a time and handed to `write`, block
    /// after block in layout order. The outer error is a failed read, the inner `write`'s.
    pub(super) fn read_blocks(
        &mut self,
        moments: bool,
        write: Option<WriteWindow>,
    ) -> Result<crate::Result<()>> {
        let Some(write) = write else {
            return Ok(Ok(()));
        };
        let drives = self.drives.clone().expect("on the drives");
        let mut stream = std::mem::take(&mut self.stream);
        let read = stream.settle(&drives).and_then(|()| {
            let mut win = stream.buffer(&drives)?;
            let read = self.read_windows(&drives, &mut win, moments, write);
            stream.spare.push(win);
            read
        });
        self.stream = stream;
        read
    }

    fn read_windows(
        &self,
        drives: &Drives,
        win: &mut Window,
        moments: bool,
        write: WriteWindow,
    ) -> Result<crate::Result<()>> {
        let slots = slots(drives, moments);
        for b in 0..self.layout.blocks.len() {
            let offset = self.layout.blocks[b].offset;
            for w in drives.windows(&self.layout, b) {
                drives.read(b, w.clone(), win, &slots)?;
                let (g, len) = (offset + w.start..offset + w.end, w.len());
                let hi = || {
                    &self
                        .store
                        .bf16()
                        .expect("a split or bf16 master has a bf16 store")[g.clone()]
                };
                let master = match (&self.master, &win.master) {
                    (Master::F32(_), Some(x)) => x.values(0..len),
                    (Master::Split(_), Some(WinBuf::U16(lo))) => MasterRef::Split {
                        hi: hi(),
                        lo: &lo.as_slice()[..len],
                    },
                    (Master::Bf16 { .. }, None) => MasterRef::Bf16(hi()),
                    _ => unreachable!("the window holds the master's fields"),
                };
                let values = match moments {
                    true => Tensors {
                        master,
                        m: win.m.values(0..len),
                        v: win.v.values(0..len),
                    },
                    false => Tensors::master_only(master),
                };
                if let Err(e) = write(b, w, &values) {
                    return Ok(Err(e));
                }
            }
        }
        Ok(Ok(()))
    }
}

/// The fields on `drives` a pass reads or writes: the master where it is there, and with
/// `moments`, m and v.
fn slots(drives: &Drives, moments: bool) -> Vec<Slot> {
    let master = drives.holds(Slot::Master).then_some(Slot::Master);
    let mv = moments.then_some([Slot::M, Slot::V]).into_iter().flatten();
    master.into_iter().chain(mv).collect()
}

/// A window's transfer on a thread of its own: its buffer back, and the result.
type Done = (Window, Result<()>);

/// A read in flight: block `block`'s elements `r`.
struct Ahead {
    block: usize,
    r: Range<usize>,
    done: JoinHandle<Done>,
}

/// The update's windows in flight from one block's call to the next: reads ahead of the
/// window computed (into the next blocks), writes behind it, and the buffers of those
/// not in flight; [`BUFFERS`] buffers at most.
#[derive(Default)]
pub(super) struct Stream {
    spare: Vec<Window>,
    /// Buffers made.
    made: usize,
    ahead: VecDeque<Ahead>,
    behind: VecDeque<JoinHandle<Done>>,
}

impl Stream {
    /// A buffer for a transfer: a spare one, a new one while fewer than [`BUFFERS`] were
    /// made, else the oldest write's once done (its error, if it failed).
    pub(super) fn buffer(&mut self, drives: &Drives) -> Result<Window> {
        if let Some(w) = self.spare.pop() {
            return Ok(w);
        }
        match self.behind.pop_front() {
            Some(h) if self.made >= BUFFERS => self.join(drives, h),
            h => {
                if let Some(h) = h {
                    self.behind.push_front(h);
                }
                self.made += 1;
                Ok(drives.new_window())
            }
        }
    }

    /// Gives back a buffer [`Stream::buffer`] lent.
    pub(super) fn spare_buffer(&mut self, win: Window) {
        self.spare.push(win);
    }

    /// Waits for `h`, counting the wait as the drives'; its buffer, or its error (the
    /// buffer kept).
    fn join(&mut self, drives: &Drives, h: JoinHandle<Done>) -> Result<Window> {
        let t = Instant::now();
        let (win, res) = h.join().expect("a drive transfer panicked");
        drives.waited(t.elapsed().as_secs_f64());
        match res {
            Ok(()) => Ok(win),
            Err(e) => {
                self.spare.push(win);
                Err(e)
            }
        }
    }

    /// Starts reading block `block`'s elements `r` of the fields `slots` into `win`.
    fn read(
        &mut self,
        drives: &Arc<Drives>,
        block: usize,
        r: Range<usize>,
        mut win: Window,
        slots: &[Slot],
    ) {
        let (d, slots, at) = (Arc::clone(drives), slots.to_vec(), r.clone());
        let done = std::thread::spawn(move || {
            let res = d.read(block, at, &mut win, &slots);
            (win, res)
        });
        self.ahead.push_back(Ahead { block, r, done });
    }

    /// Starts writing `win` to block `block`'s elements `r` (`fail`: a test's EIO instead).
    fn write(
        &mut self,
        drives: &Arc<Drives>,
        block: usize,
        r: Range<usize>,
        mut win: Window,
        slots: &[Slot],
        fail: bool,
    ) {
        let (d, slots) = (Arc::clone(drives), slots.to_vec());
        self.behind.push_back(std::thread::spawn(move || {
            let res = match fail {
                true => Err(d.injected_eio()),
                false => d.write(block, r, &mut win, &slots),
            };
            (win, res)
        }));
    }

    /// Keeps the reads in flight where they are the first of `seq` (the windows the update
    /// goes on with), drops them otherwise (an update called out of order).
    fn expect(&mut self, drives: &Drives, seq: &[(usize, Range<usize>)]) {
        let ours = self.ahead.len() <= seq.len()
            && (self.ahead.iter().zip(seq)).all(|(a, (b, r))| a.block == *b && a.r == *r);
        if !ours {
            self.drop_ahead(drives);
        }
    }

    /// Waits for the reads in flight and drops what they read.
    fn drop_ahead(&mut self, drives: &Drives) {
        while let Some(a) = self.ahead.pop_front() {
            let _ = self.join(drives, a.done).map(|w| self.spare.push(w));
        }
    }

    /// Waits for every transfer in flight (what the reads read dropped): the first error
    /// of the writes.
    pub(super) fn settle(&mut self, drives: &Drives) -> Result<()> {
        self.drop_ahead(drives);
        let mut first = Ok(());
        while let Some(h) = self.behind.pop_front() {
            match self.join(drives, h) {
                Ok(w) => self.spare.push(w),
                Err(e) => {
                    first = first.and(Err(e));
                }
            }
        }
        first
    }
}
