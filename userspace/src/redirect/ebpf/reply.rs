//! The reply path of source preservation in a pod's netns (`--preserve-source
//! on`): the policy route and `accept_local` on `lo` that deliver the
//! application's replies to the proxy's transparent sockets once TC egress
//! has marked them (`ebpf/src/tc_pod.rs`), and `tcp_fwmark_accept`, which
//! lets TC egress look up only the packets that can be such replies (pod
//! flag [`PodConfig::REPLY_BY_MARK`]).

use std::{io, path::Path};

use shunt_common::PodConfig;

use super::{EbpfRedirector, RedirectError, kernel, route};
use crate::{netns::NetNs, state::WorkloadKey};

const FWMARK_ACCEPT: &str = "/proc/sys/net/ipv4/tcp_fwmark_accept";

/// How `verify` names an enrolment whose `REPLY_BY_MARK` no longer holds.
pub(super) const FWMARK_ACCEPT_OFF: &str = "net.ipv4.tcp_fwmark_accept in the pod's netns";

/// Installs the reply path in the pod's netns when its settings ask for it:
/// `tcp_fwmark_accept` ([`enable_fwmark_accept`]), the policy route that
/// delivers packets marked 0x111 locally (shared with the iptables mode, see
/// [`route`]) and `accept_local` on `lo` ([`route::accept_local_on_lo`]).
/// The TC egress program marks the replies. Idempotent.
pub(super) fn reply_path(
    pod: &WorkloadKey,
    netns: &NetNs,
    config: PodConfig,
) -> Result<(), RedirectError> {
    if config.flags & PodConfig::REPLY_TO_PROXY == 0 {
        return Ok(());
    }
    netns
        .run(|| -> io::Result<()> {
            enable_fwmark_accept()?;
            route::accept_local_on_lo()?;
            for family in route::families() {
                let present = route::present(family)?;
                if !(present.rule && present.route) {
                    route::add(family)?;
                }
            }
            Ok(())
        })?
        .map_err(|e| kernel(pod, "adding the policy route for transparent inbound", e))
}

/// Deletes the policy route (both families; either absent is fine).
/// `accept_local` on `lo` and `tcp_fwmark_accept` stay on: harmless, and
/// their earlier values are unknown to a later agent. Restoring
/// `tcp_fwmark_accept` would change no socket (an accepted socket keeps the
/// mark it was given), and an enrolment that follows (the pod back in the
/// mesh, a later agent) finds it on.
pub(super) fn remove_reply_path() -> io::Result<()> {
    route::delete(route::Family::V4)?;
    if route::ipv6_on_lo() {
        route::delete(route::Family::V6)?;
    }
    Ok(())
}

impl EbpfRedirector {
    /// [`super::Redirector::before_serving`]: with source preservation,
    /// turns `tcp_fwmark_accept` on in the pod's netns before a proxy binds
    /// its listeners there. An HBONE connection to podIP:15008 needs no
    /// redirect, so it can arrive as soon as that listener exists, before
    /// the pod is enrolled; the application must accept the proxy's
    /// connection it leads to marked, or `REPLY_BY_MARK` (set at the
    /// enrolment) would lose its replies. Remembers whether the sysctl was
    /// on before (the first answer per netns) for [`fwmark_was_on`].
    /// Nothing to do for a pod already enrolled in that netns.
    pub(super) fn fwmark_accept_before_serving(
        &self,
        pod: &WorkloadKey,
        path: &Path,
    ) -> Result<(), RedirectError> {
        if !self.preserve_source
            || self
                .pods
                .get(pod)
                .is_some_and(|enrolled| enrolled.netns.is_at(path))
        {
            return Ok(());
        }
        let netns = NetNs::open(path)?;
        let id = netns.id()?;
        let was_on = netns
            .run(enable_fwmark_accept)?
            .map_err(|e| kernel(pod, "turning net.ipv4.tcp_fwmark_accept on", e))?;
        self.fwmark_before_serving
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(id)
            .or_insert(was_on);
        Ok(())
    }

    /// What the enrolment's own [`enable_fwmark_accept`] answer (`now`)
    /// means for [`reply_by_mark`]: whether the sysctl was on before
    /// this agent touched the netns, counting a turn-on by
    /// [`EbpfRedirector::fwmark_accept_before_serving`] as "was off".
    pub(super) fn fwmark_was_on(&self, netns: &NetNs, now: io::Result<bool>) -> io::Result<bool> {
        let before = netns.id().ok().and_then(|id| {
            self.fwmark_before_serving
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&id)
        });
        now.map(|on| on && before.unwrap_or(true))
    }
}

/// Sets `net.ipv4.tcp_fwmark_accept=1` in the calling thread's netns and
/// says whether it was on already.
///
/// With it on, a socket accepted by a listener that has no mark of its own
/// gets the mark of the SYN that created it (`inet_request_mark`), for
/// IPv4 and IPv6: the application's end of a connection from the proxy
/// (whose sockets carry `SO_MARK` 0x539, and whose SYN stays in the netns,
/// over `lo`, so keeps it) then marks everything it sends, time-wait ACKs
/// included. Connections from outside arrive through `eth0` with no mark
/// (crossing into the netns scrubs it), so their sockets stay unmarked.
pub(super) fn enable_fwmark_accept() -> io::Result<bool> {
    if fwmark_accept_on()? {
        return Ok(true);
    }
    std::fs::write(FWMARK_ACCEPT, "1")?;
    Ok(false)
}

/// Whether `net.ipv4.tcp_fwmark_accept` is on in the calling thread's netns.
pub(super) fn fwmark_accept_on() -> io::Result<bool> {
    Ok(std::fs::read_to_string(FWMARK_ACCEPT)?.trim() != "0")
}

/// Whether a pod being enrolled gets [`PodConfig::REPLY_BY_MARK`]:
/// `earlier` is the settings an earlier enrolment of the same netns left in
/// the pinned map (`None`: this is its first enrolment), `fwmark_accept`
/// whether the sysctl was on before this agent turned it on
/// ([`EbpfRedirector::fwmark_was_on`]; it goes on before the proxy binds
/// the pod's listeners, so before any connection from the proxy).
///
/// The flag is only safe if every live connection from the proxy to the
/// pod's applications was accepted with `tcp_fwmark_accept` on: an
/// unmarked one would have its replies leave through `eth0` to the real
/// client. A first enrolment has none: the sysctl went on before the
/// proxy's listeners were bound. An adopted pod
/// (a restart, a handover, an upgrade) keeps the flag only if the earlier
/// enrolment had it and the sysctl is still on: an earlier release never
/// set it, so the proxy it ran may still hold connections the application
/// accepted unmarked — "the sysctl is on now" proves nothing about them
/// (this release may have turned it on at a previous adoption). Such a pod
/// is looked up packet by packet until its netns changes.
pub(super) fn reply_by_mark(earlier: Option<&PodConfig>, fwmark_accept: &io::Result<bool>) -> bool {
    match (earlier, fwmark_accept) {
        (_, Err(_)) => false,
        (None, Ok(_)) => true,
        (Some(earlier), Ok(was_on)) => *was_on && earlier.flags & PodConfig::REPLY_BY_MARK != 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(flags: u32) -> PodConfig {
        PodConfig {
            flags,
            ..PodConfig::default()
        }
    }

    const PRESERVING: u32 = PodConfig::REPLY_TO_PROXY;
    const BY_MARK: u32 = PodConfig::REPLY_TO_PROXY | PodConfig::REPLY_BY_MARK;

    #[test]
    fn a_first_enrolment_gets_the_flag_once_the_sysctl_is_on() {
        assert!(reply_by_mark(None, &Ok(false)));
        assert!(reply_by_mark(None, &Ok(true)));
    }

    #[test]
    fn no_flag_when_the_sysctl_cannot_be_set() {
        let denied = || Err(io::Error::from(io::ErrorKind::PermissionDenied));
        assert!(!reply_by_mark(None, &denied()));
        assert!(!reply_by_mark(Some(&config(BY_MARK)), &denied()));
    }

    #[test]
    fn an_adopted_pod_keeps_the_flag_only_if_it_had_it_and_the_sysctl_stayed_on() {
        assert!(reply_by_mark(Some(&config(BY_MARK)), &Ok(true)));
        // Turned off meanwhile: sockets accepted since carry no mark.
        assert!(!reply_by_mark(Some(&config(BY_MARK)), &Ok(false)));
    }

    #[test]
    fn a_pod_enrolled_by_an_earlier_release_never_gets_the_flag() {
        // Its proxy may hold connections accepted before the sysctl was on,
        // whether or not it is on now.
        assert!(!reply_by_mark(Some(&config(PRESERVING)), &Ok(false)));
        assert!(!reply_by_mark(Some(&config(PRESERVING)), &Ok(true)));
        assert!(!reply_by_mark(Some(&config(0)), &Ok(true)));
    }
}
