//! The kernel side the agent starts with: the redirector `--redirect`
//! asks for, the cgroup root it attaches to, and the eBPF programs' logs.

use std::path::Path;

use tracing::{info, warn};

use super::{AgentError, parts::fast_path_wanted};
use crate::{
    cli::{AgentArgs, OnOff, ProxyKind},
    redirect::{
        RedirectMode, Redirector,
        ebpf::{EbpfOptions, EbpfRedirector, LoadError},
    },
};

/// The redirector `--redirect` asks for (`auto`: eBPF when the kernel has
/// every hook, else iptables).
pub(super) fn redirector(args: &AgentArgs) -> Result<Box<dyn Redirector>, AgentError> {
    let iptables = || -> Result<Box<dyn Redirector>, AgentError> {
        let mut options = crate::redirect::iptables::IptablesOptions::new(args.node_name.clone());
        options.probe_source = args.probe_source;
        options.node_netns = args.node_netns.clone();
        // --proxy ztunnel: Istio's own in-pod rules, as istio-cni installs
        // them, so a stock ztunnel finds what it expects.
        if args.proxy == ProxyKind::Ztunnel {
            options.rules = crate::redirect::iptables::InpodRules::Istio;
        }
        let iptables = crate::redirect::iptables::IptablesRedirector::new(options)?;
        info!(mode = "iptables", requested = %args.redirect, backend = %iptables.backend(), "redirection ready: netfilter rules in each pod's netns");
        Ok(Box::new(iptables))
    };
    Ok(match args.redirect {
        RedirectMode::Iptables => iptables()?,
        RedirectMode::Auto | RedirectMode::Ebpf => {
            let options = EbpfOptions {
                pin_dir: args.bpf_pin_dir.clone(),
                cgroup_root: args.cgroup_root.clone(),
                probe_source: args.probe_source,
                splice: args.splice,
                splice_backlog: args.splice_backlog,
                preserve_source: args.preserve_source == OnOff::On,
                fast_path: fast_path_wanted(args),
                node_netns: args.node_netns.clone(),
            };
            match EbpfRedirector::load(&options) {
                Ok(mut ebpf) => {
                    info!(mode = "ebpf", requested = %args.redirect, pin_dir = %args.bpf_pin_dir.display(), cgroup_root = %ebpf.cgroup_root().display(), "redirection ready: every eBPF hook it needs is available");
                    forward_kernel_logs(&mut ebpf);
                    Box::new(ebpf)
                }
                // Only a kernel that lacks a hook falls back; any other
                // failure (bpffs, pins, cgroup) is reported, not papered over.
                Err(LoadError::Features(missing)) if args.redirect == RedirectMode::Auto => {
                    warn!(reason = %missing, "eBPF redirection is not possible on this kernel; --redirect auto falls back to iptables");
                    iptables()?
                }
                Err(e) => return Err(e.into()),
            }
        }
    })
}

pub(super) fn check_cgroup_root(path: Option<&Path>) -> Result<(), AgentError> {
    let Some(path) = path else { return Ok(()) };
    const CGROUP2_SUPER_MAGIC: i64 = 0x63677270;
    let problem = |problem: &str| AgentError::CgroupRoot {
        path: path.to_path_buf(),
        problem: problem.to_string(),
    };
    match nix::sys::statfs::statfs(path) {
        Ok(fs) if fs.filesystem_type().0 == CGROUP2_SUPER_MAGIC => Ok(()),
        Ok(_) => Err(problem("not a directory of a cgroup v2 filesystem")),
        Err(e) => Err(problem(&e.to_string())),
    }
}

/// Forwards aya-log records from the eBPF programs into `tracing` (through
/// the `log` bridge the subscriber installed).
pub(super) fn forward_kernel_logs(redirector: &mut EbpfRedirector) {
    let logger = match aya_log::EbpfLogger::init(redirector.ebpf_mut()) {
        Ok(logger) => logger,
        Err(e) => {
            warn!(error = %e, "kernel-side logs will not be shown");
            return;
        }
    };
    // SAFETY: the logger owns its ring buffer's fd and keeps it open, with
    // the same value, until it is dropped together with the AsyncFd.
    let registered = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(logger, tokio::io::Interest::READABLE)
    };
    let mut logger = match registered {
        Ok(fd) => fd,
        Err(e) => {
            warn!(error = %e, "kernel-side logs will not be shown");
            return;
        }
    };
    tokio::spawn(async move {
        loop {
            let Ok(mut guard) = logger.readable_mut().await else {
                return;
            };
            guard.get_inner_mut().flush();
            guard.clear_ready();
        }
    });
}
