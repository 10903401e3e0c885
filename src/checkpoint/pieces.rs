//! safetensors files read and written a piece at a time, never mapped or held whole.
//!
//! A mapped weight or optimizer file puts every page it reads into the launcher's resident
//! set: resuming a 7B run mapped its 91 GB `optimizer.safetensors` on top of the training
//! state it was being read into, and an export held each tensor (the 0.5 GB embedding of
//! Qwen2.5-0.5B, joined to fp32 and then converted) beside the master. Here reads are
//! positional (`pread`) into buffers of at most [`PIECE`] elements per rayon task, and
//! writes are positional too (`pwrite`, [`Positioned`]) into a file laid out as
//! `safetensors::serialize` lays it out, a piece or a block at a time, so the host peak is
//! the training state plus a piece per thread (0.75 MiB at most: 96 MiB on a 128-core
//! host).

use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use safetensors::Dtype;
use safetensors::tensor::{Metadata, TensorInfo};

use super::atomic;
use super::direct::Direct;
use super::manifest::{self, Entry, PieceCrcs};
use crate::error::{Error, Result};

/// Elements per piece (256 KiB of f32): small enough that one buffer per thread is
/// negligible beside the state, large enough that a read is one efficient `pread`.
pub const PIECE: usize = 1 << 16;

thread_local! {
    /// Each thread's byte buffer, taken while in use (so a nested use allocates its own
    /// instead of colliding) and put back after.
    static BYTES: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Runs `f` with this thread's reusable byte buffer (cleared).
pub fn with_bytes<R>(f: impl FnOnce(&mut Vec<u8>) -> R) -> R {
    let mut buf = BYTES.take();
    buf.clear();
    let r = f(&mut buf);
    BYTES.set(buf);
    r
}

/// Bytes of the header-length prefix.
const N_LEN: usize = 8;
/// The largest header read (safetensors' own limit).
const MAX_HEADER: usize = 100_000_000;

/// A safetensors file opened for positional reads.
pub struct Reader {
    path: PathBuf,
    file: File,
    /// Offset of the data section in the file.
    data_start: u64,
    meta: Metadata,
}

impl Reader {
    /// Opens `path` and checks its header: valid JSON, offsets that tile the data
    /// section, and a data section exactly as long as the file's remainder.
    pub fn open(path: &Path) -> Result<Reader> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let bad = |msg: String| Error::Weights {
            path: path.into(),
            msg: format!("not a valid safetensors file: {msg}"),
        };
        let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        let mut n = [0u8; N_LEN];
        file.read_exact_at(&mut n, 0)
            .map_err(|_| bad(format!("{len} bytes, shorter than a header")))?;
        let n = u64::from_le_bytes(n);
        if n > MAX_HEADER as u64 || N_LEN as u64 + n > len {
            return Err(bad(format!("header of {n} bytes in a file of {len} bytes")));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact_at(&mut header, N_LEN as u64)
            .map_err(|e| Error::io(path, e))?;
        // Deserializing validates that the offsets tile the data section.
        let meta: Metadata =
            serde_json::from_slice(&header).map_err(|e| bad(format!("header: {e}")))?;
        let data_start = N_LEN as u64 + n;
        if data_start + meta.data_len() as u64 != len {
            return Err(bad(format!(
                "the header describes {} bytes of data, the file holds {}",
                meta.data_len(),
                len - data_start
            )));
        }
        Ok(Reader {
            path: path.into(),
            file,
            data_start,
            meta,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Every tensor, in file order.
    pub fn tensors(&self) -> Vec<(String, TensorInfo)> {
        let mut all: Vec<(String, TensorInfo)> = self
            .meta
            .tensors()
            .into_iter()
            .map(|(name, info)| (name, info.clone()))
            .collect();
        all.sort_by_key(|(_, info)| info.data_offsets.0);
        all
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.meta.info(name)
    }

    /// Elements `elems` of tensor `info` (F64, F32, BF16 or F16) converted to f32 into
    /// `out` (as long as `elems`), read through this thread's buffer.
    pub fn read_f32(&self, info: &TensorInfo, elems: Range<usize>, out: &mut [f32]) -> Result<()> {
        assert_eq!(out.len(), elems.len());
        let width = float_width(info.dtype).expect("dtype checked by the caller");
        let at = self.data_start + (info.data_offsets.0 + elems.start * width) as u64;
        with_bytes(|buf| {
            buf.resize(elems.len() * width, 0);
            self.file
                .read_exact_at(buf, at)
                .map_err(|e| Error::io(&self.path, e))?;
            convert(info.dtype, buf, out);
            Ok(())
        })
    }

    /// Raw bytes `bytes` of tensor `info`'s data into `out`.
    pub fn read_bytes(&self, info: &TensorInfo, bytes: Range<usize>, out: &mut [u8]) -> Result<()> {
        assert!(bytes.end <= info.data_offsets.1 - info.data_offsets.0);
        let at = self.data_start + (info.data_offsets.0 + bytes.start) as u64;
        self.file
            .read_exact_at(out, at)
            .map_err(|e| Error::io(&self.path, e))
    }
}

/// Bytes per element of the float dtypes weights may come in.
pub fn float_width(dtype: Dtype) -> Option<usize> {
    match dtype {
        Dtype::F64 => Some(8),
        Dtype::F32 => Some(4),
        Dtype::BF16 | Dtype::F16 => Some(2),
        _ => None,
    }
}

/// Little-endian `bytes` of `dtype` (a float dtype) to f32.
pub(crate) fn convert(dtype: Dtype, bytes: &[u8], out: &mut [f32]) {
    let pairs = out.iter_mut();
    match dtype {
        Dtype::F64 => pairs
            .zip(bytes.chunks_exact(8))
            .for_each(|(d, b)| *d = f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32),
        Dtype::F32 => pairs
            .zip(bytes.chunks_exact(4))
            .for_each(|(d, b)| *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        Dtype::BF16 => pairs
            .zip(bytes.chunks_exact(2))
            .for_each(|(d, b)| *d = bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        Dtype::F16 => pairs
            .zip(bytes.chunks_exact(2))
            .for_each(|(d, b)| *d = f16::from_le_bytes([b[0], b[1]]).to_f32()),
        other => unreachable!("dtype {other:?} is not a float dtype"),
    }
}

/// What a file's header says of one tensor.
#[derive(Debug, Clone)]
pub struct Meta {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

impl Meta {
    fn bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.bitsize() / 8
    }
}

/// A safetensors file created at its full length with the header `safetensors::serialize`
/// writes for the same tensors (ordered by descending alignment, then name; the header
/// padded with spaces to 8 bytes); the tensors' bytes are then written at their offsets
/// ([`Positioned::write`], `pwrite`), in any order and from any thread, so a checkpoint can
/// be written block by block as its blocks become available; past the page cache where
/// the filesystem allows ([`super::direct`]). The file is created exclusively, never
/// through a link ([`super::atomic::create_new`]); each write's CRC32C is recorded, and
/// [`Positioned::finish`] fsyncs the file and gives its manifest entry.
pub struct Positioned {
    path: PathBuf,
    file: File,
    direct: Direct,
    /// File offset of each tensor's data.
    at: HashMap<String, u64>,
    /// Bytes of the whole file.
    len: u64,
    /// The CRC of every piece written (the header included).
    crcs: PieceCrcs,
}

impl Positioned {
    pub fn create(
        path: &Path,
        mut tensors: Vec<Meta>,
        metadata: Option<HashMap<String, String>>,
    ) -> Result<Positioned> {
        let failed = |e: String| Error::Weights {
            path: path.to_path_buf(),
            msg: format!("write failed: {e}"),
        };
        tensors.sort_by(|a, b| b.dtype.cmp(&a.dtype).then_with(|| a.name.cmp(&b.name)));
        let mut offset = 0;
        let infos = tensors
            .iter()
            .map(|t| {
                let info = TensorInfo {
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    data_offsets: (offset, offset + t.bytes()),
                };
                offset += t.bytes();
                (t.name.clone(), info)
            })
            .collect();
        let meta = Metadata::new(metadata, infos).map_err(|e| failed(format!("header: {e}")))?;
        let mut header = serde_json::to_string(&meta)
            .map_err(|e| failed(format!("header: {e}")))?
            .into_bytes();
        header.resize(header.len().next_multiple_of(N_LEN), b' ');
        let data_start = (N_LEN + header.len()) as u64;
        let io = |e: std::io::Error| failed(e.to_string());
        let file = atomic::create_new(path)?;
        let mut prefix = (header.len() as u64).to_le_bytes().to_vec();
        prefix.extend_from_slice(&header);
        file.write_all_at(&prefix, 0).map_err(io)?;
        let len = data_start + offset as u64;
        file.set_len(len).map_err(io)?;
        let crcs = PieceCrcs::default();
        crcs.record(0, &prefix);
        let at = tensors
            .iter()
            .map(|t| {
                let info = meta.info(&t.name).expect("every tensor is in the header");
                (t.name.clone(), data_start + info.data_offsets.0 as u64)
            })
            .collect();
        Ok(Positioned {
            path: path.into(),
            direct: Direct::open(path),
            file,
            at,
            len,
            crcs,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `bytes` at byte `offset` of tensor `name`'s data.
    pub fn write(&self, name: &str, offset: usize, bytes: &[u8]) -> Result<()> {
        let at = self.at[name] + offset as u64;
        self.direct
            .write_at(&self.file, bytes, at)
            .map_err(|e| Error::Weights {
                path: self.path.clone(),
                msg: format!("write failed: {e}"),
            })?;
        self.crcs.record(at, bytes);
        Ok(())
    }

    /// Fsyncs the file (every tensor written) and returns its manifest entry.
    pub fn finish(self) -> Result<Entry> {
        self.file.sync_all().map_err(|e| Error::io(&self.path, e))?;
        let crc = self.crcs.finish(&self.path, self.len)?;
        Ok(manifest::entry_of(&self.path, self.len, crc))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("mt-pieces-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// Positioned writes in any order give safetensors' own bytes, mixed dtypes included,
    /// and the reader gives back every element.
    #[test]
    fn writes_safetensors_own_bytes_and_reads_them_back() {
        let dir = scratch("roundtrip");
        let a: Vec<f32> = (0..PIECE + 5).map(|i| i as f32 * 0.5 - 3.0).collect();
        let b: Vec<bf16> = (0..37).map(|i| bf16::from_f32(i as f32 - 9.25)).collect();
        let bytes_a: Vec<u8> = a.iter().flat_map(|x| x.to_le_bytes()).collect();
        let bytes_b: Vec<u8> = b.iter().flat_map(|x| x.to_le_bytes()).collect();
        let tensors = vec![
            Meta {
                name: "b".into(),
                dtype: Dtype::BF16,
                shape: vec![37],
            },
            Meta {
                name: "a".into(),
                dtype: Dtype::F32,
                shape: vec![PIECE + 5],
            },
        ];
        let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
        let path = dir.join("x.safetensors");
        let file = Positioned::create(&path, tensors, Some(meta.clone())).unwrap();
        // Out of order, in pieces that do not follow tensor boundaries.
        file.write("a", 4 * PIECE, &bytes_a[4 * PIECE..]).unwrap();
        file.write("b", 0, &bytes_b).unwrap();
        file.write("a", 0, &bytes_a[..4 * PIECE]).unwrap();
        let views = [
            (
                "a",
                TensorView::new(Dtype::F32, vec![PIECE + 5], &bytes_a).unwrap(),
            ),
            (
                "b",
                TensorView::new(Dtype::BF16, vec![37], &bytes_b).unwrap(),
            ),
        ];
        let own = safetensors::serialize(views, Some(meta)).unwrap();
        assert!(
            std::fs::read(&path).unwrap() == own,
            "bytes differ from safetensors'"
        );

        let r = Reader::open(&path).unwrap();
        let names: Vec<String> = r.tensors().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["a", "b"]);
        let (ia, ib) = (r.tensor("a").unwrap(), r.tensor("b").unwrap());
        let mut out = vec![0.0f32; 7];
        r.read_f32(ia, PIECE - 2..PIECE + 5, &mut out).unwrap();
        assert_eq!(out, a[PIECE - 2..]);
        let mut out = vec![0.0f32; 37];
        r.read_f32(ib, 0..37, &mut out).unwrap();
        assert!(out.iter().zip(&b).all(|(x, y)| *x == y.to_f32()));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn truncated_and_malformed_files_are_named() {
        let dir = scratch("bad");
        let path = dir.join("t.safetensors");
        let w = Meta {
            name: "w".into(),
            dtype: Dtype::F32,
            shape: vec![4],
        };
        let file = Positioned::create(&path, vec![w], None).unwrap();
        let bytes: Vec<u8> = (0..4).flat_map(|i| (i as f32).to_le_bytes()).collect();
        file.write("w", 0, &bytes).unwrap();
        let full = std::fs::read(&path).unwrap();
        std::fs::write(&path, &full[..full.len() - 1]).unwrap();
        let e = Reader::open(&path).err().unwrap().to_string();
        assert!(e.contains("t.safetensors") && e.contains("data"), "{e}");
        std::fs::write(&path, b"\x04\0\0\0\0\0\0\0{x}:").unwrap();
        let e = Reader::open(&path).err().unwrap().to_string();
        assert!(e.contains("header"), "{e}");
        std::fs::write(&path, b"abc").unwrap();
        let e = Reader::open(&path).err().unwrap().to_string();
        assert!(e.contains("shorter than a header"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
