//! Logging: `tracing` to stderr as text or JSON. Records from the eBPF
//! programs (aya-log, via the `log` crate) are bridged into the same output.

use tracing_subscriber::{EnvFilter, fmt, prelude::*};

use crate::cli::{LogArgs, LogFormat};

/// Installs the global subscriber. `RUST_LOG`, when set, wins over
/// `--log-level`.
pub fn init(args: &LogArgs) -> Result<(), String> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(value) if !value.is_empty() => EnvFilter::try_new(&value)
            .map_err(|e| format!("RUST_LOG={value:?} is not a valid log filter: {e}"))?,
        _ => EnvFilter::try_new(&args.log_level).map_err(|e| {
            format!(
                "--log-level {:?} is not a valid log filter: {e}",
                args.log_level
            )
        })?,
    };
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
    result.map_err(|e| format!("cannot install the logger: {e}"))
}
