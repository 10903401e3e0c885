//! The host state driven as the launcher drives it, without any process: hand-made
//! gradients written into the workers' slab slots, reduced part by part, then updated
//! block by block. Checked against AdamW as torch.optim.AdamW defines it, computed here in
//! f64 from the same f32 inputs (an independent, straightforward implementation); against
//! itself where two ways must give the same bits (deferred moments); and against a
//! checkpoint read back (the gates).
//!
//! Shared regions are named after the process (`mt-<pid>-…`): one `HostState` at a time
//! ([`one_at_a_time`]).

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use super::*;
use crate::checkpoint::ExportOptions;
use crate::config::hf::{HfConfig, ModelSpec};
use crate::optim::StoreOut;
use crate::protocol::ResidentPart;

/// Workers whose slabs the tests write.
const WORKERS: usize = 2;

/// Micro-batches a step accumulates.
const ACCUM: usize = 2;

fn one_at_a_time() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// A 3-layer Llama of a few thousand parameters in 5 blocks (embedding, layers, head).
const TINY: &str = r#"{"model_type":"llama","vocab_size":37,"hidden_size":24,
    "intermediate_size":40,"num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2}"#;

fn layout() -> Layout {
    let spec = ModelSpec::from_hf(
        &serde_json::from_str::<HfConfig>(TINY).unwrap(),
        "c".as_ref(),
    );
    Layout::new(&spec.unwrap())
}

/// configs/tiny.yaml (float32 model, master and moments) with `overrides`.
fn config(overrides: &[&str]) -> RunConfig {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny.yaml");
    let overrides: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    RunConfig::load(&path, &overrides).unwrap()
}

/// A value with few significant bits (a multiple of 2^-10 below 4 in magnitude), so that
/// sums of a few of them, and their squares in f64, are exact.
fn value(i: usize, salt: u64) -> f32 {
    let h =
        (i as u64 ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    (((h >> 40) % 4001) as f32 - 2000.0) / 1024.0
}

/// Worker `rank`'s gradient of element `i` in micro-batch `micro` of step `step`.
fn grad(step: u64, micro: usize, rank: usize, i: usize) -> f32 {
    value(i, 1 + step * 100 + micro as u64 * 10 + rank as u64)
}

/// A host state of `layout()` for `cfg`, its master set to `value(i, 0)`.
fn host(cfg: &RunConfig, resident: usize) -> HostState {
    let mut h = HostState::new(cfg, layout(), WORKERS, None, resident).unwrap();
    h.init_master(|_, m| {
        let MasterMut::F32(x) = m else {
            unreachable!("an fp32 master")
        };
        x.iter_mut().enumerate().for_each(|(i, x)| *x = value(i, 0));
        Ok(())
    })
    .unwrap();
    h
}

/// Step `step`'s backward as the workers deliver it: for each micro-batch, each block from
/// the last, each part of it written into every worker's slot (a different slot per
/// worker and micro-batch) and reduced. Returns Σ g² of the final parts.
fn reduce_step(h: &mut HostState, step: u64, slots: usize) -> f64 {
    let slot_len = h.slabs.slot_len();
    let mut sum_sq = 0.0;
    for micro in 0..ACCUM {
        for b in (0..h.layout.blocks.len()).rev() {
            let off = h.layout.blocks[b].offset;
            for part in h.layout.grad_parts(b, slot_len) {
                let slot: Vec<usize> = (0..WORKERS).map(|r| (micro + r) % slots).collect();
                let bf16_slabs = matches!(h.store.out_mut(0..0), StoreOut::Bf16(_));
                for (r, &s) in slot.iter().enumerate() {
                    let g = |j: usize| grad(step, micro, r, off + part.start + j);
                    if bf16_slabs {
                        let dst = &mut h.slabs.slot_mut::<bf16>(r, s)[..part.len()];
                        dst.iter_mut()
                            .enumerate()
                            .for_each(|(j, x)| *x = bf16::from_f32(g(j)));
                    } else {
                        let dst = &mut h.slabs.slot_mut::<f32>(r, s)[..part.len()];
                        dst.iter_mut().enumerate().for_each(|(j, x)| *x = g(j));
                    }
                }
                let last = micro + 1 == ACCUM;
                let s = h.reduce_part(b, part, &slot, micro == 0, last);
                if last {
                    sum_sq += s;
                }
            }
        }
    }
    sum_sq
}

/// The master, m and v as bits (f32, or bf16 widened), every element.
fn bits(h: &HostState) -> [Vec<u32>; 3] {
    let (m, v) = h.moments.refs();
    [h.master(), m, v].map(|t| match t {
        MasterRef::F32(x) => x.iter().map(|x| x.to_bits()).collect(),
        MasterRef::Bf16(x) => x.iter().map(|x| u32::from(x.to_bits())).collect(),
        MasterRef::Split { .. } => unreachable!("an fp32 master"),
    })
}

/// The fp32 master, m and v.
fn values(h: &HostState) -> [Vec<f32>; 3] {
    let MasterRef::F32(p) = h.master() else {
        unreachable!("an fp32 master")
    };
    let AdamMoments::F32 { m, v } = &h.moments else {
        unreachable!("fp32 moments")
    };
    [p.to_vec(), m.as_slice().to_vec(), v.as_slice().to_vec()]
}

fn hp(h: &mut HostState, cfg: &RunConfig, step: u64) -> AdamWStep {
    // A learning rate and decay that move every weight visibly; a clip coefficient.
    let lr = 1e-2 / step as f64;
    h.next_update(&cfg.optimizer, lr, 0.1, 0.5)
}

/// Three steps of two micro-batches on two workers: each step's Σ g² is the exact one, and
/// its update, from the f32 state the host held before it, is torch.optim.AdamW's
/// (decoupled decay on tensors of two dimensions or more, as HF Trainer groups them;
/// `grad_scale` applied to the gradient first) within the rounding of f32 arithmetic; the
/// fp32 store holds the master's bits; the gaps between tensors stay as they were.
#[test]
fn reduce_then_update_is_torch_adamw() {
    let _one = one_at_a_time();
    let cfg = config(&[]);
    let mut h = host(&cfg, 0);
    let slots = cfg.memory.num_grad_slabs;
    let eps32 = f64::from(f32::EPSILON);
    for step in 1..=3u64 {
        let [p0, m0, v0] = values(&h);
        let sum_sq = reduce_step(&mut h, step, slots);
        let hp = hp(&mut h, &cfg, step);
        for b in 0..h.layout.blocks.len() {
            h.update_block(b, &hp, Moments::Write).unwrap();
        }
        let [p, m, v] = values(&h);
        let StoreOut::F32(store) = h.store.out_mut(0..h.layout.total) else {
            unreachable!("a float32 model has an fp32 store")
        };
        assert!(
            store
                .iter()
                .zip(&p)
                .all(|(s, p)| s.to_bits() == p.to_bits())
        );
        let (b1, b2) = (hp.beta1, hp.beta2);
        let bc1 = 1.0 - b1.powi(step as i32);
        let bc2 = 1.0 - b2.powi(step as i32);
        let mut want_sum_sq = 0.0;
        let mut tensor = vec![false; h.layout.total];
        for (blk, t) in h.layout.tensors() {
            let decay = t.shape.len() >= 2;
            for i in Layout::global_range(blk, t) {
                tensor[i] = true;
                // The gradient: every worker's, every micro-batch's (exact: few bits).
                let g: f64 = (0..ACCUM)
                    .flat_map(|mb| (0..WORKERS).map(move |r| (mb, r)))
                    .map(|(mb, r)| f64::from(grad(step, mb, r, i)))
                    .sum();
                want_sum_sq += g * g;
                let g = g * f64::from(hp.grad_scale);
                let (p0, m0, v0) = (f64::from(p0[i]), f64::from(m0[i]), f64::from(v0[i]));
                // torch.optim.AdamW, single-tensor path.
                let pd = if decay {
                    p0 * (1.0 - hp.lr * hp.weight_decay)
                } else {
                    p0
                };
                let m1 = b1 * m0 + (1.0 - b1) * g;
                let v1 = b2 * v0 + (1.0 - b2) * g * g;
                let denom = v1.sqrt() / bc2.sqrt() + hp.eps;
                let p1 = pd - hp.lr / bc1 * m1 / denom;
                // Each f32 operation rounds by at most eps/2 of its result; the kernel makes
                // about ten, on terms no larger than these (m's terms may cancel: the bound
                // is on the terms, not on m).
                let m_terms = b1 * m0.abs() + (1.0 - b1) * g.abs();
                let tol_m = 4.0 * eps32 * m_terms;
                let tol_v = 4.0 * eps32 * v1;
                let tol_p = 16.0 * eps32 * (pd.abs() + hp.lr / bc1 * m_terms / denom);
                let at = format!("step {step}, element {i} ({})", blk.hf_name(t));
                assert!(
                    (f64::from(m[i]) - m1).abs() <= tol_m,
                    "m at {at}: {} vs {m1}",
                    m[i]
                );
                assert!(
                    (f64::from(v[i]) - v1).abs() <= tol_v,
                    "v at {at}: {} vs {v1}",
                    v[i]
                );
                assert!(
                    (f64::from(p[i]) - p1).abs() <= tol_p,
                    "p at {at}: {} vs {p1}",
                    p[i]
                );
            }
        }
        for i in (0..h.layout.total).filter(|&i| !tensor[i]) {
            assert_eq!(p[i].to_bits(), p0[i].to_bits(), "gap element {i} moved");
        }
        // Every g² is exact in f64 and their sum too but for the last bits of its order.
        let tol = 1e-12 * want_sum_sq;
        assert!(
            (sum_sq - want_sum_sq).abs() <= tol,
            "Σ g²: {sum_sq} vs {want_sum_sq}"
        );
    }
}

/// Deferring the moments (the weights pass with `Moments::Keep`, the moments pass run
/// later: partly as idle work, the rest as the next step's reduce reaches each block)
/// gives the bits of writing them at once, with fp32 and with bf16 gradient and moments.
#[test]
fn deferred_moments_give_the_bits_of_writing_them_at_once() {
    let _one = one_at_a_time();
    let variants: [&[&str]; 2] = [
        &[],
        &[
            "memory.grad_dtype=bfloat16",
            "memory.moments_dtype=bfloat16",
        ],
    ];
    for over in variants {
        let cfg = config(over);
        let run = |moments: Moments| {
            let mut h = host(&cfg, 0);
            for step in 1..=3u64 {
                reduce_step(&mut h, step, cfg.memory.num_grad_slabs);
                let hp = hp(&mut h, &cfg, step);
                for b in 0..h.layout.blocks.len() {
                    h.update_block(b, &hp, moments).unwrap();
                }
                if moments == Moments::Keep {
                    h.defer_moments(hp);
                    // One block's pass as idle work; the next step's reduce does the rest.
                    assert_eq!(h.idle_work(), Some(IdleWork::Moments));
                    assert!(h.deferred.is_some(), "blocks below the last still lack it");
                }
            }
            h.settle_moments();
            assert!(h.deferred.is_none());
            bits(&h)
        };
        let at_once = run(Moments::Write);
        let deferred = run(Moments::Keep);
        for (what, (a, d)) in ["master", "m", "v"]
            .iter()
            .zip(at_once.iter().zip(&deferred))
        {
            let differ = a.iter().zip(d).filter(|(a, d)| a != d).count();
            assert_eq!(differ, 0, "{what} ({over:?}): {differ} elements differ");
        }
    }
}

/// A checkpoint started after step 1's weights pass, its moments pass still due, while
/// step 2 reduces and updates every block (the moments pass running as the reduce reaches
/// each block, the checkpoint waiting for it): read back, it holds step 1's state bit for
/// bit (as a run that wrote step 1's moments at once and checkpointed nothing holds it).
/// Without a staging area (the update waits for the writer) and with one.
#[test]
fn a_checkpoint_in_flight_holds_its_step() {
    let _one = one_at_a_time();
    let cfg = config(&[]);
    let step1 = |h: &mut HostState, moments: Moments| {
        reduce_step(h, 1, cfg.memory.num_grad_slabs);
        let hp = hp(h, &cfg, 1);
        for b in 0..h.layout.blocks.len() {
            h.update_block(b, &hp, moments).unwrap();
        }
        hp
    };
    let want = {
        let mut h = host(&cfg, 0);
        step1(&mut h, Moments::Write);
        values(&h)
    };
    for staging in [0u64, 4 << 10] {
        let dir = scratch(&format!("gates-{staging}"));
        let export = ExportOptions {
            dtype: DType::Float32,
            source: dir.join("src"),
            max_shard_bytes: 1 << 30,
            carried: Default::default(),
            chat_template: None,
        };
        let mut writer = Writer::new(dir.join("ck"), 2, layout(), export, staging);
        let mut h = host(&cfg, 0);
        let hp1 = step1(&mut h, Moments::Keep);
        h.defer_moments(hp1);
        let st = TrainState {
            format: state::FORMAT,
            step: 1,
            updates: 1,
            nan_run: 0,
            layout: state::fingerprint(&h.layout),
            schedule: None,
            extra: Vec::new(),
        };
        h.start_checkpoint(&mut writer, st, CheckpointContents::Full)
            .unwrap();
        reduce_step(&mut h, 2, cfg.memory.num_grad_slabs);
        let hp2 = hp(&mut h, &cfg, 2);
        for b in 0..h.layout.blocks.len() {
            h.update_block(b, &hp2, Moments::Keep).unwrap();
        }
        h.defer_moments(hp2);
        h.settle_moments();
        let written = writer.finish().unwrap().expect("a checkpoint was written");
        let n = h.layout.total;
        let (mut p, mut m, mut v) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
        let layout = h.layout.clone();
        drop(h);
        let (pm, mm, vm) = (
            MasterMut::F32(&mut p),
            MasterMut::F32(&mut m),
            MasterMut::F32(&mut v),
        );
        let st = state::load(&written.dir, &layout, pm, mm, vm).unwrap();
        assert_eq!((st.step, st.updates), (1, 1));
        for (what, (got, want)) in ["master", "m", "v"].iter().zip([p, m, v].iter().zip(&want)) {
            let differ = got
                .iter()
                .zip(want)
                .filter(|(a, b)| a.to_bits() != b.to_bits());
            assert_eq!(differ.count(), 0, "{what}, staging {staging}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A resident block (`memory.resident_blocks`): the host's update leaves it alone (the
/// workers update it); its state goes out through the transfer buffer as the host holds
/// it, and what a worker saves there comes back into the master, the store and m and v,
/// piece by piece.
#[test]
fn resident_blocks_copy_back_through_the_transfer_buffer() {
    let _one = one_at_a_time();
    let cfg = config(&[]);
    let mut h = host(&cfg, 1);
    assert_eq!(h.resident_blocks(), 1);
    assert!(h.resident_init(false).is_some());
    let [p0, ..] = values(&h);
    reduce_step(&mut h, 1, cfg.memory.num_grad_slabs);
    let hp = hp(&mut h, &cfg, 1);
    for b in 0..h.layout.blocks.len() {
        h.update_block(b, &hp, Moments::Write).unwrap();
    }
    let [p1, m1, _] = values(&h);
    let block0 = h.layout.blocks[0].range();
    assert_eq!(
        p1[block0.clone()],
        p0[block0.clone()],
        "a resident block is not updated"
    );
    assert!(m1[block0.clone()].iter().all(|&m| m == 0.0));
    let moved = h.layout.blocks[1].range();
    assert_ne!(p1[moved.clone()], p0[moved], "the others are");

    let pieces = h.resident_pieces(0);
    assert!(pieces.iter().all(|r| r.len() <= h.layout.grad_slot_len()));
    assert_eq!(pieces.iter().map(|r| r.len()).sum::<usize>(), block0.len());
    let parts = [ResidentPart::Master, ResidentPart::M, ResidentPart::V];
    for (k, part) in parts.into_iter().enumerate() {
        for r in &pieces {
            h.stage_resident(0, r.clone(), part);
            let staged = h.transfer.as_ref().unwrap()[..r.len()].to_vec();
            assert_eq!(staged, values(&h)[k][r.clone()], "{part:?} staged as held");
            // A worker saves its state there.
            let saved: Vec<f32> = r.clone().map(|i| value(i, 7 + k as u64)).collect();
            h.transfer.as_mut().unwrap()[..r.len()].copy_from_slice(&saved);
            h.take_resident(0, r.clone(), part);
            assert_eq!(values(&h)[k][r.clone()], saved, "{part:?} taken back");
        }
    }
    let [p, ..] = values(&h);
    let StoreOut::F32(store) = h.store.out_mut(block0.clone()) else {
        unreachable!("a float32 model has an fp32 store")
    };
    assert_eq!(store, &p[block0], "the store follows the master");
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mt-host-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("src")).unwrap();
    std::fs::write(dir.join("src/config.json"), "{}").unwrap();
    dir
}

/// The master's initial values (`value(i, 0)`) written as `m` takes them: an fp32 master,
/// a split one's halves, a bf16 one rounded to nearest even, or a piece at a time.
fn fill(m: &mut MasterMut) {
    match m {
        MasterMut::F32(x) => x.iter_mut().enumerate().for_each(|(i, x)| *x = value(i, 0)),
        MasterMut::Split { hi, lo } => {
            for (i, (h, l)) in hi.iter_mut().zip(lo.iter_mut()).enumerate() {
                (*h, *l) = crate::elem::bits::split(value(i, 0));
            }
        }
        MasterMut::Bf16 { p, .. } => {
            for (i, p) in p.iter_mut().enumerate() {
                *p = bf16::from_f32(value(i, 0));
            }
        }
        MasterMut::Sink { len, put } => {
            // Pieces of an odd length, from the last, as a parallel load may hand them.
            let starts: Vec<usize> = (0..*len).step_by(777).collect();
            for &s in starts.iter().rev() {
                let x: Vec<f32> = (s..(s + 777).min(*len)).map(|i| value(i, 0)).collect();
                put(s, &x);
            }
        }
    }
}

/// Every block's master, m and v as a checkpoint reads them (fp32 values, as bits): from
/// the live state in RAM, or read back from the drives a window at a time.
fn saved_bits(h: &mut HostState) -> [Vec<u32>; 3] {
    use crate::checkpoint::state::{BlockValues, Field};
    let n = h.layout.total;
    let mut out = [vec![0u32; n], vec![0u32; n], vec![0u32; n]];
    let mut put = |at: usize, v: &dyn BlockValues, r: std::ops::Range<usize>| {
        for (k, f) in [Field::Master, Field::M, Field::V].into_iter().enumerate() {
            let x = v.values(f, r.clone());
            for (j, x) in x.iter().enumerate() {
                out[k][at + j] = x.to_bits();
            }
        }
    };
    if h.windowed() {
        let layout = h.layout.clone();
        let mut write = |b: usize, w: std::ops::Range<usize>, v: &dyn BlockValues| {
            put(layout.blocks[b].offset + w.start, v, 0..w.len());
            Ok(())
        };
        h.gather_blocks(true, Some(&mut write)).unwrap().unwrap();
    } else {
        let live = h.live();
        for b in &h.layout.blocks {
            put(b.offset, &live, b.range());
        }
    }
    out
}

/// The store's bits.
fn store_bits(h: &mut HostState) -> Vec<u32> {
    match h.store.out_mut(0..h.layout.total) {
        StoreOut::F32(s) => s.iter().map(|x| x.to_bits()).collect(),
        StoreOut::Bf16(s) => s.iter().map(|x| u32::from(x.to_bits())).collect(),
    }
}

/// `memory.optimizer_offload: nvme`: three steps with the master and moments on a
/// "drive" (a temporary directory), streamed in windows shorter than most blocks (so a
/// block spans several, its last one partial), give the RAM path's bits (its weights and
/// moments written at once, and deferred) in the store and in what a checkpoint reads, for
/// every master and moments mode; nothing is left in the directory.
#[test]
fn the_state_on_the_drives_gives_the_bits_of_ram() {
    let _one = one_at_a_time();
    let variants: [&[&str]; 4] = [
        &[],
        &[
            "model.dtype=bfloat16",
            "memory.master_weights=split",
            "memory.moments_dtype=bfloat16",
        ],
        &[
            "model.dtype=bfloat16",
            "memory.master_weights=bfloat16",
            "memory.grad_dtype=bfloat16",
        ],
        &[
            "memory.moments_dtype=bfloat16",
            "memory.grad_dtype=bfloat16",
        ],
    ];
    let root = scratch("drive");
    let drives = [root.join("nvme0"), root.join("nvme1")];
    drives.iter().for_each(|d| std::fs::create_dir(d).unwrap());
    for over in variants {
        let run = |cfg: &RunConfig, moments: Moments| {
            let mut h = HostState::new(cfg, layout(), WORKERS, None, 0).unwrap();
            if let Some(d) = h.drives.take() {
                assert!(d.window() > nvme::PAD, "the largest block spans windows");
                // Blocks over several windows and stripes, a stripe on each drive in turn.
                let d = std::sync::Arc::into_inner(d).expect("one owner");
                h.drives = Some(std::sync::Arc::new(d.with_geometry(nvme::PAD, nvme::PAD)));
            }
            h.init_master(|_, m| {
                fill(m);
                Ok(())
            })
            .unwrap();
            // The fresh master's transfers are not an update's.
            h.take_drive_io();
            let mut io = Vec::new();
            for step in 1..=3u64 {
                reduce_step(&mut h, step, cfg.memory.num_grad_slabs);
                let hp = hp(&mut h, cfg, step);
                for b in 0..h.layout.blocks.len() {
                    h.update_block(b, &hp, moments).unwrap();
                }
                if moments == Moments::Keep {
                    h.defer_moments(hp);
                }
                h.settle_moments();
                io.extend(h.take_drive_io());
            }
            (store_bits(&mut h), saved_bits(&mut h), io)
        };
        let ram = run(&config(over), Moments::Write);
        let ram_deferred = run(&config(over), Moments::Keep);
        assert!(ram == ram_deferred, "{over:?}: RAM, deferred moments");
        let mut on = config(over);
        on.memory.optimizer_offload = OptimizerOffload::Nvme;
        on.memory.nvme_path = drives.to_vec();
        let (store, saved, io) = run(&on, Moments::Keep);
        // What each update moved is what `mt-launch plan` counts (`DrivePlan`).
        let m = &on.memory;
        let want =
            crate::layout::drives::update_bytes(&layout(), m.master_weights, m.moments_dtype);
        assert_eq!(io.len(), 3, "{over:?}: the state is on the drives");
        for io in &io {
            assert_eq!((io.read_bytes, io.write_bytes), (want, want), "{over:?}");
        }
        assert!(store == ram.0, "{over:?}: the store differs");
        for (what, (got, want)) in ["master", "m", "v"].iter().zip(saved.iter().zip(&ram.1)) {
            let differ = got.iter().zip(want).filter(|(a, b)| a != b).count();
            assert_eq!(differ, 0, "{over:?}: {what}: {differ} elements differ");
        }
        for d in &drives {
            let left: Vec<_> = std::fs::read_dir(d).unwrap().collect();
            assert!(left.is_empty(), "files left on {}: {left:?}", d.display());
        }
    }
    let _ = std::fs::remove_dir_all(&root);
}
