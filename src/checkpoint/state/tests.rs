use super::*;
use half::bf16;
use safetensors::SafeTensors;
use safetensors::tensor::TensorView;

/// The optimizer file, written in ranges, has the bytes safetensors writes for the same
/// tensors, and a split master is stored joined and read back split as it was.
#[test]
fn optimizer_file_is_safetensors_own_bytes() {
    let dir = std::env::temp_dir().join(format!("mt-optfile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let n = (1 << 20) + 37;
    // Arbitrary bit patterns, the non-finite ones (which a checkpoint refuses) replaced.
    let val = |i: usize, k: u32| {
        let x = f32::from_bits((i as u32).wrapping_mul(0x9e37_79b9) ^ k) % 7.0;
        if x.is_finite() { x } else { 1.5 }
    };
    let master: Vec<f32> = (0..n).map(|i| val(i, 1)).collect();
    let m: Vec<f32> = (0..n).map(|i| val(i, 2)).collect();
    let v: Vec<f32> = (0..n).map(|i| val(i, 3)).collect();
    fn view(x: &[f32]) -> TensorView<'_> {
        TensorView::new(Dtype::F32, vec![x.len()], f32_bytes(x)).unwrap()
    }
    let want = safetensors::serialize(
        [
            ("master", view(&master)),
            ("exp_avg", view(&m)),
            ("exp_avg_sq", view(&v)),
        ],
        None,
    )
    .unwrap();
    let path = dir.join(OPTIMIZER);
    let live = Tensors::f32(&master, &m, &v);
    let write = |t: &Tensors| {
        let _ = std::fs::remove_file(&path);
        let file = optimizer_file(&path, n).unwrap();
        // Two ranges, the second first, neither on a chunk boundary.
        let cut = WRITE_CHUNK / 2 + 3;
        let all = staging::fields(true);
        write_flat(&file, cut..n, &t.slice(cut..n), all, None).unwrap();
        write_flat(&file, 0..cut, &t.slice(0..cut), all, None).unwrap();
    };
    write(&live);
    assert!(std::fs::read(&path).unwrap() == want, "bytes differ");

    let (mut hi, mut lo) = (vec![bf16::ZERO; n], vec![0u16; n]);
    crate::elem::bits::split_slice(&master, &mut hi, &mut lo);
    let split = Tensors {
        master: MasterRef::Split { hi: &hi, lo: &lo },
        m: MasterRef::F32(&m),
        v: MasterRef::F32(&v),
    };
    write(&split);
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let joined = split.master.values();
    assert!(st.tensor("master").unwrap().data() == f32_bytes(&joined));
    assert!(st.tensor("exp_avg").unwrap().data() == f32_bytes(&m));
    let data = st.tensor("master").unwrap().data().to_vec();
    let (mut hi2, mut lo2) = (vec![bf16::ZERO; n], vec![0u16; n]);
    let mut back = MasterMut::Split {
        hi: &mut hi2,
        lo: &mut lo2,
    };
    back.try_fill(0..n, |first, out| {
        for (k, o) in out.iter_mut().enumerate() {
            let i = 4 * (first + k);
            *o = f32::from_le_bytes(data[i..i + 4].try_into().unwrap());
        }
        Ok::<_, ()>(())
    })
    .unwrap();
    let bits = |h: &[bf16]| h.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(bits(&hi2) == bits(&hi) && lo2 == lo);
}

/// The layout of config.json text `hf`, a fresh scratch directory `mt-<tag>-<pid>`, and
/// export options whose source (`src/` in it) holds an empty config.json.
fn scratch_export(
    hf: &str,
    tag: &str,
    dtype: crate::config::DType,
) -> (Layout, std::path::PathBuf, ExportOptions) {
    let hf: crate::config::hf::HfConfig = serde_json::from_str(hf).unwrap();
    let spec = crate::config::hf::ModelSpec::from_hf(&hf, Path::new("config.json")).unwrap();
    let dir = std::env::temp_dir().join(format!("mt-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let src = dir.join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("config.json"), "{}").unwrap();
    let export = ExportOptions {
        dtype,
        source: src,
        max_shard_bytes: 1 << 30,
        carried: Default::default(),
        chat_template: None,
    };
    (Layout::new(&spec), dir, export)
}

/// Writes a `Full` checkpoint (bf16 export) of the model of `hf` (a config.json) from
/// made-up state twice, whole and through `fill`, and asserts that every file has the
/// same bytes.
fn fills_give_the_bytes_of_whole_blocks(
    hf: &str,
    tag: &str,
    fill: impl FnOnce(&Files, &Layout, &Tensors) -> Result<()>,
) {
    let (layout, dir, export) = scratch_export(hf, tag, crate::config::DType::Bfloat16);
    let n = layout.total;
    let val = |i: usize, k: usize| ((i * 7 + k) as f32 * 0.37).sin();
    let (master, m, v): (Vec<f32>, Vec<f32>, Vec<f32>) = (
        (0..n).map(|i| val(i, 1)).collect(),
        (0..n).map(|i| val(i, 2)).collect(),
        (0..n).map(|i| val(i, 3)).collect(),
    );
    let live = Tensors::f32(&master, &m, &v);
    let state = TrainState {
        format: FORMAT,
        step: 1,
        updates: 1,
        nan_run: 0,
        layout: fingerprint(&layout),
        schedule: None,
        extra: Vec::new(),
    };
    let full = CheckpointContents::Full;
    let whole = save(&dir.join("whole"), &state, &layout, &live, &export, full).unwrap();
    let filled = save_with(&dir.join("filled"), &state, &layout, &export, full, |f| {
        fill(f, &layout, &live)
    })
    .unwrap();
    let mut names: Vec<_> = std::fs::read_dir(&whole)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    names.sort();
    assert!(names.iter().any(|f| f == "model.safetensors"), "{names:?}");
    assert!(names.iter().any(|f| f == OPTIMIZER), "{names:?}");
    for f in &names {
        let (a, b) = (whole.join(f), filled.join(f));
        assert!(
            std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap(),
            "{} differs",
            b.display()
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Blocks written window by window (windows of 7 elements, which divide no tensor nor
/// block, last window first) give every file the bytes whole blocks give, in a `Full`
/// checkpoint with a bf16 export: each window lands at its tensors' and the optimizer
/// file's offsets.
#[test]
fn windows_write_the_bytes_of_whole_blocks() {
    let hf = r#"{"model_type":"llama","vocab_size":37,"hidden_size":24,"intermediate_size":40,
        "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2}"#;
    fills_give_the_bytes_of_whole_blocks(hf, "windows", |f, layout, live| {
        for (b, block) in layout.blocks.iter().enumerate() {
            let ws: Vec<_> = (0..block.len).step_by(7).collect();
            for &lo in ws.iter().rev() {
                let w = lo..(lo + 7).min(block.len);
                let at = block.offset;
                f.write_window(b, w.clone(), &live.slice(at + w.start..at + w.end))?;
            }
        }
        Ok(())
    });
}

/// Blocks written a part at a time (the background writer's units: moments first, last
/// block first, then the weights) give the bytes whole blocks give, with an embedding of
/// 2.6e6 elements, which several threads write in runs of `WRITE_CHUNK`: each run reads
/// its own elements.
#[test]
fn parts_write_the_bytes_of_whole_blocks() {
    let hf = r#"{"model_type":"llama","vocab_size":40000,"hidden_size":64,"intermediate_size":40,
        "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2}"#;
    fills_give_the_bytes_of_whole_blocks(hf, "parts", |f, layout, live| {
        assert!(layout.max_block_len() > 2 * WRITE_CHUNK);
        for part in [staging::Part::Moments, staging::Part::Weights] {
            for (block, b) in layout.blocks.iter().enumerate().rev() {
                let u = staging::Unit { block, part };
                f.write_unit(u, &live.slice(b.range()))?;
            }
        }
        Ok(())
    });
}

/// `keep_last` counts every complete checkpoint, but the newest one that can be resumed
/// is never deleted, however many model-only ones follow it.
#[test]
fn pruning_keeps_the_newest_resumable_checkpoint() {
    let root = std::env::temp_dir().join(format!("mt-prune-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    for (step, full) in [(1, true), (2, true), (3, false), (4, false)] {
        let d = root.join(format!("step-{step:08}"));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join(MARKER), b"").unwrap();
        if full {
            std::fs::write(d.join(OPTIMIZER), b"").unwrap();
        }
    }
    prune(&root, 1).unwrap();
    let left: Vec<u64> = complete(&root)
        .unwrap()
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(left, [2, 4]);
    assert_eq!(
        resolve("latest", Some(&root)).unwrap(),
        root.join("step-00000002")
    );
    std::fs::remove_dir_all(&root).unwrap();
}

/// Only this project's temporary directories of writers known to be gone are removed:
/// never a live writer's, an entry without our owner record, nor a link.
#[test]
fn stale_temporary_dirs_of_dead_writers_are_removed() {
    use crate::checkpoint::owner::Owner;
    let root = std::env::temp_dir().join(format!("mt-stale-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let me = Owner::this_run();
    // pid_max is at most 2^22, so this writer is certainly gone.
    let gone = Owner {
        pid: 1 << 23,
        ..me.clone()
    };
    let mk = |name: &str, files: &[(&str, Vec<u8>)]| {
        let d = root.join(name);
        std::fs::create_dir_all(&d).unwrap();
        for (f, bytes) in files {
            std::fs::write(d.join(f), bytes).unwrap();
        }
        d
    };
    let record = |o: &Owner| serde_json::to_vec(o).unwrap();
    let manifest = serde_json::to_vec(&Manifest {
        owner: gone.clone(),
        ..Manifest::new(vec![])
    })
    .unwrap();
    let dead = mk(
        ".mt-tmp-00000000000000aa",
        &[(atomic::OWNER_FILE, record(&gone))],
    );
    let replaced = mk(".mt-tmp-00000000000000ab", &[(MARKER, manifest)]);
    let live = mk(
        ".mt-tmp-00000000000000ac",
        &[(atomic::OWNER_FILE, record(me))],
    );
    let foreign = mk(".mt-tmp-00000000000000ad", &[("data", b"user".to_vec())]);
    let legacy = mk(".tmp-step-00000002-8388608", &[(STATE, b"{}".to_vec())]);
    let legacy_user = mk(".tmp-notes-8388608", &[("notes.txt", b"mine".to_vec())]);
    let legacy_live = mk(
        &format!(".tmp-step-00000003-{}", std::process::id()),
        &[(MARKER, vec![])],
    );
    let done = mk("step-00000001", &[(atomic::OWNER_FILE, record(&gone))]);
    let target = mk("elsewhere", &[(atomic::OWNER_FILE, record(&gone))]);
    let link = root.join(".mt-tmp-00000000000000ae");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    remove_stale(&root).unwrap();
    for gone in [&dead, &replaced, &legacy] {
        assert!(!gone.exists(), "{} kept", gone.display());
    }
    for kept in [
        &live,
        &foreign,
        &legacy_user,
        &legacy_live,
        &done,
        &target,
        &link,
    ] {
        assert!(
            std::fs::symlink_metadata(kept).is_ok(),
            "{} removed",
            kept.display()
        );
    }
    assert!(target.join(atomic::OWNER_FILE).is_file());
    std::fs::remove_dir_all(&root).unwrap();
}

/// A master or moment that is not finite is never written over a complete checkpoint (the
/// write fails naming the parameter, nothing of it is left); one planted in a checkpoint,
/// whose manifest is then remade so that its checksums pass, is refused on reading, naming
/// the parameter and the file.
#[test]
fn non_finite_values_are_never_written_nor_read() {
    let hf = r#"{"model_type":"llama","vocab_size":37,"hidden_size":24,"intermediate_size":40,
        "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2}"#;
    let (layout, dir, export) = scratch_export(hf, "nonfinite", crate::config::DType::Float32);
    let n = layout.total;
    let mut master: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    let m = vec![0.5f32; n];
    let mut v = vec![0.25f32; n];
    let mut state = TrainState {
        format: FORMAT,
        step: 1,
        updates: 1,
        nan_run: 0,
        layout: fingerprint(&layout),
        schedule: None,
        extra: Vec::new(),
    };
    let root = dir.join("ck");
    let full = CheckpointContents::Full;
    let one = save(
        &root,
        &state,
        &layout,
        &Tensors::f32(&master, &m, &v),
        &export,
        full,
    )
    .unwrap();
    crate::checkpoint::verify(&one).unwrap();
    // The first parameter of the first layer (after the embedding).
    let b1 = &layout.blocks[1];
    let at = b1.offset + b1.tensors[0].offset + 3;
    let name = b1.hf_name(&b1.tensors[0]);
    state.step = 2;
    for (field, nan) in [("exp_avg_sq", true), ("model.safetensors", false)] {
        if nan {
            v[at] = f32::NAN;
        } else {
            v[at] = 0.25;
            master[at] = f32::INFINITY;
        }
        let t = Tensors::f32(&master, &m, &v);
        let e = save(&root, &state, &layout, &t, &export, full)
            .unwrap_err()
            .to_string();
        assert!(e.contains(&name) && e.contains(field), "{e}");
        let left: Vec<_> = std::fs::read_dir(&root).unwrap().collect();
        assert_eq!(left.len(), 1, "only step 1 is left: {left:?}");
    }
    // NaN planted in step 1's master, the manifest remade: the checksums pass.
    let opt = one.join(OPTIMIZER);
    let reader = pieces::Reader::open(&opt).unwrap();
    let info = reader.tensor("master").unwrap().clone();
    drop(reader);
    let mut bytes = std::fs::read(&opt).unwrap();
    let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let p = header + info.data_offsets.0 + 4 * at;
    bytes[p..p + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&opt, &bytes).unwrap();
    let mut mf = Manifest::read(&one, MARKER).unwrap().unwrap();
    let entry = mf.files.iter_mut().find(|f| f.name == OPTIMIZER).unwrap();
    entry.crc32c = format!("{:08x}", crc32c::crc32c(&bytes));
    std::fs::write(one.join(MARKER), serde_json::to_vec(&mf).unwrap()).unwrap();
    crate::checkpoint::verify(&one).unwrap();
    let (mut a, mut b, mut c) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
    let e = load(
        &one,
        &layout,
        MasterMut::F32(&mut a),
        MasterMut::F32(&mut b),
        MasterMut::F32(&mut c),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains(&format!("master of {name}")) && e.contains(OPTIMIZER) && e.contains("NaN"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
