//! Several nodes: one `mt-launch` per node, started by `mpirun`, talking through MPI.
//!
//! MPI is reached through `libmt_mpi.so` (launcher/mpi/shim.c), built with the machine's
//! own `mpicc` beside the binaries and loaded here only when the launcher finds itself
//! under mpirun (OpenMPI's `OMPI_COMM_WORLD_SIZE`, MPICH/Hydra's `PMI_SIZE`, PMIx's
//! `PMIX_RANK`). So the binaries never link libmpi, and OpenMPI and MPICH (whose C ABIs
//! differ) both work: the shim is compiled against the local `mpi.h`.
//!
//! Nothing waits forever. Before each collective every rank tells every other that it has
//! arrived ([`Mpi::arrive`]); a rank that does not arrive within `training.worker_timeout_s`
//! is named with its host, and the job ends: a peer that hangs stops every rank. A rank
//! that stops inside a collective is caught by a watchdog thread, which ends the job
//! (MPI_Abort) naming the collective. A peer that dies is seen by mpirun, which ends the
//! others; a launcher that fails ends the job too ([`Mpi::abort`] from `main`), after
//! stopping its own workers.

use std::ffi::{c_char, c_int, c_long, c_void};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use half::bf16;
use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW, Symbol};
use mt::host::{Elems, ElemsRef, Peers};
use mt::layout::shards::{Window, windows};

/// Environment variables that say the process was started by an MPI launcher.
const MPI_ENV: [&str; 4] = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "PMI_RANK"];

/// Elements per MPI call: counts are C ints.
const MAX_COUNT: usize = mt::switches::MPI_MAX_COUNT;

/// An element type a collective sums (the shim's numbering).
pub trait Elem: Copy {
    const KIND: c_int;
}
impl Elem for f32 {
    const KIND: c_int = 0;
}
impl Elem for bf16 {
    const KIND: c_int = 1;
}
impl Elem for f64 {
    const KIND: c_int = 2;
}
/// A split master's low halves: moved, never summed (their kind is bf16's, 16 bits).
impl Elem for u16 {
    const KIND: c_int = 1;
}

type AllreduceFn = unsafe extern "C" fn(*mut c_void, c_long, c_int) -> c_int;

/// The shim's functions, resolved once.
struct Fns {
    finalize: unsafe extern "C" fn() -> c_int,
    abort: unsafe extern "C" fn(c_int) -> c_int,
    barrier: unsafe extern "C" fn() -> c_int,
    allreduce_same: AllreduceFn,
    allreduce_sum: AllreduceFn,
    reduce_scatter: unsafe extern "C" fn(*const c_void, *mut c_void, *const c_int, c_int) -> c_int,
    allgather_f64: unsafe extern "C" fn(*const f64, c_int, *mut f64) -> c_int,
    allgather_inplace:
        unsafe extern "C" fn(*mut c_void, *const c_int, *const c_int, c_int) -> c_int,
    gather_root: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        *const c_int,
        *const c_int,
        c_int,
    ) -> c_int,
    max_i64: unsafe extern "C" fn(*mut i64) -> c_int,
    arrive_start: unsafe extern "C" fn() -> c_int,
    arrive_test: unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int,
    error_string: unsafe extern "C" fn(c_int, *mut c_char, c_int),
}

/// This launcher's place among the nodes.
pub struct Mpi {
    pub rank: usize,
    pub size: usize,
    pub host: String,
    /// Every rank's host, by rank.
    hosts: Vec<String>,
    fns: Fns,
    /// The collective in progress and when it started, for the watchdog.
    waiting: Arc<Mutex<Option<(String, Instant)>>>,
    /// Seconds a collective may wait (`training.worker_timeout_s`).
    timeout_s: Arc<AtomicU64>,
    /// Elements per MPI call ([`max_count`]).
    max_count: usize,
    /// Nanoseconds spent so far waiting for the other ranks to reach a collective
    /// ([`Mpi::arrive`]), as against moving its data ([`Mpi::waited`]).
    arrival_wait_ns: AtomicU64,
    _lib: Library,
}

static WORLD: OnceLock<Mpi> = OnceLock::new();

/// Joins the MPI job when the process was started by an MPI launcher; `None` otherwise.
pub fn init() -> Result<Option<&'static Mpi>> {
    let Some(var) = MPI_ENV.iter().find(|v| std::env::var_os(v).is_some()) else {
        return Ok(None);
    };
    let mpi = Mpi::load(var)?;
    Ok(Some(WORLD.get_or_init(|| mpi)))
}

/// The MPI job this launcher belongs to, when it has more than one rank.
pub fn world() -> Option<&'static Mpi> {
    job().filter(|m| m.size > 1)
}

/// The MPI job this launcher joined, one rank or more (it must finalize it).
pub fn job() -> Option<&'static Mpi> {
    WORLD.get()
}

/// The shim: `$MT_MPI_SHIM`, beside this executable, or where the build left it.
fn shim_path(var: &str) -> Result<PathBuf> {
    if let Some(p) = &mt::switches::get().mpi_shim {
        return Ok(p.clone());
    }
    let exe = std::env::current_exe().context("locate mt-launch")?;
    let beside = exe.with_file_name("libmt_mpi.so");
    let built = PathBuf::from(env!("MT_MPI_SHIM_BUILT"));
    [beside.clone(), built]
        .into_iter()
        .find(|p| p.is_file())
        .ok_or_else(|| anyhow!(no_shim(var, &beside)))
}

/// Why there is no MPI shim, and the commands that build one (`MT_MPI=1` makes setup.sh
/// install OpenMPI and MPICH; the shim is built by the launcher's build script, which
/// only `--workspace` reaches from the checkout's root).
fn no_shim(var: &str, beside: &Path) -> String {
    format!(
        "mt-launch runs under an MPI launcher ({var} is set) but was built without MPI: {} is \
         missing. In the source checkout, install an MPI with its compiler wrapper `mpicc` and \
         build again: MT_MPI=1 scripts/setup.sh && cargo build --release --workspace (then copy \
         target/release/libmt_mpi.so beside mt-launch); or point MT_MPI_SHIM at a libmt_mpi.so",
        beside.display()
    )
}

impl Mpi {
    fn load(var: &str) -> Result<Mpi> {
        let max_count = max_count()?;
        let path = shim_path(var)?;
        // SAFETY: loading the shim runs libmpi's initializers, which are sound to run at
        // any time; RTLD_GLOBAL lets MPI's own plugins see libmpi's symbols.
        let lib = unsafe { Library::open(Some(&path), RTLD_NOW | RTLD_GLOBAL) }
            .with_context(|| format!("load the MPI shim {}", path.display()))?;
        // SAFETY: each symbol is declared in shim.c with exactly this signature.
        let fns = unsafe {
            fn get<T: Copy>(lib: &Library, name: &[u8]) -> Result<T> {
                // SAFETY: the caller names T as the symbol's C signature.
                let s: Symbol<T> = unsafe { lib.get(name) }
                    .with_context(|| format!("MPI shim lacks {}", String::from_utf8_lossy(name)))?;
                Ok(*s)
            }
            let init: unsafe extern "C" fn(*mut c_int, *mut c_int, *mut c_int) -> c_int =
                get(&lib, b"mt_mpi_init")?;
            let names: unsafe extern "C" fn(*mut c_char, c_int) -> c_int =
                get(&lib, b"mt_mpi_host_names")?;
            let fns = Fns {
                finalize: get(&lib, b"mt_mpi_finalize")?,
                abort: get(&lib, b"mt_mpi_abort")?,
                barrier: get(&lib, b"mt_mpi_barrier")?,
                allreduce_same: get(&lib, b"mt_mpi_allreduce_same")?,
                allreduce_sum: get(&lib, b"mt_mpi_allreduce_sum")?,
                reduce_scatter: get(&lib, b"mt_mpi_reduce_scatter")?,
                allgather_f64: get(&lib, b"mt_mpi_allgather_f64")?,
                allgather_inplace: get(&lib, b"mt_mpi_allgather_inplace")?,
                gather_root: get(&lib, b"mt_mpi_gather_root")?,
                max_i64: get(&lib, b"mt_mpi_allreduce_max_i64")?,
                arrive_start: get(&lib, b"mt_mpi_arrive_start")?,
                arrive_test: get(&lib, b"mt_mpi_arrive_test")?,
                error_string: get(&lib, b"mt_mpi_error_string")?,
            };
            let (mut rank, mut size, mut provided) = (0, 0, 0);
            let rc = init(&mut rank, &mut size, &mut provided);
            if rc != 0 {
                bail!("MPI_Init_thread failed (MPI error {rc})");
            }
            const LEN: usize = 256;
            let mut buf = vec![0 as c_char; LEN * size as usize];
            let rc = names(buf.as_mut_ptr(), LEN as c_int);
            if rc != 0 {
                bail!("gathering the ranks' host names failed (MPI error {rc})");
            }
            let hosts: Vec<String> = buf
                .chunks(LEN)
                .map(|c| {
                    let c = c.split(|&b| b == 0).next().unwrap_or(&[]);
                    String::from_utf8_lossy(&c.iter().map(|&b| b as u8).collect::<Vec<_>>())
                        .into_owned()
                })
                .collect();
            (fns, rank as usize, size as usize, hosts)
        };
        let (fns, rank, size, hosts) = fns;
        let mpi = Mpi {
            rank,
            size,
            host: hosts[rank].clone(),
            hosts,
            fns,
            waiting: Arc::new(Mutex::new(None)),
            timeout_s: Arc::new(AtomicU64::new(600)),
            arrival_wait_ns: AtomicU64::new(0),
            max_count,
            _lib: lib,
        };
        mpi.start_watchdog();
        Ok(mpi)
    }

    /// `rank R of N on HOST`, for messages.
    pub fn who(&self) -> String {
        format!("rank {} of {} on {}", self.rank, self.size, self.host)
    }

    /// The time this rank has spent so far waiting for the others to reach a collective:
    /// the part of an exchange's time that is another rank's lateness, not the transfer.
    pub fn waited(&self) -> Duration {
        Duration::from_nanos(self.arrival_wait_ns.load(Ordering::Relaxed))
    }

    /// How long a collective may wait for the other ranks.
    pub fn set_timeout(&self, timeout: Duration) {
        self.timeout_s
            .store(timeout.as_secs().max(1), Ordering::Relaxed);
    }

    /// Ends every rank's process (never returns), once what this rank printed has had
    /// time to leave it ([`drain_output`]).
    pub fn abort(&self, code: i32) -> ! {
        drain_output();
        // SAFETY: MPI_Abort may be called from any thread once MPI is initialized.
        unsafe { (self.fns.abort)(code) };
        std::process::exit(code)
    }

    /// Leaves the MPI job after a run that succeeded on this rank.
    pub fn finalize(&self) {
        // SAFETY: called once, at the end of main, with no collective in flight.
        unsafe { (self.fns.finalize)() };
    }

    fn start_watchdog(&self) {
        let (waiting, timeout_s) = (self.waiting.clone(), self.timeout_s.clone());
        let (who, abort) = (self.who(), self.fns.abort);
        std::thread::spawn(move || {
            loop {
                std::thread::sleep(Duration::from_millis(200));
                let late = waiting.lock().ok().and_then(|w| {
                    let (what, since) = w.as_ref()?;
                    let limit = timeout_s.load(Ordering::Relaxed);
                    (since.elapsed().as_secs() >= limit).then(|| (what.clone(), limit))
                });
                if let Some((what, limit)) = late {
                    eprintln!(
                        "mt-launch ({who}): error: {what} waited more than {limit} s after every \
                         rank had reached it (training.worker_timeout_s): one of them hangs or is gone; ending every rank"
                    );
                    drain_output();
                    // SAFETY: MPI was initialized with MPI_THREAD_MULTIPLE (the watchdog may
                    // call in while the main thread waits in the collective).
                    unsafe { abort(1) };
                    std::process::exit(1);
                }
            }
        });
    }

    /// Waits until every rank has reached collective `what` (each sends every other a
    /// message on arrival), for at most the timeout: a rank that does not arrive is named
    /// with its host, where the collective itself could only wait.
    fn arrive(&self, what: &str) -> Result<()> {
        let t = Instant::now();
        let arrived = self.arrive_within(what, t);
        let ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.arrival_wait_ns.fetch_add(ns, Ordering::Relaxed);
        arrived
    }

    /// [`Mpi::arrive`] from `t`, when this rank reached collective `what`.
    fn arrive_within(&self, what: &str, t: Instant) -> Result<()> {
        // SAFETY: no arguments; the shim keeps the requests until the test completes them.
        self.check(what, unsafe { (self.fns.arrive_start)() })?;
        let limit = Duration::from_secs(self.timeout_s.load(Ordering::Relaxed));
        let mut arrived: Vec<c_int> = vec![0; self.size];
        let mut pause = Duration::from_micros(1);
        loop {
            let mut all = 0;
            // SAFETY: `arrived` has one entry per rank.
            let rc = unsafe { (self.fns.arrive_test)(arrived.as_mut_ptr(), &mut all) };
            self.check(what, rc)?;
            if all == 1 {
                return Ok(());
            }
            if t.elapsed() >= limit {
                let missing: Vec<String> = (0..self.size)
                    .filter(|&r| arrived[r] == 0)
                    .map(|r| format!("rank {r} (on {})", self.hosts[r]))
                    .collect();
                bail!(
                    "{} did not reach {what} within {} s (training.worker_timeout_s): it hangs or is gone; ending every rank",
                    missing.join(", "),
                    limit.as_secs()
                );
            }
            // Spin briefly (the others are usually close behind), then back off to 1 ms so
            // as not to take the cores the workers and the reduce use.
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    /// An MPI error code as an error naming this rank and the collective.
    fn check(&self, what: &str, rc: c_int) -> Result<()> {
        if rc == 0 {
            return Ok(());
        }
        let mut buf = [0 as c_char; 512];
        // SAFETY: the shim writes at most buf.len() bytes, NUL-terminated.
        let text = unsafe {
            (self.fns.error_string)(rc, buf.as_mut_ptr(), buf.len() as c_int);
            std::ffi::CStr::from_ptr(buf.as_ptr()).to_string_lossy()
        };
        bail!("{}: {what} failed: MPI error {rc} ({text})", self.who())
    }

    /// Runs collective `what` once every rank has reached it ([`Mpi::arrive`]), under the
    /// watchdog (a rank that stops in the middle of it), and turns its error code into an
    /// error.
    fn watched(&self, what: &str, call: impl FnOnce() -> c_int) -> Result<()> {
        self.arrive(what)?;
        *self.waiting.lock().expect("watchdog lock") = Some((what.to_string(), Instant::now()));
        let rc = call();
        *self.waiting.lock().expect("watchdog lock") = None;
        self.check(what, rc)
    }

    /// Sums `buf` over the ranks in place; every rank gets the same bits (a reduce-scatter
    /// then an all-gather, each part summed once by one rank).
    pub fn allreduce_same<T: Elem>(&self, what: &str, buf: &mut [T]) -> Result<()> {
        self.allreduce_with(self.fns.allreduce_same, what, buf)
    }

    /// MPI_Allreduce (sum) of `buf`, in place: MPI picks the order of additions.
    pub fn allreduce_mpi<T: Elem>(&self, what: &str, buf: &mut [T]) -> Result<()> {
        self.allreduce_with(self.fns.allreduce_sum, what, buf)
    }

    fn allreduce_with<T: Elem>(&self, f: AllreduceFn, what: &str, buf: &mut [T]) -> Result<()> {
        for chunk in buf.chunks_mut(self.max_count) {
            let (ptr, n) = (chunk.as_mut_ptr().cast(), chunk.len() as c_long);
            // SAFETY: the shim reads and writes exactly `n` elements of type T at `ptr`.
            self.watched(what, || unsafe { f(ptr, n, T::KIND) })?;
        }
        Ok(())
    }

    /// Reduce-scatter by sum: this rank's `recv` is the sum over ranks of its part of
    /// `send` (`recv.len()` elements at `rank x recv.len()`; `send` has size parts).
    pub fn reduce_scatter<T: Elem>(&self, what: &str, send: &[T], recv: &mut [T]) -> Result<()> {
        assert_eq!(send.len(), recv.len() * self.size, "one part per rank");
        assert!(recv.len() <= MAX_COUNT, "a part's count fits a C int");
        let counts = vec![recv.len() as c_int; self.size];
        // SAFETY: send holds size x counts[r] elements, recv counts[rank].
        self.watched(what, || unsafe {
            (self.fns.reduce_scatter)(
                send.as_ptr().cast(),
                recv.as_mut_ptr().cast(),
                counts.as_ptr(),
                T::KIND,
            )
        })
    }

    /// Reduce-scatter by sum over pieces of `buf`, in place: `pieces[r]` (contiguous, in
    /// rank order, covering `buf`) is summed over the ranks into this rank's own piece of
    /// `buf` (the others' pieces keep this rank's values). Every rank passes the same
    /// pieces. One MPI call per window of the buffer ([`windows`]); no copy of the buffer.
    pub fn reduce_scatter_pieces<T: Elem>(
        &self,
        what: &str,
        buf: &mut [T],
        pieces: &[Range<usize>],
    ) -> Result<()> {
        self.check_pieces(buf.len(), pieces);
        let base = buf.as_mut_ptr();
        for w in windows(pieces, self.max_count) {
            let (counts, _) = counts(&w);
            // SAFETY: the window's parts lie within `buf`: send is the window (Σ counts
            // elements), recv this rank's part of it (counts[rank]), which the shim reads
            // before it writes each chunk of it.
            self.watched(what, || unsafe {
                (self.fns.reduce_scatter)(
                    base.add(w.range.start).cast_const().cast(),
                    base.add(w.parts[self.rank].start).cast(),
                    counts.as_ptr(),
                    T::KIND,
                )
            })?;
        }
        Ok(())
    }

    /// All-gather in place: every rank's piece `pieces[r]` of `buf` (contiguous, in rank
    /// order, covering `buf`) goes to every rank. One MPI call per window of the buffer.
    pub fn allgather_pieces<T: Elem>(
        &self,
        what: &str,
        buf: &mut [T],
        pieces: &[Range<usize>],
    ) -> Result<()> {
        self.check_pieces(buf.len(), pieces);
        for w in windows(pieces, self.max_count) {
            let (counts, displs) = counts(&w);
            let buf = &mut buf[w.range.clone()];
            // SAFETY: every part lies within the window `buf` (displacements relative to it).
            self.watched(what, || unsafe {
                (self.fns.allgather_inplace)(
                    buf.as_mut_ptr().cast(),
                    counts.as_ptr(),
                    displs.as_ptr(),
                    T::KIND,
                )
            })?;
        }
        Ok(())
    }

    /// Gathers every rank's piece `pieces[r]` (this rank's is `mine`) into `all` on rank 0,
    /// which must then cover the pieces; `all` is not used on other ranks. One MPI call per
    /// window of the pieces.
    pub fn gather_pieces<T: Elem>(
        &self,
        what: &str,
        mine: &[T],
        all: &mut [T],
        pieces: &[Range<usize>],
    ) -> Result<()> {
        let len = pieces.last().map_or(0, |p| p.end);
        self.check_pieces(len, pieces);
        let piece = pieces[self.rank].clone();
        assert_eq!(mine.len(), piece.len(), "this rank's piece");
        assert!(
            self.rank != 0 || all.len() == len,
            "rank 0 receives every piece"
        );
        for w in windows(pieces, self.max_count) {
            let (counts, displs) = counts(&w);
            let send = &mine[w.within(self.rank, &piece)];
            let recv = match self.rank {
                0 => all[w.range.clone()].as_mut_ptr(),
                _ => all.as_mut_ptr(),
            };
            // SAFETY: send holds counts[rank] elements; on rank 0 recv holds Σ counts.
            self.watched(what, || unsafe {
                (self.fns.gather_root)(
                    send.as_ptr().cast(),
                    recv.cast(),
                    counts.as_ptr(),
                    displs.as_ptr(),
                    T::KIND,
                )
            })?;
        }
        Ok(())
    }

    /// Checks that `pieces` tile `0..len` in rank order, one per rank.
    fn check_pieces(&self, len: usize, pieces: &[Range<usize>]) {
        assert_eq!(pieces.len(), self.size, "one piece per rank");
        let mut at = 0;
        for p in pieces {
            assert_eq!(p.start, at, "pieces tile the buffer in rank order");
            at = p.end;
        }
        assert_eq!(at, len, "pieces cover the buffer");
    }

    /// Every rank's `send` (all of one length), in rank order.
    pub fn allgather_f64(&self, what: &str, send: &[f64]) -> Result<Vec<f64>> {
        let mut recv = vec![0.0; send.len() * self.size];
        let n = send.len() as c_int;
        // SAFETY: send holds n values, recv n x size.
        self.watched(what, || unsafe {
            (self.fns.allgather_f64)(send.as_ptr(), n, recv.as_mut_ptr())
        })?;
        Ok(recv)
    }

    /// The largest of every rank's `value`.
    pub fn max_i64(&self, what: &str, value: i64) -> Result<i64> {
        let mut v = value;
        // SAFETY: one i64, read and written in place.
        self.watched(what, || unsafe { (self.fns.max_i64)(&mut v) })?;
        Ok(v)
    }

    /// Waits until every rank gets here.
    pub fn barrier(&self, what: &str) -> Result<()> {
        // SAFETY: no arguments.
        self.watched(what, || unsafe { (self.fns.barrier)() })
    }
}

/// The host state's and the step's exchanges between nodes ([`mt::host::Peers`]), through
/// this job's collectives; an error keeps the whole message of the collective's.
impl Peers for Mpi {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn reduce_scatter_pieces(
        &self,
        what: &str,
        buf: Elems,
        pieces: &[Range<usize>],
    ) -> mt::Result<()> {
        match buf {
            Elems::F32(b) => Mpi::reduce_scatter_pieces(self, what, b, pieces),
            Elems::Bf16(b) => Mpi::reduce_scatter_pieces(self, what, b, pieces),
            Elems::U16(_) => unreachable!("a split master's low halves are never summed"),
        }
        .map_err(lib_error)
    }

    fn allgather_pieces(&self, what: &str, buf: Elems, pieces: &[Range<usize>]) -> mt::Result<()> {
        match buf {
            Elems::F32(b) => Mpi::allgather_pieces(self, what, b, pieces),
            Elems::Bf16(b) => Mpi::allgather_pieces(self, what, b, pieces),
            Elems::U16(b) => Mpi::allgather_pieces(self, what, b, pieces),
        }
        .map_err(lib_error)
    }

    fn gather_pieces(
        &self,
        what: &str,
        mine: ElemsRef,
        all: Elems,
        pieces: &[Range<usize>],
    ) -> mt::Result<()> {
        match (mine, all) {
            (ElemsRef::F32(x), Elems::F32(a)) => Mpi::gather_pieces(self, what, x, a, pieces),
            (ElemsRef::Bf16(x), Elems::Bf16(a)) => Mpi::gather_pieces(self, what, x, a, pieces),
            (ElemsRef::U16(x), Elems::U16(a)) => Mpi::gather_pieces(self, what, x, a, pieces),
            _ => unreachable!("a gather receives its pieces' element type"),
        }
        .map_err(lib_error)
    }

    fn allgather_f64(&self, what: &str, send: &[f64]) -> mt::Result<Vec<f64>> {
        Mpi::allgather_f64(self, what, send).map_err(lib_error)
    }

    fn max_i64(&self, what: &str, value: i64) -> mt::Result<i64> {
        Mpi::max_i64(self, what, value).map_err(lib_error)
    }

    fn waited(&self) -> Duration {
        Mpi::waited(self)
    }
}

/// A collective's error as the library's, its message whole (`{:#}`: every context).
fn lib_error(e: anyhow::Error) -> mt::Error {
    mt::Error::Other(format!("{e:#}"))
}

/// A window's C counts and displacements (relative to the window), by rank.
fn counts(w: &Window) -> (Vec<c_int>, Vec<c_int>) {
    let c = |x: usize| c_int::try_from(x).expect("a window's count fits a C int");
    w.parts
        .iter()
        .map(|p| (c(p.len()), c(p.start - w.range.start)))
        .unzip()
}

/// Elements per MPI call: [`MAX_COUNT`], or `$MT_MPI_MAX_COUNT` where a test sets a smaller
/// window (a test hook: the tiny test models' blocks are far below 2^30 elements, so only
/// this makes their collectives run over several windows). Read once, at start-up.
fn max_count() -> Result<usize> {
    Ok(mt::switches::get().mpi_max_count.unwrap_or(MAX_COUNT))
}

/// Flushes this rank's output and waits a moment before `MPI_Abort`: the launcher's
/// (mpiexec's) forwarder reads each rank's output from a pipe, and an abort that follows the
/// last line at once can tear the job down before the line is read (seen under MPICH: a
/// hung rank's job ended at the timeout with rank 0's error lost, about one run in three).
fn drain_output() {
    use std::io::Write;
    let _ = std::io::stderr().flush();
    let _ = std::io::stdout().flush();
    std::thread::sleep(Duration::from_millis(250));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hint is a command line that works from the checkout's root as written: the
    /// setup script it names exists and reads MT_MPI, and the build reaches the launcher's
    /// build script (which builds the shim) only with --workspace.
    #[test]
    fn the_missing_shim_hint_builds_the_shim() {
        let msg = no_shim("OMPI_COMM_WORLD_SIZE", Path::new("/x/libmt_mpi.so"));
        let cmd = "MT_MPI=1 scripts/setup.sh && cargo build --release --workspace";
        assert!(msg.contains(cmd), "{msg}");
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let setup = std::fs::read_to_string(root.join("scripts/setup.sh")).unwrap();
        assert!(setup.contains("MT_MPI"), "scripts/setup.sh reads MT_MPI");
        let workspace = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
        assert!(
            workspace.contains("\"launcher\""),
            "launcher/ is a workspace member"
        );
        assert!(msg.contains("OMPI_COMM_WORLD_SIZE") && msg.contains("/x/libmt_mpi.so"));
    }
}
