//! The launcher's side of the shared regions: the weight store it writes between steps and
//! the gradient slabs it reduces from.
//!
//! Soundness rests on the protocol (`crate::protocol`), which these types cannot check
//! across processes: the store is written only while no step is in flight, and a slab slot
//! is read only between the worker's `LayerGrads` for it and the launcher's `SlotFree`.
//! Within the launcher, `&mut self` makes each write exclusive; the checkpoint writer's
//! view of the store ([`Store::lend_bf16`]) follows the protocol of [`super::lent`].

use half::bf16;

use std::sync::Arc;

use super::lent::Lent;
use super::{Region, RegionHandle, RegionKind};
use crate::config::DType;
use crate::elem::{GradAcc, GradElem, Pod};
use crate::error::Result;
use crate::optim::StoreOut;
use crate::reduce;

/// The shared copy of all weights in the compute dtype, laid out as `Layout` says; or,
/// created as [`RegionKind::Vision`], of the frozen vision tower's (`checkpoint::vision`),
/// written once before any worker maps it.
pub struct Store {
    /// Shared with the views lent to the checkpoint writer ([`Store::lend_bf16`]).
    region: Arc<Region>,
    kind: RegionKind,
    dtype: DType,
    len: usize,
}

impl Store {
    pub fn create(name: &str, elements: usize, dtype: DType) -> Result<Store> {
        Store::create_as(name, RegionKind::Store, elements, dtype)
    }

    /// A store of `elements` in `dtype` whose region says it holds `kind`.
    pub fn create_as(name: &str, kind: RegionKind, elements: usize, dtype: DType) -> Result<Store> {
        let region = Region::create(name, kind, elements * dtype.size())?;
        Ok(Store {
            region: Arc::new(region),
            kind,
            dtype,
            len: elements,
        })
    }

    pub fn handle(&self) -> RegionHandle {
        self.region.handle(self.kind)
    }

    /// Bytes of the payload.
    pub fn bytes(&self) -> usize {
        self.region.payload_len()
    }

    /// Elements `range` as the optimizer's output.
    pub fn out_mut(&mut self, range: std::ops::Range<usize>) -> StoreOut<'_> {
        assert!(range.end <= self.len);
        // SAFETY: `&mut self` excludes other launcher views; workers do not read the store
        // while the launcher updates it (protocol).
        unsafe {
            match self.dtype {
                DType::Float32 => StoreOut::F32(self.region.slice_mut(range)),
                DType::Bfloat16 => StoreOut::Bf16(self.region.slice_mut(range)),
            }
        }
    }

    /// The whole store when its dtype is bf16 (read-only).
    pub fn bf16(&self) -> Option<&[bf16]> {
        // SAFETY: launcher writes need `&mut self`, so none happens while this borrow
        // lives; workers only read the store.
        (self.dtype == DType::Bfloat16).then(|| unsafe { self.region.slice(0..self.len) })
    }

    /// A view of a bf16 store (the master's high halves, or the master) for the checkpoint
    /// writer thread, which reads a block only while the launcher does not write it
    /// ([`super::lent`]); `None` for another dtype.
    pub fn lend_bf16(&self) -> Option<Lent<bf16>> {
        let keep: Arc<dyn Send + Sync> = self.region.clone();
        // SAFETY: the payload holds `len` bf16 values, mapped as long as the region lives,
        // which `keep` ensures.
        (self.dtype == DType::Bfloat16)
            .then(|| unsafe { Lent::new(self.region.payload_ptr() as *const bf16, self.len, keep) })
    }

    /// Elements `range` of a bf16 store, writable (`None` for another dtype).
    pub fn bf16_mut(&mut self, range: std::ops::Range<usize>) -> Option<&mut [bf16]> {
        match self.out_mut(range) {
            StoreOut::Bf16(s) => Some(s),
            StoreOut::F32(_) => None,
        }
    }

    /// Writes `values` (fp32 master values) into the store from element `start` on.
    pub fn write_range(&mut self, start: usize, values: &[f32]) {
        use rayon::prelude::*;
        match self.out_mut(start..start + values.len()) {
            StoreOut::F32(s) => s
                .par_chunks_mut(1 << 20)
                .zip(values.par_chunks(1 << 20))
                .for_each(|(d, x)| d.copy_from_slice(x)),
            StoreOut::Bf16(s) => s
                .par_iter_mut()
                .zip(values)
                .for_each(|(d, x)| *d = bf16::from_f32(*x)),
        }
    }

    /// Writes all of `master` (fp32) into the store.
    pub fn write_all(&mut self, master: &[f32]) {
        use rayon::prelude::*;
        match self.out_mut(0..master.len()) {
            StoreOut::F32(s) => s.par_iter_mut().zip(master).for_each(|(d, x)| *d = *x),
            StoreOut::Bf16(s) => s
                .par_iter_mut()
                .zip(master)
                .for_each(|(d, x)| *d = bf16::from_f32(*x)),
        }
    }
}

/// Every worker's gradient slab: `slots` slots of `slot_len` elements each.
pub struct GradSlabs {
    regions: Vec<Region>,
    dtype: DType,
    slot_len: usize,
    slots: usize,
}

impl GradSlabs {
    pub fn create(
        prefix: &str,
        workers: usize,
        slots: usize,
        slot_len: usize,
        dtype: DType,
    ) -> Result<GradSlabs> {
        let regions = (0..workers)
            .map(|r| {
                Region::create(
                    &format!("{prefix}-{r}"),
                    RegionKind::GradSlab,
                    slots * slot_len * dtype.size(),
                )
            })
            .collect::<Result<_>>()?;
        Ok(GradSlabs {
            regions,
            dtype,
            slot_len,
            slots,
        })
    }

    pub fn handle(&self, rank: usize) -> RegionHandle {
        self.regions[rank].handle(RegionKind::GradSlab)
    }

    pub fn slot_len(&self) -> usize {
        self.slot_len
    }

    /// Reduces elements `offset..offset + dst.len()` of every worker's slot (`slots[r]`)
    /// into `dst`, in rank order: `dst = Σ` for a step's first micro-batch (`first`),
    /// `dst += Σ` after. With `sum_sq`, also returns Σ dst² of the result from the same
    /// pass (else 0). Slots are shared by blocks of different shapes, so only tensor
    /// ranges hold meaningful values, never the gaps between them.
    pub fn reduce_into<D: GradAcc>(
        &self,
        dst: &mut [D],
        slots: &[usize],
        offset: usize,
        first: bool,
        sum_sq: bool,
    ) -> f64 {
        let n = dst.len();
        self.reduce_segments_into(dst, slots, offset, &[n], first, sum_sq)[0]
    }

    /// [`GradSlabs::reduce_into`] over consecutive segments of `dst` (adjacent tensors),
    /// in one parallel pass with the bits of one call per segment; each segment's Σ dst²
    /// ([`reduce::reduce_segments_into`]).
    pub fn reduce_segments_into<D: GradAcc>(
        &self,
        dst: &mut [D],
        slots: &[usize],
        offset: usize,
        segs: &[usize],
        first: bool,
        sum_sq: bool,
    ) -> Vec<f64> {
        assert_eq!(slots.len(), self.regions.len(), "one slot per worker");
        let n = dst.len();
        assert!(offset + n <= self.slot_len);
        match self.dtype {
            DType::Float32 => {
                let srcs = self.sources::<f32>(slots, offset, n);
                reduce::reduce_segments_into(dst, &srcs, segs, first, sum_sq)
            }
            DType::Bfloat16 => {
                let srcs = self.sources::<bf16>(slots, offset, n);
                reduce::reduce_segments_into(dst, &srcs, segs, first, sum_sq)
            }
        }
    }

    /// Worker `rank`'s slot `slot`, written as that worker writes it: for the host state's
    /// unit tests, which run without workers.
    #[cfg(test)]
    pub(crate) fn slot_mut<T: GradElem>(&mut self, rank: usize, slot: usize) -> &mut [T] {
        assert!(slot < self.slots, "slot {slot} out of range");
        assert_eq!(
            std::mem::size_of::<T>(),
            self.dtype.size(),
            "the slabs' dtype"
        );
        let r = slot * self.slot_len..(slot + 1) * self.slot_len;
        // SAFETY: no worker maps the region in a unit test, and `&mut self` keeps every
        // view of the launcher's own (a reduce) out while this one lives.
        unsafe { self.regions[rank].slice_mut(r) }
    }

    /// Elements `offset..offset + n` of each worker's slot `slots[r]`.
    fn sources<T: GradElem>(&self, slots: &[usize], offset: usize, n: usize) -> Vec<&[T]> {
        let range = |s: usize| {
            assert!(s < self.slots, "slot {s} out of range");
            s * self.slot_len + offset..s * self.slot_len + offset + n
        };
        // SAFETY: each worker handed us its slot with `LayerGrads` and writes it again only
        // after our `SlotFree` (protocol); the launcher only reads slabs, and the views do
        // not outlive the reduce that borrows them.
        self.regions
            .iter()
            .zip(slots)
            .map(|(r, &s)| unsafe { r.slice(range(s)) })
            .collect()
    }
}

/// `len` elements of `T` in a shared region that the launcher alone writes: its gradient
/// accumulator where workers hold resident blocks (they read a block's part of it once the
/// protocol says it is final, see `crate::protocol::ResidentInit`), and the transfer
/// buffer of those blocks' state. Its pages are backed at creation, so that a host short of
/// memory fails at start-up.
pub struct SharedVec<T> {
    region: Region,
    kind: RegionKind,
    len: usize,
    _elem: std::marker::PhantomData<T>,
}

impl<T: Pod + Default> SharedVec<T> {
    pub fn create(name: &str, kind: RegionKind, len: usize) -> Result<SharedVec<T>> {
        use rayon::prelude::*;
        let region = Region::create(name, kind, len * std::mem::size_of::<T>())?;
        let v = SharedVec {
            region,
            kind,
            len,
            _elem: std::marker::PhantomData,
        };
        // SAFETY: no worker has the region yet; this is the only view.
        let all: &mut [T] = unsafe { v.region.slice_mut(0..len) };
        all.par_chunks_mut(1 << 20)
            .for_each(|c| c.fill(T::default()));
        Ok(v)
    }

    pub fn handle(&self) -> RegionHandle {
        self.region.handle(self.kind)
    }
}

impl<T: Pod> std::ops::Deref for SharedVec<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: workers only read the region (protocol); launcher writes need `&mut self`.
        unsafe { self.region.slice(0..self.len) }
    }
}

impl<T: Pod> std::ops::DerefMut for SharedVec<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: `&mut self` excludes other launcher views; a worker reads a range only
        // while the protocol keeps the launcher from writing it.
        unsafe { self.region.slice_mut(0..self.len) }
    }
}
