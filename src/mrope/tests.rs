//! `rope_index` against transformers' `get_rope_index` on the rows of
//! scripts/make_golden.py's `mrope` stage (`$MT_GOLDEN_DIR/mrope/rope_index.json`), and its
//! refusals.

use std::path::PathBuf;

use super::*;

const TOKENS: ImageTokens = ImageTokens {
    image_token_id: 9,
    spatial_merge_size: 2,
};

#[test]
fn positions_equal_transformers_on_rows_with_images_of_different_grids() {
    let Some(dir) = std::env::var_os("MT_GOLDEN_DIR").map(PathBuf::from) else {
        eprintln!("no golden fixtures (MT_GOLDEN_DIR): skipped");
        return;
    };
    let path = dir.join("mrope/rope_index.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (scripts/make_golden.py --cases mrope)",
            path.display()
        )
    });
    let fx: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ints = |v: &serde_json::Value| -> Vec<i64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_i64().unwrap())
            .collect()
    };
    let ids: Vec<i32> = ints(&fx["input_ids"]).iter().map(|&x| x as i32).collect();
    let row_lens: Vec<usize> = ints(&fx["row_lens"]).iter().map(|&x| x as usize).collect();
    let grids: Vec<[u32; 3]> = fx["grids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            let g = ints(g);
            [g[0] as u32, g[1] as u32, g[2] as u32]
        })
        .collect();
    let tokens = ImageTokens {
        image_token_id: fx["image_token_id"].as_i64().unwrap(),
        spatial_merge_size: fx["spatial_merge_size"].as_u64().unwrap() as usize,
    };
    let seq_len = fx["seq_len"].as_u64().unwrap() as usize;
    assert!(grids.len() >= 3 && grids.windows(2).any(|w| w[0] != w[1]));
    let got = rope_index(&ids, &row_lens, seq_len, &grids, tokens).unwrap();
    assert_eq!(
        got.pos_3bt,
        ints(&fx["position_ids"]),
        "positions (3, B, T)"
    );
    assert_eq!(got.deltas_b, ints(&fx["deltas"]), "rope deltas");
}

#[test]
fn text_rows_get_three_equal_rows_and_padding_zero() {
    let got = rope_index(&[5, 6, 7, 0, 1, 2, 3, 4], &[3, 4], 4, &[], TOKENS).unwrap();
    let row = [0, 1, 2, 0, 0, 1, 2, 3];
    assert_eq!(got.pos_3bt, [row, row, row].concat());
    assert_eq!(got.deltas_b, [0, 0]);
}

#[test]
fn image_tokens_that_disagree_with_the_grids_are_refused() {
    // One image of grid [1, 4, 4]: 4 tokens after merging 2 x 2.
    let ids = [1, 8, 9, 9, 9, 9, 7, 1];
    assert!(rope_index(&ids, &[8], 8, &[[1, 4, 4]], TOKENS).is_ok());
    let cases: [(&[[u32; 3]], &str); 4] = [
        (&[], "grids are placed"),
        (&[[1, 4, 6]], "needs 6"),
        (&[[1, 3, 4]], "merge size"),
        (&[[1, 4, 4], [1, 2, 2]], "place only 1"),
    ];
    for (grids, want) in cases {
        let e = rope_index(&ids, &[8], 8, grids, TOKENS)
            .unwrap_err()
            .to_string();
        assert!(e.contains(want) && e.contains("row 0"), "{grids:?}: {e}");
    }
    // Two images with no token between them: one run of 5 tokens for a 4-token grid.
    let e = rope_index(&[9, 9, 9, 9, 9], &[5], 5, &[[1, 4, 4], [1, 2, 2]], TOKENS)
        .unwrap_err()
        .to_string();
    assert!(e.contains("5 image tokens"), "{e}");
}
