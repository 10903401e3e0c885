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
    let val = |i: usize, k: u32| f32::from_bits((i as u32).wrapping_mul(0x9e37_79b9) ^ k) % 7.0;
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
        let file = optimizer_file(&path, n).unwrap();
        // Two ranges, the second first, neither on a chunk boundary.
        let cut = WRITE_CHUNK / 2 + 3;
        let all = staging::fields(true);
        write_flat(&file, cut..n, &t.slice(cut..n), all).unwrap();
        write_flat(&file, 0..cut, &t.slice(0..cut), all).unwrap();
    };
    write(&live);
    assert!(std::fs::read(&path).unwrap() == want, "bytes differ");

    let (mut hi, mut lo) = (vec![bf16::ZERO; n], vec![0u16; n]);
    crate::optim::bits::split_slice(&master, &mut hi, &mut lo);
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

/// Writes a `Full` checkpoint (bf16 export) of the model of `hf` (a config.json) from
/// made-up state twice, whole and through `fill`, and asserts that every file has the
/// same bytes.
fn fills_give_the_bytes_of_whole_blocks(
    hf: &str,
    tag: &str,
    fill: impl FnOnce(&Files, &Layout, &Tensors) -> Result<()>,
) {
    let hf: crate::config::hf::HfConfig = serde_json::from_str(hf).unwrap();
    let spec = crate::config::hf::ModelSpec::from_hf(&hf, Path::new("config.json")).unwrap();
    let layout = Layout::new(&spec);
    let dir = std::env::temp_dir().join(format!("mt-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let src = dir.join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("config.json"), "{}").unwrap();
    let export = ExportOptions {
        dtype: crate::config::DType::Bfloat16,
        source: src,
        max_shard_bytes: 1 << 30,
        carried: Default::default(),
    };
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

#[test]
fn stale_temporary_dirs_of_dead_writers_are_removed() {
    let root = std::env::temp_dir().join(format!("mt-stale-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    // pid_max is at most 2^22, so this writer is certainly gone.
    let dead = root.join(format!("{TMP_PREFIX}step-00000002-999999999"));
    let ours = root.join(format!("{TMP_PREFIX}step-00000003-{}", std::process::id()));
    let done = root.join("step-00000001");
    for d in [&dead, &ours, &done] {
        std::fs::create_dir_all(d).unwrap();
    }
    remove_stale(&root).unwrap();
    assert!(!dead.exists() && ours.exists() && done.exists());
}
