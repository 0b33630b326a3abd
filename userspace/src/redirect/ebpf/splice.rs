//! The splice programs (`ebpf/src/splice.rs` explains the datapath and its
//! bound): the `sk_msg` verdict attached to the pinned `SHUNT_SPLICE_SOCKS`
//! map, and the receive hook on the `sock_recv_length` raw tracepoint
//! through a BPF link pinned under `<pin dir>/links/`. Both outlive the agent: the map keeps its
//! program and the link its pin, so spliced connections survive a restart.

use std::{fmt, path::Path, str::FromStr};

use aya::{
    Ebpf,
    maps::{MapData, SockHash},
    programs::{
        Program, ProgramError, RawTracePoint, SkMsg,
        links::{FdLink, PinnedLink},
    },
};
use shunt_common::{SpliceKey, maps, programs};
use tracing::info;

use super::{
    LoadError,
    cgroup::links_dir,
    upgrade::{Decision, Upgrade},
};

/// `--splice`: whether app ⇄ proxy payload skips the TCP stack.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SpliceMode {
    /// On for every pod but those that opt out (annotation
    /// `shunt.io/splice: off`); the agent fails to start where the kernel
    /// cannot.
    On,
    /// Only pods that opt in (`shunt.io/splice: on`) are spliced.
    OptIn,
    /// Off: every byte takes the TCP stack. The default, because a spliced
    /// socket reads through the kernel's sockmap path, where a blocking
    /// `read()` woken without data (e.g. by `shutdown(SHUT_WR)` from
    /// another thread) returns EAGAIN instead of waiting on (Linux 6.18).
    #[default]
    Off,
}

impl FromStr for SpliceMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "on" => Ok(Self::On),
            "opt-in" => Ok(Self::OptIn),
            "off" => Ok(Self::Off),
            other => Err(format!(
                "unknown splice mode {other:?}: expected on, opt-in or off"
            )),
        }
    }
}

impl fmt::Display for SpliceMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::On => "on",
            Self::OptIn => "opt-in",
            Self::Off => "off",
        })
    }
}

impl SpliceMode {
    /// Whether a pod whose own say is `pod` (its `shunt.io/splice`
    /// annotation, if any) is spliced in this mode.
    pub fn splices(self, pod: Option<bool>) -> bool {
        match self {
            Self::On => pod != Some(false),
            Self::OptIn => pod == Some(true),
            Self::Off => false,
        }
    }
}

/// The pin of the receive hook's link.
fn recv_link_pin(pin_dir: &Path) -> std::path::PathBuf {
    links_dir(pin_dir).join(programs::SPLICE_RECV)
}

/// Attaches the sk_msg verdict to the splice map (replacing a previous
/// agent's: sockets already spliced keep the program they joined with,
/// sockets added from now on run this one) and the receive hook, unless a
/// previous agent's pinned link runs this release's program already (a
/// link of another release is replaced: the new link first, then the old
/// one's pin goes).
pub fn attach_or_adopt(
    ebpf: &mut Ebpf,
    pin_dir: &Path,
    upgrade: &mut Upgrade,
) -> Result<(), LoadError> {
    let map = ebpf.map(maps::SPLICE_SOCKS).ok_or(LoadError::Map {
        name: maps::SPLICE_SOCKS,
        detail: "not in the eBPF object".to_string(),
    })?;
    let socks: SockHash<&MapData, SpliceKey> =
        SockHash::try_from(map).map_err(|e| LoadError::Map {
            name: maps::SPLICE_SOCKS,
            detail: e.to_string(),
        })?;
    let map_fd = socks.fd().try_clone().map_err(|e| LoadError::Map {
        name: maps::SPLICE_SOCKS,
        detail: format!("duplicating its descriptor: {e}"),
    })?;
    let name = programs::SPLICE_MSG;
    let program_error = |source| LoadError::Program { name, source };
    let program: &mut SkMsg = program_mut(ebpf, name)?;
    program.load().map_err(program_error)?;
    let id = program.attach(&map_fd).map_err(program_error)?;
    let attachment = program.take_link(id).map_err(program_error)?;
    // The attachment belongs to the pinned map from now on: dropping the
    // handle would detach it, and a later agent must find it in place.
    std::mem::forget(attachment);
    let info = program.info().map_err(program_error)?;
    upgrade.record("sockhash".into(), None, name, None, &info, None);

    let name = programs::SPLICE_RECV;
    let pin = recv_link_pin(pin_dir);
    let program_error = |source| LoadError::Program { name, source };
    let program: &mut RawTracePoint = program_mut(ebpf, name)?;
    program.load().map_err(program_error)?;
    let info = program.info().map_err(program_error)?;
    let adopted = PinnedLink::from_pin(&pin)
        .ok()
        .and_then(|pinned| FdLink::from(pinned).info().ok())
        .map(|link| link.program_id());
    let decision = adopted.map(|old_id| upgrade.decide(old_id, &info));
    if decision == Some(Decision::Keep) {
        info!(program = name, pin = %pin.display(), "splice receive hook attached by a previous agent is this release's; keeping it");
        upgrade.record("tracepoint".into(), None, name, adopted, &info, decision);
        return Ok(());
    }
    let id = program
        .attach(programs::SPLICE_RECV_TARGET)
        .map_err(program_error)?;
    let link: FdLink = program.take_link(id).map_err(program_error)?.into();
    if decision.is_some() {
        // A raw tracepoint link cannot switch programs: the new link runs
        // beside the old one until the rename below drops the old pin
        // (and with it the old link). In that moment a read may be counted
        // twice in a splice backlog (it reads low, briefly).
        let fresh = pin.with_extension("new");
        let _ = std::fs::remove_file(&fresh);
        link.pin(&fresh).map_err(|e| LoadError::Link {
            name,
            detail: format!("pinning at {}: {e}", fresh.display()),
        })?;
        std::fs::rename(&fresh, &pin).map_err(|e| LoadError::Link {
            name,
            detail: format!("moving {} over {}: {e}", fresh.display(), pin.display()),
        })?;
    } else {
        let _ = std::fs::remove_file(&pin);
        link.pin(&pin).map_err(|e| LoadError::Link {
            name,
            detail: format!("pinning at {}: {e}", pin.display()),
        })?;
        info!(program = name, tracepoint = programs::SPLICE_RECV_TARGET, pin = %pin.display(), "splice receive hook attached");
    }
    upgrade.record("tracepoint".into(), None, name, adopted, &info, decision);
    Ok(())
}

/// The object's program `name`, as the program type `T` it must be.
fn program_mut<'a, T>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut T, LoadError>
where
    &'a mut T: TryFrom<&'a mut Program, Error = ProgramError>,
{
    ebpf.program_mut(name)
        .ok_or(LoadError::Program {
            name,
            source: ProgramError::UnexpectedProgramType,
        })?
        .try_into()
        .map_err(|source| LoadError::Program { name, source })
}

/// Whether the receive hook's link is in place.
pub fn present(pin_dir: &Path) -> bool {
    PinnedLink::from_pin(recv_link_pin(pin_dir)).is_ok()
}

#[cfg(test)]
mod tests {
    use super::SpliceMode;

    #[test]
    fn the_mode_and_the_pods_say_decide_together() {
        use SpliceMode::{Off, On, OptIn};
        for (mode, pod, spliced) in [
            (On, None, true),
            (On, Some(true), true),
            (On, Some(false), false),
            (OptIn, None, false),
            (OptIn, Some(true), true),
            (OptIn, Some(false), false),
            (Off, Some(true), false),
            (Off, None, false),
        ] {
            assert_eq!(
                mode.splices(pod),
                spliced,
                "{mode} with the pod saying {pod:?}"
            );
        }
    }

    #[test]
    fn modes_parse_and_print_alike() {
        for mode in [SpliceMode::On, SpliceMode::OptIn, SpliceMode::Off] {
            assert_eq!(mode.to_string().parse::<SpliceMode>(), Ok(mode));
        }
        let typo = "opt_in".parse::<SpliceMode>().expect_err("typo");
        assert!(typo.contains("expected on, opt-in or off"), "{typo}");
    }
}
