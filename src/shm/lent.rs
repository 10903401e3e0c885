//! Host buffers lent to another thread while their owner goes on changing them.
//!
//! The checkpoint writer thread reads the blocks of the master weights and Adam moments that
//! the optimizer has not changed since the checkpoint's step, while the optimizer changes
//! others ([`crate::checkpoint::writer`]). Both are parts of the same allocations, so the
//! writer cannot hold a borrow: it holds a [`Lent`] view, which keeps the memory alive (an
//! `Arc` to its owner), so it can never dangle. Race freedom rests on a protocol, as for the
//! shared regions ([`super`]): the writer reads a block only while the checkpoint's gate
//! says the owner will not change it, and the owner changes a block only after the gate's
//! `before_change` returned for it ([`crate::checkpoint::staging`]).

use std::ops::Range;
use std::sync::Arc;

use super::huge::{Zeroable, zeroed};

/// An allocation whose address never changes.
struct Alloc<T> {
    ptr: *mut T,
    len: usize,
    /// The owner of the memory; never touched after `ptr` was taken from it.
    _vec: Vec<T>,
}

// SAFETY: `Alloc` is a `Vec<T>` with its pointer cached; sharing it shares `T`s.
unsafe impl<T: Send + Sync> Send for Alloc<T> {}
// SAFETY: as above.
unsafe impl<T: Send + Sync> Sync for Alloc<T> {}

/// A host buffer of zeros (pages touched, [`zeroed`]) that can be lent ([`Buf::lend`]).
/// The owner reaches it through `&self`/`&mut self` like a `Vec`, except that a range is
/// borrowed mutably without borrowing the rest ([`Buf::range_mut`]).
pub struct Buf<T> {
    alloc: Arc<Alloc<T>>,
}

impl<T: Zeroable> Buf<T> {
    pub fn zeroed(n: usize) -> Buf<T> {
        let mut vec = zeroed(n);
        Buf {
            alloc: Arc::new(Alloc {
                ptr: vec.as_mut_ptr(),
                len: n,
                _vec: vec,
            }),
        }
    }
}

impl<T> Buf<T> {
    pub fn len(&self) -> usize {
        self.alloc.len
    }

    pub fn is_empty(&self) -> bool {
        self.alloc.len == 0
    }

    pub fn as_slice(&self) -> &[T] {
        // SAFETY: the allocation holds `len` initialized elements; the owner writes only
        // through `&mut self`, and lent views only read.
        unsafe { std::slice::from_raw_parts(self.alloc.ptr, self.alloc.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [T] {
        self.range_mut(0..self.len())
    }

    /// Elements `r`, writable, without a reference to the others (which a lent view may
    /// be reading).
    pub fn range_mut(&mut self, r: Range<usize>) -> &mut [T] {
        assert!(
            r.start <= r.end && r.end <= self.len(),
            "{r:?} of {}",
            self.len()
        );
        // SAFETY: in bounds; `&mut self` excludes other owner references, and the protocol
        // (module docs) keeps lent views off `r` while this borrow lives.
        unsafe { std::slice::from_raw_parts_mut(self.alloc.ptr.add(r.start), r.len()) }
    }

    /// A read-only view for another thread.
    pub fn lend(&self) -> Lent<T>
    where
        T: Send + Sync + 'static,
    {
        Lent {
            ptr: self.alloc.ptr,
            len: self.alloc.len,
            _keep: self.alloc.clone(),
        }
    }
}

/// A read-only view of a lent host buffer (a [`Buf`], or a shared region's), which keeps
/// the memory alive.
pub struct Lent<T> {
    ptr: *const T,
    len: usize,
    _keep: Arc<dyn Send + Sync>,
}

// SAFETY: a `Lent` only reads `T`s, which `T: Sync` lets any thread do; the memory stays
// alive through `_keep`; races are excluded by the protocol (module docs).
unsafe impl<T: Sync> Send for Lent<T> {}
// SAFETY: as above.
unsafe impl<T: Sync> Sync for Lent<T> {}

impl<T> Lent<T> {
    /// A view of the `len` elements at `ptr`, which `keep` keeps allocated and in place.
    ///
    /// # Safety
    /// `ptr` points to `len` initialized `T`s that live as long as `keep` does.
    pub(super) unsafe fn new(ptr: *const T, len: usize, keep: Arc<dyn Send + Sync>) -> Lent<T> {
        Lent {
            ptr,
            len,
            _keep: keep,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements `r`, which the protocol must let this thread read now.
    pub fn get(&self, r: Range<usize>) -> &[T] {
        assert!(
            r.start <= r.end && r.end <= self.len,
            "{r:?} of {}",
            self.len
        );
        // SAFETY: in bounds of memory `_keep` keeps alive; unwritten while the protocol
        // lets this thread read it.
        unsafe { std::slice::from_raw_parts(self.ptr.add(r.start), r.len()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lent_view_reads_from_another_thread_and_outlives_its_owner() {
        let mut buf = Buf::<f32>::zeroed(100);
        buf.as_mut_slice()
            .iter_mut()
            .enumerate()
            .for_each(|(i, x)| *x = i as f32);
        let lent = buf.lend();
        let reader = std::thread::spawn(move || lent.get(10..20).iter().sum::<f32>());
        // The owner writes elements the reader does not read.
        buf.range_mut(50..60).fill(-1.0);
        assert_eq!(reader.join().unwrap(), (10..20).sum::<i32>() as f32);
        let lent = buf.lend();
        drop(buf);
        assert_eq!(lent.get(99..100), [99.0]);
        assert_eq!(lent.len(), 100);
    }

    #[test]
    #[should_panic]
    fn out_of_bounds_panics() {
        Buf::<u16>::zeroed(4).lend().get(2..5);
    }
}
