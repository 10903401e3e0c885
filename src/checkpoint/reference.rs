//! DPO's reference log-probabilities in a checkpoint: `dpo_reference.safetensors` beside
//! `trainer_state.json`, the `ref_logps` tensor (f64, pairs x 2: each pair's chosen and
//! rejected row's summed label log-probability under the initial weights) and, in its
//! metadata, a fingerprint of the token rows they were computed for. A resume reads them
//! instead of running the reference pass again (the weights it would run on are no longer
//! the initial ones), and refuses them for other data. A run with an eval set keeps its
//! pairs' the same way in `dpo_eval_reference.safetensors`.

use std::path::Path;

use safetensors::Dtype;
use safetensors::tensor::TensorView;

use super::sidecar::Sidecar;
use crate::data::Example;
use crate::error::Result;

pub const FILE: &str = "dpo_reference.safetensors";
/// The eval pairs' reference log-probabilities.
pub const EVAL_FILE: &str = "dpo_eval_reference.safetensors";
const TENSOR: &str = "ref_logps";
const DATA_KEY: &str = "data";

/// The reference log-probability of every row of a pair dataset (rows 2i, 2i + 1: pair i).
#[derive(Debug, Clone, PartialEq)]
pub struct Reference {
    pub logps: Vec<f64>,
    /// [`fingerprint`] of the rows.
    pub data: String,
}

impl Reference {
    /// The file's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let bytes: Vec<u8> = self.logps.iter().flat_map(|x| x.to_le_bytes()).collect();
        let view = TensorView::new(Dtype::F64, vec![self.logps.len() / 2, 2], &bytes)
            .expect("the shape holds every value");
        let meta = [(DATA_KEY.to_string(), self.data.clone())].into();
        safetensors::serialize([(TENSOR, view)], Some(meta)).expect("one f64 tensor serializes")
    }

    /// The reference of checkpoint `dir`, which must be for the rows of fingerprint `data`.
    pub fn read(dir: &Path, data: &str) -> Result<Reference> {
        Reference::read_file(dir, FILE, data)
    }

    /// The eval pairs' reference of checkpoint `dir` ([`EVAL_FILE`]).
    pub fn read_eval(dir: &Path, data: &str) -> Result<Reference> {
        Reference::read_file(dir, EVAL_FILE, data)
    }

    fn read_file(dir: &Path, name: &str, data: &str) -> Result<Reference> {
        let file = Sidecar::read(dir.join(name), || {
            match name {
            FILE => "missing: this checkpoint holds no DPO reference log-probabilities (it was not written by a training.stage: dpo run), so a dpo run cannot resume from it".into(),
            _ => "missing: this checkpoint holds no reference log-probabilities of DPO eval pairs (the run that wrote it had no eval set), and the initial weights they need are gone: resume without dataset.val_size, eval_name and eval_path".into(),
        }
        })?;
        let saved = file.meta(DATA_KEY);
        let t = file.tensor(TENSOR)?;
        if t.dtype() != Dtype::F64 || t.shape().len() != 2 || t.shape()[1] != 2 {
            return Err(file.bad(format!(
                "`{TENSOR}` is {:?} {:?}, expected f64 [pairs, 2]",
                t.dtype(),
                t.shape()
            )));
        }
        if saved != data {
            return Err(file.bad(format!(
                "computed for other data ({} pairs, rows {saved}); this run's dataset gives rows {data}: resume with the dataset, tokenizer and max_seq_len of the run that wrote it",
                t.shape()[0]
            )));
        }
        let logps = t
            .data()
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect();
        Ok(Reference {
            logps,
            data: data.into(),
        })
    }
}

/// A fingerprint of token rows (ids and labels, in order): their count and an FNV-1a hash.
pub fn fingerprint(rows: &[Example]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |x: i32| {
        for b in x.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    for r in rows {
        eat(r.input_ids.len() as i32);
        r.input_ids.iter().chain(&r.labels).for_each(|&x| eat(x));
    }
    format!("{} rows, fnv1a {h:016x}", rows.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_reference_reads_back_exactly_for_its_data_only() {
        let dir = std::env::temp_dir().join(format!("mt-dpo-ref-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let rows = |k: i32| -> Vec<Example> {
            (0..4)
                .map(|i| Example {
                    input_ids: vec![i, k],
                    labels: vec![-100, k],
                    position_ids: Vec::new(),
                    images: Vec::new(),
                })
                .collect()
        };
        let data = fingerprint(&rows(1));
        assert_ne!(data, fingerprint(&rows(2)));
        let r = Reference {
            logps: vec![-1.5, -2.25, -1e-300, -123.456789012345],
            data: data.clone(),
        };
        std::fs::write(dir.join(FILE), r.to_bytes()).unwrap();
        assert_eq!(Reference::read(&dir, &data).unwrap(), r);
        let e = Reference::read(&dir, &fingerprint(&rows(2)))
            .unwrap_err()
            .to_string();
        assert!(e.contains(FILE) && e.contains("other data"), "{e}");
        std::fs::remove_file(dir.join(FILE)).unwrap();
        let e = Reference::read(&dir, &data).unwrap_err().to_string();
        assert!(e.contains("missing") && e.contains("dpo"), "{e}");
    }
}
