//! The eBPF redirection mode.
//!
//! One [`EbpfRedirector`] per agent owns the pinned maps and the per-pod
//! attachments. Enrolling a pod:
//!
//! 1. reads the pod netns's cookie and gives the pod a counter slot;
//! 2. records `cookie → slot` in `SHUNT_ENROLLED` and zeroes the slot;
//! 3. loads the pod's own instance of the TC programs, with the slot baked in
//!    (see `ebpf/src/tc_pod.rs` for why), sharing the pinned maps;
//! 4. inside the pod's netns, adds a `clsact` qdisc to `eth0` and attaches the
//!    two programs as netlink filters with shunt's own priority and handle.
//!
//! Filters are kernel objects owned by the qdisc, not by this process: an
//! agent that dies leaves them (and the pinned maps they count into) in
//! place, and a restarted agent loads the same pinned maps.

use std::{
    collections::BTreeMap,
    io,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{HashMap as BpfHashMap, MapData, PerCpuArray, PerCpuValues},
    programs::{
        SchedClassifier, TcAttachType,
        tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcError, TcHandle},
    },
    util::nr_cpus,
};
use shunt_common::{MAX_PODS, PodCounters, PodSlot, globals, maps, programs};
use tracing::{debug, info, warn};

use super::{
    EnrolledPod, Hook, POD_INTERFACE, PodTarget, RedirectError, RedirectMode, Redirector,
    Verification,
};
use crate::{netns::NetNs, state::WorkloadKey};

/// The compiled programs, built by `build.rs`.
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/shunt-ebpf"));

/// TC filter priority of shunt's filters on a pod's `eth0`. Fixed, so that an
/// enrolment is recognisable (and replaceable) across agent restarts; low
/// enough to run before filters a CNI adds at the default priority.
pub const TC_PRIORITY: u16 = 49;
/// TC filter handle of shunt's filters (one per direction and priority).
pub const TC_HANDLE: TcHandle = TcHandle::new(0, 1);

/// Errors from loading the programs and maps.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(
        "{dir} is not on a bpf filesystem and mounting one there failed: {source}; mount it with `mount -t bpf bpf /sys/fs/bpf` or pass --bpf-pin-dir under a bpffs mount"
    )]
    BpfFs { dir: PathBuf, source: io::Error },
    #[error("cannot create pin directory {dir}: {source}")]
    PinDir { dir: PathBuf, source: io::Error },
    #[error(transparent)]
    Features(#[from] super::probe::MissingFeatures),
    #[error("loading the eBPF object: {0}")]
    Object(#[from] aya::EbpfError),
    #[error("eBPF program {name}: {source}")]
    Program {
        name: &'static str,
        source: aya::programs::ProgramError,
    },
    #[error("eBPF map {name}: {detail}")]
    Map { name: &'static str, detail: String },
}

/// A pod this redirector enrolled: the open netns keeps the namespace (and so
/// the attachments) reachable for unenrolment.
struct Enrolment {
    netns: NetNs,
    cookie: u64,
    slot: u32,
}

/// The eBPF redirector. See the module docs.
pub struct EbpfRedirector {
    /// Keeps the programs loaded (attachments also hold references).
    ebpf: Ebpf,
    enrolled_map: BpfHashMap<MapData, u64, PodSlot>,
    counters_map: PerCpuArray<MapData, PodCounters>,
    pods: BTreeMap<WorkloadKey, Enrolment>,
    pin_dir: PathBuf,
    /// aya-log level baked into every pod's programs.
    log_level: u8,
}

impl EbpfRedirector {
    /// Probes the kernel, loads the programs and opens (or creates) the maps
    /// pinned under `pin_dir`.
    pub fn load(pin_dir: &Path) -> Result<Self, LoadError> {
        super::probe::Probe::run().require_all()?;
        ensure_bpffs(pin_dir)?;
        std::fs::create_dir_all(pin_dir).map_err(|source| LoadError::PinDir {
            dir: pin_dir.to_path_buf(),
            source,
        })?;
        // This instance holds the maps (and the log ring buffer) for the
        // agent; programs are loaded per pod.
        let log_level = kernel_log_level();
        let mut ebpf = loader(pin_dir, &u32::MAX, &log_level).load(EBPF_OBJECT)?;
        let enrolled_map: BpfHashMap<MapData, u64, PodSlot> = take_map(&mut ebpf, maps::ENROLLED)?;
        let counters_map: PerCpuArray<MapData, PodCounters> =
            take_map(&mut ebpf, maps::POD_COUNTERS)?;
        let stale = enrolled_map.keys().count();
        if stale > 0 {
            // Entries of a previous agent. This agent re-enrols the pods it is
            // told about (reusing their entries) and removes the rest once its
            // source has listed every pod: see `forget_unknown`.
            info!(entries = stale, pin_dir = %pin_dir.display(), "found enrolment entries pinned by a previous agent");
        }
        Ok(Self {
            ebpf,
            enrolled_map,
            counters_map,
            pods: BTreeMap::new(),
            pin_dir: pin_dir.to_path_buf(),
            log_level,
        })
    }

    /// The agent's instance of the object, e.g. to start forwarding aya-log
    /// records (every pod's programs write into its pinned ring buffer).
    pub fn ebpf_mut(&mut self) -> &mut Ebpf {
        &mut self.ebpf
    }

    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    /// Removes enrolment entries that no pod of this agent owns (left by a
    /// previous agent for pods that are gone). Call once the pod source has
    /// been fully listed.
    pub fn forget_unknown(&mut self) -> usize {
        let owned: std::collections::HashSet<u64> = self.pods.values().map(|e| e.cookie).collect();
        let unknown: Vec<u64> = self
            .enrolled_map
            .keys()
            .filter_map(Result::ok)
            .filter(|cookie| !owned.contains(cookie))
            .collect();
        for cookie in &unknown {
            if let Err(error) = self.enrolled_map.remove(cookie) {
                warn!(cookie, %error, "cannot remove a stale enrolment entry");
            }
        }
        unknown.len()
    }

    fn free_slot(&self) -> Option<u32> {
        let mut used: Vec<u32> = self
            .enrolled_map
            .iter()
            .filter_map(Result::ok)
            .map(|(_, pod)| pod.slot)
            .collect();
        used.sort_unstable();
        let mut candidate = 0;
        for slot in used {
            if slot == candidate {
                candidate += 1;
            } else if slot > candidate {
                break;
            }
        }
        (candidate < MAX_PODS).then_some(candidate)
    }

    fn reset_counters(&mut self, pod: &WorkloadKey, slot: u32) -> Result<(), RedirectError> {
        let zeros = nr_cpus()
            .map_err(|(_, e)| kernel(pod, "counting CPUs", e))
            .and_then(|n| {
                PerCpuValues::try_from(vec![PodCounters::default(); n])
                    .map_err(|e| kernel(pod, "sizing counters", e))
            })?;
        self.counters_map
            .set(slot, zeros, 0)
            .map_err(|e| kernel(pod, "resetting the pod's counters", e))
    }

    fn read_counters(&self, slot: u32) -> PodCounters {
        let mut total = PodCounters::default();
        if let Ok(per_cpu) = self.counters_map.get(&slot, 0) {
            for cpu in per_cpu.iter() {
                total.add(cpu);
            }
        }
        total
    }

    /// Loads the pod's instance of the TC programs and attaches both on its
    /// `eth0`, inside its netns. A filter already there under shunt's
    /// priority and handle (left by a previous agent for the same slot) is
    /// kept: it counts into the same pinned maps.
    fn attach_tc(
        &mut self,
        pod: &WorkloadKey,
        netns: &NetNs,
        slot: u32,
    ) -> Result<(), RedirectError> {
        let mut pod_ebpf = loader(&self.pin_dir, &slot, &self.log_level)
            .load(EBPF_OBJECT)
            .map_err(|e| kernel(pod, "loading the pod's TC programs", e))?;
        for (name, _) in tc_programs() {
            let program: &mut SchedClassifier = pod_ebpf
                .program_mut(name)
                .ok_or_else(|| kernel(pod, "finding the TC program", missing(name)))?
                .try_into()
                .map_err(|e| kernel(pod, "finding the TC program", e))?;
            program
                .load()
                .map_err(|e| kernel(pod, "loading the TC program into the kernel", e))?;
        }
        let ebpf = &mut pod_ebpf;
        netns.run(|| -> Result<(), RedirectError> {
            match tc::qdisc_add_clsact(POD_INTERFACE) {
                Ok(()) => {}
                Err(error) if is_exists(&error) => {}
                Err(TcError::IoError(e)) if e.kind() == io::ErrorKind::NotFound => {
                    return Err(RedirectError::NoInterface {
                        pod: pod.clone(),
                        interface: POD_INTERFACE,
                        netns: netns.path().to_path_buf(),
                    });
                }
                Err(error) => return Err(kernel(pod, "adding the clsact qdisc on eth0", error)),
            }
            for (name, attach_type) in tc_programs() {
                let program: &mut SchedClassifier = ebpf
                    .program_mut(name)
                    .ok_or_else(|| kernel(pod, "finding the TC program", missing(name)))?
                    .try_into()
                    .map_err(|e| kernel(pod, "finding the TC program", e))?;
                let options = TcAttachOptions::Netlink(NlOptions {
                    priority: TC_PRIORITY,
                    handle: TC_HANDLE,
                    classid: None,
                });
                match program.attach_with_options(POD_INTERFACE, attach_type, options) {
                    Ok(link_id) => {
                        // The filter must outlive this process (see module
                        // docs): take the link out of aya's bookkeeping and
                        // drop it without detaching.
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
        })?
    }
}

/// A loader for the object with the maps shared through their pins and the
/// pod's slot baked in.
fn loader<'a>(pin_dir: &Path, slot: &'a u32, log_level: &'a u8) -> EbpfLoader<'a> {
    let mut loader = EbpfLoader::new();
    for name in [maps::ENROLLED, maps::POD_COUNTERS, shunt_common::LOG_MAP] {
        loader.map_pin_path(name, pin_dir.join(name));
    }
    loader
        .override_global(globals::POD_SLOT, slot, true)
        .override_global(globals::LOG_LEVEL, log_level, true);
    loader
}

/// The most verbose aya-log level worth emitting from the kernel: what the
/// `shunt_ebpf` tracing target has enabled (aya-log levels: error 1 … trace 5),
/// so that disabled debug lines cost nothing per packet.
fn kernel_log_level() -> u8 {
    use tracing::{Level, enabled};
    if enabled!(target: "shunt_ebpf", Level::TRACE) {
        5
    } else if enabled!(target: "shunt_ebpf", Level::DEBUG) {
        4
    } else if enabled!(target: "shunt_ebpf", Level::INFO) {
        3
    } else if enabled!(target: "shunt_ebpf", Level::WARN) {
        2
    } else {
        1
    }
}

fn tc_programs() -> [(&'static str, TcAttachType); 2] {
    [
        (programs::TC_POD_INGRESS, TcAttachType::Ingress),
        (programs::TC_POD_EGRESS, TcAttachType::Egress),
    ]
}

/// Detaches shunt's TC filters from `eth0` in the calling thread's netns.
/// Filters already gone are not an error.
fn detach_tc(pod: &WorkloadKey) -> Result<(), RedirectError> {
    for (_, attach_type) in tc_programs() {
        let link = match SchedClassifierLink::attached(
            POD_INTERFACE,
            attach_type,
            TC_PRIORITY,
            TC_HANDLE,
            None,
        ) {
            Ok(link) => link,
            // No eth0 any more: nothing can be attached to it.
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => return Ok(()),
            Err(e) => return Err(kernel(pod, "finding eth0", e)),
        };
        match aya::programs::links::Link::detach(link) {
            Ok(()) => {}
            Err(aya::programs::ProgramError::TcError(error)) if is_not_found(&error) => {}
            Err(e) => return Err(kernel(pod, "detaching the TC program", e)),
        }
    }
    Ok(())
}

/// Which of shunt's TC filters are on `eth0` in the calling thread's netns.
fn tc_filters_present() -> io::Result<[bool; 2]> {
    let mut present = [false; 2];
    for (i, (name, attach_type)) in tc_programs().into_iter().enumerate() {
        present[i] = super::tc_dump::has_filter(POD_INTERFACE, attach_type, name)?;
    }
    Ok(present)
}

impl Redirector for EbpfRedirector {
    fn mode(&self) -> RedirectMode {
        RedirectMode::Ebpf
    }

    fn enrol(&mut self, target: &PodTarget) -> Result<(), RedirectError> {
        let pod = &target.key;
        if let Some(existing) = self.pods.get(pod) {
            if existing.netns.path() == target.netns {
                return self.repair(pod);
            }
            // The pod's netns changed (e.g. sandbox recreated): start over.
            self.unenrol(pod)?;
        }
        let netns = NetNs::open(&target.netns)?;
        let cookie = netns.cookie()?;
        if let Some((other, _)) = self.pods.iter().find(|(_, e)| e.cookie == cookie) {
            return Err(RedirectError::NetNsTaken {
                pod: pod.clone(),
                netns: target.netns.clone(),
                other: other.clone(),
            });
        }
        // A previous agent's entry for this netns is adopted with its slot,
        // so counters and filters carry on without a gap.
        let slot = match self.enrolled_map.get(&cookie, 0) {
            Ok(existing) => existing.slot,
            Err(_) => {
                let slot = self.free_slot().ok_or(RedirectError::Full {
                    pod: pod.clone(),
                    max: MAX_PODS,
                })?;
                self.reset_counters(pod, slot)?;
                self.enrolled_map
                    .insert(cookie, PodSlot { slot, flags: 0 }, 0)
                    .map_err(|e| kernel(pod, "recording the enrolment", e))?;
                slot
            }
        };
        if let Err(error) = self.attach_tc(pod, &netns, slot) {
            // Leave nothing half-done behind.
            let _ = netns.run(|| detach_tc(pod));
            let _ = self.enrolled_map.remove(&cookie);
            return Err(error);
        }
        info!(%pod, netns = %target.netns.display(), cookie, slot, "pod enrolled: TC ingress+egress attached on eth0");
        self.pods.insert(
            pod.clone(),
            Enrolment {
                netns,
                cookie,
                slot,
            },
        );
        Ok(())
    }

    fn unenrol(&mut self, pod: &WorkloadKey) -> Result<(), RedirectError> {
        let enrolment = self
            .pods
            .remove(pod)
            .ok_or_else(|| RedirectError::NotEnrolled(pod.clone()))?;
        let detached = enrolment.netns.run(|| detach_tc(pod));
        if let Err(error) = self.enrolled_map.remove(&enrolment.cookie) {
            warn!(%pod, %error, "enrolment entry was already gone");
        }
        detached??;
        info!(%pod, "pod unenrolled: TC programs detached, enrolment entry removed");
        Ok(())
    }

    fn verify(&self, pod: &WorkloadKey) -> Result<Verification, RedirectError> {
        let enrolment = self
            .pods
            .get(pod)
            .ok_or_else(|| RedirectError::NotEnrolled(pod.clone()))?;
        let mut missing = Vec::new();
        match self.enrolled_map.get(&enrolment.cookie, 0) {
            Ok(entry) if entry.slot == enrolment.slot => {}
            _ => missing.push(format!("{} entry", maps::ENROLLED)),
        }
        let present = enrolment
            .netns
            .run(tc_filters_present)?
            .map_err(|e| kernel(pod, "listing TC filters", e))?;
        for ((name, _), present) in tc_programs().into_iter().zip(present) {
            if !present {
                missing.push(format!("TC filter {name} on {POD_INTERFACE}"));
            }
        }
        Ok(if missing.is_empty() {
            Verification::Redirected
        } else {
            Verification::Missing(missing)
        })
    }

    fn list(&self) -> Vec<EnrolledPod> {
        self.pods
            .iter()
            .map(|(key, enrolment)| {
                let present = enrolment
                    .netns
                    .run(tc_filters_present)
                    .ok()
                    .and_then(Result::ok)
                    .unwrap_or([false; 2]);
                let hooks = tc_programs()
                    .into_iter()
                    .zip(present)
                    .map(|((name, attach_type), present)| Hook {
                        name: format!("tc {}", direction(attach_type)),
                        attachment: format!(
                            "{name}: netlink clsact filter on {POD_INTERFACE}, priority {TC_PRIORITY}, handle 0:1"
                        ),
                        present,
                    })
                    .collect();
                EnrolledPod {
                    key: key.clone(),
                    netns: enrolment.netns.path().to_path_buf(),
                    netns_cookie: enrolment.cookie,
                    mode: RedirectMode::Ebpf,
                    hooks,
                    counters: self.read_counters(enrolment.slot),
                }
            })
            .collect()
    }
}

impl EbpfRedirector {
    /// Re-attaches whatever is missing for an enrolled pod.
    fn repair(&mut self, pod: &WorkloadKey) -> Result<(), RedirectError> {
        let Verification::Missing(missing) = self.verify(pod)? else {
            return Ok(());
        };
        warn!(%pod, ?missing, "enrolled pod was not fully redirected; repairing");
        let Some(enrolment) = self.pods.get(pod) else {
            return Err(RedirectError::NotEnrolled(pod.clone()));
        };
        let (cookie, slot) = (enrolment.cookie, enrolment.slot);
        self.enrolled_map
            .insert(cookie, PodSlot { slot, flags: 0 }, 0)
            .map_err(|e| kernel(pod, "recording the enrolment", e))?;
        // Borrow dance: attach_tc needs &mut self and the netns.
        let netns = NetNs::open(enrolment.netns.path())?;
        self.attach_tc(pod, &netns, slot)
    }
}

fn direction(attach_type: TcAttachType) -> &'static str {
    match attach_type {
        TcAttachType::Ingress => "ingress",
        TcAttachType::Egress => "egress",
        TcAttachType::Custom(_) => "custom",
    }
}

fn take_map<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, LoadError>
where
    T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>,
{
    let map = ebpf.take_map(name).ok_or(LoadError::Map {
        name,
        detail: "missing from the object".into(),
    })?;
    T::try_from(map).map_err(|e| LoadError::Map {
        name,
        detail: e.to_string(),
    })
}

/// Makes sure `dir` lies on a bpf filesystem, mounting one at `/sys/fs/bpf`
/// when nothing is mounted there (as Cilium's agent does): pins need bpffs.
fn ensure_bpffs(dir: &Path) -> Result<(), LoadError> {
    const BPF_FS_MAGIC: i64 = 0xcafe4a11;
    let on_bpffs = |p: &Path| {
        nix::sys::statfs::statfs(p)
            .map(|s| s.filesystem_type().0 == BPF_FS_MAGIC)
            .unwrap_or(false)
    };
    let existing = dir
        .ancestors()
        .find(|p| p.exists())
        .unwrap_or(Path::new("/"));
    if on_bpffs(existing) {
        return Ok(());
    }
    let mount_point = Path::new("/sys/fs/bpf");
    if !dir.starts_with(mount_point) || on_bpffs(mount_point) {
        return Err(LoadError::BpfFs {
            dir: dir.to_path_buf(),
            source: io::Error::other("not a bpf filesystem"),
        });
    }
    info!("no bpf filesystem at /sys/fs/bpf; mounting one");
    nix::mount::mount(
        Some("bpf"),
        mount_point,
        Some("bpf"),
        nix::mount::MsFlags::empty(),
        None::<&str>,
    )
    .map_err(|e| LoadError::BpfFs {
        dir: dir.to_path_buf(),
        source: e.into(),
    })
}

fn kernel(
    pod: &WorkloadKey,
    what: &'static str,
    source: impl std::error::Error + Send + Sync + 'static,
) -> RedirectError {
    RedirectError::Kernel {
        pod: pod.clone(),
        what,
        source: Box::new(source),
    }
}

fn missing(name: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        format!("program {name} is not in the object"),
    )
}

fn is_exists(error: &TcError) -> bool {
    matches!(error, TcError::AlreadyAttached) || tc_errno(error) == Some(libc::EEXIST)
}

fn is_not_found(error: &TcError) -> bool {
    matches!(tc_errno(error), Some(libc::ENOENT) | Some(libc::ENODEV))
}

fn tc_errno(error: &TcError) -> Option<i32> {
    match error {
        TcError::IoError(e) => e.raw_os_error(),
        TcError::NetlinkError(e) => e.raw_os_error(),
        _ => None,
    }
}
