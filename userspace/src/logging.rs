//! Logging: `tracing` to stderr as text or JSON. Records from the eBPF
//! programs (aya-log, via the `log` crate) are bridged into the same output.
//! The filter can be replaced while the agent runs ([`set_filter`], the
//! admin API's `/logging?level=`).
//!
//! The filter is `target=level` directives (`info,shunt::proxy=debug`), as
//! ztunnel's: [`Targets`] decides once per call site and does nothing when
//! a span is entered or left. `EnvFilter`'s span-scoped directives would
//! cost a lock and a thread-local lookup on every enter and exit, that is
//! on every poll of every instrumented connection task.
//!
//! Lines reach stderr through a batching writer ([`writer`]): no proxy
//! task writes to stderr itself. Keep the [`Guard`] from [`init`] until
//! exit: dropping it writes what is still buffered.

mod fields;
mod line_budget;
mod writer;

pub use line_budget::LineBudget;

use std::sync::{Mutex, OnceLock};

use std::str::FromStr;

use tracing_subscriber::{Registry, filter::Targets, fmt, prelude::*, reload};

use crate::cli::{LogArgs, LogFormat};

/// The installed filter's reload handle and its text (now and at start).
struct Control {
    handle: reload::Handle<Targets, Registry>,
    current: Mutex<String>,
    initial: String,
}

static CONTROL: OnceLock<Control> = OnceLock::new();

/// The installed writer, for [`flush`] and [`dropped_lines`].
static WRITER: OnceLock<writer::Batched<std::io::Stderr>> = OnceLock::new();

/// Writes the buffered log lines when dropped (keep it until exit).
#[must_use = "dropping the guard stops the log writer"]
pub struct Guard(#[allow(dead_code)] writer::Guard<std::io::Stderr>);

/// Installs the global subscriber. `RUST_LOG`, when set, wins over
/// `--log-level`.
pub fn init(args: &LogArgs) -> Result<Guard, String> {
    let (text, filter) = match std::env::var("RUST_LOG") {
        Ok(value) if !value.is_empty() => {
            let filter = parse(&value)
                .map_err(|e| format!("RUST_LOG={value:?} is not a valid log filter: {e}"))?;
            (value, filter)
        }
        _ => {
            let filter = parse(&args.log_level).map_err(|e| {
                format!(
                    "--log-level {:?} is not a valid log filter: {e}",
                    args.log_level
                )
            })?;
            (args.log_level.clone(), filter)
        }
    };
    let max = log_max_level(&filter);
    let (filter, handle) = reload::Layer::new(filter);
    let registry = tracing_subscriber::registry().with(filter);
    // Colours only for a person at a terminal, never into log files.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let interval = std::time::Duration::from_millis(args.log_batch_interval_ms);
    let (out, guard) = writer::Batched::start(std::io::stderr(), writer::CAPACITY, interval)
        .map_err(|e| format!("cannot start the log writer thread: {e}"))?;
    let result = match args.log_format {
        LogFormat::Text if ansi => registry
            .with(fmt::layer().with_ansi(true).with_writer(out.clone()))
            .try_init(),
        // The default's lines, without its per-field styling (fields.rs).
        LogFormat::Text => registry
            .with(
                fmt::layer()
                    .with_ansi(false)
                    .fmt_fields(fields::PlainFields)
                    .with_writer(out.clone()),
            )
            .try_init(),
        LogFormat::Json => registry
            .with(fmt::layer().json().with_writer(out.clone()))
            .try_init(),
    };
    result.map_err(|e| format!("cannot install the logger: {e}"))?;
    let _ = WRITER.set(out);
    // A panic's message (stderr, directly) comes after the lines before it.
    let panic_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        flush();
        panic_hook(info);
    }));
    // The `log` bridge filters by its own maximum first; keep it in step
    // with the filter (here and on every reload). Release builds have no
    // `log` trace records at all (`release_max_level_debug`, the workspace
    // Cargo.toml says why): `trace` reaches `tracing`'s callers only.
    log::set_max_level(max);
    let _ = CONTROL.set(Control {
        handle,
        current: Mutex::new(text.clone()),
        initial: text,
    });
    Ok(Guard(guard))
}

/// Writes the buffered log lines now.
pub fn flush() {
    if let Some(writer) = WRITER.get() {
        writer.flush();
    }
}

/// The admin, metrics and readiness endpoints' last step
/// (`axum::middleware::map_response`): whatever was logged before an
/// answer, and whatever the answer counts (the access line is written
/// before the counters move), is in the log when the answer arrives.
pub async fn flush_after(response: axum::response::Response) -> axum::response::Response {
    flush();
    response
}

/// Log lines dropped because the writer's buffer was full
/// (`shunt_log_lines_dropped_total`).
pub fn dropped_lines() -> u64 {
    WRITER.get().map_or(0, |w| w.dropped())
}

/// Why the filter could not be changed.
#[derive(Debug, thiserror::Error)]
pub enum SetFilterError {
    #[error("{filter:?} is not a valid log filter: {reason}")]
    Invalid { filter: String, reason: String },
    #[error("logging was not set up by `logging::init` in this process")]
    NotInstalled,
    #[error("cannot replace the log filter: {0}")]
    Reload(String),
}

/// Replaces the log filter (same syntax as `--log-level`/`RUST_LOG`, e.g.
/// `debug` or `info,shunt::proxy=debug`); `None` restores the one the agent
/// started with. Returns the filter now in force.
pub fn set_filter(filter: Option<&str>) -> Result<String, SetFilterError> {
    let control = CONTROL.get().ok_or(SetFilterError::NotInstalled)?;
    let text = filter.unwrap_or(&control.initial).trim().to_string();
    let parsed = parse(&text).map_err(|reason| SetFilterError::Invalid {
        filter: text.clone(),
        reason,
    })?;
    let max = log_max_level(&parsed);
    let mut current = control.current.lock().unwrap_or_else(|p| p.into_inner());
    control
        .handle
        .reload(parsed)
        .map_err(|e| SetFilterError::Reload(e.to_string()))?;
    log::set_max_level(max);
    *current = text.clone();
    Ok(text)
}

/// A filter's text: comma-separated `level` or `target=level` directives.
fn parse(text: &str) -> Result<Targets, String> {
    Targets::from_str(text.trim()).map_err(|e| {
        format!("{e} (the filter is `level` and `target=level` directives, comma-separated, as ztunnel's)")
    })
}

/// The most verbose level `filter` lets through, for the `log` crate.
fn log_max_level(filter: &Targets) -> log::LevelFilter {
    use tracing_subscriber::{Layer, filter::LevelFilter};
    match <Targets as Layer<Registry>>::max_level_hint(filter) {
        Some(LevelFilter::OFF) => log::LevelFilter::Off,
        Some(LevelFilter::ERROR) => log::LevelFilter::Error,
        Some(LevelFilter::WARN) => log::LevelFilter::Warn,
        Some(LevelFilter::INFO) => log::LevelFilter::Info,
        Some(LevelFilter::DEBUG) => log::LevelFilter::Debug,
        _ => log::LevelFilter::Trace,
    }
}

/// The log filter in force, when [`init`] installed the logger.
pub fn current_filter() -> Option<String> {
    let control = CONTROL.get()?;
    let current = control.current.lock().unwrap_or_else(|p| p.into_inner());
    Some(current.clone())
}
