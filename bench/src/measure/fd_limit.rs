//! Whether a path's proxies can hold the idle workload at all: each keeps
//! one or two sockets per idle connection, and the process's hard
//! `RLIMIT_NOFILE` (which it cannot raise) bounds them. A path that cannot
//! is skipped with its reason instead of failing every repetition.

use crate::{
    client::WorkloadKind,
    model::{Dest, Locality, Mode, PathSpec, Workload},
};

/// Descriptors a proxy keeps besides the per-connection ones (listeners,
/// eBPF maps and links, pooled HBONE connections, the runtime's own).
const BASE_FDS: u64 = 1024;

/// Sockets the busiest proxy process of `path` holds per idle connection:
/// two where one process holds both legs (passthrough, and shunt's
/// same-node HBONE, one agent in both roles), one where each leg is in a
/// process of its own, none where the kernel carries the connection.
fn sockets_per_connection(path: PathSpec) -> u64 {
    match (path.mode, path.locality, path.dest) {
        (Mode::Direct, _, _) | (Mode::EbpfFastPath, _, _) => 0,
        (_, _, Dest::Plain) => 2,
        // ztunnel in dedicated mode: one process per pod, per role.
        (Mode::Ztunnel, _, Dest::Hbone) => 1,
        (_, Locality::Same, Dest::Hbone) => 2,
        (_, Locality::Cross, Dest::Hbone) => 1,
    }
}

/// Why `workload` cannot run over `path` whose proxies have these hard
/// limits (`None`: it can, or the workload holds few connections).
pub(super) fn skip_reason(
    path: PathSpec,
    workload: &Workload,
    hard_limits: &[(u32, u64)],
) -> Option<String> {
    if workload.kind != WorkloadKind::Idle {
        return None;
    }
    let per = sockets_per_connection(path);
    if per == 0 {
        return None;
    }
    let need = per * workload.conns as u64 + BASE_FDS;
    let (pid, limit) = hard_limits.iter().copied().min_by_key(|&(_, l)| l)?;
    (limit < need).then(|| {
        format!(
            "{} skipped on {}: a proxy there holds {per} socket(s) per connection, {need} descriptors with its own, but its hard RLIMIT_NOFILE is {limit} (pid {pid})",
            workload.id,
            path.id()
        )
    })
}

/// The hard `RLIMIT_NOFILE` of `pid` (`/proc/PID/limits`; `unlimited` as
/// `u64::MAX`), or `None` when it cannot be read.
pub(super) fn hard_nofile(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/limits")).ok()?;
    parse_hard_nofile(&text)
}

fn parse_hard_nofile(limits: &str) -> Option<u64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    let hard = line["Max open files".len()..].split_whitespace().nth(1)?;
    if hard == "unlimited" {
        Some(u64::MAX)
    } else {
        hard.parse().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::workloads;

    fn idle() -> Workload {
        workloads(false)
            .into_iter()
            .find(|w| w.id == "idle10k")
            .expect("the idle workload")
    }

    fn path(mode: Mode, locality: Locality, dest: Dest) -> PathSpec {
        PathSpec {
            mode,
            locality,
            dest,
        }
    }

    #[test]
    fn reads_the_hard_limit() {
        let text = "Limit                     Soft Limit           Hard Limit           Units     \n\
Max processes             63448                63448                processes \n\
Max open files            1024                 20000                files     \n";
        assert_eq!(parse_hard_nofile(text), Some(20000));
        let text =
            "Max open files            1024                 unlimited            files     \n";
        assert_eq!(parse_hard_nofile(text), Some(u64::MAX));
    }

    #[test]
    fn skips_a_single_agent_path_over_the_limit_only() {
        let limits = [(7, 20_000)];
        let same = path(Mode::Ebpf, Locality::Same, Dest::Hbone);
        let reason = skip_reason(same, &idle(), &limits).expect("skipped");
        assert!(
            reason.contains("ebpf/same/hbone") && reason.contains("20000"),
            "{reason}"
        );
        let cross = path(Mode::Ebpf, Locality::Cross, Dest::Hbone);
        assert_eq!(skip_reason(cross, &idle(), &limits), None);
        let passthrough = path(Mode::Iptables, Locality::Cross, Dest::Plain);
        assert!(skip_reason(passthrough, &idle(), &limits).is_some());
        let fast = path(Mode::EbpfFastPath, Locality::Cross, Dest::Plain);
        assert_eq!(skip_reason(fast, &idle(), &limits), None);
        assert_eq!(skip_reason(same, &idle(), &[(7, 1 << 20)]), None);
    }
}
