//! Host buffers aligned for direct I/O (`O_DIRECT`), viewed as elements or as bytes.
//!
//! `O_DIRECT` wants the memory address, the file offset and the length of every transfer
//! aligned to the device's logical block; a `Vec`'s allocation is not (glibc's large
//! allocations sit 16 bytes into a page). An [`Aligned`] buffer starts on a page
//! ([`ALIGN`]) and holds a whole number of pages, so any of its page-aligned stretches can
//! be read or written direct. The optimizer's state on the drives is streamed through
//! buffers of this kind (`crate::host`'s drive store).

use std::alloc::Layout;

use crate::elem::Pod;

/// Alignment of the buffer's start and of its length in bytes: 4 KiB, the largest logical
/// block size of common devices.
pub const ALIGN: usize = 4096;

/// `n` elements of `T` (zero at first) on page-aligned memory whose length is a whole
/// number of pages.
pub struct Aligned<T: Pod> {
    ptr: *mut T,
    n: usize,
    layout: Layout,
}

// SAFETY: an `Aligned` owns its memory as a `Vec<T>` would; sharing it shares `T`s.
unsafe impl<T: Pod> Send for Aligned<T> {}
// SAFETY: as above.
unsafe impl<T: Pod> Sync for Aligned<T> {}

impl<T: Pod> Aligned<T> {
    /// `n` zero elements (at least one page).
    pub fn zeroed(n: usize) -> Aligned<T> {
        let bytes = (n * size_of::<T>()).next_multiple_of(ALIGN).max(ALIGN);
        let layout = Layout::from_size_align(bytes, ALIGN).expect("a buffer of a valid size");
        // SAFETY: the layout's size is non-zero.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<T>();
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        Aligned { ptr, n, layout }
    }

    pub fn len(&self) -> usize {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    pub fn as_slice(&self) -> &[T] {
        // SAFETY: `n` elements of initialized (zeroed or written) memory owned by `self`;
        // `T: Pod` makes any bits a valid `T`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.n) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as above, borrowed mutably through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.n) }
    }

    /// The buffer's bytes: its elements, then the rest of its last page.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the allocation holds `layout.size()` initialized bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.cast::<u8>(), self.layout.size()) }
    }

    /// The buffer's bytes, writable (any bits are valid elements: `T: Pod`).
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, borrowed mutably through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.cast::<u8>(), self.layout.size()) }
    }
}

impl<T: Pod> Drop for Aligned<T> {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.cast::<u8>(), self.layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_on_a_page_and_holds_whole_pages() {
        let mut a = Aligned::<f32>::zeroed(1500);
        assert_eq!(a.bytes().as_ptr() as usize % ALIGN, 0);
        assert_eq!(a.bytes().len(), 2 * ALIGN);
        assert!(a.as_slice().iter().all(|&x| x == 0.0));
        a.as_mut_slice()[1] = 1.0;
        assert_eq!(a.bytes()[4..8], 1.0f32.to_le_bytes());
        assert_eq!(Aligned::<u16>::zeroed(0).bytes().len(), ALIGN);
    }
}
