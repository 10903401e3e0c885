use super::*;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mt-manifest-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Pieces recorded out of order and of uneven lengths combine to the CRC of the whole;
/// pieces that leave a gap or overlap fall back to reading the file, which gives the same.
#[test]
fn piece_crcs_combine_to_the_whole_files() {
    let dir = scratch("pieces");
    let path = dir.join("f");
    let bytes: Vec<u8> = (0..100_003u32).map(|i| (i * 31 + i / 7) as u8).collect();
    std::fs::write(&path, &bytes).unwrap();
    let want = crc32c::crc32c(&bytes);
    let cuts = [0, 1, 8, 4096, 4099, 65_536, 99_999, 100_003];
    let crcs = PieceCrcs::default();
    for w in cuts.windows(2).rev() {
        crcs.record(w[0] as u64, &bytes[w[0]..w[1]]);
    }
    assert_eq!(crcs.finish(&path, bytes.len() as u64).unwrap(), want);
    // A gap (the last piece missing), and the same piece twice: read back.
    for extra in [None, Some(4096usize)] {
        let crcs = PieceCrcs::default();
        for w in cuts.windows(2).take(cuts.len() - 2) {
            crcs.record(w[0] as u64, &bytes[w[0]..w[1]]);
        }
        if let Some(at) = extra {
            crcs.record(at as u64, &bytes[at..at + 3]);
        }
        assert_eq!(crcs.finish(&path, bytes.len() as u64).unwrap(), want);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A verified directory; then each kind of damage is named with its file.
#[test]
fn verify_names_the_damaged_file() {
    let dir = scratch("verify");
    let mut files = Vec::new();
    for (name, len) in [("a.bin", 10_000usize), ("b.json", 17), ("empty", 0)] {
        let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let crc = atomic::write_new(&dir.join(name), &bytes).unwrap();
        files.push(Entry::new(name, len as u64, crc));
    }
    Manifest::new(files).write(&dir, CHECKPOINT_MARKER).unwrap();
    let m = Manifest::read(&dir, CHECKPOINT_MARKER).unwrap().unwrap();
    assert_eq!(m.owner, *Owner::this_run());
    assert!(m.lists("b.json") && !m.lists(CHECKPOINT_MARKER));
    assert_eq!(
        verify(&dir).unwrap(),
        Checked::Verified {
            files: 3,
            bytes: 10_017
        }
    );
    let a = dir.join("a.bin");
    let good = std::fs::read(&a).unwrap();
    let expect = |what: &str| {
        let e = verify(&dir).unwrap_err().to_string();
        assert!(e.contains("a.bin") && e.contains(what), "{e}");
    };
    // One flipped bit.
    let mut flipped = good.clone();
    flipped[7777] ^= 0x10;
    std::fs::write(&a, &flipped).unwrap();
    expect("checksum mismatch");
    std::fs::write(&a, &good[..9000]).unwrap();
    expect("truncated: 9000 bytes, the manifest says 10000");
    std::fs::remove_file(&a).unwrap();
    expect("missing");
    // Replaced by a link to a good copy: not followed.
    std::fs::write(dir.join("copy"), &good).unwrap();
    std::os::unix::fs::symlink(dir.join("copy"), &a).unwrap();
    let e = verify(&dir).unwrap_err().to_string();
    assert!(e.contains("a.bin"), "{e}");
    std::fs::remove_file(&a).unwrap();
    std::fs::write(&a, &good).unwrap();
    verify(&dir).unwrap();

    // An empty marker is an earlier version's checkpoint: accepted, unverified.
    std::fs::write(dir.join(CHECKPOINT_MARKER), b"").unwrap();
    assert_eq!(verify(&dir).unwrap(), Checked::Unverified);
    // A manifest naming a path outside the directory is refused.
    let mut m = m;
    m.files[0].name = "../a.bin".into();
    std::fs::write(dir.join(CHECKPOINT_MARKER), serde_json::to_vec(&m).unwrap()).unwrap();
    let e = verify(&dir).unwrap_err().to_string();
    assert!(e.contains("COMPLETE") && e.contains("../a.bin"), "{e}");
    std::fs::remove_file(dir.join(CHECKPOINT_MARKER)).unwrap();
    let e = verify(&dir).unwrap_err().to_string();
    assert!(e.contains("no megatrain-export.json or COMPLETE"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Not a check: measures, on this machine, the export of a random-init model of ~300M
/// parameters (fp32 master, bf16 export) with its checksums computed while writing, the
/// CRC32C alone over the same bytes, and [`verify`] of the result. Run with
/// `cargo test --release -p mt --lib manifest::tests::measure -- --ignored --nocapture`.
#[test]
#[ignore]
fn measure_export_and_verify_speed() {
    use crate::checkpoint::{ExportOptions, MasterMut, MasterRef, init_random, save_hf};
    use crate::layout::Layout;
    let json = r#"{"model_type":"llama","vocab_size":32000,"hidden_size":1024,"intermediate_size":4096,
        "num_hidden_layers":20,"num_attention_heads":16,"num_key_value_heads":16}"#;
    let hf: crate::config::hf::HfConfig = serde_json::from_str(json).unwrap();
    let spec = crate::config::hf::ModelSpec::from_hf(&hf, Path::new("config.json")).unwrap();
    let layout = Layout::new(&spec);
    let mut master = vec![0.0f32; layout.total];
    init_random(&layout, &spec, 1, &mut MasterMut::F32(&mut master));
    let dir = scratch("measure");
    let src = dir.join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("config.json"), json).unwrap();
    let opts = ExportOptions {
        dtype: crate::config::DType::Bfloat16,
        source: src,
        max_shard_bytes: 5_000_000_000,
        carried: Default::default(),
        chat_template: None,
    };
    let out = dir.join("out");
    for round in 0..3 {
        let t = std::time::Instant::now();
        save_hf(&out, &layout, MasterRef::F32(&master), &opts).unwrap();
        let export_s = t.elapsed().as_secs_f64();
        let bytes = std::fs::metadata(out.join("model.safetensors"))
            .unwrap()
            .len();
        let data = std::fs::read(out.join("model.safetensors")).unwrap();
        let t = std::time::Instant::now();
        let crc = crc32c::crc32c(&data);
        let crc_s = t.elapsed().as_secs_f64();
        let t = std::time::Instant::now();
        verify(&out).unwrap();
        let verify_s = t.elapsed().as_secs_f64();
        let gb = bytes as f64 / 1e9;
        println!(
            "round {round}: {} params, {gb:.3} GB exported in {export_s:.3}s ({:.2} GB/s); crc32c alone {:.3}s ({:.2} GB/s, {crc:08x}, {:.1}% of the export); verify {verify_s:.3}s ({:.2} GB/s, from the page cache)",
            layout.total,
            gb / export_s,
            crc_s,
            gb / crc_s,
            100.0 * crc_s / export_s,
            gb / verify_s
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
