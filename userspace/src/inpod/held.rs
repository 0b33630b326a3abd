//! A pod's network namespace as ztunnel is handed it: opened once, when the
//! pod is first described for ztunnel (its capture), and held open while it
//! is wanted, so that every `AddWorkload` — in this connection's adds or in
//! any later connection's snapshot — carries the namespace that was
//! captured, not whatever its path names at send time. Its identity is
//! read from the open descriptor and checked again before each send.

use std::{
    os::fd::{AsFd, BorrowedFd},
    path::Path,
};

use crate::netns::{NetNs, NetNsError, NsId};

#[derive(Debug)]
pub struct HeldNetns {
    netns: NetNs,
    /// Read from the descriptor when it was opened.
    id: NsId,
}

impl HeldNetns {
    /// Opens the namespace `path` names now (a namespace file, else an
    /// error) and records its identity from the open descriptor.
    pub fn open(path: &Path) -> Result<Self, NetNsError> {
        let netns = NetNs::open(path)?;
        let id = netns.checked_id()?;
        Ok(Self { netns, id })
    }

    pub fn id(&self) -> NsId {
        self.id
    }

    /// The descriptor to send, once checked to still be the namespace
    /// recorded when it was opened (an `Err` names what differs).
    pub fn checked_fd(&self) -> Result<BorrowedFd<'_>, String> {
        match self.netns.checked_id() {
            Ok(id) if id == self.id => Ok(self.netns.as_fd()),
            Ok(id) => Err(format!(
                "the descriptor held for {} is namespace {id:?}, not {:?} as recorded at capture",
                self.netns.path().display(),
                self.id
            )),
            Err(e) => Err(e.to_string()),
        }
    }
}
