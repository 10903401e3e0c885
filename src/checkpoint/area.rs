//! The staging area's pages, touched in the background.
//!
//! The area grows at launch into half the RAM left free ([`super::staging`]): 172 GB beside
//! a 14B run on a 512 GiB host, whose first touch took 39 s of the start-up on a cloud VM
//! (4.4 GB/s: the hypervisor backs each page as it is first written). No checkpoint needs
//! it before the first one starts, `checkpoint.every_steps` steps later, so a few threads of
//! their own touch it while training starts and runs; a checkpoint that starts sooner waits
//! for the rest, and that wait is reported as its stall. The launch's host check counts the
//! area already, so a host short of memory is still refused before anything is allocated.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Instant;

/// One staging page: `page_elems` f32s.
pub type Page = Vec<f32>;

/// The staging pages: being touched, or ready (while no write holds them).
pub struct Area {
    ready: Vec<Page>,
    touching: Option<Touching>,
}

struct Touching {
    handle: JoinHandle<Vec<Page>>,
    /// Set on drop: the thread stops after the page it is on.
    stop: Arc<AtomicBool>,
}

impl Area {
    /// `count` pages of `page` elements, touched on a thread of their own (with a pool of
    /// an eighth of the cores, at least one, for the zeroing): this returns at once.
    pub fn touch_in_background(count: usize, page: usize) -> Area {
        if count == 0 {
            return Area::ready(Vec::new());
        }
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let threads = std::thread::available_parallelism().map_or(1, |n| (n.get() / 8).max(1));
        let touch = move || {
            let t = Instant::now();
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(|i| format!("mt-staging-{i}"))
                .build();
            let one = |_| crate::shm::huge::zeroed::<f32>(page);
            let pages: Vec<Page> = match &pool {
                // The zeroing's parallel chunks run on this pool, not the optimizer's.
                Ok(pool) => pool.install(|| {
                    (0..count)
                        .take_while(|_| !flag.load(Ordering::Relaxed))
                        .map(one)
                        .collect()
                }),
                Err(_) => (0..count).map(one).collect(),
            };
            tracing::info!(
                "checkpoint staging area touched: {:.1} GB in {:.1}s on {threads} thread(s)",
                (pages.len() * page * 4) as f64 / 1e9,
                t.elapsed().as_secs_f64(),
            );
            pages
        };
        match std::thread::Builder::new()
            .name("mt-staging".into())
            .spawn(touch)
        {
            Ok(handle) => Area {
                ready: Vec::new(),
                touching: Some(Touching { handle, stop }),
            },
            // No thread to spare: touch it here, as before.
            Err(_) => Area::ready((0..count).map(|_| crate::shm::huge::zeroed(page)).collect()),
        }
    }

    /// An area of `pages` already touched.
    pub fn ready(pages: Vec<Page>) -> Area {
        Area {
            ready: pages,
            touching: None,
        }
    }

    /// Every page, once touched (this waits for the touch).
    pub fn take(&mut self) -> Vec<Page> {
        self.wait();
        std::mem::take(&mut self.ready)
    }

    /// Gives back the pages a write held.
    pub fn put(&mut self, pages: Vec<Page>) {
        self.wait();
        self.ready = pages;
    }

    /// Pages held, once touched.
    pub fn len(&mut self) -> usize {
        self.wait();
        self.ready.len()
    }

    /// Whether the area has no page (once touched).
    pub fn is_empty(&mut self) -> bool {
        self.len() == 0
    }

    fn wait(&mut self) {
        if let Some(t) = self.touching.take() {
            self.ready = t
                .handle
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        }
    }
}

impl Drop for Area {
    /// A run that ends before the area is touched stops the touching.
    fn drop(&mut self) {
        if let Some(t) = &self.touching {
            t.stop.store(true, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_touched_in_the_background_are_all_there_and_zero() {
        let mut area = Area::touch_in_background(9, 1 << 12);
        let pages = area.take();
        assert_eq!(pages.len(), 9);
        assert!(pages.iter().all(|p| p.len() == 1 << 12));
        assert!(pages.iter().flatten().all(|&x| x == 0.0));
        assert_eq!(area.len(), 0, "taken");
        area.put(pages);
        assert_eq!(area.len(), 9, "given back");
    }

    #[test]
    fn an_empty_area_starts_no_thread() {
        let mut area = Area::touch_in_background(0, 1 << 20);
        assert!(area.touching.is_none());
        assert!(area.is_empty());
    }

    #[test]
    fn a_stopped_touch_ends_early() {
        // 2048 pages of 1 MiB: stopped at once, it touches a few of them, not 2 GiB.
        let mut area = Area::touch_in_background(2048, 1 << 18);
        area.touching
            .as_ref()
            .unwrap()
            .stop
            .store(true, Ordering::Relaxed);
        assert!(area.len() < 2048, "touched {} pages", area.len());
    }
}
