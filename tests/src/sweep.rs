//! Removing what killed runs left behind.

use std::{fs, io, path::PathBuf};

use crate::{
    cgroup, cmd,
    error::{Result, TestbedError},
    names::{self, NETNS_DIR},
    warn,
};

/// What [`sweep_stale`] removed.
#[derive(Debug, Default, Clone)]
pub struct SweepReport {
    /// Netns names deleted from `/var/run/netns`.
    pub netns: Vec<String>,
    /// Cgroup dirs removed below `<cgroup2>/shunt-test/`.
    pub cgroups: Vec<PathBuf>,
}

/// Deletes every netns and cgroup dir this library made for a process that is
/// gone. [`crate::Topology::new`] calls it first, so a `kill -9`ed test run is
/// cleaned up by the next one. Leftovers that cannot be removed are reported
/// on stderr and skipped: they have unique names, so they never get in the way.
pub fn sweep_stale() -> Result<SweepReport> {
    let mut report = SweepReport::default();

    let entries = match fs::read_dir(NETNS_DIR) {
        Ok(entries) => Some(entries),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(TestbedError::io(format!("cannot list {NETNS_DIR}"), e)),
    };
    for entry in entries.into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !names::is_stale(&name) {
            continue;
        }
        match cmd::ip(&["netns", "delete", &name]) {
            Ok(_) => report.netns.push(name),
            // A concurrent sweep (another test or process) got there first.
            Err(_) if !entry.path().exists() => {}
            Err(e) => warn(format_args!("cannot delete stale netns {name}: {e}")),
        }
    }

    // Machines without cgroup v2 have no cgroups of ours to sweep.
    let Ok(mount) = cgroup::cgroup2_mount() else {
        return Ok(report);
    };
    let parent = mount.join(cgroup::CGROUP_PARENT);
    let entries = match fs::read_dir(&parent) {
        Ok(entries) => Some(entries),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => {
            return Err(TestbedError::io(
                format!("cannot list {}", parent.display()),
                e,
            ));
        }
    };
    for entry in entries.into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !names::is_stale(&name) {
            continue;
        }
        let path = entry.path();
        match cgroup::remove_tree(&path, &mount) {
            Ok(()) => report.cgroups.push(path),
            Err(e) => warn(format_args!("cannot remove stale cgroup: {e}")),
        }
    }
    Ok(report)
}
