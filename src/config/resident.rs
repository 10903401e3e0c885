//! `memory.resident_blocks`: how many blocks, from the first (the embedding, then layers 0,
//! 1, ...), keep their fp32 master weights, Adam moments and compute-dtype weights on every
//! GPU and are updated there, instead of crossing host memory each step. DeepSpeed calls the
//! same split ZeRO-Offload++'s `offload_optimizer.ratio`; here it is counted in blocks, the
//! unit the engine streams. Written `off` (or `0`, or left out), `auto` (as many as the
//! device memory the step leaves free holds), `all`, or a number of blocks.
//!
//! The host stays the home of every persistent state: it keeps its copy of these blocks'
//! state, brings it up to date before a checkpoint or the export, and still reduces their
//! gradients and takes them into the global norm; a worker updates its copy from the
//! reduced gradient with the host's own AdamW arithmetic, so a run gives the same bits with
//! or without resident blocks.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ResidentBlocks {
    /// Every block streams from the host and is updated there.
    #[default]
    Off,
    /// As many leading blocks as fit beside the step in the device memory
    /// (`crate::plan::resident_blocks`).
    Auto,
    /// Every block.
    All,
    /// This many leading blocks (more than the model has: all).
    Blocks(usize),
}

const EXPECTED: &str = "`off`, `auto`, `all` or a number of blocks (0: off)";

impl std::str::FromStr for ResidentBlocks {
    type Err = String;

    fn from_str(s: &str) -> Result<ResidentBlocks, String> {
        match s.trim() {
            "off" => Ok(ResidentBlocks::Off),
            "auto" => Ok(ResidentBlocks::Auto),
            "all" => Ok(ResidentBlocks::All),
            t => match t.parse::<usize>() {
                Ok(0) => Ok(ResidentBlocks::Off),
                Ok(n) => Ok(ResidentBlocks::Blocks(n)),
                Err(_) => Err(format!("expected {EXPECTED}, got `{t}`")),
            },
        }
    }
}

impl std::fmt::Display for ResidentBlocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ResidentBlocks::Off => write!(f, "off"),
            ResidentBlocks::Auto => write!(f, "auto"),
            ResidentBlocks::All => write!(f, "all"),
            ResidentBlocks::Blocks(n) => write!(f, "{n}"),
        }
    }
}

impl Serialize for ResidentBlocks {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let number = match self {
            ResidentBlocks::Blocks(n) => Some(*n),
            _ => None,
        };
        super::word_or_number::serialize(self, number, s)
    }
}

impl<'de> Deserialize<'de> for ResidentBlocks {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<ResidentBlocks, D::Error> {
        super::word_or_number::deserialize(d, EXPECTED)
    }
}

impl ResidentBlocks {
    /// The leading blocks of a model of `blocks` blocks this asks for, `auto` resolved to
    /// `fit` (what the device memory holds).
    pub fn count(self, blocks: usize, fit: impl FnOnce() -> usize) -> usize {
        match self {
            ResidentBlocks::Off => 0,
            ResidentBlocks::Auto => fit().min(blocks),
            ResidentBlocks::All => blocks,
            ResidentBlocks::Blocks(n) => n.min(blocks),
        }
    }
}
