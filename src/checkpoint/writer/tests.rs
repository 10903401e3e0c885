use super::*;
use crate::checkpoint::MasterMut;
use crate::checkpoint::staging::Part;
use crate::config::DType;
use crate::config::hf::{HfConfig, ModelSpec};
use crate::shm::lent::Buf;

fn layout() -> Layout {
    let hf: HfConfig = serde_json::from_str(
        r#"{"model_type":"llama","vocab_size":37,"hidden_size":24,"intermediate_size":40,
        "num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2}"#,
    )
    .unwrap();
    Layout::new(&ModelSpec::from_hf(&hf, Path::new("config.json")).unwrap())
}

fn state(step: u64, layout: &Layout) -> TrainState {
    TrainState {
        format: state::FORMAT,
        step,
        updates: step,
        nan_run: 0,
        layout: state::fingerprint(layout),
        schedule: None,
        extra: Vec::new(),
    }
}

fn scratch(name: &str) -> (PathBuf, ExportOptions) {
    let dir = std::env::temp_dir().join(format!("mt-writer-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let src = dir.join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("config.json"), "{}").unwrap();
    let export = ExportOptions {
        dtype: DType::Float32,
        source: src,
        max_shard_bytes: 1 << 30,
        carried: Default::default(),
        chat_template: None,
    };
    (dir, export)
}

fn lend(master: &Buf<f32>, m: &Buf<f32>, v: &Buf<f32>) -> LentTensors {
    LentTensors {
        master: LentMaster::F32(master.lend()),
        m: LentMaster::F32(m.lend()),
        v: LentMaster::F32(v.lend()),
    }
}

fn buf(n: usize, f: impl Fn(usize) -> f32) -> Buf<f32> {
    let mut b = Buf::zeroed(n);
    b.as_mut_slice()
        .iter_mut()
        .enumerate()
        .for_each(|(i, x)| *x = f(i));
    b
}

/// While the writer writes the checkpoint of step 1, the "optimizer" changes every
/// block twice as training does, each part after its `before_change`: a weights pass
/// over the blocks first to last, then a moments pass last to first. Without staging (it
/// waits for each part), with a staging area smaller than a part (the same), and with
/// room for several; and with the checkpoint started before step 1's own moments pass
/// (every block's moments `Waiting` until that pass makes them ready). The checkpoint,
/// export included, holds step 1's values, and the staging pages all come back.
#[test]
fn staged_writes_hold_their_step_while_training_changes_the_state() {
    let l = layout();
    let (n, blocks) = (l.total, l.blocks.len());
    let val = |i: usize, k: u32| (i as f32 * 0.37 + k as f32).sin();
    for staging in [0, 4 << 10, 1 << 20] {
        for due in [0, blocks] {
            let (dir, export) = scratch(&format!("staged-{staging}-{due}"));
            let mut w = Writer::new(dir.join("ck"), 2, l.clone(), export, staging);
            let pages = w.pages.len();
            let mut master = buf(n, |i| val(i, 1));
            // Step 1's moments; before its moments pass, other values.
            let (m1, v1) = (buf(n, |i| val(i, 2)), buf(n, |i| val(i, 3).abs()));
            let before = |x: &Buf<f32>| buf(n, |i| x.as_slice()[i] - 5.0);
            let (mut m, mut v) = match due {
                0 => (buf(n, |i| m1.as_slice()[i]), buf(n, |i| v1.as_slice()[i])),
                _ => (before(&m1), before(&v1)),
            };
            let want = (master.as_slice().to_vec(), m1.as_slice().to_vec());
            let want_v = v1.as_slice().to_vec();
            // Every change below follows `before_change` of its part (or, for step 1's
            // moments pass, precedes `ready`).
            let lent = lend(&master, &m, &v);
            let (_, _, gate) = w
                .start(state(1, &l), lent, CheckpointContents::Full, due)
                .unwrap();
            for b in (0..due).rev() {
                assert!(gate.waiting(b));
                for (x, x1) in [(&mut m, &m1), (&mut v, &v1)] {
                    let r = l.blocks[b].range();
                    x.range_mut(r.clone()).copy_from_slice(&x1.as_slice()[r]);
                }
                gate.ready(b);
            }
            for _ in 0..2 {
                for (b, block) in l.blocks.iter().enumerate() {
                    let t = Tensors::f32(master.as_slice(), m.as_slice(), v.as_slice());
                    gate.before_change(b, Part::Weights, &t);
                    master
                        .range_mut(block.range())
                        .iter_mut()
                        .for_each(|x| *x += 1.0);
                }
                for (b, block) in l.blocks.iter().enumerate().rev() {
                    let t = Tensors::f32(master.as_slice(), m.as_slice(), v.as_slice());
                    gate.before_change(b, Part::Moments, &t);
                    for x in [&mut m, &mut v] {
                        x.range_mut(block.range())
                            .iter_mut()
                            .for_each(|x| *x += 1.0);
                    }
                }
            }
            let written = w.finish().unwrap().expect("a write was in flight");
            assert_eq!(w.pages.len(), pages, "every staging page is back");
            // Without room for a part's copy, every part is written from the live state.
            let c = written.blocks;
            assert_eq!(c.staged + c.copied + c.live, 2 * blocks, "{c:?}");
            assert_eq!(c.live == 2 * blocks, staging < 1 << 20, "{c:?}");
            assert!(written.dir.ends_with("step-00000001"));
            assert!(written.bytes as usize > 12 * n, "{written:?}");
            let (mut a, mut b, mut c) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
            let (mb, mc) = (MasterMut::F32(&mut b), MasterMut::F32(&mut c));
            state::load(&written.dir, &l, MasterMut::F32(&mut a), mb, mc).unwrap();
            assert!(a == want.0, "staging {staging}, due {due}: master");
            assert!(b == want.1, "staging {staging}, due {due}: m");
            assert!(c == want_v, "staging {staging}, due {due}: v");
            let mut exported = vec![0.0; n];
            crate::checkpoint::load_pretrained(
                &written.dir,
                &l,
                &mut MasterMut::F32(&mut exported),
            )
            .unwrap();
            for (b, t) in l.tensors() {
                let r = Layout::global_range(b, t);
                assert!(
                    exported[r.clone()] == want.0[r],
                    "the export holds step 1's master"
                );
            }
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }
}

/// A checkpoint staged window by window (1000 elements, dividing no block) through a
/// staging area of 4 pages, so that each window waits for the writer to free the last
/// one's, has every file's bytes of one written from the whole state at once; its pages
/// all come back, and a gather that stops short leaves no checkpoint.
#[test]
fn fed_windows_write_the_bytes_of_a_whole_state() {
    let l = layout();
    let n = l.total;
    let (dir, export) = scratch("fed");
    let val = |i: usize, k: u32| (i as f32 * 0.37 + k as f32).sin();
    let master: Vec<f32> = (0..n).map(|i| val(i, 1)).collect();
    let m: Vec<f32> = (0..n).map(|i| val(i, 2)).collect();
    let v: Vec<f32> = (0..n).map(|i| val(i, 3).abs()).collect();
    let live = Tensors::f32(&master, &m, &v);
    let full = CheckpointContents::Full;
    let want = state::save(&dir.join("whole"), &state(1, &l), &l, &live, &export, full).unwrap();
    let mut w = Writer::new(dir.join("fed"), 2, l.clone(), export, 16 << 10);
    assert_eq!((w.page, w.page_count), (1024, 4));
    assert!(w.can_feed(1000, true) && !w.can_feed(2000, true));
    for complete in [true, false] {
        let (_, _, feed) = w.start_fed(state(1, &l), full).unwrap();
        for (b, block) in l.blocks.iter().enumerate() {
            for lo in (0..block.len)
                .step_by(1000)
                .take(if complete { usize::MAX } else { 1 })
            {
                let r = lo..(lo + 1000).min(block.len);
                let at = block.offset;
                feed.stage(b, r.clone(), &live.slice(at + r.start..at + r.end))
                    .unwrap();
            }
        }
        feed.end(complete, 0.0);
        match w.finish() {
            Ok(written) => {
                assert!(complete);
                let written = written.expect("a write was in flight");
                assert_eq!(written.blocks.staged, l.blocks.len());
                for f in std::fs::read_dir(&want).unwrap() {
                    let name = f.unwrap().file_name();
                    let (a, b) = (want.join(&name), written.dir.join(&name));
                    assert!(
                        std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap(),
                        "{} differs",
                        b.display()
                    );
                }
            }
            Err(e) => {
                assert!(!complete, "{e}");
                assert!(e.to_string().contains("stopped before every block"), "{e}");
            }
        }
        assert_eq!(w.pages.len(), 4, "every staging page is back");
    }
    let left = state::complete(&dir.join("fed")).unwrap();
    assert_eq!(left.len(), 1, "the incomplete one left nothing: {left:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_failed_write_is_reported_and_leaves_the_previous_checkpoint() {
    let (dir, export) = scratch("fail");
    let src = export.source.clone();
    let l = layout();
    let root = dir.join("ck");
    let mut w = Writer::new(root.clone(), 1, l.clone(), export, 1 << 20);
    let z = buf(l.total, |_| 0.5);
    for step in [1, 2] {
        let lent = lend(&z, &z, &z);
        w.start(state(step, &l), lent, CheckpointContents::Full, 0)
            .unwrap();
        if step == 1 {
            w.finish().unwrap();
            // The next write cannot read the source config: it fails after the weights.
            std::fs::remove_file(src.join("config.json")).unwrap();
        }
    }
    let e = w.finish().unwrap_err().to_string();
    assert!(e.contains("config.json"), "{e}");
    let left: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into())
        .collect();
    assert_eq!(left, ["step-00000001"], "nothing partial is left");
    std::fs::remove_dir_all(&dir).unwrap();
}
