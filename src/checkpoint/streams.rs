//! A window of a checkpoint written by several threads at once, each a run of it.
//!
//! One positioned write at a time leaves the disk idle whenever the writing thread waits:
//! for a core, for memory the optimizer's passes keep busy, for the write itself. Beside
//! training, a periodic checkpoint so wrote at 54-65% of the disk's `dd oflag=direct` rate
//! (benches/results/checkpoint_qwen2.5-7b-4L_H200-16c_2026-11-24_streams.md); on that host,
//! with every core busy, one `dd` of 4 MiB writes reached 1.3 GB/s and four at once 1.95.
//! The writes' threads are their own, not rayon's: the launcher's pool is the optimizer's,
//! and work queued there waits behind it.

use std::borrow::Cow;
use std::ops::Range;

use super::state::{BlockValues, Field, WRITE_CHUNK};
use crate::error::Result;

/// Threads writing one window at once, unless `MT_CHECKPOINT_STREAMS` sets another count
/// (1 writes as one thread did; for comparisons, and for disks that want one stream).
pub const STREAMS: usize = 4;

/// [`STREAMS`], or `MT_CHECKPOINT_STREAMS` (a count from 1, checked at start).
fn streams() -> usize {
    crate::switches::get().checkpoint_streams.unwrap_or(STREAMS)
}

/// Runs `write(part)` for parts that tile `window` (runs of whole [`WRITE_CHUNK`]s, the
/// last maybe shorter), on up to [`STREAMS`] threads at once (`MT_CHECKPOINT_STREAMS`); the
/// first error, if any.
pub fn in_streams(
    window: Range<usize>,
    write: impl Fn(Range<usize>) -> Result<()> + Sync,
) -> Result<()> {
    let per = window
        .len()
        .div_ceil(WRITE_CHUNK)
        .div_ceil(streams())
        .max(1)
        * WRITE_CHUNK;
    let parts: Vec<Range<usize>> = window
        .clone()
        .step_by(per)
        .map(|at| at..(at + per).min(window.end))
        .collect();
    if parts.len() <= 1 {
        return write(window);
    }
    let write = &write;
    std::thread::scope(|s| {
        let running: Vec<_> = parts
            .into_iter()
            .map(|part| s.spawn(move || write(part)))
            .collect();
        running
            .into_iter()
            .map(|t| t.join().expect("a checkpoint write panicked"))
            .collect::<Result<Vec<()>>>()
    })?;
    Ok(())
}

/// `values` read from its element `by` on: a part's values, where `values` is its window's.
pub struct Shifted<'a> {
    pub values: &'a dyn BlockValues,
    pub by: usize,
}

impl BlockValues for Shifted<'_> {
    fn values(&self, field: Field, r: Range<usize>) -> Cow<'_, [f32]> {
        self.values
            .values(field, r.start + self.by..r.end + self.by)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    /// The parts tile the window in whole chunks, at most STREAMS of them, each written
    /// once; an error from any part is the result.
    #[test]
    fn parts_tile_the_window() {
        for (start, len) in [
            (0, 0),
            (5, 1),
            (3, WRITE_CHUNK),
            (7, 3 * WRITE_CHUNK + 1),
            (0, 9 * WRITE_CHUNK - 2),
        ] {
            let window = start..start + len;
            let seen = Mutex::new(Vec::new());
            in_streams(window.clone(), |p| {
                seen.lock().unwrap().push(p);
                Ok(())
            })
            .unwrap();
            let mut seen = seen.into_inner().unwrap();
            seen.sort_by_key(|p| p.start);
            assert!(seen.len() <= STREAMS, "{} parts", seen.len());
            let mut at = window.start;
            for p in &seen {
                assert_eq!(p.start, at, "parts of {window:?}: {seen:?}");
                assert!(p.end == window.end || (p.len() % WRITE_CHUNK == 0 && !p.is_empty()));
                at = p.end;
            }
            assert_eq!(at, window.end, "parts of {window:?}: {seen:?}");
        }
        let failed = in_streams(0..4 * WRITE_CHUNK, |p| match p.start {
            0 => Ok(()),
            _ => Err(crate::Error::Other(format!("part at {}", p.start))),
        });
        assert!(failed.is_err());
    }
}
