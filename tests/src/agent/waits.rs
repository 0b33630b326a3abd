//! Bounded waits on a running agent: for a status, for a verify pass, for
//! a log line; each fails with what it last saw and the agent's log, and
//! at once if the agent exited.

use std::{process::ExitStatus, time::Duration};

use shunt::api::NodeStatus;

use super::Agent;
use crate::{Result, TestbedError, poll::until};

/// How often the agent is asked.
const EVERY: Duration = Duration::from_millis(100);

impl Agent {
    /// The status once a verify pass that started after this call has
    /// finished: its hooks and counters are read after whatever the caller
    /// did before (a pass under way at the call counts once, hence two).
    pub fn status_after_verify(&self, timeout: Duration) -> Result<NodeStatus> {
        let passes = self.status()?.verify_passes;
        let mut last = passes;
        let seen = until(timeout, EVERY, || match self.status() {
            Ok(status) if status.verify_passes >= passes + 2 => Some(Ok(status)),
            Ok(status) => {
                last = status.verify_passes;
                None
            }
            Err(e) => Some(Err(e)),
        });
        seen.unwrap_or_else(|| {
            Err(TestbedError::Invalid(format!(
                "no verify pass within {timeout:?} (passes: {passes} then {last}); agent log:\n{}",
                self.logs()
            )))
        })
    }

    /// Polls the status until `done` holds (on a status of an agent that
    /// has reconciled its first list), failing after `timeout` with the last
    /// status (or error) and the agent's log.
    pub fn wait_for(
        &mut self,
        what: &str,
        timeout: Duration,
        done: impl Fn(&NodeStatus) -> bool,
    ) -> Result<NodeStatus> {
        let mut last = String::from("no answer yet");
        let seen = until(timeout, EVERY, || {
            if let Some(status) = self.exited() {
                return Some(Err(TestbedError::Invalid(format!(
                    "the agent exited ({status}) while waiting for {what}; its log:\n{}",
                    self.logs()
                ))));
            }
            match self.status() {
                // Before the agent reconciled its first list of pods, its
                // status lists none: that proves nothing either way.
                Ok(status) if status.synced && done(&status) => return Some(Ok(status)),
                Ok(status) => last = format!("{status:?}"),
                Err(e) => last = e.to_string(),
            }
            None
        });
        seen.unwrap_or_else(|| {
            Err(TestbedError::Invalid(format!(
                "timed out after {timeout:?} waiting for {what}; last status: {last}; agent log:\n{}",
                self.logs()
            )))
        })
    }

    /// Polls the agent's log until `done` holds for it, failing after
    /// `timeout` with the log; returns the log that satisfied `done`.
    pub fn wait_for_log(
        &mut self,
        what: &str,
        timeout: Duration,
        done: impl Fn(&str) -> bool,
    ) -> Result<String> {
        let mut last = String::new();
        let seen = until(timeout, EVERY, || {
            let logs = self.logs();
            if done(&logs) {
                return Some(Ok(logs));
            }
            if let Some(status) = self.exited() {
                return Some(Err(TestbedError::Invalid(format!(
                    "the agent exited ({status}) while waiting for {what}; its log:\n{logs}"
                ))));
            }
            last = logs;
            None
        });
        seen.unwrap_or_else(|| {
            Err(TestbedError::Invalid(format!(
                "timed out after {timeout:?} waiting for {what} in the agent log:\n{last}"
            )))
        })
    }

    /// The agent's exit status, if it has exited.
    fn exited(&mut self) -> Option<ExitStatus> {
        self.child.as_mut()?.try_wait().ok().flatten()
    }
}
