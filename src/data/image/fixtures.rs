//! The files of scripts/make_pixel_fixtures.py (under `$MT_DATA_FIXTURES/vlm/pixels`)
//! decoded by us against Pillow's `Image.open(path).convert("RGB")`: PNG and lossless WebP
//! to the byte; JPEG to the byte too, as the decoder follows libjpeg-turbo's integer IDCT,
//! fancy upsampling and colour tables; lossy WebP to the byte, as the decoder follows
//! libwebp's (the spec's integer transforms, its loop filter, fancy upsampling and
//! fixed-point YUV to RGB); the bounds below are 0, with the measured figures printed. The
//! lossy files written through libwebp's advanced API show the headers their options
//! promise, and the animated WebP is refused by name.

use std::path::PathBuf;

use safetensors::SafeTensors;

/// The largest difference allowed between our JPEG samples and Pillow's. libjpeg-turbo's
/// islow IDCT, fancy upsampling and YCbCr tables are integer arithmetic we follow step for
/// step (its SIMD paths are bit-exact with its C ones), so no rounding is left to bound.
const JPEG_MAX_DIFF: u8 = 0;

/// The same for lossy WebP: libwebp's decoding is integer arithmetic throughout (the
/// transforms are the spec's, its SIMD upsampling and YUV to RGB are bit-exact with its C
/// versions), which the decoder follows, so again no rounding is left to bound.
const LOSSY_WEBP_MAX_DIFF: u8 = 0;

pub(crate) fn pixel_fixtures_dir() -> Option<PathBuf> {
    let dir = PathBuf::from(std::env::var_os("MT_DATA_FIXTURES")?).join("vlm/pixels");
    dir.join("manifest.json").exists().then_some(dir)
}

#[test]
fn decodes_equal_pillows() {
    let Some(dir) = pixel_fixtures_dir() else {
        eprintln!("no pixel fixtures (MT_DATA_FIXTURES): skipped");
        return;
    };
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    let bytes = std::fs::read(dir.join("decoded.safetensors")).unwrap();
    let want = SafeTensors::deserialize(&bytes).unwrap();
    let names = manifest["decoded"].as_array().unwrap();
    assert!(names.len() > 40, "the fixture's files");
    let mut failures = Vec::new();
    let mut jpeg_max = 0u8;
    let mut lossy = Vec::new();
    for name in names {
        let name = name.as_str().unwrap();
        let t = want.tensor(name).unwrap();
        let got = match super::decode(&dir.join("images").join(name)) {
            Ok(g) => g,
            Err(e) => {
                failures.push(format!("{name}: {e}"));
                continue;
            }
        };
        let shape = [got.height as usize, got.width as usize, 3];
        if t.shape() != shape {
            failures.push(format!("{name}: shape {shape:?}, Pillow's {:?}", t.shape()));
            continue;
        }
        let diffs = got.data.iter().zip(t.data()).map(|(a, b)| a.abs_diff(*b));
        let (max, n) = diffs.fold((0, 0), |(m, n), d| (m.max(d), n + usize::from(d > 0)));
        let bound = if name.ends_with(".jpg") {
            jpeg_max = jpeg_max.max(max);
            JPEG_MAX_DIFF
        } else if name.starts_with("lossy") {
            lossy.push(format!("{name} {max}"));
            LOSSY_WEBP_MAX_DIFF
        } else {
            0
        };
        if max > bound {
            failures.push(format!("{name}: max difference {max} over {n} samples"));
        }
    }
    eprintln!("JPEG: largest difference from Pillow {jpeg_max} (bound {JPEG_MAX_DIFF})");
    eprintln!(
        "lossy WebP: largest difference from Pillow per file (bound {LOSSY_WEBP_MAX_DIFF}): {}",
        lossy.join(", ")
    );
    let kinds = |f: &dyn Fn(&str) -> bool| names.iter().filter(|n| f(n.as_str().unwrap())).count();
    eprintln!(
        "{} PNG, {} JPEG, {} lossless and {} lossy WebP files compared",
        kinds(&|n| n.ends_with(".png")),
        kinds(&|n| n.ends_with(".jpg")),
        kinds(&|n| n.ends_with(".webp") && !n.starts_with("lossy")),
        lossy.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // 27 with the encoder-option files, 18 where Pillow has no libwebp of its own to call.
    assert!(lossy.len() >= 15, "the fixture's lossy WebP files");
    // The files written for an encoder option show it in their frame header.
    let options = manifest["lossy_options"].as_object().unwrap();
    for (name, opts) in options {
        let bytes = std::fs::read(dir.join("images").join(name)).unwrap();
        let header = super::webp::describe_lossy(&bytes).unwrap();
        let opt = |k: &str| opts.get(k).and_then(|v| v.as_i64());
        let mut want = vec![match (opt("filter_strength"), opt("filter_type")) {
            (Some(0), _) => "no filter".to_string(),
            (_, Some(0)) => "simple filter".to_string(),
            _ => "normal filter".to_string(),
        }];
        if let Some(s) = opt("filter_sharpness") {
            want.push(format!("sharpness {s}"));
        }
        if let Some(p) = opt("partitions") {
            want.push(format!("{} token partitions", 1 << p));
        }
        if opt("segments") == Some(1) {
            want.push("no segment map".into());
        }
        eprintln!("{name}: {header}");
        for w in want {
            assert!(header.contains(&w), "{name}: {header} (expected {w})");
        }
    }
    for name in manifest["refused"].as_array().unwrap() {
        let path = dir.join("images").join(name.as_str().unwrap());
        let e = super::decode(&path).unwrap_err().to_string();
        assert!(
            e.contains("animated WebP is not decoded") && e.contains("animated.webp"),
            "{e}"
        );
    }
}
