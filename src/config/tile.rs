//! `memory.tile_tokens`: the tile of the flattened (rows x tokens) axis in which each
//! decoder layer's token-wise half (post-attention norm, MLP, residual) runs, in the
//! forward and in the backward's recompute. Written `auto` (or `0`, or left out), `off`, or
//! a number of tokens ([`human`]; the worker protocol carries the derived form).

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// How the token-wise half of each decoder layer is tiled (`crate::plan::DevicePlan`
/// resolves it for a micro-batch).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum TileTokens {
    /// The device plan picks the tile (`DevicePlan::new`): the largest that keeps the MLP
    /// tiles' memory within what the other phases of the micro-batch need.
    #[default]
    Auto,
    /// Every layer whole.
    Off,
    /// Tiles of this many tokens (a micro-batch of no more tokens runs whole).
    Tokens(usize),
}

const EXPECTED: &str = "`auto`, `off` or a number of tokens (0: auto)";

impl std::str::FromStr for TileTokens {
    type Err = String;

    fn from_str(s: &str) -> Result<TileTokens, String> {
        match s.trim() {
            "auto" => Ok(TileTokens::Auto),
            "off" => Ok(TileTokens::Off),
            t => match t.parse::<usize>() {
                Ok(0) => Ok(TileTokens::Auto),
                Ok(n) => Ok(TileTokens::Tokens(n)),
                Err(_) => Err(format!("expected {EXPECTED}, got `{t}`")),
            },
        }
    }
}

impl std::fmt::Display for TileTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TileTokens::Auto => write!(f, "auto"),
            TileTokens::Off => write!(f, "off"),
            TileTokens::Tokens(n) => write!(f, "{n}"),
        }
    }
}

/// The config file's form, for `#[serde(with = "tile::human")]`: `auto`, `off` or a
/// number (0: auto).
pub mod human {
    use super::*;

    pub fn serialize<S: Serializer>(t: &TileTokens, s: S) -> Result<S::Ok, S::Error> {
        let number = match t {
            TileTokens::Tokens(n) => Some(*n),
            _ => None,
        };
        super::super::word_or_number::serialize(t, number, s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<TileTokens, D::Error> {
        super::super::word_or_number::deserialize(d, EXPECTED)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_auto_off_and_tokens() {
        let p = |s: &str| s.parse::<TileTokens>();
        assert_eq!(p("auto"), Ok(TileTokens::Auto));
        assert_eq!(p("0"), Ok(TileTokens::Auto));
        assert_eq!(p("off"), Ok(TileTokens::Off));
        assert_eq!(p("4096"), Ok(TileTokens::Tokens(4096)));
        for bad in ["", "-1", "1.5", "on", "4k"] {
            assert!(p(bad).unwrap_err().contains("`auto`, `off` or"), "{bad}");
        }
        for t in [TileTokens::Auto, TileTokens::Off, TileTokens::Tokens(7)] {
            assert_eq!(p(&t.to_string()), Ok(t));
        }
    }
}
