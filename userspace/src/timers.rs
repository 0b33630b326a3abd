//! The data path's timers, kept on a wheel of their own.
//!
//! A tokio worker with nothing to do sleeps in `epoll_wait`; while its
//! runtime's timer wheel holds any timer it passes the time to the next one
//! as the timeout, and the kernel then arms and cancels a high-resolution
//! timer around every sleep (≈ 0.1 µs each, measured; a proxied 1-byte
//! request/response puts the two agents to sleep four times). The proxy
//! always has timers (each HBONE connection's keepalive, handshake and
//! connect deadlines, idle pools), rarely due. So the binary registers
//! them with a one-thread runtime that only keeps time ([`install`]): the
//! data path's workers sleep without a timeout, and a timer that fires
//! wakes its task across threads like any other wake-up.
//!
//! The data path's shards (`shards.rs`) are then built without a time
//! driver, which also spares their threads a clock read and a look at an
//! empty wheel after every sleep: a `tokio::time` timer made on one
//! panics. `proxy/` and `dns/` are held to this module by clippy
//! (`userspace/clippy.toml`); the identity manager's wait for a certificate,
//! asked for per connection, uses it too.
//!
//! Without [`install`] (unit tests, the library used in-process) these are
//! the current runtime's timers, exactly `tokio::time`'s: a paused test
//! clock still drives them.

use std::{future::Future, io, sync::OnceLock, time::Duration};

use tokio::{
    runtime::Handle,
    time::{Instant, Sleep, Timeout},
};

static WHEEL: OnceLock<Handle> = OnceLock::new();

/// Starts the thread that keeps the data path's timers (`shunt-timers`),
/// for the life of the process: its runtime is never shut down, so no
/// timer made here can outlive it. A second call does nothing.
pub fn install() -> io::Result<()> {
    if WHEEL.get().is_some() {
        return Ok(());
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()?;
    let handle = runtime.handle().clone();
    std::thread::Builder::new()
        .name("shunt-timers".into())
        .spawn(move || runtime.block_on(std::future::pending::<()>()))?;
    // Called by every `shards::DataPath::start` (one in the agent, one per
    // node in some tests): a later call returns above, a racing one leaves
    // its thread idle, harmless.
    let _ = WHEEL.set(handle);
    Ok(())
}

/// Runs `make` (which creates a timer) with the timer runtime as tokio's
/// current one, if installed.
fn on_wheel<T>(make: impl FnOnce() -> T) -> T {
    match WHEEL.get() {
        Some(wheel) => {
            let _entered = wheel.enter();
            make()
        }
        None => make(),
    }
}

/// [`tokio::time::sleep`] on the timer thread's wheel.
pub fn sleep(duration: Duration) -> Sleep {
    on_wheel(|| tokio::time::sleep(duration))
}

/// [`tokio::time::sleep_until`] on the timer thread's wheel.
pub fn sleep_until(deadline: Instant) -> Sleep {
    on_wheel(|| tokio::time::sleep_until(deadline))
}

/// [`tokio::time::timeout`] on the timer thread's wheel.
pub fn timeout<F: Future>(duration: Duration, future: F) -> Timeout<F> {
    on_wheel(|| tokio::time::timeout(duration, future))
}

/// [`tokio::time::timeout_at`] on the timer thread's wheel.
pub fn timeout_at<F: Future>(deadline: Instant, future: F) -> Timeout<F> {
    on_wheel(|| tokio::time::timeout_at(deadline, future))
}
