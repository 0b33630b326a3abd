//! TC attachments on a pod's `eth0`. All functions act in the calling
//! thread's network namespace: call them from inside the pod's
//! (`NetNs::run`).

use std::io;

use aya::{
    Ebpf,
    programs::{
        SchedClassifier, TcAttachType,
        links::Link as _,
        tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcError, TcHandle},
    },
};
use shunt_common::programs;
use tracing::debug;

use super::{
    LoadError, kernel,
    upgrade::{Decision, Upgrade},
};
use crate::{
    redirect::{POD_INTERFACE, RedirectError, tc_dump},
    state::WorkloadKey,
};

/// TC filter priority of shunt's filters on a pod's `eth0`. Fixed, so that an
/// enrolment is recognisable (and removable) across agent restarts; low
/// enough to run before filters a CNI adds at the default priority.
pub const TC_PRIORITY: u16 = 49;
/// TC filter handle of shunt's filters (one per direction and priority).
pub const TC_HANDLE: TcHandle = TcHandle::new(0, 1);

/// The two programs and where each goes.
pub fn programs() -> [(&'static str, TcAttachType); 2] {
    [
        (programs::TC_POD_INGRESS, TcAttachType::Ingress),
        (programs::TC_POD_EGRESS, TcAttachType::Egress),
    ]
}

pub fn direction(attach_type: TcAttachType) -> &'static str {
    match attach_type {
        TcAttachType::Ingress => "ingress",
        TcAttachType::Egress => "egress",
        TcAttachType::Custom(_) => "custom",
    }
}

/// Loads (verifies) the TC programs into the kernel, once per agent: every
/// pod's filters run this one instance.
pub fn load(ebpf: &mut Ebpf) -> Result<(), LoadError> {
    for (name, _) in programs() {
        let program_error = |source| LoadError::Program { name, source };
        let program: &mut SchedClassifier = ebpf
            .program_mut(name)
            .ok_or(LoadError::Program {
                name,
                source: aya::programs::ProgramError::UnexpectedProgramType,
            })?
            .try_into()
            .map_err(program_error)?;
        program.load().map_err(program_error)?;
    }
    Ok(())
}

/// The classid that tells the shared programs which pod a filter serves:
/// the slot + 1 in the minor (`cls_bpf` hands the programs only the minor;
/// 0 means "no classid").
pub fn classid(slot: u32) -> TcHandle {
    const _: () = assert!(shunt_common::MAX_PODS < u16::MAX as u32);
    // Slots are below MAX_PODS (4096): slot + 1 fits in 16 bits.
    TcHandle::new(0, (slot + 1) as u16)
}

/// Adds `clsact` to `eth0` and attaches the agent's (loaded) TC programs as
/// netlink filters whose classid names `slot`. A filter already there under
/// shunt's priority and handle (a previous agent's, for the same slot) is
/// kept.
pub fn attach(
    pod: &WorkloadKey,
    ebpf: &mut Ebpf,
    slot: u32,
    netns_path: &std::path::Path,
) -> Result<(), RedirectError> {
    match tc::qdisc_add_clsact(POD_INTERFACE) {
        Ok(()) => {}
        Err(error) if is_exists(&error) => {}
        Err(TcError::IoError(e)) if e.kind() == io::ErrorKind::NotFound => {
            return Err(RedirectError::NoInterface {
                pod: pod.clone(),
                interface: POD_INTERFACE,
                netns: netns_path.to_path_buf(),
            });
        }
        Err(error) => return Err(kernel(pod, "adding the clsact qdisc on eth0", error)),
    }
    for (name, attach_type) in programs() {
        let program: &mut SchedClassifier = ebpf
            .program_mut(name)
            .ok_or_else(|| kernel(pod, "finding the TC program", super::missing(name)))?
            .try_into()
            .map_err(|e| kernel(pod, "finding the TC program", e))?;
        let options = TcAttachOptions::Netlink(NlOptions {
            priority: TC_PRIORITY,
            handle: TC_HANDLE,
            classid: Some(classid(slot)),
        });
        match program.attach_with_options(POD_INTERFACE, attach_type, options) {
            Ok(link_id) => {
                // The filter must outlive this process (it is the kernel's,
                // held by the qdisc): take the link out of aya's bookkeeping
                // and forget it, since dropping it would detach.
                let link = program
                    .take_link(link_id)
                    .map_err(|e| kernel(pod, "taking the TC link", e))?;
                std::mem::forget(link);
            }
            Err(aya::programs::ProgramError::TcError(error)) if is_exists(&error) => {
                debug!(%pod, program = name, "TC filter already in place; adopting it");
            }
            Err(e) => return Err(kernel(pod, "attaching the TC program", e)),
        }
    }
    Ok(())
}

/// The filters a previous agent left on this netns's `eth0` for `slot`
/// (found by shunt's priority and handle): each is kept when it runs this
/// release's program, else replaced in place — a filter change at the same
/// priority and handle, carrying this release's program and the slot's
/// classid, which `cls_bpf` swaps atomically (no packet sees no filter, or
/// both). Filters that are missing are left to enrolment (`attach`).
pub fn upgrade(ebpf: &mut Ebpf, slot: u32, pod: &str, upgrade: &mut Upgrade) -> Result<(), String> {
    for (name, attach_type) in programs() {
        let filters = match tc_dump::bpf_filters(POD_INTERFACE, attach_type) {
            Ok(filters) => filters,
            // No eth0 (the pod is going away): nothing to upgrade.
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => return Ok(()),
            Err(e) => return Err(format!("listing the TC filters on eth0: {e}")),
        };
        let Some(old_id) = filters
            .iter()
            .find(|f| f.priority == TC_PRIORITY && f.handle == u32::from(TC_HANDLE))
            .and_then(|f| f.program_id)
        else {
            continue;
        };
        let program: &mut SchedClassifier = ebpf
            .program_mut(name)
            .ok_or_else(|| format!("program {name} is not in the object"))?
            .try_into()
            .map_err(|e| format!("program {name}: {e}"))?;
        let new_info = program
            .info()
            .map_err(|e| format!("reading program {name}: {e}"))?;
        let decision = upgrade.decide(old_id, &new_info);
        if let Decision::Replace(_) = decision {
            let existing = SchedClassifierLink::attached(
                POD_INTERFACE,
                attach_type,
                TC_PRIORITY,
                TC_HANDLE,
                Some(classid(slot)),
            )
            .map_err(|e| format!("finding eth0: {e}"))?;
            // aya sends the change without NLM_F_EXCL (and without
            // NLM_F_CREATE): the kernel replaces the filter it finds at
            // that priority and handle, and fails if there is none.
            let link_id = program
                .attach_to_link(existing)
                .map_err(|e| format!("replacing the {} filter: {e}", direction(attach_type)))?;
            // As in `attach`: the filter belongs to the qdisc, not to us.
            let link = program
                .take_link(link_id)
                .map_err(|e| format!("taking the TC link: {e}"))?;
            std::mem::forget(link);
        }
        upgrade.record(
            format!("tc {}", direction(attach_type)),
            Some(pod.to_string()),
            name,
            Some(old_id),
            &new_info,
            Some(decision),
        );
    }
    Ok(())
}

/// Detaches shunt's TC filters from `eth0`. Filters (or `eth0`) already gone
/// are not an error.
pub fn detach(pod: &WorkloadKey) -> Result<(), RedirectError> {
    for (_, attach_type) in programs() {
        let link = match SchedClassifierLink::attached(
            POD_INTERFACE,
            attach_type,
            TC_PRIORITY,
            TC_HANDLE,
            None,
        ) {
            Ok(link) => link,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => return Ok(()),
            Err(e) => return Err(kernel(pod, "finding eth0", e)),
        };
        match link.detach() {
            Ok(()) => {}
            Err(aya::programs::ProgramError::TcError(error)) if is_not_found(&error) => {}
            Err(e) => return Err(kernel(pod, "detaching the TC program", e)),
        }
    }
    Ok(())
}

/// Which of shunt's filters are on `eth0`, in [`programs`] order.
pub fn present() -> io::Result<[bool; 2]> {
    let mut present = [false; 2];
    for (i, (name, attach_type)) in programs().into_iter().enumerate() {
        present[i] = tc_dump::bpf_filters(POD_INTERFACE, attach_type)?
            .iter()
            .any(|f| f.program_name.starts_with(name) && f.priority == TC_PRIORITY);
    }
    Ok(present)
}

fn is_exists(error: &TcError) -> bool {
    matches!(error, TcError::AlreadyAttached) || errno(error) == Some(libc::EEXIST)
}

fn is_not_found(error: &TcError) -> bool {
    matches!(errno(error), Some(libc::ENOENT) | Some(libc::ENODEV))
}

fn errno(error: &TcError) -> Option<i32> {
    match error {
        TcError::IoError(e) => e.raw_os_error(),
        TcError::NetlinkError(e) => e.raw_os_error(),
        _ => None,
    }
}
