//! Where test agents pin their maps: one dir per agent under [`BPF_ROOT`],
//! what killed runs left swept, and [`PinDir`] for a redirector a test runs
//! in-process.

use std::{
    fs,
    path::{Path, PathBuf},
};

use crate::Topology;

/// Where bpf pin dirs of test agents live (`<BPF_ROOT>/<prefix>-<node>`).
pub const BPF_ROOT: &str = "/sys/fs/bpf";

/// Removes pin dirs of test agents whose topology is gone (a killed run
/// never reached `Drop`).
pub(super) fn sweep_stale_pins() {
    let Ok(entries) = fs::read_dir(BPF_ROOT) else {
        return;
    };
    for entry in entries.flatten() {
        if crate::names::is_stale(&entry.file_name().to_string_lossy()) {
            let _ = fs::remove_dir_all(entry.path());
        }
    }
}

/// A bpf pin dir for a redirector a test runs in-process; removed (which
/// also detaches the pinned socket-program links) on drop.
pub struct PinDir {
    path: PathBuf,
}

impl PinDir {
    pub fn new(topology: &Topology, name: &str) -> PinDir {
        sweep_stale_pins();
        PinDir {
            path: Path::new(BPF_ROOT).join(format!("{}-{name}", topology.prefix())),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for PinDir {
    fn drop(&mut self) {
        if let Err(e) = fs::remove_dir_all(&self.path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            crate::warn(format_args!(
                "cannot remove pin dir {}: {e}",
                self.path.display()
            ));
        }
    }
}
