//! `dataset.val_size`: the samples held out of training for evaluation, as LlamaFactory's
//! `split_dataset` sizes them (`datasets`' `train_test_split`: a fraction is rounded up, a
//! whole number is a count), chosen by a permutation seeded with `training.seed`. A sample
//! may span rows: under `dpo` a preference pair (two rows), under `grpo` a group of
//! completions (held out whole, as its advantages are relative to one another).

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

use super::Example;
use crate::config::ValSize;
use crate::error::{Error, Result};

/// The seed's stream for the split, apart from the one packing shuffles with.
const SPLIT_STREAM: u64 = 1;

/// Moves the held-out samples out of `samples` and returns them; both keep file order.
pub fn hold_out(samples: &mut Vec<Example>, size: ValSize, seed: u64) -> Result<Vec<Example>> {
    let ids: Vec<usize> = (0..samples.len()).collect();
    let held = held_rows(&ids, size, seed, "samples")?;
    let (train, eval) = partition(std::mem::take(samples), &held);
    *samples = train;
    Ok(eval)
}

/// Which rows are held out when whole samples are: `sample[i]` is row i's sample, numbered
/// 0.. (`what` names them in the error: "preference pairs", "groups of completions").
pub fn held_rows(sample: &[usize], size: ValSize, seed: u64, what: &str) -> Result<Vec<bool>> {
    let n = sample.iter().max().map_or(0, |s| s + 1);
    let k = size.of(n);
    if k >= n {
        return Err(Error::invalid(
            "dataset.val_size",
            format!("holds out {k} of the {n} {what}: none would be left to train on"),
        ));
    }
    let held = held_out(n, k, seed);
    Ok(sample.iter().map(|&s| held[s]).collect())
}

/// `items` split by `held` into (kept, held), both in order.
pub fn partition<T>(items: Vec<T>, held: &[bool]) -> (Vec<T>, Vec<T>) {
    assert_eq!(items.len(), held.len());
    let (mut kept, mut out) = (Vec::new(), Vec::new());
    for (x, &h) in items.into_iter().zip(held) {
        match h {
            true => out.push(x),
            false => kept.push(x),
        }
    }
    (kept, out)
}

/// Which of `n` samples are the `k` held out.
pub fn held_out(n: usize, k: usize, seed: u64) -> Vec<bool> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(SPLIT_STREAM);
    order.shuffle(&mut rng);
    let mut held = vec![false; n];
    for &i in &order[..k] {
        held[i] = true;
    }
    held
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples(n: i32) -> Vec<Example> {
        (0..n)
            .map(|i| Example {
                input_ids: vec![i, i],
                labels: vec![i, i],
                position_ids: Vec::new(),
                images: Vec::new(),
            })
            .collect()
    }

    #[test]
    fn sizes_follow_train_test_split_and_the_seed_decides_which() {
        let mut s = samples(10);
        let eval = hold_out(&mut s, ValSize::Fraction(0.25), 7).unwrap();
        assert_eq!((s.len(), eval.len()), (7, 3), "0.25 x 10 rounds up to 3");
        let ids = |v: &[Example]| v.iter().map(|e| e.input_ids[0]).collect::<Vec<_>>();
        let (train_ids, eval_ids) = (ids(&s), ids(&eval));
        assert!(train_ids.windows(2).all(|w| w[0] < w[1]), "file order kept");
        assert!(eval_ids.iter().all(|i| !train_ids.contains(i)));
        let mut again = samples(10);
        assert_eq!(
            ids(&hold_out(&mut again, ValSize::Fraction(0.25), 7).unwrap()),
            eval_ids
        );
        let mut other = samples(10);
        let other_ids = ids(&hold_out(&mut other, ValSize::Count(3), 8).unwrap());
        assert_ne!(other_ids, eval_ids, "another seed holds out others");
        let e = hold_out(&mut samples(4), ValSize::Count(4), 0).unwrap_err();
        assert!(e.to_string().contains("dataset.val_size"), "{e}");
    }

    #[test]
    fn samples_spanning_rows_are_held_out_whole() {
        // Three pairs of two rows: whichever pair is held out, both its rows are.
        let held = held_rows(&[0, 0, 1, 1, 2, 2], ValSize::Count(1), 3, "pairs").unwrap();
        assert_eq!(held.iter().filter(|&&h| h).count(), 2);
        assert!(held.chunks(2).all(|p| p[0] == p[1]), "{held:?}");
        let e = held_rows(&[0, 0], ValSize::Fraction(0.1), 0, "preference pairs").unwrap_err();
        assert!(e.to_string().contains("1 of the 1 preference pairs"), "{e}");
    }
}
