//! The log lines of an in-process test binary, captured for assertions
//! (tracing's subscriber is global: one per binary, shared by its tests).

use std::sync::{Mutex, OnceLock};

fn logs() -> &'static Mutex<Vec<u8>> {
    static LOGS: OnceLock<Mutex<Vec<u8>>> = OnceLock::new();
    LOGS.get_or_init(Mutex::default)
}

struct LogWriter;

impl std::io::Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        logs()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(buf);
        // Also visible with --nocapture.
        let _ = std::io::stderr().write_all(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Installs the capturing subscriber once per binary, with `filter` (an
/// `EnvFilter` directive such as `info,shunt=debug`).
pub fn init_logging(filter: &'static str) {
    static INIT: OnceLock<()> = OnceLock::new();
    INIT.get_or_init(|| {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(false)
            .with_writer(|| LogWriter)
            .try_init();
    });
}

/// Whether any captured line contains `needle`.
#[allow(dead_code)] // not every binary asks
pub fn logged(needle: &str) -> bool {
    !log_lines_with(&[needle]).is_empty()
}

/// The captured lines that contain every one of `needles`.
pub fn log_lines_with(needles: &[&str]) -> Vec<String> {
    let logs = logs().lock().unwrap_or_else(|p| p.into_inner());
    String::from_utf8_lossy(&logs)
        .lines()
        .filter(|l| needles.iter().all(|n| l.contains(n)))
        .map(str::to_owned)
        .collect()
}
