//! `dataset.val_size`: the samples held out of training for evaluation, as LlamaFactory's
//! `split_dataset` sizes them (`datasets`' `train_test_split`: a fraction is rounded up, a
//! whole number is a count), chosen by a permutation seeded with `training.seed`.

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
    let n = samples.len();
    let k = size.of(n);
    if k >= n {
        return Err(Error::invalid(
            "dataset.val_size",
            format!("holds out {k} of the {n} samples: none would be left to train on"),
        ));
    }
    let held = held_out(n, k, seed);
    let (mut train, mut eval) = (Vec::with_capacity(n - k), Vec::with_capacity(k));
    for (i, ex) in std::mem::take(samples).into_iter().enumerate() {
        match held[i] {
            true => eval.push(ex),
            false => train.push(ex),
        }
    }
    *samples = train;
    Ok(eval)
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
}
