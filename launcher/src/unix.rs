//! Signals. SIGINT and SIGTERM ask the run to stop at the next step boundary (checkpoint,
//! then exit 130 / 143); the handler only records the signal. It is installed with
//! SA_RESETHAND, so a second Ctrl-C kills the launcher at once (the workers follow through
//! PR_SET_PDEATHSIG, and the kernel frees the shared memory).
//!
//! Before the first step there is nothing to checkpoint: start-up stops at once. The
//! handlers are installed before the config is read; the flag is mt's cancellation hook
//! (`mt::cancel`), which data preparation checks at every record, and start-up checks it
//! between its phases and while it waits for the workers ([`check_stop`]). Either way the
//! error is an [`Interrupted`] (or `mt::Error::Interrupted`, see [`interrupted`]), which
//! `main` turns into "stopped by SIGTERM during data preparation" and exit 128 + signal,
//! after the trainer's parts are dropped (workers stopped, shared memory freed).

use std::sync::atomic::{AtomicI32, Ordering};

use anyhow::{Context, Result};
use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction};

static STOP: AtomicI32 = AtomicI32::new(0);

extern "C" fn record(sig: libc::c_int) {
    STOP.store(sig, Ordering::SeqCst);
}

/// Installs the handlers for SIGINT and SIGTERM, and the flag they set as mt's
/// cancellation hook.
pub fn install_stop_handlers() -> Result<()> {
    mt::cancel::install(|| stop_requested().is_some());
    let action = SigAction::new(
        SigHandler::Handler(record),
        SaFlags::SA_RESETHAND | SaFlags::SA_RESTART,
        SigSet::empty(),
    );
    for sig in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { sigaction(sig, &action) }.with_context(|| format!("install a {sig} handler"))?;
    }
    Ok(())
}

/// Restores SIGPIPE's default action (Rust ignores it), so that a report piped into
/// `head` ends the process quietly, as other command-line tools do, instead of panicking
/// on the broken pipe.
pub fn default_sigpipe() -> Result<()> {
    let action = SigAction::new(SigHandler::SigDfl, SaFlags::empty(), SigSet::empty());
    // SAFETY: installing the default action runs no code of ours in the handler.
    unsafe { sigaction(Signal::SIGPIPE, &action) }.context("restore SIGPIPE")?;
    Ok(())
}

/// The stop signal received so far, if any.
pub fn stop_requested() -> Option<Signal> {
    match STOP.load(Ordering::SeqCst) {
        0 => None,
        s => Signal::try_from(s).ok(),
    }
}

/// Start-up stopped by a signal before the first step.
#[derive(Debug)]
pub struct Interrupted {
    pub signal: Signal,
    /// The phase it stopped in (`data preparation`, `worker start-up`).
    pub during: String,
}

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "stopped by {} during {}",
            self.signal.as_str(),
            self.during
        )
    }
}

impl std::error::Error for Interrupted {}

/// `Err(Interrupted)` once SIGINT or SIGTERM was received; `during` names the phase.
pub fn check_stop(during: &str) -> Result<()> {
    match stop_requested() {
        Some(signal) => Err(Interrupted {
            signal,
            during: during.into(),
        }
        .into()),
        None => Ok(()),
    }
}

/// The start-up stop `e` reports, if it is one: an [`Interrupted`], or mt's
/// `Error::Interrupted` (from data preparation) with the signal received.
pub fn interrupted(e: &anyhow::Error) -> Option<Interrupted> {
    e.chain().find_map(|c| {
        if let Some(i) = c.downcast_ref::<Interrupted>() {
            return Some(Interrupted {
                signal: i.signal,
                during: i.during.clone(),
            });
        }
        match c.downcast_ref::<mt::Error>() {
            Some(mt::Error::Interrupted { during }) => Some(Interrupted {
                signal: stop_requested()?,
                during: (*during).into(),
            }),
            _ => None,
        }
    })
}
