//! Synthetic token data: reproducible ids from a fixed generator, so a test's samples are
//! the same on every machine without a fixture file.

use std::path::Path;

/// Knuth's MMIX linear congruential generator; [`Lcg::below`] takes the state's high bits.
pub struct Lcg(pub u64);

impl Lcg {
    /// The next value in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

/// 8 sample lengths of 5..=15 tokens: packed greedily into rows of at most 30 tokens, 3
/// rows (packing.rs, tiling.rs).
pub const SHORT_SAMPLES: [usize; 8] = [7, 12, 5, 15, 9, 11, 6, 13];

/// Writes one tokenized sample per entry of `lens` (that many ids below the golden
/// fixtures' vocabulary of 67, the first two labels ignored) to `path` as JSONL, from the
/// generator seeded 12345: the same lengths give the same samples in every test.
pub fn write_samples(path: &Path, lens: &[usize]) {
    let mut text = String::new();
    let mut rng = Lcg(12345);
    for &n in lens {
        let ids: Vec<u64> = (0..n).map(|_| rng.below(67)).collect();
        let labels: Vec<i64> = ids
            .iter()
            .enumerate()
            .map(|(i, &t)| if i < 2 { -100 } else { t as i64 })
            .collect();
        text += &format!("{{\"input_ids\": {ids:?}, \"labels\": {labels:?}}}\n");
    }
    std::fs::write(path, text).unwrap();
}
