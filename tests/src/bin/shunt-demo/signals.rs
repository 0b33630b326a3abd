//! Ctrl-C and SIGTERM: recorded, never acted on in the handler; the demo
//! checks [`interrupted`] between steps and tears down cleanly.

use std::{
    sync::atomic::{AtomicI32, Ordering},
    thread,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction};

/// The signal (SIGINT/SIGTERM) that asked us to stop, 0 while none did.
static STOP_SIGNAL: AtomicI32 = AtomicI32::new(0);

/// The stop signal received, if any.
pub(super) fn interrupted() -> Option<Signal> {
    match STOP_SIGNAL.load(Ordering::SeqCst) {
        0 => None,
        raw => Signal::try_from(raw).ok(),
    }
}

/// Records SIGINT/SIGTERM in [`STOP_SIGNAL`]; the main loop notices and tears
/// down. Only an atomic store happens here, which is async-signal-safe.
extern "C" fn on_stop_signal(signal: libc::c_int) {
    let _ = STOP_SIGNAL.compare_exchange(0, signal, Ordering::SeqCst, Ordering::SeqCst);
}

/// Installs [`on_stop_signal`] for SIGINT and SIGTERM. A handler, not a
/// blocked mask and a `sigwait` thread: children inherit the signal mask
/// (std's `Command` no longer resets it), so the agent would never see its
/// SIGTERM, while handlers are reset to the default by `execve`.
pub(super) fn catch_stop_signals() -> anyhow::Result<()> {
    let action = SigAction::new(
        SigHandler::Handler(on_stop_signal),
        SaFlags::SA_RESTART,
        SigSet::empty(),
    );
    for signal in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: the handler only does an atomic compare-exchange, which is
        // async-signal-safe, and it is a plain `extern "C" fn` that lives for
        // the whole process.
        unsafe { sigaction(signal, &action) }
            .with_context(|| format!("cannot install a handler for {signal}"))?;
    }
    Ok(())
}

/// Sleeps `duration` in short steps; false if a stop signal came meanwhile.
pub(super) fn sleep_unless_interrupted(duration: Duration) -> bool {
    let until = Instant::now() + duration;
    while interrupted().is_none() {
        let now = Instant::now();
        if now >= until {
            return true;
        }
        thread::sleep((until - now).min(Duration::from_millis(50)));
    }
    false
}
