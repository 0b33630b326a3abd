//! The "previous release" fixture (cargo feature `previous-release-fixture`,
//! built only for the agent's upgrade test, `tests/tests/upgrade.rs`): the
//! same programs, except that the TC programs and connect4 run
//! [`previous_release_marker`] first. It changes their instructions (and so
//! their kernel tags) without changing what they do. Without the feature it
//! is empty and compiles to nothing.

/// A stack write and a volatile read of it: two instructions the verifier
/// accepts and that change nothing. Empty in a release build.
#[inline(always)]
pub fn previous_release_marker() {
    #[cfg(feature = "previous-release-fixture")]
    {
        let marker: u64 = 0x5052_4556; // "PREV"
        // SAFETY: a read of a live local.
        unsafe { core::ptr::read_volatile(&marker) };
    }
}
