//! Image files: their pixels ([`decode`], PNG, JPEG and WebP, see the submodules) and their
//! width and height read from the header alone ([`read_size`]), without decoding the pixels:
//! PNG (the IHDR chunk), JPEG (the first start-of-frame marker, any SOFn: baseline,
//! extended, progressive, lossless, arithmetic) and WebP (its `VP8 `, `VP8L` or `VP8X`
//! chunk). These are the sizes PIL's `Image.open(path).size` reports (EXIF orientation is
//! not applied, as LlamaFactory's image plugin does not apply it). Anything else, or a
//! header cut short, is an error naming what was found.
//!
//! Only the header is read: at most a few dozen bytes for PNG and WebP; for JPEG the
//! segments before the frame header are skipped by their lengths (an EXIF thumbnail is
//! never read), so the bytes read stay a small share of the file.

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use crate::error::{Error, Result as MtResult};

mod jpeg;
mod png;
pub mod resample;
mod webp;

/// Pixels above which a file is refused rather than decoded: Pillow's
/// `Image.MAX_IMAGE_PIXELS` x 2, where it raises `DecompressionBombError`.
pub const MAX_PIXELS: u64 = 2 * 89_478_485;

/// An 8-bit RGB image: `width` x `height` pixels, RGB interleaved, row-major.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rgb8 {
    pub width: u32,
    pub height: u32,
    pub data: Vec<u8>,
}

/// The pixels of the image file at `path`, as Pillow's `Image.open(path).convert("RGB")`
/// gives them (what LlamaFactory and transformers' processors feed the model): PNG, JPEG
/// and WebP, lossless and lossy (see the `png`, `jpeg` and `webp` modules for what each
/// covers).
pub fn decode(path: &Path) -> MtResult<Rgb8> {
    let err = |msg: String| Error::Image {
        path: path.to_path_buf(),
        msg,
    };
    let size = read_size(path).map_err(err)?;
    check_area(u64::from(size.width), u64::from(size.height)).map_err(err)?;
    let bytes = std::fs::read(path).map_err(|cause| Error::Io {
        path: path.to_path_buf(),
        cause,
    })?;
    decode_bytes(&bytes).map_err(err)
}

/// The pixels of the image file held in `b`.
pub fn decode_bytes(b: &[u8]) -> Result<Rgb8, String> {
    if b.starts_with(b"\x89PNG\r\n\x1a\n") {
        png::decode(b)
    } else if b.starts_with(&[0xff, 0xd8]) {
        jpeg::decode(b)
    } else if b.len() >= 12 && &b[..4] == b"RIFF" && &b[8..12] == b"WEBP" {
        webp::decode(b)
    } else {
        Err("not a PNG, JPEG or WebP image".into())
    }
}

/// An error unless `width` x `height` is a non-empty image within [`MAX_PIXELS`].
fn check_area(width: u64, height: u64) -> Result<(), String> {
    if width == 0 || height == 0 {
        return Err(format!("image of {width}x{height} pixels has no area"));
    }
    if width * height > MAX_PIXELS {
        return Err(format!(
            "image of {width}x{height} pixels, above the {MAX_PIXELS} pixels decoded (Pillow's bound)"
        ));
    }
    Ok(())
}

/// An image's size in pixels, as PIL reports it (`(width, height)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageSize {
    pub width: u32,
    pub height: u32,
}

/// The size of the image in the file at `path`; the error is a lowercase fragment
/// (`unreadable image: ...`, `not a PNG, JPEG or WebP image`) for the record's error.
pub fn read_size(path: &Path) -> Result<ImageSize, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("unreadable image: {e}"))?;
    if !meta.is_file() {
        return Err("unreadable image: not a regular file".into());
    }
    let mut f = std::fs::File::open(path).map_err(|e| format!("unreadable image: {e}"))?;
    size_of(&mut f)
}

/// The size of the image `r` holds, read from its header.
pub fn size_of<R: Read + Seek>(r: &mut R) -> Result<ImageSize, String> {
    let mut head = [0u8; 12];
    let n = read_up_to(r, &mut head)?;
    let head = &head[..n];
    let size = if head.starts_with(b"\x89PNG\r\n\x1a\n") {
        png(r)?
    } else if head.starts_with(&[0xff, 0xd8]) {
        jpeg(r)?
    } else if head.len() == 12 && &head[..4] == b"RIFF" && &head[8..12] == b"WEBP" {
        webp(r)?
    } else {
        return Err("not a PNG, JPEG or WebP image".into());
    };
    if size.width == 0 || size.height == 0 {
        return Err(format!(
            "image of {}x{} pixels has no area",
            size.width, size.height
        ));
    }
    Ok(size)
}

/// PNG: the signature, then the IHDR chunk (length, `IHDR`, width and height big-endian).
fn png<R: Read + Seek>(r: &mut R) -> Result<ImageSize, String> {
    let b = exact::<_, 24>(r, 0, "PNG")?;
    if &b[12..16] != b"IHDR" {
        return Err("PNG without an IHDR chunk first".into());
    }
    Ok(ImageSize {
        width: u32::from_be_bytes([b[16], b[17], b[18], b[19]]),
        height: u32::from_be_bytes([b[20], b[21], b[22], b[23]]),
    })
}

/// JPEG: the segments after SOI, each `FF marker` and a big-endian length counting itself,
/// until a start-of-frame (precision, height, width).
fn jpeg<R: Read + Seek>(r: &mut R) -> Result<ImageSize, String> {
    r.seek(SeekFrom::Start(2)).map_err(unreadable)?;
    loop {
        let mut byte = [0u8; 1];
        // Markers may be preceded by fill bytes 0xFF.
        loop {
            if read_up_to(r, &mut byte)? == 0 {
                return Err("JPEG ends before its frame header".into());
            }
            if byte[0] == 0xff {
                break;
            }
        }
        let mut marker = 0xff;
        while marker == 0xff {
            if read_up_to(r, &mut byte)? == 0 {
                return Err("JPEG ends before its frame header".into());
            }
            marker = byte[0];
        }
        match marker {
            // Standalone markers: TEM, RST0-7, and a stray byte-stuffed zero.
            0x00 | 0x01 | 0xd0..=0xd7 => continue,
            0xd9 | 0xda => return Err("JPEG without a frame header before its scan".into()),
            _ => {}
        }
        let mut len = [0u8; 2];
        if read_up_to(r, &mut len)? < 2 {
            return Err("JPEG segment cut short".into());
        }
        let len = u16::from_be_bytes(len);
        if len < 2 {
            return Err(format!("JPEG segment of length {len}"));
        }
        // SOF0-SOF15 but DHT (C4), JPG (C8) and DAC (CC).
        if (0xc0..=0xcf).contains(&marker) && !matches!(marker, 0xc4 | 0xc8 | 0xcc) {
            let mut f = [0u8; 5];
            if read_up_to(r, &mut f)? < 5 {
                return Err("JPEG frame header cut short".into());
            }
            return Ok(ImageSize {
                height: u16::from_be_bytes([f[1], f[2]]) as u32,
                width: u16::from_be_bytes([f[3], f[4]]) as u32,
            });
        }
        r.seek(SeekFrom::Current(i64::from(len) - 2))
            .map_err(unreadable)?;
    }
}

/// WebP: `RIFF size WEBP`, then the first chunk: `VP8 ` (lossy: the key frame's 14-bit
/// sizes after its 3-byte tag and start code, the 2 scaling bits above them ignored, as
/// libwebp ignores them), `VP8L` (lossless: 14-bit sizes minus one after the 0x2f
/// signature) or `VP8X` (extended: the canvas's 24-bit sizes minus one).
fn webp<R: Read + Seek>(r: &mut R) -> Result<ImageSize, String> {
    let b = exact::<_, 30>(r, 0, "WebP")?;
    let le24 = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], 0]);
    let le14 = |i: usize| u32::from(u16::from_le_bytes([b[i], b[i + 1]]) & 0x3fff);
    match &b[12..16] {
        b"VP8 " => {
            if b[23..26] != [0x9d, 0x01, 0x2a] {
                return Err("lossy WebP (VP8) without its start code 9d 01 2a".into());
            }
            Ok(ImageSize {
                width: le14(26),
                height: le14(28),
            })
        }
        b"VP8L" => {
            if b[20] != 0x2f {
                return Err("WebP (VP8L) without its signature byte".into());
            }
            let bits = u32::from_le_bytes([b[21], b[22], b[23], b[24]]);
            Ok(ImageSize {
                width: (bits & 0x3fff) + 1,
                height: ((bits >> 14) & 0x3fff) + 1,
            })
        }
        b"VP8X" => Ok(ImageSize {
            width: le24(24) + 1,
            height: le24(27) + 1,
        }),
        other => Err(format!(
            "WebP whose first chunk is `{}` (expected VP8, VP8L or VP8X)",
            String::from_utf8_lossy(other)
        )),
    }
}

/// The first `N` bytes from `at`, or an error saying the `what` header is cut short.
fn exact<R: Read + Seek, const N: usize>(
    r: &mut R,
    at: u64,
    what: &str,
) -> Result<[u8; N], String> {
    r.seek(SeekFrom::Start(at)).map_err(unreadable)?;
    let mut b = [0u8; N];
    if read_up_to(r, &mut b)? < N {
        return Err(format!("{what} header cut short"));
    }
    Ok(b)
}

/// Fills `buf` as far as the reader goes; the count read.
fn read_up_to<R: Read>(r: &mut R, buf: &mut [u8]) -> Result<usize, String> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(unreadable(e)),
        }
    }
    Ok(n)
}

fn unreadable(e: std::io::Error) -> String {
    format!("unreadable image: {e}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    fn size(bytes: &[u8]) -> Result<(u32, u32), String> {
        size_of(&mut Cursor::new(bytes)).map(|s| (s.width, s.height))
    }

    fn png_bytes(w: u32, h: u32) -> Vec<u8> {
        let mut b = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
        b.extend(w.to_be_bytes());
        b.extend(h.to_be_bytes());
        b.extend([8, 2, 0, 0, 0, 0, 0, 0, 0]);
        b
    }

    fn segment(marker: u8, body: &[u8]) -> Vec<u8> {
        let mut s = vec![0xff, marker];
        s.extend(((body.len() + 2) as u16).to_be_bytes());
        s.extend(body);
        s
    }

    #[test]
    fn png_reads_ihdr() {
        assert_eq!(size(&png_bytes(77, 45)), Ok((77, 45)));
        let e = size(&png_bytes(77, 45)[..20]).unwrap_err();
        assert_eq!(e, "PNG header cut short");
        assert!(size(&png_bytes(0, 45)).unwrap_err().contains("no area"));
    }

    #[test]
    fn jpeg_skips_segments_to_the_frame_header() {
        for sof in [0xc0, 0xc1, 0xc2] {
            let mut b = vec![0xff, 0xd8];
            b.extend(segment(0xe0, b"JFIF\0\x01\x01\0\0\x01\0\x01\0\0"));
            b.extend(segment(0xe1, &[7u8; 300])); // an EXIF block
            b.extend([0xff, 0xff]); // fill bytes before the next marker
            b.extend(segment(0xdb, &[0u8; 65]));
            b.extend(segment(0xc4, &[0u8; 20]));
            b.extend(segment(sof, &[8, 0x01, 0x2c, 0x00, 0x63, 3, 1, 0x11, 0]));
            assert_eq!(size(&b), Ok((99, 300)), "SOF {sof:#x}");
        }
        let mut b = vec![0xff, 0xd8];
        b.extend(segment(0xe0, b"JFIF"));
        assert_eq!(size(&b).unwrap_err(), "JPEG ends before its frame header");
        b.extend(segment(0xda, &[0u8; 4]));
        assert!(size(&b).unwrap_err().contains("without a frame header"));
    }

    #[test]
    fn webp_reads_each_chunk_kind() {
        let riff = |chunk: &[u8; 4], data: &[u8]| {
            let mut b = b"RIFF\0\0\0\0WEBP".to_vec();
            b.extend(chunk);
            b.extend((data.len() as u32).to_le_bytes());
            b.extend(data);
            b.resize(b.len().max(40), 0);
            b
        };
        // Lossy: frame tag, start code, 14-bit width and height (scale bits above, ignored).
        let mut vp8 = vec![0x30, 0x01, 0x00, 0x9d, 0x01, 0x2a];
        vp8.extend((0x4000u16 | 321).to_le_bytes());
        vp8.extend(123u16.to_le_bytes());
        assert_eq!(size(&riff(b"VP8 ", &vp8)), Ok((321, 123)));
        vp8[4] = 0x02;
        assert!(
            size(&riff(b"VP8 ", &vp8))
                .unwrap_err()
                .contains("without its start code")
        );
        // Lossless: 0x2f, then width-1 and height-1 in 14 bits each.
        let bits: u32 = (321 - 1) | ((123 - 1) << 14);
        let mut vp8l = vec![0x2f];
        vp8l.extend(bits.to_le_bytes());
        assert_eq!(size(&riff(b"VP8L", &vp8l)), Ok((321, 123)));
        // Extended: flags, reserved, then 24-bit width-1 and height-1.
        let mut vp8x = vec![0x10, 0, 0, 0];
        vp8x.extend(&(70000u32 - 1).to_le_bytes()[..3]);
        vp8x.extend(&(5u32 - 1).to_le_bytes()[..3]);
        assert_eq!(size(&riff(b"VP8X", &vp8x)), Ok((70000, 5)));
        assert!(size(&riff(b"ALPH", &[0; 10])).unwrap_err().contains("ALPH"));
    }

    #[test]
    fn undecodable_files_say_what_was_expected() {
        let frame = |marker: u8, precision: u8, comps: u8| {
            let mut b = vec![0xff, 0xd8];
            let mut body = vec![precision, 0, 8, 0, 8, comps];
            for c in 0..comps {
                body.extend([c + 1, 0x11, 0]);
            }
            b.extend(segment(marker, &body));
            b
        };
        let e = |b: &[u8]| decode_bytes(b).unwrap_err();
        assert!(e(&frame(0xc9, 8, 3)).contains("arithmetic-coded JPEG"));
        assert!(e(&frame(0xc3, 8, 3)).contains("lossless or hierarchical JPEG (SOF3)"));
        assert!(e(&frame(0xc0, 8, 4)).contains("CMYK/YCCK JPEG"));
        assert!(e(&frame(0xc1, 12, 3)).contains("12-bit samples"));
        assert!(e(&frame(0xc0, 8, 3)).contains("ends before its end-of-image"));
        let mut png = png_bytes(4, 4);
        png[24] = 4; // RGB at 4 bits
        png[25] = 2;
        assert!(
            e(&png).contains("colour type 2 and bit depth 4"),
            "{}",
            e(&png)
        );
        assert!(e(&png_bytes(4, 4)).contains("ends before its IEND"));
        // The path's error names the file.
        let path = std::env::temp_dir().join(format!("mt-image-{}.png", std::process::id()));
        std::fs::write(&path, &png).unwrap();
        let msg = decode(&path).unwrap_err().to_string();
        std::fs::remove_file(&path).ok();
        assert!(
            msg.contains(&path.display().to_string()) && msg.contains("bit depth 4"),
            "{msg}"
        );
    }

    #[test]
    fn other_files_are_named() {
        assert_eq!(
            size(b"GIF89a\x01\0\x01\0").unwrap_err(),
            "not a PNG, JPEG or WebP image"
        );
        assert_eq!(size(b"").unwrap_err(), "not a PNG, JPEG or WebP image");
    }
}

#[cfg(test)]
mod fixtures;
#[cfg(test)]
pub(crate) use fixtures::pixel_fixtures_dir;
