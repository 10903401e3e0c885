//! Which tensors of a checkpoint are carried rather than trained (`checkpoint::carried`
//! holds and writes them).

use serde::{Deserialize, Serialize};

use crate::config::hf::{ModelSpec, TextNames};

/// Which tensors a checkpoint of `spec` carries: every name outside the text model, the
/// multi-token-prediction layers after the decoder layers, and the layers' buffers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CarryRule {
    names: TextNames,
    num_layers: usize,
    mtp_layers: usize,
    /// Checkpoint names of the buffers: (layer, name inside the layer, shape).
    pub buffers: Vec<(usize, String, Vec<usize>)>,
    /// The vision tower's tensors that train (hub names: `visual.merger.ln_q.weight`):
    /// in the layout, so not carried.
    #[serde(default)]
    pub tower: Vec<String>,
}

impl CarryRule {
    pub fn new(spec: &ModelSpec) -> CarryRule {
        let buffers = (0..spec.num_layers)
            .flat_map(|l| {
                spec.layer_buffers(l)
                    .into_iter()
                    .map(move |(name, shape)| (l, name.to_string(), shape))
            })
            .collect();
        CarryRule {
            names: spec.names,
            num_layers: spec.num_layers,
            mtp_layers: spec.mtp_layers,
            buffers,
            tower: Vec::new(),
        }
    }

    pub fn buffer_name(&self, layer: usize, name: &str) -> String {
        self.names
            .hf(&format!("model.layers.{layer}.{name}"))
            .into_owned()
    }

    /// Whether checkpoint tensor `name` is carried rather than trained.
    pub fn carries(&self, name: &str) -> bool {
        if self.tower.iter().any(|t| self.names.hf(t) == name) {
            return false;
        }
        let Some(canonical) = self.names.canonical(name) else {
            return true;
        };
        let mtp = canonical
            .strip_prefix("model.layers.")
            .and_then(|rest| rest.split('.').next()?.parse::<usize>().ok())
            .is_some_and(|l| (self.num_layers..self.num_layers + self.mtp_layers).contains(&l));
        mtp || self
            .buffers
            .iter()
            .any(|(l, b, _)| self.buffer_name(*l, b) == name)
    }
}
