//! Signals. SIGINT and SIGTERM ask the run to stop at the next step boundary (checkpoint,
//! then exit 130 / 143); the handler only records the signal. It is installed with
//! SA_RESETHAND, so a second Ctrl-C kills the launcher at once (the workers follow through
//! PR_SET_PDEATHSIG, and the kernel frees the shared memory).

use std::sync::atomic::{AtomicI32, Ordering};

use anyhow::{Context, Result};
use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction};

static STOP: AtomicI32 = AtomicI32::new(0);

extern "C" fn record(sig: libc::c_int) {
    STOP.store(sig, Ordering::SeqCst);
}

/// Installs the handlers for SIGINT and SIGTERM.
pub fn install_stop_handlers() -> Result<()> {
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
