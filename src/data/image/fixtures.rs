//! The files of scripts/make_pixel_fixtures.py (under `$MT_DATA_FIXTURES/vlm/pixels`)
//! decoded by us against Pillow's `Image.open(path).convert("RGB")`: PNG and lossless WebP
//! to the byte, and JPEG to the byte too, as the decoder follows libjpeg-turbo's integer
//! IDCT, fancy upsampling and colour tables (the bound below is 0, with the measured
//! figure printed); and the lossy WebP refused by name.

use std::path::PathBuf;

use safetensors::SafeTensors;

/// The largest difference allowed between our JPEG samples and Pillow's. libjpeg-turbo's
/// islow IDCT, fancy upsampling and YCbCr tables are integer arithmetic we follow step for
/// step (its SIMD paths are bit-exact with its C ones), so no rounding is left to bound.
const JPEG_MAX_DIFF: u8 = 0;

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
        let jpeg = name.ends_with(".jpg");
        let bound = if jpeg { JPEG_MAX_DIFF } else { 0 };
        if jpeg {
            jpeg_max = jpeg_max.max(max);
        }
        if max > bound {
            failures.push(format!("{name}: max difference {max} over {n} samples"));
        }
    }
    eprintln!("JPEG: largest difference from Pillow {jpeg_max} (bound {JPEG_MAX_DIFF})");
    let kinds = |ext: &str| {
        names
            .iter()
            .filter(|n| n.as_str().unwrap().ends_with(ext))
            .count()
    };
    eprintln!(
        "{} PNG, {} JPEG, {} WebP files compared",
        kinds(".png"),
        kinds(".jpg"),
        kinds(".webp")
    );
    for name in manifest["refused"].as_array().unwrap() {
        let path = dir.join("images").join(name.as_str().unwrap());
        let e = super::decode(&path).unwrap_err().to_string();
        assert!(
            e.contains("lossy WebP (VP8) is not decoded yet") && e.contains("lossy.webp"),
            "{e}"
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
