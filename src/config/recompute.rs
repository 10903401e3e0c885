//! `memory.recompute`: what the backward recomputes of each decoder layer. Every layer's
//! input is kept for the backward; with `full` the backward recomputes the rest of the
//! layer from it. Layers may keep more from the forward: their MLP half's activations
//! (the attention half's output and the gate and up projections' outputs), so their
//! backward recomputes only the attention half (worker/src/layer.rs). Written `auto` (or
//! left out: the device plan keeps them for as many layers as the GPU's free memory
//! holds), `full`, or a number of layers (the last ones). Results equal `full`'s to f32
//! rounding.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// How many decoder layers keep their MLP activations for the backward
/// (`crate::plan::DevicePlan` resolves it for a micro-batch).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum Recompute {
    /// As many of the last layers as fit in the GPU's free memory beside the rest of the
    /// micro-batch (none on CPU workers, and none where the free memory is not known).
    #[default]
    Auto,
    /// None: every layer recomputed from its input.
    Full,
    /// The last this many layers (those whose models have such an MLP half).
    Layers(usize),
}

const EXPECTED: &str = "`auto`, `full` or a number of layers that keep their MLP activations";

impl std::str::FromStr for Recompute {
    type Err = String;

    fn from_str(s: &str) -> Result<Recompute, String> {
        match s.trim() {
            "auto" => Ok(Recompute::Auto),
            "full" => Ok(Recompute::Full),
            t => match t.parse::<usize>() {
                Ok(0) => Ok(Recompute::Full),
                Ok(n) => Ok(Recompute::Layers(n)),
                Err(_) => Err(format!("expected {EXPECTED}, got `{t}`")),
            },
        }
    }
}

impl std::fmt::Display for Recompute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Recompute::Auto => write!(f, "auto"),
            Recompute::Full => write!(f, "full"),
            Recompute::Layers(n) => write!(f, "{n}"),
        }
    }
}

/// The config file's form, for `#[serde(with = "recompute::human")]`: `auto`, `full` or a
/// number (0: full).
pub mod human {
    use super::*;

    pub fn serialize<S: Serializer>(r: &Recompute, s: S) -> Result<S::Ok, S::Error> {
        let number = match r {
            Recompute::Layers(n) => Some(*n),
            _ => None,
        };
        super::super::word_or_number::serialize(r, number, s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Recompute, D::Error> {
        super::super::word_or_number::deserialize(d, EXPECTED)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_auto_full_and_layers() {
        let p = |s: &str| s.parse::<Recompute>();
        assert_eq!(p("auto"), Ok(Recompute::Auto));
        assert_eq!(p("full"), Ok(Recompute::Full));
        assert_eq!(p("0"), Ok(Recompute::Full));
        assert_eq!(p("6"), Ok(Recompute::Layers(6)));
        for bad in ["", "-1", "1.5", "none", "all"] {
            let e = p(bad).unwrap_err();
            assert!(
                e.contains("`auto`, `full` or a number of layers"),
                "{bad}: {e}"
            );
        }
        for r in [Recompute::Auto, Recompute::Full, Recompute::Layers(3)] {
            assert_eq!(p(&r.to_string()), Ok(r));
        }
    }
}
