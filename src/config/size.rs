//! Byte sizes in configs, written as huggingface_hub writes `max_shard_size`: an integer
//! number of bytes, or a number with a unit (`5GB`, `500MB`, `64KiB`; KB/MB/GB/TB are
//! powers of 1000, KiB/MiB/GiB/TiB powers of 1024).

use serde::{Deserialize, Deserializer, Serialize, Serializer};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub u64);

const UNITS: &[(&str, u64)] = &[
    ("KiB", 1 << 10),
    ("MiB", 1 << 20),
    ("GiB", 1 << 30),
    ("TiB", 1 << 40),
    ("KB", 1_000),
    ("MB", 1_000_000),
    ("GB", 1_000_000_000),
    ("TB", 1_000_000_000_000),
    ("B", 1),
];

impl std::str::FromStr for ByteSize {
    type Err = String;

    fn from_str(s: &str) -> Result<ByteSize, String> {
        let s = s.trim();
        let (num, mult) = UNITS
            .iter()
            .find_map(|(u, m)| s.strip_suffix(u).map(|n| (n.trim(), *m)))
            .unwrap_or((s, 1));
        let bad = || format!("`{s}` is not a size (expected bytes or e.g. 5GB, 500MB, 64KiB)");
        let n: f64 = num.parse().map_err(|_| bad())?;
        let bytes = n * mult as f64;
        if !(bytes.is_finite() && bytes >= 1.0 && bytes < u64::MAX as f64) {
            return Err(bad());
        }
        Ok(ByteSize(bytes as u64))
    }
}

impl std::fmt::Display for ByteSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}B", self.0)
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<ByteSize, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = ByteSize;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a size: bytes, or e.g. 5GB, 500MB, 64KiB")
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<ByteSize, E> {
                n.to_string().parse().map_err(E::custom)
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<ByteSize, E> {
                n.to_string().parse().map_err(E::custom)
            }
            fn visit_f64<E: serde::de::Error>(self, n: f64) -> Result<ByteSize, E> {
                n.to_string().parse().map_err(E::custom)
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<ByteSize, E> {
                s.parse().map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_hub_style_sizes() {
        let p = |s: &str| s.parse::<ByteSize>().map(|b| b.0);
        assert_eq!(p("5GB"), Ok(5_000_000_000));
        assert_eq!(p("64KiB"), Ok(65_536));
        assert_eq!(p("1.5MB"), Ok(1_500_000));
        assert_eq!(p("123"), Ok(123));
        assert_eq!(p("20 KB"), Ok(20_000));
        for bad in ["", "GB", "five GB", "-1MB", "0"] {
            assert!(p(bad).unwrap_err().contains("not a size"), "{bad}");
        }
    }
}
