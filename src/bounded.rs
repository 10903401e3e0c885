//! Reads with bounds. Every file start-up reads whole (config.json, tokenizer files, chat
//! templates, the dataset registry, dataset files) is checked by its metadata first: it
//! must be a regular file (`/dev/zero`, a FIFO or a directory never reaches a read that
//! would not end), and no larger than a bound stated in the error, so a huge or sparse file
//! is refused at once instead of filling the host's RAM. The read itself stops one byte
//! past the bound, should the file grow in between.
//!
//! Bounds: small JSON documents (configs, registries, templates) are fixed and far above
//! any published one ([`SMALL_JSON`], [`TOKENIZER`]); dataset files are read whole with
//! their records and token rows beside them, so their bound is a share of the RAM
//! available now ([`data_bound`]).

use std::io::Read;
use std::path::Path;

use crate::error::{Error, Result};

/// config.json, tokenizer_config.json, chat_template.jinja, dataset_info.json, a
/// `save_to_disk` state.json, a run config: 64 MiB. The largest published ones are a few
/// MB (tokenizer_config.json files listing ~250k added tokens, ~20 MB).
pub const SMALL_JSON: u64 = 64 << 20;

/// tokenizer.json: 1 GiB. The largest published ones (Gemma 3's 262k-token vocabulary) are
/// ~33 MB.
pub const TOKENIZER: u64 = 1 << 30;

/// Bound on a dataset file used where the available RAM is unknown (not Linux): 64 GiB.
const DATA_UNKNOWN_RAM: u64 = 64 << 30;

/// The largest dataset file read whole: half the RAM available now (`MemAvailable`, or
/// the test hook of [`crate::sysmem::available_host_bytes`]). Its text stays in memory
/// while its records are parsed and tokenized, which takes at least as much again.
pub fn data_bound() -> u64 {
    crate::sysmem::available_host_bytes().map_or(DATA_UNKNOWN_RAM, |a| a / 2)
}

/// Checks `path` by its metadata: a regular file of at most `max` bytes. Returns its size.
/// `what` names the file's role in the error (`dataset file`, `model config`).
pub fn check_file(path: &Path, max: u64, what: &'static str) -> Result<u64> {
    let refuse = |msg: String| Error::Refused {
        what,
        path: path.into(),
        msg,
    };
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    let ft = meta.file_type();
    if !ft.is_file() {
        use std::os::unix::fs::FileTypeExt;
        let kind = if ft.is_dir() {
            "a directory"
        } else if ft.is_char_device() {
            "a character device"
        } else if ft.is_block_device() {
            "a block device"
        } else if ft.is_fifo() {
            "a FIFO"
        } else if ft.is_socket() {
            "a socket"
        } else {
            "not a regular file"
        };
        return Err(refuse(format!("is {kind}, not a regular file")));
    }
    if meta.len() > max {
        return Err(refuse(format!(
            "is {} bytes ({}), larger than the {} this file may have{}",
            meta.len(),
            human(meta.len()),
            human(max),
            match what {
                "dataset file" => " (half the RAM available now: it is read whole)",
                _ => "",
            }
        )));
    }
    Ok(meta.len())
}

/// `path` read whole as UTF-8 after [`check_file`]; the read stops past `max` bytes.
pub fn read_text(path: &Path, max: u64, what: &'static str) -> Result<String> {
    let len = check_file(path, max, what)?;
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut text = String::with_capacity(len as usize);
    file.take(max + 1)
        .read_to_string(&mut text)
        .map_err(|e| Error::io(path, e))?;
    if text.len() as u64 > max {
        return Err(Error::Refused {
            what,
            path: path.into(),
            msg: format!("grew past {} while it was read", human(max)),
        });
    }
    Ok(text)
}

/// `bytes` for a message: `1.5 GiB`.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["bytes", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    match u {
        0 => format!("{bytes} bytes"),
        _ => format!("{v:.1} {}", UNITS[u]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn special_and_oversized_files_are_refused_by_metadata() {
        let e = read_text(Path::new("/dev/zero"), SMALL_JSON, "dataset file").unwrap_err();
        assert!(
            e.to_string()
                .starts_with("dataset file /dev/zero: is a character device"),
            "{e}"
        );
        let dir = std::env::temp_dir().join(format!("mt-bounded-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let e = read_text(&dir, SMALL_JSON, "model config").unwrap_err();
        assert!(e.to_string().contains("is a directory"), "{e}");
        // A sparse file: its length is past the bound, none of it is read.
        let big = dir.join("big.json");
        let f = std::fs::File::create(&big).unwrap();
        f.set_len(SMALL_JSON + 1).unwrap();
        let e = read_text(&big, SMALL_JSON, "model config").unwrap_err();
        assert!(
            e.to_string()
                .contains("67108865 bytes (64.0 MiB), larger than the 64.0 MiB"),
            "{e}"
        );
        std::fs::write(&big, "{}").unwrap();
        assert_eq!(read_text(&big, SMALL_JSON, "model config").unwrap(), "{}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
