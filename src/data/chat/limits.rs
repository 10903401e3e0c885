//! Bounds on one render of a chat template, so that a template that loops (two nested
//! `range(100000)`) or writes gigabytes fails at its first record, naming the template and
//! the record, instead of running for hours or aborting on allocation.
//!
//! - Work: minijinja's fuel, one unit per template instruction, counted the same on every
//!   machine. [`TEMPLATE_FUEL`] is derived from measurements beside it.
//! - Output: [`TEMPLATE_OUTPUT`] bytes written per render.
//!
//! Not bounded: memory a template builds up without writing it (a string doubled in a loop
//! of a few dozen steps); minijinja caps `*` repetition at 100 MB, not `~`.

use minijinja::ErrorKind;

/// Instructions one render may execute: 5 million. Measured (`tests.rs`,
/// `real_templates_take_a_small_share_of_the_fuel`, 2026-11-28), with a tool list of two
/// functions: the tiny demo template 66 instructions for 3 messages and 17 per message
/// more; the tool-calling fixtures' public templates (scripts/fixture_templates.py)
/// Qwen2.5 142 + 31, Llama 3.1 173 + 33, Mistral v0.3 452 + 68 per message (27,914 for a
/// conversation of 401 messages); the built-in templates 67-83 + 19-23. 5 million renders conversations of ~70,000 messages with
/// the costliest of them (180 times that 401-message one) and runs out in ~0.45 s of one
/// loaded core here (20 million took 1.76 s), so a template that does not end fails at
/// its first record, and a stop request waits for at most one render.
pub const TEMPLATE_FUEL: u64 = 5_000_000;

/// Bytes one render may write: 64 MiB, a thousand times the text of a 16k-token record.
pub const TEMPLATE_OUTPUT: usize = 64 << 20;

/// Why a record could not be rendered or tokenized.
#[derive(Debug, Clone, PartialEq)]
pub enum RenderError {
    /// This record: skipped, or an error with `dataset.strict`.
    Bad(String),
    /// The template went past a bound: an error, whatever `dataset.strict` says.
    Limit(String),
}

impl RenderError {
    pub fn message(&self) -> &str {
        match self {
            RenderError::Bad(m) | RenderError::Limit(m) => m,
        }
    }
}

impl std::fmt::Display for RenderError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.message())
    }
}

impl From<String> for RenderError {
    fn from(msg: String) -> Self {
        RenderError::Bad(msg)
    }
}

/// A writer that refuses to hold more than `max` bytes.
pub struct Capped {
    buf: Vec<u8>,
    max: usize,
    over: bool,
}

impl Capped {
    pub fn new(max: usize) -> Capped {
        Capped {
            buf: Vec::new(),
            max,
            over: false,
        }
    }

    pub fn into_text(self) -> std::result::Result<String, std::string::FromUtf8Error> {
        String::from_utf8(self.buf)
    }
}

impl std::io::Write for Capped {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + b.len() > self.max {
            self.over = true;
            return Err(std::io::Error::other("render output bound"));
        }
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The error of a failed render of the template `path` (its file or name), `out` its
/// output so far.
pub fn render_failure(
    e: minijinja::Error,
    out: &Capped,
    path: &dyn std::fmt::Display,
) -> RenderError {
    if out.over {
        RenderError::Limit(format!(
            "chat template ({path}): one render wrote more than {} MiB (the bound on a record's text): does the template loop?",
            TEMPLATE_OUTPUT >> 20
        ))
    } else if e.kind() == ErrorKind::OutOfFuel {
        RenderError::Limit(format!(
            "chat template ({path}): one render ran more than {TEMPLATE_FUEL} template instructions (the bound on a record's work): does the template loop?"
        ))
    } else {
        RenderError::Bad(format!("chat template ({path}): {e}"))
    }
}
