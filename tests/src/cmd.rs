//! Running external commands (mostly `ip`) with a time bound and an error that
//! names the command line and its stderr.

use std::{
    io::Read,
    process::{Command, ExitStatus, Stdio},
    thread,
    time::{Duration, Instant},
};

use crate::error::{Result, TestbedError};

/// `ip` finishes in milliseconds; anything near this bound means the kernel or
/// the machine is wedged, and a test should fail rather than hang.
pub(crate) const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs `ip ARGS...` and returns its stdout.
pub(crate) fn ip(args: &[&str]) -> Result<String> {
    run("ip", args)
}

/// Runs `program ARGS...` to completion (bounded by [`COMMAND_TIMEOUT`]) and
/// returns its stdout; a non-zero exit becomes [`TestbedError::CommandFailed`].
pub(crate) fn run(program: &str, args: &[&str]) -> Result<String> {
    let command_line = std::iter::once(program)
        .chain(args.iter().copied())
        .collect::<Vec<_>>()
        .join(" ");
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| TestbedError::Spawn {
            command: command_line.clone(),
            source,
        })?;
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();

    // Pipes are drained on their own threads so a chatty command cannot block
    // on a full pipe while we wait for it to exit.
    let (status, out, err) = thread::scope(|scope| {
        let out = scope.spawn(move || read_all(stdout));
        let err = scope.spawn(move || read_all(stderr));
        let status = wait_bounded(&mut child, COMMAND_TIMEOUT);
        if status.is_none() {
            let _ = child.kill();
            let _ = child.wait();
        }
        (
            status,
            out.join().unwrap_or_default(),
            err.join().unwrap_or_default(),
        )
    });

    match status {
        None => Err(TestbedError::CommandTimeout {
            command: command_line,
            timeout: COMMAND_TIMEOUT,
        }),
        Some(Err(source)) => Err(TestbedError::Spawn {
            command: command_line,
            source,
        }),
        Some(Ok(status)) if status.success() => Ok(out),
        Some(Ok(status)) => Err(TestbedError::CommandFailed {
            command: command_line,
            status: status.to_string(),
            stderr: err.trim().to_string(),
        }),
    }
}

fn read_all(pipe: Option<impl Read>) -> String {
    let mut text = String::new();
    if let Some(mut pipe) = pipe {
        let mut bytes = Vec::new();
        let _ = pipe.read_to_end(&mut bytes);
        text = String::from_utf8_lossy(&bytes).into_owned();
    }
    text
}

/// Polls the child with a growing interval: `ip` usually exits within a few
/// milliseconds, so short first naps keep topology setup fast.
fn wait_bounded(
    child: &mut std::process::Child,
    timeout: Duration,
) -> Option<std::io::Result<ExitStatus>> {
    let start = Instant::now();
    let mut nap = Duration::from_micros(200);
    // The count bound backs up the time bound should the clock misbehave.
    let max_polls = 100_000;
    for _ in 0..max_polls {
        match child.try_wait() {
            Ok(Some(status)) => return Some(Ok(status)),
            Ok(None) => {}
            Err(e) => return Some(Err(e)),
        }
        if start.elapsed() >= timeout {
            return None;
        }
        thread::sleep(nap);
        nap = (nap * 2).min(Duration::from_millis(20));
    }
    None
}
