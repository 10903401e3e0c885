//! Continued-pretraining rows (`training.stage: pt`) packed as LlamaFactory's pretraining
//! processor packs them (after transformers' `run_clm` example): the documents, each
//! `text + eos` ([`super::ChatTokenizer::document`]), concatenated in order and cut into
//! blocks of exactly `max_seq_len` tokens; the tokens after the last full block are
//! dropped; where the tokenizer adds a BOS, it replaces the first token of every block.
//! A block is one sequence (attention and positions run across its documents, as in
//! pretraining) with loss on every token.

use super::Example;

/// Blocks of `len` tokens cut from the concatenation of `docs`, and the tokens dropped
/// after the last full block.
pub fn blocks(docs: &[Example], len: usize, bos: Option<i32>) -> (Vec<Example>, usize) {
    assert!(len > 0);
    let ids: Vec<i32> = docs
        .iter()
        .flat_map(|d| d.input_ids.iter().copied())
        .collect();
    let labels: Vec<i32> = docs.iter().flat_map(|d| d.labels.iter().copied()).collect();
    let full = ids.len() / len * len;
    let rows = (0..full)
        .step_by(len)
        .map(|at| {
            let mut input_ids = ids[at..at + len].to_vec();
            let mut labels = labels[at..at + len].to_vec();
            if let Some(b) = bos {
                input_ids[0] = b;
                labels[0] = b;
            }
            Example {
                input_ids,
                labels,
                position_ids: Vec::new(),
                images: Vec::new(),
            }
        })
        .collect();
    (rows, ids.len() - full)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(ids: &[i32]) -> Example {
        Example {
            input_ids: ids.to_vec(),
            labels: ids.to_vec(),
            position_ids: Vec::new(),
            images: Vec::new(),
        }
    }

    #[test]
    fn documents_are_concatenated_cut_and_the_rest_dropped() {
        let docs = [doc(&[1, 2, 3, 9]), doc(&[4, 5, 9]), doc(&[6, 7, 8, 9])];
        let (rows, dropped) = blocks(&docs, 4, None);
        let ids: Vec<_> = rows.iter().map(|r| r.input_ids.clone()).collect();
        assert_eq!(ids, [[1, 2, 3, 9], [4, 5, 9, 6]]);
        assert_eq!(dropped, 3);
        let (rows, _) = blocks(&docs, 5, Some(0));
        assert_eq!(rows[0].input_ids, [0, 2, 3, 9, 4]);
        assert_eq!(rows[1].input_ids, [0, 9, 6, 7, 8]);
        assert_eq!(rows[1].labels, rows[1].input_ids);
        assert!(rows.iter().all(|r| r.position_ids.is_empty()));
    }
}
