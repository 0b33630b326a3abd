//! Loading: probing the kernel, opening (or creating) the pinned maps,
//! attaching the socket programs to the cgroup root or adopting a previous
//! agent's (see the module docs of [`super`]).

use super::{upgrade::Upgrade, *};

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
    Features(#[from] crate::redirect::probe::MissingFeatures),
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
    /// Whether enrolled pods' connects to destinations outside the
    /// fast-path table go direct (`--fast-path on`, with the builtin proxy;
    /// each pod's `PodConfig::FAST_PATH`).
    pub fast_path: bool,
    /// The node's network namespace (`--node-netns`): its sockets'
    /// connections to enrolled pods are kubelet's probes and get the probe
    /// source (`ebpf/src/host_probe.rs`). `None`: not rewritten.
    pub node_netns: Option<PathBuf>,
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
            fast_path: false,
            node_netns: None,
        }
    }
}

impl EbpfRedirector {
    /// Probes the kernel, opens (or creates) the pinned maps, and attaches the
    /// socket programs to the cgroup root (or adopts a previous agent's).
    pub fn load(options: &EbpfOptions) -> Result<Self, LoadError> {
        crate::redirect::probe::Probe::run().require_all()?;
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
        // Maps first: every pinned map is reused as it is or migrated to
        // this release's definition (`pins.rs`), before any program of this
        // release references it.
        let object = upgrade::object();
        let (reused, migrations) = pins::prepare(pin_dir, object)?;
        let mut ebpf = loader(pin_dir, &log_level).load(object)?;
        let mut map_changes = reused;
        for migration in migrations {
            map_changes.push(migration.complete()?);
        }
        // Then the programs: each attachment a previous agent left is kept
        // or switched to this release's program (`upgrade.rs`).
        let mut upgrade = Upgrade::new(pin_dir, map_changes);
        // One verified instance of the TC programs serves every pod (each
        // pod's filter names its slot in its classid: `tc.rs`).
        tc::load(&mut ebpf)?;
        let enrolled_map: BpfHashMap<MapData, u64, PodSlot> = take_map(&mut ebpf, maps::ENROLLED)?;
        let counters_map: PerCpuArray<MapData, PodCounters> =
            take_map(&mut ebpf, maps::POD_COUNTERS)?;
        let config_map: Array<MapData, PodConfig> = take_map(&mut ebpf, maps::POD_CONFIG)?;
        let addrs_map: Array<MapData, PodAddrs> = take_map(&mut ebpf, maps::POD_ADDRS)?;
        let records_map: BpfHashMap<MapData, u64, PodRecord> =
            take_map(&mut ebpf, maps::POD_RECORDS)?;
        let policy = policy::PolicyMaps::open(&mut ebpf)?;
        let mesh_local = mesh_local::MeshLocalMaps::open(&mut ebpf, options.fast_path)?;
        let host_probes =
            super::host_probe::HostProbeMaps::open(&mut ebpf, options.node_netns.as_deref())?;
        cgroup::attach_or_adopt(&mut ebpf, &cgroup_root, pin_dir, &mut upgrade)?;
        let splice = options.splice;
        if splice != SpliceMode::Off {
            splice::attach_or_adopt(&mut ebpf, pin_dir, &mut upgrade)?;
        }
        upgrade_pods(&mut ebpf, &enrolled_map, &records_map, &mut upgrade);
        upgrade.publish();
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
            slots: slots::SlotTable::from_map(&enrolled_map),
            enrolled_map,
            counters_map,
            config_map,
            addrs_map,
            records_map,
            policy,
            mesh_local,
            pods: BTreeMap::new(),
            pin_dir: pin_dir.to_path_buf(),
            cgroup_root,
            original_dst,
            splice,
            preserve_source: options.preserve_source,
            fwmark_before_serving: Default::default(),
            fast_path: options.fast_path,
            host_probes,
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
}

/// The TC filters of every pod a previous agent enrolled (from the pinned
/// enrolments and records alone, before any source lists a pod): kept or
/// replaced by this release's programs (`tc::upgrade`). A pod whose netns
/// is gone is left to `remove_stale`; one that fails keeps its filters as
/// they are (logged), and enrolment adopts them.
fn upgrade_pods(
    ebpf: &mut Ebpf,
    enrolled: &BpfHashMap<MapData, u64, PodSlot>,
    records: &BpfHashMap<MapData, u64, PodRecord>,
    upgrade: &mut Upgrade,
) {
    let pods: Vec<(u64, u32)> = enrolled
        .iter()
        .filter_map(Result::ok)
        .map(|(cookie, pod)| (cookie, pod.slot))
        .collect();
    let text = |bytes: &[u8]| {
        let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
        String::from_utf8_lossy(&bytes[..end]).into_owned()
    };
    for (cookie, slot) in pods {
        let Ok(record) = records.get(&cookie, 0) else {
            warn!(
                cookie,
                slot, "enrolled pod without a record: its TC filters are not upgraded"
            );
            continue;
        };
        let (pod, path) = (text(&record.pod), PathBuf::from(text(&record.netns)));
        let netns = match NetNs::open(&path) {
            Ok(netns) if netns.cookie().ok() == Some(cookie) => netns,
            _ => continue,
        };
        match netns.run(|| tc::upgrade(ebpf, slot, &pod, upgrade)) {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                warn!(%pod, %error, "cannot upgrade the pod's TC filters; they keep their program")
            }
            Err(error) => {
                warn!(%pod, %error, "cannot upgrade the pod's TC filters; they keep their program")
            }
        }
    }
}

/// A loader for the object with every map shared through its pin.
pub(super) fn loader<'a>(pin_dir: &Path, log_level: &'a u8) -> EbpfLoader<'a> {
    let mut loader = EbpfLoader::new();
    for name in maps::ALL.into_iter().chain([shunt_common::LOG_MAP]) {
        loader.map_pin_path(name, pin_dir.join(name));
    }
    // aya-log level 4 is debug: only then are connection starts logged.
    let log_connections: &'static u8 = if *log_level >= 4 { &1 } else { &0 };
    loader
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

pub(super) fn take_map<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T, LoadError>
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
    let not_bpffs = || LoadError::BpfFs {
        dir: dir.to_path_buf(),
        source: io::Error::other("not a bpf filesystem"),
    };
    if !dir.starts_with(mount_point) {
        return Err(not_bpffs());
    }
    // Two agents starting at once (a surge, a test run) must not both
    // mount: the second bpffs would hide the pins made on the first. Both
    // lock the directory they see there and look again under the lock.
    let _held = std::fs::File::open(mount_point)
        .and_then(|d| {
            nix::fcntl::Flock::lock(d, nix::fcntl::FlockArg::LockExclusive)
                .map_err(|(_, errno)| io::Error::from(errno))
        })
        .map_err(|source| LoadError::BpfFs {
            dir: mount_point.to_path_buf(),
            source,
        })?;
    if on_bpffs(mount_point) {
        // Mounted meanwhile by the agent that held the lock.
        return if on_bpffs(existing) {
            Ok(())
        } else {
            Err(not_bpffs())
        };
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

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Barrier};

    use nix::{
        mount::{MntFlags, MsFlags, mount, umount2},
        sched::{CloneFlags, unshare},
    };

    use super::*;

    /// bpf filesystems mounted at /sys/fs/bpf in the calling thread's
    /// mount namespace.
    fn bpffs_mounts() -> usize {
        std::fs::read_to_string("/proc/thread-self/mountinfo")
            .unwrap()
            .lines()
            .filter(|l| l.split(' ').nth(4) == Some("/sys/fs/bpf") && l.contains(" - bpf "))
            .count()
    }

    /// Two agents starting together on a node without bpffs mount one, not
    /// two stacked (the second would hide the first's pins). Root only; in
    /// a mount namespace of a thread of its own, so nothing outside it sees
    /// the unmounts.
    #[test]
    fn two_agents_starting_together_mount_one_bpffs() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("skipping: mounting needs root");
            return;
        }
        std::thread::spawn(|| {
            unshare(CloneFlags::CLONE_NEWNS).unwrap();
            mount(
                None::<&str>,
                "/",
                None::<&str>,
                MsFlags::MS_REC | MsFlags::MS_PRIVATE,
                None::<&str>,
            )
            .unwrap();
            for round in 0..20 {
                while bpffs_mounts() > 0 {
                    umount2("/sys/fs/bpf", MntFlags::MNT_DETACH).unwrap();
                }
                let start = Arc::new(Barrier::new(2));
                let agents: Vec<_> = (0..2)
                    .map(|i| {
                        let start = start.clone();
                        std::thread::spawn(move || {
                            start.wait();
                            ensure_bpffs(&PathBuf::from(format!("/sys/fs/bpf/agent-{i}")))
                        })
                    })
                    .collect();
                for agent in agents {
                    agent.join().unwrap().unwrap();
                }
                assert_eq!(bpffs_mounts(), 1, "round {round}");
            }
        })
        .join()
        .unwrap();
    }
}
