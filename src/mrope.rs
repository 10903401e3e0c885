//! Qwen2.5-VL's 3-D rotary positions (temporal, height, width) of a micro-batch's tokens,
//! by the rule of transformers 5.17's `Qwen2_5_VLModel.get_rope_index` for images:
//!
//! - a text token takes the next position p on all three axes (p, p, p);
//! - an image's tokens (a run of `image_token_id`, one per merged group of patches, grid
//!   (t, h, w) in patches, so t × h/m × w/m tokens for merge size m) sit on its grid, in
//!   row-major (t, h, w) order: token (i, j, k) at (p + i, p + j, p + k); the text after it
//!   resumes at p + max(h, w)/m (the grid's side, not its token count);
//! - each row counts from 0 over its real tokens; padding takes 0 on all axes;
//! - the rope delta of a row is its largest position + 1 - its real length (what generation
//!   adds to the next positions; training reads only the positions).
//!
//! transformers finds images as the runs of image-type tokens (`mm_token_type_ids`, which
//! the processor sets exactly at `image_token_id`), taking the next grid at each run. A run
//! must then hold exactly one image's tokens: a run of another length (two images with no
//! token between them, a grid that does not match) is refused here, where transformers
//! would misplace or fail. A row of text only gets three equal rows 0..len, the 1-D RoPE.
//!
//! Shapes: B rows, T padded length; positions are (3, B, T) row-major.

use crate::error::{Error, Result};

/// The 3-D positions of a micro-batch and each row's rope delta.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Positions3d {
    /// (3, B, T): the temporal, height and width position of every token.
    pub pos_3bt: Vec<i64>,
    /// (B,): each row's largest position + 1 - its real length (0 for an empty row).
    pub deltas_b: Vec<i64>,
}

/// What places image tokens in the positions (`config::hf::Mrope`'s keys).
#[derive(Debug, Clone, Copy)]
pub struct ImageTokens {
    pub image_token_id: i64,
    pub spatial_merge_size: usize,
}

/// The positions of `ids_bt` (B × T row-major, rows right-padded past `row_lens`) whose
/// images have grids `grids` (in patches, (t, h, w)), in the order their tokens appear, row
/// by row.
pub fn rope_index(
    ids_bt: &[i32],
    row_lens: &[usize],
    seq_len: usize,
    grids: &[[u32; 3]],
    tokens: ImageTokens,
) -> Result<Positions3d> {
    let (b, t) = (row_lens.len(), seq_len);
    assert_eq!(ids_bt.len(), b * t, "ids for {b} rows of {t}");
    let m = tokens.spatial_merge_size as u64;
    let mut pos_3bt = vec![0i64; 3 * b * t];
    let mut deltas_b = Vec::with_capacity(b);
    let mut next_grid = grids.iter().enumerate();
    for (row, &len) in row_lens.iter().enumerate() {
        let err = |msg: String| Error::MultimodalRow { row, msg };
        if len > t {
            return Err(err(format!("real length {len} past the padded length {t}")));
        }
        let ids = &ids_bt[row * t..row * t + len];
        let mut put = |i: usize, p: [i64; 3]| {
            for (axis, v) in p.into_iter().enumerate() {
                pos_3bt[(axis * b + row) * t + i] = v;
            }
        };
        let is_image = |i: usize| i64::from(ids[i]) == tokens.image_token_id;
        let (mut i, mut next, mut max) = (0usize, 0i64, -1i64);
        while i < len {
            if !is_image(i) {
                put(i, [next; 3]);
                max = max.max(next);
                next += 1;
                i += 1;
                continue;
            }
            let run = (i..len).take_while(|&j| is_image(j)).count();
            let Some((k, &[gt, gh, gw])) = next_grid.next() else {
                return Err(err(format!(
                    "image tokens at {i} but all {} images' grids are placed",
                    grids.len()
                )));
            };
            let (gt, gh, gw) = (u64::from(gt), u64::from(gh), u64::from(gw));
            if gt == 0 || gh == 0 || gw == 0 || gh % m != 0 || gw % m != 0 {
                return Err(err(format!(
                    "image {k}: grid [{gt}, {gh}, {gw}] is not whole groups of the merge size {m}"
                )));
            }
            let (lh, lw) = (gh / m, gw / m);
            let n = gt * lh * lw;
            if run as u64 != n {
                return Err(err(format!(
                    "image {k}: {run} image tokens at {i}, its grid [{gt}, {gh}, {gw}] needs {n}"
                )));
            }
            // Token `i + j` of the image is grid cell j in row-major (t, h, w) order.
            for j in 0..n {
                let (ti, hi, wi) = (j / (lh * lw), j / lw % lh, j % lw);
                let p = [next + ti as i64, next + hi as i64, next + wi as i64];
                max = max.max(p[0]).max(p[1]).max(p[2]);
                put(i + j as usize, p);
            }
            next += lh.max(lw) as i64;
            i += run;
        }
        deltas_b.push(if len == 0 { 0 } else { max + 1 - len as i64 });
    }
    if let Some((k, _)) = next_grid.next() {
        return Err(Error::MultimodalRow {
            row: b.saturating_sub(1),
            msg: format!(
                "{} images' grids given, the rows' image tokens place only {k}",
                grids.len()
            ),
        });
    }
    Ok(Positions3d { pos_3bt, deltas_b })
}

#[cfg(test)]
mod tests;
