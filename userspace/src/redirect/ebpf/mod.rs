//! The eBPF redirection mode.
//!
//! One [`EbpfRedirector`] per agent owns the pinned maps, the socket programs
//! on its cgroup root, and the per-pod TC attachments. Enrolling a pod:
//!
//! 1. reads the pod netns's cookie and gives the pod a slot;
//! 2. writes the pod's capture settings to `SHUNT_POD_CONFIG[slot]`, zeroes
//!    its counters, and records `cookie → slot` in `SHUNT_ENROLLED` — from
//!    then on `connect4/6` capture the pod's outbound connects;
//! 3. loads the pod's own instance of the TC programs with the slot baked in
//!    (`ebpf/src/tc_pod.rs` says why) and attaches them to its `eth0`;
//! 4. with source preservation on (`--preserve-source`), installs the reply
//!    path: the policy route for mark 0x111 ([`route`], shared with the
//!    iptables mode) and `accept_local` on `lo`; the TC egress program turns
//!    the application's replies to the proxy's transparent sockets back in
//!    through `lo` with that mark;
//! 5. records the pod's name and netns path in `SHUNT_POD_RECORDS`, so a
//!    later agent can clean up after a pod it never heard of.
//!
//! Everything the datapath needs is the kernel's: TC filters belong to the
//! qdisc, socket programs to pinned links, state to pinned maps. An agent
//! that dies leaves redirection working; the next one adopts it.

mod cgroup;
mod original_dst;
mod pins;
mod splice;
mod tc;

use std::{
    collections::{BTreeMap, HashSet},
    io,
    net::IpAddr,
    path::{Path, PathBuf},
    sync::Arc,
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap as BpfHashMap, MapData, PerCpuArray, PerCpuValues},
    programs::SchedClassifier,
    util::nr_cpus,
};
pub use cgroup::cgroup2_mount;
pub use original_dst::EbpfOriginalDst;
use shunt_common::{
    Cidr4, DEFAULT_SPLICE_BACKLOG, GlobalConfig, MAX_EXCLUDED_CIDRS, MAX_EXCLUDED_PORTS, MAX_PODS,
    PodAddrs, PodConfig, PodCounters, PodRecord, PodSlot, globals, maps,
};
pub use splice::SpliceMode;
pub use tc::{TC_HANDLE, TC_PRIORITY};
use tracing::{info, warn};

use super::{
    EnrolledPod, Hook, OriginalDst, PodTarget, RedirectError, RedirectMode, Redirector,
    Verification, route,
};
use crate::{netns::NetNs, state::WorkloadKey};

/// The compiled programs, built by `build.rs`.
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/shunt-ebpf"));

/// Errors from loading the programs and maps.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(
        "{dir} is not on a bpf filesystem and mounting one there failed: {source}; mount it with `mount -t bpf bpf /sys/fs/bpf` or pass --bpf-pin-dir under a bpffs mount"
    )]
    BpfFs { dir: PathBuf, source: io::Error },
    #[error("cannot create pin directory {dir}: {source}")]
    PinDir { dir: PathBuf, source: io::Error },
    #[error("cgroup root {path}: {source}")]
    CgroupRoot { path: PathBuf, source: io::Error },
    #[error(
        "no cgroup v2 filesystem is mounted (see /proc/self/mounts); shunt's socket programs attach to a cgroup v2; pass --cgroup-root"
    )]
    NoCgroup2,
    #[error(transparent)]
    Features(#[from] super::probe::MissingFeatures),
    #[error("loading the eBPF object: {}", crate::error::chain(.0))]
    Object(#[from] aya::EbpfError),
    #[error("eBPF program {name}: {}", crate::error::chain(.source))]
    Program {
        name: &'static str,
        source: aya::programs::ProgramError,
    },
    #[error("eBPF link of {name}: {detail}")]
    Link { name: &'static str, detail: String },
    #[error("eBPF map {name}: {detail}")]
    Map { name: &'static str, detail: String },
    #[error(transparent)]
    IncompatiblePin(#[from] Box<pins::IncompatiblePin>),
}

/// Agent-wide settings of the eBPF mode.
#[derive(Clone, Debug)]
pub struct EbpfOptions {
    /// Where maps, links and per-pod records are pinned.
    pub pin_dir: PathBuf,
    /// The cgroup v2 directory the socket programs attach to; `None`: the
    /// cgroup v2 mount root.
    pub cgroup_root: Option<PathBuf>,
    /// Health-probe source address whose inbound traffic is never steered.
    pub probe_source: std::net::Ipv4Addr,
    /// Whether app ⇄ proxy payload is spliced.
    pub splice: SpliceMode,
    /// Most bytes spliced into a socket but not yet read before that
    /// direction falls back to the TCP stack.
    pub splice_backlog: u32,
    /// Whether pods get the reply path of source preservation (the policy
    /// route and [`PodConfig::REPLY_TO_PROXY`]).
    pub preserve_source: bool,
}

impl EbpfOptions {
    pub fn new(pin_dir: impl Into<PathBuf>) -> Self {
        Self {
            pin_dir: pin_dir.into(),
            cgroup_root: None,
            probe_source: shunt_common::DEFAULT_PROBE_SOURCE_V4.into(),
            splice: SpliceMode::default(),
            splice_backlog: DEFAULT_SPLICE_BACKLOG,
            preserve_source: true,
        }
    }
}

/// A pod this redirector enrolled. The open netns keeps the namespace (and
/// so its attachments) reachable for unenrolment.
struct Enrolment {
    netns: NetNs,
    cookie: u64,
    slot: u32,
    config: PodConfig,
    addrs: PodAddrs,
}

/// The eBPF redirector. See the module docs.
pub struct EbpfRedirector {
    /// The agent's instance of the object: holds the socket programs and the
    /// aya-log ring buffer.
    ebpf: Ebpf,
    enrolled_map: BpfHashMap<MapData, u64, PodSlot>,
    counters_map: PerCpuArray<MapData, PodCounters>,
    config_map: Array<MapData, PodConfig>,
    addrs_map: Array<MapData, PodAddrs>,
    records_map: BpfHashMap<MapData, u64, PodRecord>,
    pods: BTreeMap<WorkloadKey, Enrolment>,
    pin_dir: PathBuf,
    cgroup_root: PathBuf,
    original_dst: Arc<EbpfOriginalDst>,
    /// aya-log level baked into every pod's programs.
    log_level: u8,
    /// Which pods' new app ⇄ proxy connections are spliced.
    splice: SpliceMode,
    /// Whether pods get the reply path of source preservation.
    preserve_source: bool,
}

impl EbpfRedirector {
    /// Probes the kernel, opens (or creates) the pinned maps, and attaches the
    /// socket programs to the cgroup root (or adopts a previous agent's).
    pub fn load(options: &EbpfOptions) -> Result<Self, LoadError> {
        super::probe::Probe::run().require_all()?;
        let pin_dir = options.pin_dir.as_path();
        ensure_bpffs(pin_dir)?;
        std::fs::create_dir_all(pin_dir).map_err(|source| LoadError::PinDir {
            dir: pin_dir.to_path_buf(),
            source,
        })?;
        let cgroup_root = match &options.cgroup_root {
            Some(root) => root.clone(),
            None => cgroup2_mount().ok_or(LoadError::NoCgroup2)?,
        };
        let log_level = kernel_log_level();
        pins::check(pin_dir)?;
        let mut ebpf = loader(pin_dir, &u32::MAX, &log_level).load(EBPF_OBJECT)?;
        let enrolled_map: BpfHashMap<MapData, u64, PodSlot> = take_map(&mut ebpf, maps::ENROLLED)?;
        let counters_map: PerCpuArray<MapData, PodCounters> =
            take_map(&mut ebpf, maps::POD_COUNTERS)?;
        let config_map: Array<MapData, PodConfig> = take_map(&mut ebpf, maps::POD_CONFIG)?;
        let addrs_map: Array<MapData, PodAddrs> = take_map(&mut ebpf, maps::POD_ADDRS)?;
        let records_map: BpfHashMap<MapData, u64, PodRecord> =
            take_map(&mut ebpf, maps::POD_RECORDS)?;
        cgroup::attach_or_adopt(&mut ebpf, &cgroup_root, pin_dir)?;
        let splice = options.splice;
        if splice != SpliceMode::Off {
            splice::attach_or_adopt(&mut ebpf, pin_dir)?;
        }
        let mut global: Array<MapData, GlobalConfig> = take_map(&mut ebpf, maps::CONFIG)?;
        global
            .set(
                0,
                GlobalConfig {
                    probe_source_v4: u32::from_ne_bytes(options.probe_source.octets()),
                    flags: if splice == SpliceMode::Off {
                        0
                    } else {
                        GlobalConfig::SPLICE
                    },
                    splice_backlog: options.splice_backlog,
                    reserved: 0,
                },
                0,
            )
            .map_err(|e| LoadError::Map {
                name: maps::CONFIG,
                detail: e.to_string(),
            })?;
        info!(
            %splice,
            backlog_bytes = options.splice_backlog,
            "app ⇄ proxy splice"
        );
        let original_dst = Arc::new(EbpfOriginalDst::open(pin_dir)?);
        let stale = enrolled_map.keys().count();
        if stale > 0 {
            // A previous agent's pods: this agent re-enrols those it is told
            // about (reusing their slots) and removes the rest once its
            // source has listed every pod (`remove_stale`).
            info!(entries = stale, pin_dir = %pin_dir.display(), "found enrolled pods pinned by a previous agent");
        }
        Ok(Self {
            ebpf,
            enrolled_map,
            counters_map,
            config_map,
            addrs_map,
            records_map,
            pods: BTreeMap::new(),
            pin_dir: pin_dir.to_path_buf(),
            cgroup_root,
            original_dst,
            log_level,
            splice,
            preserve_source: options.preserve_source,
        })
    }

    /// Whether new app ⇄ proxy connections of some pods are spliced.
    pub fn splice(&self) -> bool {
        self.splice != SpliceMode::Off
    }

    /// The agent's instance of the object, e.g. to forward aya-log records
    /// (every pod's programs write into its pinned ring buffer).
    pub fn ebpf_mut(&mut self) -> &mut Ebpf {
        &mut self.ebpf
    }

    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    pub fn cgroup_root(&self) -> &Path {
        &self.cgroup_root
    }

    /// The lowest slot no enrolment entry uses.
    fn free_slot(&self) -> Option<u32> {
        let used: HashSet<u32> = self
            .enrolled_map
            .iter()
            .filter_map(Result::ok)
            .map(|(_, pod)| pod.slot)
            .collect();
        (0..MAX_PODS).find(|slot| !used.contains(slot))
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

    /// Loads the pod's instance of the TC programs and attaches it inside
    /// the pod's netns.
    /// One enrolled pod's hooks (its TC filters read in its netns; the
    /// socket programs' and splice's presence passed in, read once per
    /// listing) and counters (from the pinned map).
    fn enrolled_pod(
        &self,
        key: &WorkloadKey,
        enrolment: &Enrolment,
        sockets: [bool; cgroup::PROGRAMS.len()],
        splice_present: bool,
    ) -> EnrolledPod {
        let present = enrolment
            .netns
            .run(tc::present)
            .ok()
            .and_then(Result::ok)
            .unwrap_or([false; 2]);
        let mut hooks: Vec<Hook> = tc::programs()
            .into_iter()
            .zip(present)
            .map(|((name, attach_type), present)| Hook {
                name: format!("tc {}", tc::direction(attach_type)),
                attachment: format!(
                    "{name}: netlink clsact filter on eth0, priority {TC_PRIORITY}, handle 0:1"
                ),
                present,
            })
            .collect();
        if enrolment.config.flags & PodConfig::REDIRECT_OUTBOUND != 0 {
            hooks.extend(
                cgroup::PROGRAMS
                    .into_iter()
                    .zip(sockets)
                    .map(|(name, present)| Hook {
                        name: name.trim_start_matches("shunt_").to_string(),
                        attachment: format!(
                            "{name}: BPF link on cgroup {}",
                            self.cgroup_root.display()
                        ),
                        present,
                    }),
            );
        }
        // Only pods whose connections are spliced (see `--splice`
        // and the pod's `shunt.io/splice`) show the hook.
        if self.splice() && enrolment.config.flags & PodConfig::NO_SPLICE == 0 {
            hooks.push(Hook {
                name: "splice".to_string(),
                attachment: format!(
                    "{}: sk_msg on map {}; {}: raw tracepoint {}",
                    shunt_common::programs::SPLICE_MSG,
                    maps::SPLICE_SOCKS,
                    shunt_common::programs::SPLICE_RECV,
                    shunt_common::programs::SPLICE_RECV_TARGET
                ),
                present: splice_present,
            });
        }
        EnrolledPod {
            key: key.clone(),
            netns: enrolment.netns.path().to_path_buf(),
            netns_cookie: enrolment.cookie,
            mode: RedirectMode::Ebpf,
            hooks,
            counters: self.read_counters(enrolment.slot),
        }
    }

    fn attach_tc(
        &mut self,
        pod: &WorkloadKey,
        netns: &NetNs,
        slot: u32,
    ) -> Result<(), RedirectError> {
        let mut pod_ebpf = loader(&self.pin_dir, &slot, &self.log_level)
            .load(EBPF_OBJECT)
            .map_err(|e| kernel(pod, "loading the pod's TC programs", e))?;
        for (name, _) in tc::programs() {
            let program: &mut SchedClassifier = pod_ebpf
                .program_mut(name)
                .ok_or_else(|| kernel(pod, "finding the TC program", missing(name)))?
                .try_into()
                .map_err(|e| kernel(pod, "finding the TC program", e))?;
            program
                .load()
                .map_err(|e| kernel(pod, "loading the TC program into the kernel", e))?;
        }
        let netns_path = netns.path().to_path_buf();
        netns.run(|| tc::attach(pod, &mut pod_ebpf, &netns_path))?
    }

    /// Writes the record that lets a later agent clean up after this pod.
    fn write_record(&mut self, pod: &WorkloadKey, cookie: u64, netns: &Path) {
        let mut record = PodRecord::default();
        copy_cut(&mut record.pod, pod.to_string().as_bytes());
        copy_cut(&mut record.netns, netns.as_os_str().as_encoded_bytes());
        if let Err(e) = self.records_map.insert(cookie, record, 0) {
            warn!(%pod, error = %e, "cannot record the pod; a later agent could not clean up after it");
        }
    }

    /// The pod name and netns path recorded for `cookie`.
    fn read_record(&self, cookie: u64) -> Option<(String, PathBuf)> {
        let record = self.records_map.get(&cookie, 0).ok()?;
        let text = |bytes: &[u8]| {
            let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
            String::from_utf8_lossy(&bytes[..end]).into_owned()
        };
        Some((text(&record.pod), PathBuf::from(text(&record.netns))))
    }

    /// Re-attaches whatever is missing for an enrolled pod.
    fn repair(&mut self, pod: &WorkloadKey) -> Result<(), RedirectError> {
        let Verification::Missing(missing) = self.verify(pod)? else {
            return Ok(());
        };
        warn!(%pod, ?missing, "enrolled pod was not fully redirected; repairing");
        let Some(enrolment) = self.pods.get(pod) else {
            return Err(RedirectError::NotEnrolled(pod.clone()));
        };
        let (cookie, slot, config, addrs) = (
            enrolment.cookie,
            enrolment.slot,
            enrolment.config,
            enrolment.addrs,
        );
        let netns = NetNs::open(enrolment.netns.path())?;
        self.write_settings(pod, slot, config, addrs)?;
        self.enrolled_map
            .insert(cookie, PodSlot { slot, flags: 0 }, 0)
            .map_err(|e| kernel(pod, "recording the enrolment", e))?;
        self.attach_tc(pod, &netns, slot)?;
        reply_path(pod, &netns, config)
    }

    /// Writes a pod's settings and addresses into its slot.
    fn write_settings(
        &mut self,
        pod: &WorkloadKey,
        slot: u32,
        config: PodConfig,
        addrs: PodAddrs,
    ) -> Result<(), RedirectError> {
        self.config_map
            .set(slot, config, 0)
            .map_err(|e| kernel(pod, "writing the pod's settings", e))?;
        self.addrs_map
            .set(slot, addrs, 0)
            .map_err(|e| kernel(pod, "writing the pod's addresses", e))
    }

    /// Takes a pod out of the maps (and its record off disk).
    fn forget(&mut self, cookie: u64, slot: u32) {
        let _ = self.enrolled_map.remove(&cookie);
        let _ = self.config_map.set(slot, PodConfig::default(), 0);
        let _ = self.addrs_map.set(slot, PodAddrs::default(), 0);
        let _ = self.records_map.remove(&cookie);
    }
}

impl Redirector for EbpfRedirector {
    fn mode(&self) -> RedirectMode {
        RedirectMode::Ebpf
    }

    fn enrol(&mut self, target: &PodTarget) -> Result<(), RedirectError> {
        let pod = &target.key;
        let config = pod_config(target, self.splice, self.preserve_source)?;
        let addrs = pod_addrs(&target.ips);
        if let Some(existing) = self.pods.get_mut(pod) {
            if existing.netns.path() == target.netns {
                if (existing.config, existing.addrs) != (config, addrs) {
                    existing.config = config;
                    existing.addrs = addrs;
                    let slot = existing.slot;
                    self.write_settings(pod, slot, config, addrs)?;
                    info!(%pod, ?target.capture, ips = ?target.ips, "capture settings changed");
                }
                return self.repair(pod);
            }
            // The pod's netns changed (its sandbox was recreated): start over.
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
        // A previous agent's entry for this netns is adopted with its slot:
        // counters and filters carry on without a gap.
        let slot = match self.enrolled_map.get(&cookie, 0) {
            Ok(existing) => existing.slot,
            Err(_) => {
                let slot = self.free_slot().ok_or(RedirectError::Full {
                    pod: pod.clone(),
                    max: MAX_PODS,
                })?;
                self.reset_counters(pod, slot)?;
                slot
            }
        };
        self.write_settings(pod, slot, config, addrs)?;
        self.enrolled_map
            .insert(cookie, PodSlot { slot, flags: 0 }, 0)
            .map_err(|e| kernel(pod, "recording the enrolment", e))?;
        let attached = self
            .attach_tc(pod, &netns, slot)
            .and_then(|()| reply_path(pod, &netns, config));
        if let Err(error) = attached {
            // Leave nothing half-done behind.
            let _ = netns.run(|| tc::detach(pod));
            let _ = netns.run(remove_reply_path);
            self.forget(cookie, slot);
            return Err(error);
        }
        self.write_record(pod, cookie, &target.netns);
        let spliced = config.flags & PodConfig::NO_SPLICE == 0 && self.splice();
        info!(%pod, netns = %target.netns.display(), cookie, slot, outbound = target.capture.outbound, inbound = target.capture.inbound, spliced, "pod enrolled: TC ingress+egress on eth0, socket programs gated on its netns");
        self.pods.insert(
            pod.clone(),
            Enrolment {
                netns,
                cookie,
                slot,
                config,
                addrs,
            },
        );
        Ok(())
    }

    fn unenrol(&mut self, pod: &WorkloadKey) -> Result<(), RedirectError> {
        let enrolment = self
            .pods
            .remove(pod)
            .ok_or_else(|| RedirectError::NotEnrolled(pod.clone()))?;
        // Outbound capture stops first (the entry gates it), then inbound.
        self.forget(enrolment.cookie, enrolment.slot);
        enrolment.netns.run(|| tc::detach(pod))??;
        if enrolment.config.flags & PodConfig::REPLY_TO_PROXY != 0 {
            enrolment
                .netns
                .run(remove_reply_path)?
                .map_err(|e| kernel(pod, "deleting the policy route", e))?;
        }
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
        if self.config_map.get(&enrolment.slot, 0).ok() != Some(enrolment.config) {
            missing.push(format!("{} settings", maps::POD_CONFIG));
        }
        if self.addrs_map.get(&enrolment.slot, 0).ok() != Some(enrolment.addrs) {
            missing.push(format!("{} addresses", maps::POD_ADDRS));
        }
        let present = enrolment
            .netns
            .run(tc::present)?
            .map_err(|e| kernel(pod, "listing TC filters", e))?;
        for ((name, _), present) in tc::programs().into_iter().zip(present) {
            if !present {
                missing.push(format!("TC filter {name} on eth0"));
            }
        }
        if enrolment.config.flags & PodConfig::REPLY_TO_PROXY != 0 {
            let routes = enrolment
                .netns
                .run(|| {
                    route::families()
                        .into_iter()
                        .map(|family| route::present(family).map(|p| (family, p)))
                        .collect::<std::io::Result<Vec<_>>>()
                })?
                .map_err(|e| kernel(pod, "reading the policy route", e))?;
            for (family, present) in routes {
                if !(present.rule && present.route) {
                    missing.push(format!(
                        "{} policy route ({})",
                        family.label(),
                        route::describe(family)
                    ));
                }
            }
        }
        for (name, present) in cgroup::PROGRAMS
            .into_iter()
            .zip(cgroup::present(&self.pin_dir))
        {
            if !present {
                missing.push(format!("socket program {name}"));
            }
        }
        Ok(if missing.is_empty() {
            Verification::Redirected
        } else {
            Verification::Missing(missing)
        })
    }

    fn list(&self) -> Vec<EnrolledPod> {
        let sockets = cgroup::present(&self.pin_dir);
        let splice_present = self.splice() && splice::present(&self.pin_dir);
        self.pods
            .iter()
            .map(|(key, enrolment)| self.enrolled_pod(key, enrolment, sockets, splice_present))
            .collect()
    }

    fn inspect(&self, pod: &WorkloadKey) -> Option<EnrolledPod> {
        let (key, enrolment) = self.pods.get_key_value(pod)?;
        let sockets = cgroup::present(&self.pin_dir);
        let splice_present = self.splice() && splice::present(&self.pin_dir);
        Some(self.enrolled_pod(key, enrolment, sockets, splice_present))
    }

    fn is_enrolled(&self, pod: &WorkloadKey) -> bool {
        self.pods.contains_key(pod)
    }

    fn remove_stale(&mut self) -> usize {
        let owned: HashSet<u64> = self.pods.values().map(|e| e.cookie).collect();
        let stale: Vec<(u64, u32)> = self
            .enrolled_map
            .iter()
            .filter_map(Result::ok)
            .filter(|(cookie, _)| !owned.contains(cookie))
            .map(|(cookie, pod)| (cookie, pod.slot))
            .collect();
        for &(cookie, slot) in &stale {
            let (name, netns_path) = match self.read_record(cookie) {
                Some((name, path)) => (name, Some(path)),
                None => ("unknown pod".to_string(), None),
            };
            // The pod's netns may still exist (the pod left the mesh while no
            // agent ran): then its filters must go too. Same cookie, or it is
            // a different namespace now at that path.
            if let Some(path) = netns_path
                && let Ok(netns) = NetNs::open(&path)
                && netns.cookie().ok() == Some(cookie)
            {
                let key = WorkloadKey::new("stale", name.clone());
                if let Err(e) = netns
                    .run(|| tc::detach(&key))
                    .map_err(RedirectError::from)
                    .and_then(|r| r)
                {
                    warn!(pod = %name, error = %e, "cannot detach a stale pod's TC programs");
                }
                // Whether the previous agent preserved sources is unknown:
                // deleting an absent route is no error.
                match netns.run(remove_reply_path) {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        warn!(pod = %name, error = %e, "cannot delete a stale pod's policy route")
                    }
                    Err(e) => {
                        warn!(pod = %name, error = %e, "cannot delete a stale pod's policy route")
                    }
                }
            }
            self.forget(cookie, slot);
            info!(pod = %name, cookie, "removed what a previous agent left for a pod that is no longer enrolled");
        }
        stale.len()
    }

    fn original_dst_resolver(&self) -> Arc<dyn OriginalDst> {
        self.original_dst.clone()
    }
}

/// Installs the reply path of source preservation in the pod's netns when
/// its settings ask for it: the policy route that delivers packets marked
/// 0x111 locally (shared with the iptables mode, see [`route`]) and
/// `accept_local` on `lo` ([`route::accept_local_on_lo`]). The TC egress
/// program marks the replies. Idempotent.
fn reply_path(pod: &WorkloadKey, netns: &NetNs, config: PodConfig) -> Result<(), RedirectError> {
    if config.flags & PodConfig::REPLY_TO_PROXY == 0 {
        return Ok(());
    }
    netns
        .run(|| -> std::io::Result<()> {
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
/// `accept_local` on `lo` stays: harmless, and its earlier value is unknown
/// to a later agent.
fn remove_reply_path() -> std::io::Result<()> {
    route::delete(route::Family::V4)?;
    if route::ipv6_on_lo() {
        route::delete(route::Family::V6)?;
    }
    Ok(())
}

/// The kernel form of a pod's capture settings.
fn pod_config(
    target: &PodTarget,
    splice: SpliceMode,
    preserve_source: bool,
) -> Result<PodConfig, RedirectError> {
    let (pod, capture) = (&target.key, &target.capture);
    let invalid = |problem: String| RedirectError::InvalidCapture {
        pod: pod.clone(),
        problem,
    };
    let mut config = PodConfig::default();
    if capture.outbound {
        config.flags |= PodConfig::REDIRECT_OUTBOUND;
    }
    if capture.inbound {
        config.flags |= PodConfig::REDIRECT_INBOUND;
    }
    if preserve_source {
        config.flags |= PodConfig::REPLY_TO_PROXY;
    }
    if !splice.splices(capture.splice) {
        config.flags |= PodConfig::NO_SPLICE;
    }
    let ports = |ports: &[u16], into: &mut [u16; MAX_EXCLUDED_PORTS], what: &str| {
        if ports.len() > MAX_EXCLUDED_PORTS {
            return Err(invalid(format!(
                "{} excluded {what} ports given, at most {MAX_EXCLUDED_PORTS} are supported",
                ports.len()
            )));
        }
        into[..ports.len()].copy_from_slice(ports);
        Ok(())
    };
    ports(
        &capture.excluded_outbound_ports,
        &mut config.excluded_outbound_ports,
        "outbound",
    )?;
    ports(
        &capture.excluded_inbound_ports,
        &mut config.excluded_inbound_ports,
        "inbound",
    )?;
    if capture.excluded_outbound_cidrs.len() > MAX_EXCLUDED_CIDRS {
        return Err(invalid(format!(
            "{} excluded outbound CIDRs given, at most {MAX_EXCLUDED_CIDRS} are supported",
            capture.excluded_outbound_cidrs.len()
        )));
    }
    for (i, (addr, prefix)) in capture.excluded_outbound_cidrs.iter().enumerate() {
        if *prefix > 32 {
            return Err(invalid(format!(
                "excluded CIDR {addr}/{prefix}: prefix longer than 32"
            )));
        }
        let mask = if *prefix == 0 {
            0
        } else {
            u32::MAX << (32 - prefix)
        };
        config.excluded_cidrs_v4[i] = Cidr4 {
            addr: u32::from_ne_bytes(addr.octets()),
            mask: u32::from_ne_bytes(mask.to_be_bytes()),
        };
    }
    config.excluded_cidr_count = capture.excluded_outbound_cidrs.len() as u32;
    Ok(config)
}

/// The kernel form of a pod's own addresses: its first IPv4 and first IPv6
/// one, in network order.
fn pod_addrs(ips: &[IpAddr]) -> PodAddrs {
    let mut addrs = PodAddrs::default();
    for ip in ips {
        match ip {
            IpAddr::V4(v4) if addrs.ipv4 == 0 => addrs.ipv4 = u32::from_ne_bytes(v4.octets()),
            IpAddr::V6(v6) if addrs.ipv6 == [0; 4] => {
                for (word, chunk) in addrs.ipv6.iter_mut().zip(v6.octets().chunks_exact(4)) {
                    *word = u32::from_ne_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
                }
            }
            _ => {}
        }
    }
    addrs
}

/// Copies as much of `from` as fits, leaving the rest NUL.
fn copy_cut(into: &mut [u8], from: &[u8]) {
    let n = from.len().min(into.len());
    into[..n].copy_from_slice(&from[..n]);
}

/// A loader for the object with every map shared through its pin and the
/// pod's slot baked in.
fn loader<'a>(pin_dir: &Path, slot: &'a u32, log_level: &'a u8) -> EbpfLoader<'a> {
    let mut loader = EbpfLoader::new();
    for name in maps::ALL.into_iter().chain([shunt_common::LOG_MAP]) {
        loader.map_pin_path(name, pin_dir.join(name));
    }
    // aya-log level 4 is debug: only then are connection starts logged.
    let log_connections: &'static u8 = if *log_level >= 4 { &1 } else { &0 };
    loader
        .override_global(globals::POD_SLOT, slot, true)
        .override_global(globals::LOG_LEVEL, log_level, true)
        .override_global(globals::LOG_CONNECTIONS, log_connections, true);
    loader
}

/// The most verbose aya-log level worth emitting from the kernel: what the
/// `shunt_ebpf` tracing target has enabled (aya-log levels: error 1 … trace
/// 5), so that disabled debug lines cost nothing per packet.
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

pub(crate) fn kernel(
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
