//! Logging: `tracing` to stderr as text or JSON. Records from the eBPF
//! programs (aya-log, via the `log` crate) are bridged into the same output.
//! The filter can be replaced while the agent runs ([`set_filter`], the
//! admin API's `/logging?level=`).

use std::sync::{Mutex, OnceLock};

use tracing_subscriber::{EnvFilter, Registry, fmt, prelude::*, reload};

use crate::cli::{LogArgs, LogFormat};

/// The installed filter's reload handle and its text (now and at start).
struct Control {
    handle: reload::Handle<EnvFilter, Registry>,
    current: Mutex<String>,
    initial: String,
}

static CONTROL: OnceLock<Control> = OnceLock::new();

/// Installs the global subscriber. `RUST_LOG`, when set, wins over
/// `--log-level`.
pub fn init(args: &LogArgs) -> Result<(), String> {
    let (text, filter) = match std::env::var("RUST_LOG") {
        Ok(value) if !value.is_empty() => {
            let filter = EnvFilter::try_new(&value)
                .map_err(|e| format!("RUST_LOG={value:?} is not a valid log filter: {e}"))?;
            (value, filter)
        }
        _ => {
            let filter = EnvFilter::try_new(&args.log_level).map_err(|e| {
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
    let result = match args.log_format {
        LogFormat::Text => registry
            .with(fmt::layer().with_ansi(ansi).with_writer(std::io::stderr))
            .try_init(),
        LogFormat::Json => registry
            .with(fmt::layer().json().with_writer(std::io::stderr))
            .try_init(),
    };
    result.map_err(|e| format!("cannot install the logger: {e}"))?;
    // The `log` bridge filters by its own maximum first; keep it in step
    // with the filter (here and on every reload).
    log::set_max_level(max);
    let _ = CONTROL.set(Control {
        handle,
        current: Mutex::new(text.clone()),
        initial: text,
    });
    Ok(())
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
    let parsed = EnvFilter::try_new(&text).map_err(|e| SetFilterError::Invalid {
        filter: text.clone(),
        reason: e.to_string(),
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

/// The most verbose level `filter` lets through, for the `log` crate.
fn log_max_level(filter: &EnvFilter) -> log::LevelFilter {
    use tracing_subscriber::{Layer, filter::LevelFilter};
    match <EnvFilter as Layer<Registry>>::max_level_hint(filter) {
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
