//! A bind mount a test made (a pod's netns where the agent looks for a
//! sandbox's, say), taken down when dropped, on failure too.

use std::path::{Path, PathBuf};

/// A bind mount of a file; lazily unmounted when dropped.
pub struct BindMount(PathBuf);

impl BindMount {
    /// Binds `from` at `at` (created empty if missing). Panics if the
    /// mount fails: a test cannot go on without it.
    pub fn new(from: &Path, at: &Path) -> BindMount {
        if !at.exists() {
            std::fs::File::create(at).expect("mount point");
        }
        nix::mount::mount(
            Some(from),
            at,
            None::<&str>,
            nix::mount::MsFlags::MS_BIND,
            None::<&str>,
        )
        .expect("bind mount");
        BindMount(at.to_path_buf())
    }
}

impl Drop for BindMount {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH);
    }
}
