//! A setting written in the config file as a word or a number (`memory.tile_tokens: auto`,
//! `memory.recompute: 6`, `memory.resident_blocks: all`): read through the setting's
//! `FromStr`, which knows its words and says what it expected; written back as the number
//! where it is one, else as the word its `Display` gives.

use std::fmt::Display;
use std::marker::PhantomData;
use std::str::FromStr;

use serde::{Deserializer, Serializer};

/// Writes `value`: `number` where the setting is a number, else its word.
pub fn serialize<S: Serializer>(
    value: &impl Display,
    number: Option<usize>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match number {
        Some(n) => s.serialize_u64(n as u64),
        None => s.serialize_str(&value.to_string()),
    }
}

/// Reads a `T` from a word or a whole number; a fraction or a boolean is an error saying
/// `expected` and what was found.
pub fn deserialize<'de, D, T>(d: D, expected: &'static str) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: FromStr<Err = String>,
{
    struct V<T>(&'static str, PhantomData<T>);
    impl<T: FromStr<Err = String>> serde::de::Visitor<'_> for V<T> {
        type Value = T;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str(self.0)
        }
        fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<T, E> {
            n.to_string().parse().map_err(E::custom)
        }
        fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<T, E> {
            n.to_string().parse().map_err(E::custom)
        }
        fn visit_f64<E: serde::de::Error>(self, n: f64) -> Result<T, E> {
            Err(E::custom(format!("expected {}, got {n}", self.0)))
        }
        fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<T, E> {
            s.parse().map_err(E::custom)
        }
        fn visit_bool<E: serde::de::Error>(self, b: bool) -> Result<T, E> {
            Err(E::custom(format!("expected {}, got {b}", self.0)))
        }
    }
    d.deserialize_any(V(expected, PhantomData))
}
