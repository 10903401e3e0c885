use super::*;
use crate::checkpoint::MasterRef;

/// The area `full_bytes` sizes holds every block's copy at once (the pages `Gate`
/// asks for each), for a model whose blocks span many 4 MiB pages and for a tiny one
/// whose area has small pages, with and without the moments.
#[test]
fn the_full_area_stages_every_block_at_once() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
    for model in ["qwen2.5-0.5b", "tiny"] {
        let spec = crate::config::hf::ModelSpec::from_model_dir(&root.join(model)).unwrap();
        let layout = Layout::new(&spec);
        for moments in [true, false] {
            let bytes = full_bytes(&layout, moments);
            let page = page_elems(bytes);
            let fields = if moments { 3 } else { 1 };
            let needed: usize = layout
                .blocks
                .iter()
                .map(|b| b.len.div_ceil(page) * fields)
                .sum();
            assert!(
                page_count(bytes) >= needed,
                "{model}: {} pages of {page} elements for {needed}",
                page_count(bytes)
            );
            // Not much more than the values themselves: a page per field per block.
            let values = 4 * fields as u64 * layout.total as u64;
            let slack = 4 * (fields * layout.blocks.len()) as u64 * (1 << 20);
            assert!(bytes <= values.max(default_bytes(&layout, moments)) + slack);
        }
    }
}

/// Node 0's default area holds two windows however the pages round them (`Feed`
/// asks for each field's pages), for windows from one page's worth to the full 2^24, with
/// and without the moments; and it costs at most a page per field per window more than
/// the values.
#[test]
fn the_window_area_holds_two_windows() {
    use super::super::fed::Feed;
    for window in [1, 1000, 1024, 1025, 70_000, 3_000_000, 5_555_555, 1 << 24] {
        for moments in [true, false] {
            let bytes = window_bytes(window, moments);
            let page = page_elems(bytes);
            let per = Feed::pages_for(page, window, moments);
            assert!(
                page_count(bytes) >= 2 * per,
                "window {window}: {} pages of {page} for 2 x {per}",
                page_count(bytes)
            );
            let fields = if moments { 3 } else { 1 };
            let values = 2 * bytes_per_param(moments) * window as u64;
            // The pages of the smallest areas are 1024 elements at least; the area
            // holds at least 16 of them.
            let slack = (2 * fields * 4 * page as u64).max(16 * 4 * 1024);
            assert!(bytes <= values + slack, "window {window}: {bytes} B");
        }
    }
}

/// A staged copy gives back every range of each field, within a page or across pages,
/// and a split master comes back joined (its fp32 values, which move exact bf16 ties by
/// one ulp: `elem::bits`).
#[test]
fn staged_values_read_back_across_pages() {
    let n = 3000;
    let master: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 + 1.0).collect();
    let m: Vec<f32> = (0..n).map(|i| -(i as f32)).collect();
    let v: Vec<f32> = (0..n).map(|i| i as f32 * 3.0).collect();
    let (mut hi, mut lo) = (vec![half::bf16::ZERO; n], vec![0u16; n]);
    crate::elem::bits::split_slice(&master, &mut hi, &mut lo);
    let sources = [
        MasterRef::F32(&master),
        MasterRef::Split { hi: &hi, lo: &lo },
    ];
    for src in sources {
        let want = src.values();
        let live = Tensors {
            master: src,
            m: MasterRef::F32(&m),
            v: MasterRef::F32(&v),
        };
        let pages = (0..9).map(|_| vec![0.0f32; 1024]).collect();
        let s = Staged::copy(pages, &live, fields(true));
        for r in [0..10, 1000..1030, 500..2900, 2990..3000, 0..3000, 7..7] {
            assert_eq!(*s.values(Field::Master, r.clone()), want[r.clone()]);
            assert_eq!(*s.values(Field::M, r.clone()), m[r.clone()]);
            assert_eq!(*s.values(Field::V, r.clone()), v[r.clone()]);
        }
        assert_eq!(s.into_pages().count(), 9);
    }
}

/// Staging ahead takes the weights only, first block first, while pages are free, and
/// keeps the values they had: the weights pass then finds them staged and copies
/// nothing; the writer gets them first, oldest first.
#[test]
fn staging_ahead_copies_the_next_weights_while_there_is_room() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
    let spec = crate::config::hf::ModelSpec::from_model_dir(&root.join("tiny")).unwrap();
    let layout = Layout::new(&spec);
    let n = layout.total;
    let mut master: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let (m, v) = (vec![1.0f32; n], vec![2.0f32; n]);
    // Room for the first two blocks' weights, not the third's.
    let page = 1 << 10;
    let need = |b: usize| layout.blocks[b].len.div_ceil(page);
    let pages = (0..need(0) + need(1)).map(|_| vec![0.0f32; page]).collect();
    let gate = Gate::new(&layout, pages, true, 0);
    let want = master.clone();
    assert!(gate.stage_ahead(&Tensors::f32(&master, &m, &v)));
    assert!(gate.stage_ahead(&Tensors::f32(&master, &m, &v)));
    assert!(
        !gate.stage_ahead(&Tensors::f32(&master, &m, &v)),
        "no room for block 2"
    );
    // The training state changes: the staged copies keep the values they had, and the
    // weights pass of blocks 0 and 1 waits for nothing.
    master.iter_mut().for_each(|x| *x += 1.0);
    for b in 0..2 {
        gate.before_change(b, Part::Weights, &Tensors::f32(&master, &m, &v));
    }
    assert_eq!(
        gate.counts().staged,
        2,
        "nothing staged twice, no moments staged"
    );
    for b in 0..2 {
        let Some(Task::Write(u, staged)) = gate.next() else {
            panic!("block {b}'s staged weights are written first");
        };
        assert_eq!((u.block, u.part), (b, Part::Weights));
        let r = layout.blocks[b].range();
        assert_eq!(*staged.values(Field::Master, 0..r.len()), want[r]);
        gate.written(u, Some(staged));
    }
    gate.close();
    assert_eq!(gate.take_pages().len(), need(0) + need(1));
}
