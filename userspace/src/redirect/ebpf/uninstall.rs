//! Uninstall: the node given back as it was before the agent came. After
//! every pod is unenrolled (their TC filters gone with them), the socket
//! programs are detached from the cgroup root at once (`BPF_LINK_DETACH`
//! on each pinned link, whoever else holds it) and the whole pin dir is
//! removed, maps included: the kernel frees each object when its last
//! holder, this process, exits.

use std::{
    os::fd::AsFd as _,
    path::{Path, PathBuf},
};

use tracing::{info, warn};

use super::{cgroup::links_dir, sys};
use crate::redirect::NodeCleanupError;

/// Detaches every link pinned under `pin_dir/links/` and removes `pin_dir`.
/// Returns how many links were detached.
pub(super) fn remove_pins(pin_dir: &Path) -> Result<usize, NodeCleanupError> {
    let mut detached = 0;
    let links = links_dir(pin_dir);
    let entries: Vec<PathBuf> = match std::fs::read_dir(&links) {
        Ok(dir) => dir.filter_map(Result::ok).map(|e| e.path()).collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(source) => {
            return Err(NodeCleanupError::Io {
                what: "listing the pinned links",
                path: links,
                source,
            });
        }
    };
    for pin in entries {
        match sys::obj_get(&pin).and_then(|link| sys::link_detach(link.as_fd())) {
            Ok(()) => detached += 1,
            // A link type without detach (the splice receive hook's raw
            // tracepoint) goes when its pin and this process are gone.
            Err(e) => {
                warn!(pin = %pin.display(), error = %e, "cannot detach a pinned link now; it goes with its pin when the agent exits")
            }
        }
    }
    match std::fs::remove_dir_all(pin_dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(NodeCleanupError::Io {
                what: "removing the pin dir",
                path: pin_dir.to_path_buf(),
                source,
            });
        }
    }
    info!(pin_dir = %pin_dir.display(), links = detached, "socket programs detached from the cgroup root, pins removed");
    Ok(detached)
}
