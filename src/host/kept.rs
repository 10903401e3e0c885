//! The optimizer's state kept on the drives after a run (`memory.keep_nvme_state`,
//! `mt-launch --keep-nvme-state`), and a later run resumed from it without a checkpoint.
//!
//! The state's files then have fixed names (`megatrain-master.state`, `-m`, `-v` in each
//! directory of `memory.nvme_path`, [`super::nvme::KEPT`]) and are not unlinked. A run that
//! ends at a step boundary (its last step, or a stop signal) writes beside them, in the
//! first directory, the store when it holds the master (`megatrain-store.state`: a split
//! master's high halves, or a bf16 master) and last the manifest
//! (`megatrain-nvme-state.json`), each atomically (a temporary name, fsync, rename, the
//! directory fsynced), owner-only, never through a link: the step, updates and settings of
//! the run ([`TrainState`]), the model's layout, the master and moments modes, the
//! directories and stripe, and each field's files, their size and the CRC32C of each block's
//! elements in them (made while the update writes them, [`Drives::written_crc`]).
//!
//! A run with the flag that finds the manifest checks it against its config before anything
//! is loaded ([`Kept::check`], the launcher the run's settings), opens the files (regular,
//! owner-only, of their length: [`super::nvme::Files::Reopened`]) and reads
//! the whole state once ([`HostState::resume_kept`]), comparing every block's checksum:
//! files rewritten after the manifest (a run killed mid-update), torn or another run's are
//! refused naming the file and the block. The manifest stays while the run trains on, so a
//! run killed before its end leaves a manifest its files no longer match.

use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use half::bf16;
use serde::{Deserialize, Serialize};

use crate::checkpoint::state::{TrainState, fingerprint};
use crate::config::{DType, MasterWeights, RunConfig};
use crate::layout::{Block, Layout};
use crate::optim::StoreOut;
use crate::{Error, Result};

use super::nvme::{Drives, STRIPE, Slot, WinBuf};
use super::{HostState, Master, store_bf16};

/// The manifest, in the first directory of `memory.nvme_path`.
pub const MANIFEST: &str = "megatrain-nvme-state.json";
/// The store where it holds the master, beside the manifest.
pub const STORE: &str = "megatrain-store.state";
/// The manifest format this build writes and reads.
const FORMAT: u32 = 1;
/// Elements of the store read or written at a time.
const CHUNK: usize = 1 << 20;

/// A kept state's manifest (module docs).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Kept {
    pub format: u32,
    /// Where training stood: steps and updates done, the layout, the run's settings.
    pub state: TrainState,
    /// `model.dtype`, `memory.master_weights` and `memory.moments_dtype` of the run.
    pub dtype: DType,
    pub master_weights: MasterWeights,
    pub moments_dtype: DType,
    /// The directories, in the order the state is striped over them.
    pub nvme_path: Vec<PathBuf>,
    /// Elements per stripe.
    pub stripe: usize,
    /// Each field's files: `master`, `m`, `v` on the drives, `store` beside the manifest.
    pub fields: Vec<KeptField>,
}

/// One field's files in a [`Kept`] manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeptField {
    pub name: String,
    /// One per drive (the store: one).
    pub files: Vec<PathBuf>,
    /// Bytes of each.
    pub size: u64,
    /// The CRC32C of each block's elements, 8 lowercase hex digits, in layout order.
    pub blocks: Vec<String>,
}

/// The manifest's path under `cfg`'s drives, where the state is kept.
pub fn manifest_path(cfg: &RunConfig) -> Option<PathBuf> {
    let m = &cfg.memory;
    (m.keep_nvme_state && !m.nvme_path.is_empty()).then(|| m.nvme_path[0].join(MANIFEST))
}

/// Refuses a store file beside the manifest `path` where there is no manifest (the
/// drives' files are refused as they are created, [`super::nvme::Files::Kept`]).
pub(super) fn refuse_stray(path: &Path) -> Result<()> {
    let store = path.with_file_name(STORE);
    match crate::checkpoint::atomic::exists(&store) {
        true => Err(refused(
            &store,
            "a file of a kept state without its manifest (megatrain-nvme-state.json): a run \
             that kept its state and did not end at a step, or another's file; refused, never \
             written over: remove the state's files to start afresh",
        )),
        false => Ok(()),
    }
}

/// A block in words, for the messages.
fn block_name(layout: &Layout, b: usize) -> String {
    let block: &Block = &layout.blocks[b];
    match block.prefix.trim_end_matches('.') {
        "" => format!("block {b} ({:?})", block.kind),
        p => format!("block {b} ({p})"),
    }
}

/// A refusal of the kept state at `path`.
fn refused(path: &Path, msg: impl std::fmt::Display) -> Error {
    Error::Config {
        path: path.into(),
        msg: format!("memory.keep_nvme_state: {msg}"),
    }
}

/// Opens `path` for reading (not through a link), checked to be an owner-only regular file.
fn check_owned(path: &Path) -> Result<std::fs::File> {
    let file = crate::checkpoint::atomic::open_nofollow(path).map_err(|e| Error::io(path, e))?;
    let meta = file.metadata().map_err(|e| Error::io(path, e))?;
    if !meta.is_file() || meta.mode() & 0o077 != 0 {
        return Err(refused(
            path,
            format!(
                "is not an owner-only regular file (mode {:o}); refused",
                meta.mode() & 0o777
            ),
        ));
    }
    Ok(file)
}

impl Kept {
    /// The manifest under `cfg`'s drives: None where the state is not kept or none is there.
    pub fn read(cfg: &RunConfig) -> Result<Option<(PathBuf, Kept)>> {
        let Some(path) = manifest_path(cfg) else {
            return Ok(None);
        };
        if !crate::checkpoint::atomic::exists(&path) {
            return Ok(None);
        }
        let mut text = String::new();
        check_owned(&path)?
            .read_to_string(&mut text)
            .map_err(|e| Error::io(&path, e))?;
        let kept: Kept = serde_json::from_str(&text)
            .map_err(|e| refused(&path, format!("malformed manifest: {e}")))?;
        Ok(Some((path, kept)))
    }

    /// Refuses a kept state that is not this run's: of another format, model, dtype,
    /// master or moments mode, drives or stripe (every difference named), or with no step
    /// left to run.
    pub fn check(&self, path: &Path, cfg: &RunConfig, layout: &Layout) -> Result<()> {
        let m = &cfg.memory;
        let mut d = Vec::new();
        let mut cmp = |key: &str, kept: String, ours: String| {
            if kept != ours {
                d.push(format!(
                    "{key}: the kept state's is {kept}, this run's {ours}"
                ));
            }
        };
        cmp("format", self.format.to_string(), FORMAT.to_string());
        cmp(
            "the model's layout (architecture and config)",
            self.state.layout.clone(),
            fingerprint(layout),
        );
        cmp(
            "model.dtype",
            format!("{:?}", self.dtype),
            format!("{:?}", cfg.model.dtype),
        );
        cmp(
            "memory.master_weights",
            format!("{:?}", self.master_weights),
            format!("{:?}", m.master_weights),
        );
        cmp(
            "memory.moments_dtype",
            format!("{:?}", self.moments_dtype),
            format!("{:?}", m.moments_dtype),
        );
        cmp(
            "memory.nvme_path",
            format!("{:?}", self.nvme_path),
            format!("{:?}", m.nvme_path),
        );
        cmp("the stripe", self.stripe.to_string(), STRIPE.to_string());
        if !d.is_empty() {
            return Err(refused(
                path,
                format!(
                    "the kept state is not this run's:\n  {}\nremove its files (the manifest \
                     lists them) to start afresh, or run with its settings",
                    d.join("\n  ")
                ),
            ));
        }
        let steps = cfg.training.num_steps;
        if self.state.step >= steps {
            return Err(refused(
                path,
                format!(
                    "the kept state is at step {}, training.num_steps is {steps}: nothing left to run",
                    self.state.step
                ),
            ));
        }
        Ok(())
    }

    /// The field `name`'s entry.
    fn field(&self, path: &Path, name: &str) -> Result<&KeptField> {
        self.fields
            .iter()
            .find(|f| f.name == name)
            .ok_or_else(|| refused(path, format!("the manifest lists no `{name}` files")))
    }
}

/// Each block's CRC32C so far, folded window after window.
fn fold(acc: &mut Option<u32>, crc: u32, len: usize) {
    *acc = Some(match *acc {
        None => crc,
        Some(a) => crc32c::crc32c_combine(a, crc, len),
    });
}

fn hex(crc: Option<u32>) -> String {
    format!("{:08x}", crc.unwrap_or(0))
}

impl HostState {
    /// Resumes from the kept state `kept` (its manifest at `path`, checked by
    /// [`Kept::check`]): reads every block of the files on the drives and of the store file,
    /// comparing their checksums with the manifest's, and fills the store. Nothing is
    /// written to the drives.
    pub fn resume_kept(&mut self, path: &Path, kept: &Kept) -> Result<TrainState> {
        let drives = self.drives.clone().expect("on the drives");
        let mut stream = std::mem::take(&mut self.stream);
        let read = stream
            .settle(&drives)
            .and_then(|()| self.read_kept(&drives, &mut stream, path, kept));
        self.stream = stream;
        read?;
        if !matches!(self.master, Master::F32(_)) {
            self.read_store(path, kept)?;
        }
        self.updates = kept.state.updates;
        Ok(kept.state.clone())
    }

    fn read_kept(
        &mut self,
        drives: &Drives,
        stream: &mut super::offload::Stream,
        path: &Path,
        kept: &Kept,
    ) -> Result<()> {
        let slots: Vec<Slot> = [Slot::Master, Slot::M, Slot::V]
            .into_iter()
            .filter(|&s| drives.holds(s))
            .collect();
        let fields = (slots.iter())
            .map(|s| kept.field(path, s.name()))
            .collect::<Result<Vec<_>>>()?;
        for (f, &s) in fields.iter().zip(&slots) {
            let (files, _) = drives.files(s).expect("held");
            if f.files != files || f.blocks.len() != self.layout.blocks.len() {
                return Err(refused(
                    path,
                    format!(
                        "the manifest's `{}` files are {:?} of {} blocks, this run's {files:?} of {}",
                        f.name,
                        f.files,
                        f.blocks.len(),
                        self.layout.blocks.len()
                    ),
                ));
            }
        }
        let mut win = stream.buffer(drives)?;
        let checked = (|| {
            for b in 0..self.layout.blocks.len() {
                let mut acc = vec![None; slots.len()];
                let offset = self.layout.blocks[b].offset;
                for w in drives.windows(&self.layout, b) {
                    drives.read(b, w.clone(), &mut win, &slots)?;
                    for (acc, &s) in acc.iter_mut().zip(&slots) {
                        let (crc, len) = win.buf(s).expect("held").crc(w.len());
                        fold(acc, crc, len);
                    }
                    if let Some(WinBuf::F32(x)) = &win.master {
                        let (g, x) = (offset + w.start..offset + w.end, &x.as_slice()[..w.len()]);
                        match self.store.out_mut(g) {
                            StoreOut::F32(s) => s.copy_from_slice(x),
                            StoreOut::Bf16(s) => s
                                .iter_mut()
                                .zip(x)
                                .for_each(|(d, x)| *d = bf16::from_f32(*x)),
                        }
                    }
                }
                for ((acc, f), &s) in acc.iter().zip(&fields).zip(&slots) {
                    if hex(*acc) != f.blocks[b] {
                        let (files, _) = drives.files(s).expect("held");
                        return Err(differs(path, kept, &files, &self.layout, b, *acc, f));
                    }
                }
            }
            Ok(())
        })();
        stream.spare_buffer(win);
        checked
    }

    /// Reads the store file of `kept` into the store, checking each block's checksum.
    fn read_store(&mut self, path: &Path, kept: &Kept) -> Result<()> {
        let f = kept.field(path, "store")?;
        let file_path = path.with_file_name(STORE);
        if f.files != [file_path.clone()] || f.blocks.len() != self.layout.blocks.len() {
            return Err(refused(
                path,
                "the manifest's `store` entry is not this run's",
            ));
        }
        let mut file = check_owned(&file_path)?;
        let len = file.metadata().map_err(|e| Error::io(&file_path, e))?.len();
        let want = 2 * self.layout.total as u64;
        if len != want || f.size != want {
            return Err(refused(
                &file_path,
                format!("is {len} bytes, the store is {want}: torn or truncated; refused"),
            ));
        }
        let mut bytes = vec![0u8; 2 * CHUNK];
        for b in 0..self.layout.blocks.len() {
            let (offset, n) = (self.layout.blocks[b].offset, self.layout.blocks[b].len);
            let mut acc = None;
            for s in (0..n).step_by(CHUNK) {
                let k = CHUNK.min(n - s);
                let bytes = &mut bytes[..2 * k];
                file.read_exact(bytes)
                    .map_err(|e| Error::io(&file_path, e))?;
                fold(&mut acc, crc32c::crc32c(bytes), bytes.len());
                let dst = store_bf16(&mut self.store, offset + s..offset + s + k);
                for (d, x) in dst.iter_mut().zip(bytes.chunks_exact(2)) {
                    *d = bf16::from_bits(u16::from_le_bytes([x[0], x[1]]));
                }
            }
            if hex(acc) != f.blocks[b] {
                return Err(differs(path, kept, &[file_path], &self.layout, b, acc, f));
            }
        }
        Ok(())
    }

    /// Writes the kept state's store file (where the store holds the master) and manifest
    /// for `state`, the state on the drives being that of its step (module docs). Returns
    /// the manifest's path.
    pub fn keep_state(&mut self, state: TrainState, cfg: &RunConfig) -> Result<PathBuf> {
        let path = manifest_path(cfg).expect("the state is kept");
        let drives = self.drives.clone().expect("on the drives");
        let mut stream = std::mem::take(&mut self.stream);
        let crcs = stream
            .settle(&drives)
            .and_then(|()| drives.sync())
            .and_then(|()| self.drive_crcs(&drives, &mut stream));
        self.stream = stream;
        let mut fields = crcs?;
        if !matches!(self.master, Master::F32(_)) {
            fields.push(self.write_store(&path)?);
        }
        let m = &cfg.memory;
        let kept = Kept {
            format: FORMAT,
            state,
            dtype: cfg.model.dtype,
            master_weights: m.master_weights,
            moments_dtype: m.moments_dtype,
            nvme_path: m.nvme_path.clone(),
            stripe: drives.stripe(),
            fields,
        };
        let text = serde_json::to_vec_pretty(&kept).expect("a manifest serializes");
        write_atomic(&path, |f| f.write_all(&text))?;
        Ok(path)
    }

    /// Each field on the drives with the checksums of its blocks: of the windows as last
    /// written, or read back where this run wrote none (no update ran since they were).
    fn drive_crcs(
        &self,
        drives: &Drives,
        stream: &mut super::offload::Stream,
    ) -> Result<Vec<KeptField>> {
        let slots: Vec<Slot> = [Slot::Master, Slot::M, Slot::V]
            .into_iter()
            .filter(|&s| drives.holds(s))
            .collect();
        let mut blocks = vec![Vec::new(); slots.len()];
        let mut win = None;
        for b in 0..self.layout.blocks.len() {
            let mut acc = vec![None; slots.len()];
            for w in drives.windows(&self.layout, b) {
                let written: Option<Vec<u32>> = (slots.iter())
                    .map(|&s| drives.written_crc(b, w.start, s))
                    .collect();
                let crcs = match written {
                    Some(c) => c,
                    None => {
                        let buf = match &mut win {
                            Some(buf) => buf,
                            None => win.insert(stream.buffer(drives)?),
                        };
                        drives.read(b, w.clone(), buf, &slots)?;
                        (slots.iter())
                            .map(|&s| buf.buf(s).expect("held").crc(w.len()).0)
                            .collect()
                    }
                };
                let es = |s: Slot| match (s, self.master_kind()) {
                    (Slot::Master, MasterWeights::Split) => 2,
                    (Slot::Master, _) => 4,
                    (_, _) => match self.moments {
                        super::AdamMoments::F32 { .. } => 4,
                        super::AdamMoments::Bf16 { .. } => 2,
                    },
                };
                for ((acc, c), &s) in acc.iter_mut().zip(crcs).zip(&slots) {
                    fold(acc, c, w.len() * es(s));
                }
            }
            for (blocks, acc) in blocks.iter_mut().zip(acc) {
                blocks.push(hex(acc));
            }
        }
        if let Some(w) = win {
            stream.spare_buffer(w);
        }
        Ok(slots
            .iter()
            .zip(blocks)
            .map(|(&s, blocks)| {
                let (files, size) = drives.files(s).expect("held");
                KeptField {
                    name: s.name().into(),
                    files,
                    size,
                    blocks,
                }
            })
            .collect())
    }

    /// How the master is held, as configured.
    fn master_kind(&self) -> MasterWeights {
        match self.master {
            Master::F32(_) => MasterWeights::Float32,
            Master::Split(_) => MasterWeights::Split,
            Master::Bf16 { .. } => MasterWeights::Bfloat16,
        }
    }

    /// Writes the store (bf16: a split master's high halves, or a bf16 master) beside the
    /// manifest at `path`, atomically; its entry.
    fn write_store(&self, path: &Path) -> Result<KeptField> {
        let file_path = path.with_file_name(STORE);
        let store = self
            .store
            .bf16()
            .expect("a split or bf16 master has a bf16 store");
        let mut blocks = Vec::new();
        write_atomic(&file_path, |f| {
            let mut bytes = Vec::with_capacity(2 * CHUNK);
            for b in &self.layout.blocks {
                let mut acc = None;
                for s in (0..b.len).step_by(CHUNK) {
                    let x = &store[b.offset + s..b.offset + (s + CHUNK).min(b.len)];
                    bytes.clear();
                    bytes.extend(x.iter().flat_map(|v| v.to_bits().to_le_bytes()));
                    fold(&mut acc, crc32c::crc32c(&bytes), bytes.len());
                    f.write_all(&bytes)?;
                }
                blocks.push(hex(acc));
            }
            Ok(())
        })?;
        Ok(KeptField {
            name: "store".into(),
            files: vec![file_path],
            size: 2 * self.layout.total as u64,
            blocks,
        })
    }
}

/// The refusal of block `b` of field `f` (in `files`), whose checksum is `got`.
fn differs(
    path: &Path,
    kept: &Kept,
    files: &[PathBuf],
    layout: &Layout,
    b: usize,
    got: Option<u32>,
    f: &KeptField,
) -> Error {
    let files: Vec<String> = files.iter().map(|p| p.display().to_string()).collect();
    refused(
        path,
        format!(
            "{}: {} of `{}` has CRC32C {}, the manifest of step {} says {}: the files changed \
             after it was written (a run killed mid-update, or a file torn or replaced); \
             refused, never trained on: resume from a checkpoint, or remove the kept state's \
             files to start afresh",
            files.join(", "),
            block_name(layout, b),
            f.name,
            hex(got),
            kept.state.step,
            f.blocks[b]
        ),
    )
}

/// Writes `path` atomically: a new owner-only temporary file beside it (never through a
/// link), `fill`ed, fsynced, renamed over `path`, the directory fsynced.
fn write_atomic(
    path: &Path,
    fill: impl FnOnce(&mut std::io::BufWriter<&std::fs::File>) -> std::io::Result<()>,
) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().expect("a file name").to_string_lossy();
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&tmp)
        .map_err(|e| Error::io(&tmp, e))?;
    let written = (|| {
        let mut w = std::io::BufWriter::with_capacity(8 << 20, &file);
        fill(&mut w)?;
        w.flush()?;
        drop(w);
        file.sync_all()
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::io(&tmp, e));
    }
    if let Err(e) = std::fs::rename(&tmp, path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::io(path, e));
    }
    crate::checkpoint::atomic::fsync(dir)
}
