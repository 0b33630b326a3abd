//! Finding a pod's network namespace on this node.
//!
//! The Kubernetes API does not say where a pod's netns is; only the node
//! knows. In production the agent runs with `hostPID: true` and
//! [`ProcScanResolver`] finds a process of the pod — every container process
//! sits in a cgroup whose path carries the pod's UID (`pod<uid>` with the
//! cgroupfs driver, `pod<uid_with_underscores>.slice` with systemd's) — and
//! uses that process's `/proc/PID/ns/net`. All containers of a pod share one
//! netns, so any of its processes will do; the lowest PID is taken (usually
//! the sandbox's pause process, which lives as long as the pod).
//!
//! The container runtime's own netns path (e.g. containerd's
//! `/var/run/netns/cni-…`), asked over the CRI API, is preferred when a
//! runtime socket is available: see [`super::cri`].
//!
//! [`MapResolver`] is told the paths instead. It exists for tests and demos
//! whose "pods" are bare network namespaces without processes; it is never
//! chosen by the agent binary.

use std::{
    collections::{HashMap, HashSet},
    fs,
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    sync::{Arc, RwLock},
};

use tracing::debug;

use crate::state::WorkloadKey;

/// A pod whose netns is wanted.
#[derive(Clone, Copy, Debug)]
pub struct PodRef<'a> {
    pub key: &'a WorkloadKey,
    pub uid: &'a str,
}

/// Finds pods' network namespaces.
///
/// Blocking (reads `/proc`): the source calls it on a blocking thread, once
/// per batch of pods whose netns it does not know yet.
pub trait NetnsResolver: Send + Sync + 'static {
    /// The netns path of each of `pods` that could be found, by pod UID.
    fn resolve(&self, pods: &[PodRef<'_>]) -> HashMap<String, PathBuf>;

    /// Whether a path found earlier for `pod` still leads to its netns
    /// (the process behind a `/proc/PID/ns/net` may have exited). Cached
    /// paths are kept while valid so that a pod's netns path, and so its
    /// enrolment, does not change from one reconcile to the next.
    fn still_valid(&self, pod: PodRef<'_>, path: &Path) -> bool;
}

/// Scans `/proc/*/cgroup` for the pod's UID. See the module docs.
#[derive(Clone, Debug)]
pub struct ProcScanResolver {
    proc_root: PathBuf,
}

impl Default for ProcScanResolver {
    fn default() -> Self {
        Self::new("/proc")
    }
}

impl ProcScanResolver {
    /// Scans `proc_root` (`/proc`, or a fake tree in tests).
    pub fn new(proc_root: impl Into<PathBuf>) -> Self {
        Self {
            proc_root: proc_root.into(),
        }
    }

    /// Whether `path` is one this resolver hands out (under its `/proc`).
    pub fn owns(&self, path: &Path) -> bool {
        path.starts_with(&self.proc_root)
    }

    /// The (device, inode) of the host's netns (PID 1's): a process of a
    /// pod that shares it is not in a pod netns of its own.
    fn host_netns(&self) -> Option<(u64, u64)> {
        let meta = fs::metadata(self.proc_root.join("1/ns/net")).ok()?;
        Some((meta.dev(), meta.ino()))
    }
}

/// The forms a pod UID takes in cgroup paths: as is (cgroupfs driver) and
/// with `_` for `-` (systemd driver), each after `pod`.
fn uid_patterns(uid: &str) -> [String; 2] {
    [format!("pod{uid}"), format!("pod{}", uid.replace('-', "_"))]
}

fn cgroup_mentions(cgroup: &str, patterns: &[String; 2]) -> bool {
    patterns.iter().any(|p| {
        cgroup.match_indices(p.as_str()).any(|(at, _)| {
            // The UID must end there: `pod<uid>` followed by `.slice`, `/`,
            // the line's end… and not by more UID characters.
            cgroup[at + p.len()..]
                .chars()
                .next()
                .is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'))
        })
    })
}

impl NetnsResolver for ProcScanResolver {
    fn resolve(&self, pods: &[PodRef<'_>]) -> HashMap<String, PathBuf> {
        let mut found: HashMap<String, (u32, PathBuf)> = HashMap::new();
        if pods.is_empty() {
            return HashMap::new();
        }
        let wanted: Vec<(&str, [String; 2])> =
            pods.iter().map(|p| (p.uid, uid_patterns(p.uid))).collect();
        let host = self.host_netns();
        let entries = match fs::read_dir(&self.proc_root) {
            Ok(entries) => entries,
            Err(error) => {
                debug!(proc = %self.proc_root.display(), %error, "cannot list processes");
                return HashMap::new();
            }
        };
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            // Processes come and go during the scan: a vanished one is
            // simply not a candidate.
            let Ok(cgroup) = fs::read_to_string(entry.path().join("cgroup")) else {
                continue;
            };
            for (uid, patterns) in &wanted {
                if !cgroup_mentions(&cgroup, patterns) {
                    continue;
                }
                if found.get(*uid).is_some_and(|(best, _)| *best < pid) {
                    continue;
                }
                let netns = entry.path().join("ns/net");
                let Ok(meta) = fs::metadata(&netns) else {
                    continue;
                };
                if host == Some((meta.dev(), meta.ino())) {
                    continue;
                }
                found.insert((*uid).to_owned(), (pid, netns));
            }
        }
        found
            .into_iter()
            .map(|(uid, (_, path))| (uid, path))
            .collect()
    }

    fn still_valid(&self, pod: PodRef<'_>, path: &Path) -> bool {
        // `<proc>/<pid>/ns/net`: the same PID must still be one of the pod's
        // processes (PIDs are reused).
        let Some(pid_dir) = path.parent().and_then(Path::parent) else {
            return false;
        };
        fs::read_to_string(pid_dir.join("cgroup"))
            .is_ok_and(|cgroup| cgroup_mentions(&cgroup, &uid_patterns(pod.uid)))
            && path.exists()
    }
}

/// Netns paths given by whoever built the pods (tests, demos), by pod key.
/// Cloning shares the map.
#[derive(Clone, Debug, Default)]
pub struct MapResolver {
    paths: Arc<RwLock<HashMap<WorkloadKey, PathBuf>>>,
}

impl MapResolver {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(&self, pod: WorkloadKey, netns: PathBuf) {
        self.paths
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(pod, netns);
    }

    pub fn remove(&self, pod: &WorkloadKey) {
        self.paths
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .remove(pod);
    }

    fn get(&self, pod: &WorkloadKey) -> Option<PathBuf> {
        self.paths
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(pod)
            .cloned()
    }
}

impl NetnsResolver for MapResolver {
    fn resolve(&self, pods: &[PodRef<'_>]) -> HashMap<String, PathBuf> {
        pods.iter()
            .filter_map(|p| Some((p.uid.to_owned(), self.get(p.key)?)))
            .collect()
    }

    fn still_valid(&self, pod: PodRef<'_>, path: &Path) -> bool {
        self.get(pod.key).as_deref() == Some(path) && path.exists()
    }
}

/// Remembers each pod's netns path across reconciles (by pod UID: a pod
/// recreated under the same name is a new pod with a new netns).
#[derive(Default)]
pub(crate) struct NetnsCache {
    by_uid: HashMap<String, PathBuf>,
}

impl NetnsCache {
    /// The netns path of each pod of `pods` that can be found, reusing
    /// still-valid paths and resolving the rest in one batch.
    pub(crate) fn lookup(
        &mut self,
        resolver: &dyn NetnsResolver,
        pods: &[PodRef<'_>],
    ) -> HashMap<String, PathBuf> {
        let mut out = HashMap::new();
        let mut missing = Vec::new();
        for pod in pods {
            match self.by_uid.get(pod.uid) {
                Some(path) if resolver.still_valid(*pod, path) => {
                    out.insert(pod.uid.to_owned(), path.clone());
                }
                _ => missing.push(*pod),
            }
        }
        if !missing.is_empty() {
            for (uid, path) in resolver.resolve(&missing) {
                debug!(uid, netns = %path.display(), "pod network namespace found");
                out.insert(uid, path);
            }
        }
        // Forget pods that are gone or no longer asked about.
        let asked: HashSet<&str> = pods.iter().map(|p| p.uid).collect();
        self.by_uid.retain(|uid, _| asked.contains(uid.as_str()));
        for (uid, path) in &out {
            self.by_uid.insert(uid.clone(), path.clone());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake `/proc`: `pid/cgroup` files and `pid/ns/net` files (distinct
    /// inodes, like distinct namespaces).
    struct FakeProc {
        dir: tempfile::TempDir,
    }

    impl FakeProc {
        fn new() -> Self {
            let fake = Self {
                dir: tempfile::tempdir().expect("temp dir"),
            };
            fake.process(1, "0::/init.scope\n");
            fake
        }

        fn root(&self) -> &Path {
            self.dir.path()
        }

        fn process(&self, pid: u32, cgroup: &str) -> PathBuf {
            let dir = self.root().join(pid.to_string());
            fs::create_dir_all(dir.join("ns")).expect("mkdir");
            fs::write(dir.join("cgroup"), cgroup).expect("write cgroup");
            fs::write(dir.join("ns/net"), format!("netns of {pid}")).expect("write ns");
            dir.join("ns/net")
        }

        /// A process of a pod that shares the host's netns.
        fn host_network_process(&self, pid: u32, cgroup: &str) {
            let dir = self.root().join(pid.to_string());
            fs::create_dir_all(dir.join("ns")).expect("mkdir");
            fs::write(dir.join("cgroup"), cgroup).expect("write cgroup");
            std::os::unix::fs::symlink(self.root().join("1/ns/net"), dir.join("ns/net"))
                .expect("symlink");
        }
    }

    const UID_A: &str = "6c3b4a8e-1f2d-4c5b-9a7e-0123456789ab";
    const UID_B: &str = "0d9e8f7a-6b5c-4d3e-8f2a-fedcba987654";

    fn key(name: &str) -> WorkloadKey {
        WorkloadKey::new("default", name)
    }

    #[test]
    fn finds_pods_by_uid_in_either_cgroup_driver_layout() {
        let proc = FakeProc::new();
        proc.process(20, "0::/system.slice/containerd.service\n");
        // cgroupfs driver, cgroup v1 style lines (several hierarchies).
        let a_pause = proc.process(
            310,
            &format!("12:memory:/kubepods/besteffort/pod{UID_A}/abc\n0::/kubepods/besteffort/pod{UID_A}/abc\n"),
        );
        proc.process(455, &format!("0::/kubepods/besteffort/pod{UID_A}/def\n"));
        // systemd driver: dashes become underscores.
        let b = proc.process(
            502,
            &format!(
                "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice/cri-containerd-123.scope\n",
                UID_B.replace('-', "_")
            ),
        );
        fs::create_dir_all(proc.root().join("self")).expect("non-numeric entries are skipped");
        let (a_key, b_key, c_key) = (key("a"), key("b"), key("c"));
        let resolver = ProcScanResolver::new(proc.root());
        let found = resolver.resolve(&[
            PodRef {
                key: &a_key,
                uid: UID_A,
            },
            PodRef {
                key: &b_key,
                uid: UID_B,
            },
            PodRef {
                key: &c_key,
                uid: "no-such-uid",
            },
        ]);
        assert_eq!(found.get(UID_A), Some(&a_pause), "lowest PID of the pod");
        assert_eq!(found.get(UID_B), Some(&b));
        assert_eq!(found.len(), 2);
        assert!(resolver.still_valid(
            PodRef {
                key: &a_key,
                uid: UID_A
            },
            &a_pause
        ));
        assert!(!resolver.still_valid(
            PodRef {
                key: &b_key,
                uid: UID_B
            },
            &a_pause
        ));
    }

    #[test]
    fn a_longer_uid_sharing_a_prefix_does_not_match() {
        let proc = FakeProc::new();
        proc.process(40, &format!("0::/kubepods/pod{UID_A}ff/x\n"));
        let k = key("a");
        let resolver = ProcScanResolver::new(proc.root());
        assert!(
            resolver
                .resolve(&[PodRef {
                    key: &k,
                    uid: UID_A
                }])
                .is_empty()
        );
    }

    #[test]
    fn processes_in_the_host_netns_are_not_the_pods_netns() {
        let proc = FakeProc::new();
        proc.host_network_process(60, &format!("0::/kubepods/pod{UID_A}/x\n"));
        let k = key("a");
        let resolver = ProcScanResolver::new(proc.root());
        assert!(
            resolver
                .resolve(&[PodRef {
                    key: &k,
                    uid: UID_A
                }])
                .is_empty()
        );
        let own = proc.process(61, &format!("0::/kubepods/pod{UID_A}/y\n"));
        assert_eq!(
            resolver
                .resolve(&[PodRef {
                    key: &k,
                    uid: UID_A
                }])
                .get(UID_A),
            Some(&own)
        );
    }

    #[test]
    fn cache_keeps_a_valid_path_and_replaces_a_dead_one() {
        let proc = FakeProc::new();
        let first = proc.process(100, &format!("0::/kubepods/pod{UID_A}/x\n"));
        let k = key("a");
        let resolver = ProcScanResolver::new(proc.root());
        let mut cache = NetnsCache::default();
        let pods = [PodRef {
            key: &k,
            uid: UID_A,
        }];
        assert_eq!(cache.lookup(&resolver, &pods).get(UID_A), Some(&first));
        // A lower PID appears, but the cached path is still valid: kept, so
        // the pod's enrolment does not move.
        proc.process(90, &format!("0::/kubepods/pod{UID_A}/y\n"));
        assert_eq!(cache.lookup(&resolver, &pods).get(UID_A), Some(&first));
        // The process exits: the next lookup finds another one.
        fs::remove_dir_all(proc.root().join("100")).expect("rm");
        let second = proc.root().join("90/ns/net");
        assert_eq!(cache.lookup(&resolver, &pods).get(UID_A), Some(&second));
        // Pods no longer asked about are forgotten.
        assert!(cache.lookup(&resolver, &[]).is_empty());
        assert!(cache.by_uid.is_empty());
    }

    #[test]
    fn map_resolver_answers_what_it_was_told() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("netns");
        fs::write(&path, "").expect("write");
        let resolver = MapResolver::new();
        let k = key("a");
        let pods = [PodRef { key: &k, uid: "u" }];
        assert!(resolver.resolve(&pods).is_empty());
        resolver.insert(k.clone(), path.clone());
        assert_eq!(resolver.resolve(&pods).get("u"), Some(&path));
        assert!(resolver.still_valid(pods[0], &path));
        resolver.remove(&k);
        assert!(!resolver.still_valid(pods[0], &path));
    }
}
