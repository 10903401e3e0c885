//! Cancellation of long start-up work (reading, templating and tokenizing a dataset). The
//! library has no signal handlers: the program that owns them (the launcher, whose stop
//! flag lives in its `unix` module) installs one hook here, a function that says whether a
//! stop was asked for. Long loops call [`check`] at least every few milliseconds of work
//! (each record of a dataset, each batch of a table) and return [`Error::Interrupted`],
//! which the caller maps to its own exit (the launcher: 128 + the signal).
//!
//! The hook is process-wide: a stop request is too. Without one, nothing is cancelled.

use std::sync::OnceLock;

use crate::error::{Error, Result};

static HOOK: OnceLock<fn() -> bool> = OnceLock::new();

/// Installs `requested`, which says whether a stop was asked for; the first call wins
/// (a program has one stop flag).
pub fn install(requested: fn() -> bool) {
    let _ = HOOK.set(requested);
}

/// Whether a stop was asked for (false without a hook).
pub fn requested() -> bool {
    HOOK.get().is_some_and(|f| f())
}

/// `Err(Error::Interrupted { during })` once a stop was asked for.
pub fn check(during: &'static str) -> Result<()> {
    match requested() {
        true => Err(Error::Interrupted { during }),
        false => Ok(()),
    }
}

/// The phase a dataset's [`check`] names.
pub const DATA: &str = "data preparation";
