//! The kernel side of the passthrough fast path (`ebpf/src/passthrough.rs`
//! explains the datapath): the destination table (addresses and address
//! ranges) and its valid switch ([`DestinationTable`], whose only user is
//! the agent's table writer, `fastpath::table`), the event ring buffer
//! ([`FastPathEvents`], read by the reporter, `fastpath::report`) and the
//! programs' counters ([`FastPathCounters`]). Each opens its pinned maps
//! by path, after the redirector loaded (and so pinned) them.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    os::fd::{AsRawFd, RawFd},
    path::{Path, PathBuf},
};

use aya::maps::{
    Array, HashMap as BpfHashMap, Map, MapData, MapError, PerCpuArray, RingBuf,
    lpm_trie::{Key, LpmTrie},
};
use shunt_common::{
    FastPathDest, FastPathEvent, FastPathState, FastPathStats, MAX_FAST_PATH_DESTINATIONS,
    MAX_FAST_PATH_RANGES, MeshLocalStats, maps,
};

use super::LoadError;

/// Why the table could not be made valid; each leaves it invalid (every
/// connect of an enrolled pod goes through the proxy).
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    #[error(
        "{wanted} destinations the proxy must see, more than the table's {limit} (--fast-path-max-destinations, at most {MAX_FAST_PATH_DESTINATIONS})"
    )]
    TooLarge { wanted: usize, limit: usize },
    #[error(
        "{wanted} address ranges (ServiceEntry CIDRs) the proxy must see, more than the table's {MAX_FAST_PATH_RANGES}"
    )]
    TooManyRanges { wanted: usize },
    #[error("writing {dest} into {}: {source}", maps::FAST_PATH_DESTS)]
    Write {
        dest: IpAddr,
        #[source]
        source: MapError,
    },
    #[error("writing {}/{} into {}: {source}", range.0, range.1, maps::FAST_PATH_RANGES)]
    WriteRange {
        range: (IpAddr, u8),
        #[source]
        source: MapError,
    },
    #[error("{map}: {0}", map = maps::FAST_PATH_STATE)]
    State(#[source] MapError),
}

impl TableError {
    /// A short label for the invalidation counter.
    pub fn reason(&self) -> &'static str {
        match self {
            TableError::TooLarge { .. } => "too_large",
            TableError::TooManyRanges { .. } => "too_many_ranges",
            TableError::Write { .. } | TableError::WriteRange { .. } => "write_error",
            TableError::State(_) => "state_error",
        }
    }
}

/// Every destination the proxy must see: single addresses, and address
/// ranges (`addr/prefix`, host bits zero) for which the longest prefix
/// holding a destination sends it to the proxy.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProxyDestinations {
    pub addresses: BTreeSet<IpAddr>,
    pub ranges: BTreeSet<(IpAddr, u8)>,
}

/// What one [`DestinationTable::sync`] did (addresses and ranges together).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SyncReport {
    pub added: usize,
    pub removed: usize,
    /// Addresses now in the table.
    pub entries: usize,
    /// Ranges now in the table.
    pub ranges: usize,
}

/// `SHUNT_FP_DESTS`, `SHUNT_FP_RANGES` and `SHUNT_FP_STATE`, through the
/// agent's own handles.
pub struct DestinationTable {
    dests: BpfHashMap<MapData, FastPathDest, u32>,
    ranges: LpmTrie<MapData, FastPathDest, u32>,
    state: Array<MapData, FastPathState>,
    /// Most entries written (`--fast-path-max-destinations`).
    limit: usize,
    generation: u32,
}

impl DestinationTable {
    /// Opens the pinned maps under `pin_dir` and turns the table off: what a
    /// previous agent left was complete for its view, not for this agent's.
    pub fn open(pin_dir: &Path, limit: u32) -> Result<Self, LoadError> {
        let dests = BpfHashMap::try_from(Map::HashMap(open(pin_dir, maps::FAST_PATH_DESTS)?))
            .map_err(|e| map_error(maps::FAST_PATH_DESTS, e))?;
        let ranges = LpmTrie::try_from(Map::LpmTrie(open(pin_dir, maps::FAST_PATH_RANGES)?))
            .map_err(|e| map_error(maps::FAST_PATH_RANGES, e))?;
        let state = Array::try_from(Map::Array(open(pin_dir, maps::FAST_PATH_STATE)?))
            .map_err(|e| map_error(maps::FAST_PATH_STATE, e))?;
        let mut table = Self {
            dests,
            ranges,
            state,
            limit: limit.min(MAX_FAST_PATH_DESTINATIONS) as usize,
            generation: 0,
        };
        table
            .invalidate()
            .map_err(|e| map_error(maps::FAST_PATH_STATE, e))?;
        Ok(table)
    }

    /// Turns the table off: from now on every connect goes to the proxy.
    pub fn invalidate(&mut self) -> Result<(), MapError> {
        self.set_flags(0)
    }

    /// Whether the table is on.
    pub fn is_valid(&self) -> bool {
        self.state
            .get(&0, 0)
            .is_ok_and(|s| s.flags & FastPathState::VALID != 0)
    }

    /// Makes the table hold exactly `wanted` and turns it on. Additions are
    /// written before removals (a destination that joins the mesh is in the
    /// table before one that left is taken out), and the switch that makes
    /// the kernel look ranges up is on before the first range is written.
    /// A set larger than a limit or a failed write turns the table off
    /// first and returns the error; a removal that fails only leaves an
    /// extra entry (that destination keeps going through the proxy) and is
    /// retried on the next sync.
    pub fn sync(&mut self, wanted: &ProxyDestinations) -> Result<SyncReport, TableError> {
        if wanted.addresses.len() > self.limit {
            self.invalidate().map_err(TableError::State)?;
            return Err(TableError::TooLarge {
                wanted: wanted.addresses.len(),
                limit: self.limit,
            });
        }
        if wanted.ranges.len() > MAX_FAST_PATH_RANGES as usize {
            self.invalidate().map_err(TableError::State)?;
            return Err(TableError::TooManyRanges {
                wanted: wanted.ranges.len(),
            });
        }
        let present: BTreeSet<FastPathDest> = self.dests.keys().filter_map(Result::ok).collect();
        let present_ranges: BTreeSet<(u32, FastPathDest)> = self
            .ranges
            .keys()
            .filter_map(Result::ok)
            .map(|k| (k.prefix_len(), k.data()))
            .collect();
        if !wanted.ranges.is_empty() {
            let valid = if self.is_valid() {
                FastPathState::VALID
            } else {
                0
            };
            self.set_flags(valid | FastPathState::RANGES)
                .map_err(TableError::State)?;
        }
        let keys: BTreeMap<FastPathDest, IpAddr> = wanted
            .addresses
            .iter()
            .map(|ip| (key_of(*ip), *ip))
            .collect();
        let range_keys: BTreeMap<(u32, FastPathDest), (IpAddr, u8)> = wanted
            .ranges
            .iter()
            .map(|range| (range_key_of(range.0, range.1), *range))
            .collect();
        // Additions, addresses then ranges; any failure turns the table off.
        let mut added = (0, 0);
        for (key, ip) in keys.iter().filter(|(k, _)| !present.contains(k)) {
            if let Err(source) = self.dests.insert(key, 0u32, 0) {
                self.invalidate().map_err(TableError::State)?;
                return Err(TableError::Write { dest: *ip, source });
            }
            added.0 += 1;
        }
        for (key, range) in range_keys
            .iter()
            .filter(|(k, _)| !present_ranges.contains(k))
        {
            if let Err(source) = self.ranges.insert(&Key::new(key.0, key.1), 0u32, 0) {
                self.invalidate().map_err(TableError::State)?;
                return Err(TableError::WriteRange {
                    range: *range,
                    source,
                });
            }
            added.1 += 1;
        }
        // Removals; one that fails leaves its entry for the next sync.
        let mut removed = (0, 0);
        for key in present.iter().filter(|k| !keys.contains_key(k)) {
            match self.dests.remove(key) {
                Ok(()) => removed.0 += 1,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot remove a destination from the fast-path table; it keeps going through the proxy")
                }
            }
        }
        for key in present_ranges
            .iter()
            .filter(|k| !range_keys.contains_key(k))
        {
            match self.ranges.remove(&Key::new(key.0, key.1)) {
                Ok(()) => removed.1 += 1,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot remove an address range from the fast-path table; it keeps going through the proxy")
                }
            }
        }
        let report = SyncReport {
            added: added.0 + added.1,
            removed: removed.0 + removed.1,
            entries: present.len() + added.0 - removed.0,
            ranges: present_ranges.len() + added.1 - removed.1,
        };
        self.generation = self.generation.wrapping_add(1);
        // A range a removal left keeps the kernel looking ranges up.
        let ranges = if report.ranges > 0 {
            FastPathState::RANGES
        } else {
            0
        };
        self.set_flags(FastPathState::VALID | ranges)
            .map_err(TableError::State)?;
        Ok(report)
    }

    fn set_flags(&mut self, flags: u32) -> Result<(), MapError> {
        self.state.set(
            0,
            FastPathState {
                flags,
                generation: self.generation,
            },
            0,
        )
    }
}

/// The table's key of `ip`: IPv4 mapped into IPv6, as connect6 sees a
/// dual-stack socket's IPv4 destination (so both hooks find it).
pub fn key_of(ip: IpAddr) -> FastPathDest {
    let v6 = match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    };
    let mut addr = [0u32; 4];
    for (word, chunk) in addr.iter_mut().zip(v6.octets().chunks_exact(4)) {
        *word = u32::from_ne_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
    }
    FastPathDest { addr }
}

/// The range table's key of `addr/prefix`: IPv4 mapped into IPv6 as
/// [`key_of`], its prefix moved past the 96 bits of the mapping.
pub fn range_key_of(addr: IpAddr, prefix: u8) -> (u32, FastPathDest) {
    let prefix = u32::from(prefix);
    let prefix = match addr {
        IpAddr::V4(_) => 96 + prefix.min(32),
        IpAddr::V6(_) => prefix.min(128),
    };
    (prefix, key_of(addr))
}

/// The events the programs send (opened, closed), read through the pinned
/// ring buffer.
pub struct FastPathEvents {
    ring: RingBuf<MapData>,
}

impl FastPathEvents {
    pub fn open(pin_dir: &Path) -> Result<Self, LoadError> {
        let ring = RingBuf::try_from(Map::RingBuf(open(pin_dir, maps::FAST_PATH_EVENTS)?))
            .map_err(|e| map_error(maps::FAST_PATH_EVENTS, e))?;
        Ok(Self { ring })
    }

    /// The next event waiting, if any (records of another size, from
    /// another version of the programs, are skipped).
    pub fn next_event(&mut self) -> Option<FastPathEvent> {
        loop {
            let item = self.ring.next()?;
            if item.len() != std::mem::size_of::<FastPathEvent>() {
                continue;
            }
            // SAFETY: `FastPathEvent` is plain old data of exactly this
            // size; the read is unaligned-safe.
            return Some(unsafe { std::ptr::read_unaligned(item.as_ptr().cast()) });
        }
    }
}

impl AsRawFd for FastPathEvents {
    fn as_raw_fd(&self) -> RawFd {
        self.ring.as_raw_fd()
    }
}

/// The programs' counters, and flow 2's switch (read only: the reconciler
/// writes it).
pub struct FastPathCounters {
    map: PerCpuArray<MapData, FastPathStats>,
    mesh_local: PerCpuArray<MapData, MeshLocalStats>,
    mesh_local_state: Array<MapData, FastPathState>,
}

impl FastPathCounters {
    pub fn open(pin_dir: &Path) -> Result<Self, LoadError> {
        let map = PerCpuArray::try_from(Map::PerCpuArray(open(pin_dir, maps::FAST_PATH_STATS)?))
            .map_err(|e| map_error(maps::FAST_PATH_STATS, e))?;
        let mesh_local =
            PerCpuArray::try_from(Map::PerCpuArray(open(pin_dir, maps::MESH_LOCAL_STATS)?))
                .map_err(|e| map_error(maps::MESH_LOCAL_STATS, e))?;
        let mesh_local_state = Array::try_from(Map::Array(open(pin_dir, maps::MESH_LOCAL_STATE)?))
            .map_err(|e| map_error(maps::MESH_LOCAL_STATE, e))?;
        Ok(Self {
            map,
            mesh_local,
            mesh_local_state,
        })
    }

    /// Flow 2's counters summed over CPUs (zeros if unreadable).
    pub fn read_mesh_local(&self) -> MeshLocalStats {
        let mut total = MeshLocalStats::default();
        if let Ok(values) = self.mesh_local.get(&0, 0) {
            for cpu in values.iter() {
                total.add(cpu);
            }
        }
        total
    }

    /// Whether flow 2 is on.
    pub fn mesh_local_on(&self) -> bool {
        self.mesh_local_state
            .get(&0, 0)
            .is_ok_and(|s| s.flags & FastPathState::VALID != 0)
    }

    /// The counters summed over CPUs (zeros if the map cannot be read).
    pub fn read(&self) -> FastPathStats {
        let mut total = FastPathStats::default();
        if let Ok(values) = self.map.get(&0, 0) {
            for cpu in values.iter() {
                total.add(cpu);
            }
        }
        total
    }
}

fn open(pin_dir: &Path, name: &'static str) -> Result<MapData, LoadError> {
    let path: PathBuf = pin_dir.join(name);
    MapData::from_pin(&path).map_err(|e| LoadError::Map {
        name,
        detail: format!("opening {}: {e}", path.display()),
    })
}

fn map_error(name: &'static str, e: impl std::fmt::Display) -> LoadError {
    LoadError::Map {
        name,
        detail: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_is_keyed_as_the_kernel_sees_it_from_both_hooks() {
        let ip: IpAddr = "198.18.2.10".parse().expect("ip");
        // connect4 keys `user_ip4` (network order) through `FastPathDest::v4`.
        let from_connect4 = FastPathDest::v4(u32::from_ne_bytes([198, 18, 2, 10]));
        assert_eq!(key_of(ip), from_connect4);
        // connect6 of a dual-stack socket sees ::ffff:198.18.2.10.
        let mapped: IpAddr = "::ffff:198.18.2.10".parse().expect("ip");
        assert_eq!(key_of(mapped), from_connect4);
        let v6: IpAddr = "fd00::10".parse().expect("ip");
        assert_ne!(key_of(v6), from_connect4);
        assert_eq!(key_of(v6).addr[0], u32::from_ne_bytes([0xfd, 0, 0, 0]));
    }

    #[test]
    fn an_ipv4_range_is_keyed_past_the_mapping() {
        let (prefix, key) = range_key_of("198.19.7.0".parse().expect("ip"), 24);
        assert_eq!(prefix, 120, "96 bits of ::ffff:0:0/96, then the 24");
        assert_eq!(key, key_of("198.19.7.0".parse().expect("ip")));
        let (prefix, key) = range_key_of("fd00:7::".parse().expect("ip"), 64);
        assert_eq!(
            (prefix, key.addr[0]),
            (64, u32::from_ne_bytes([0xfd, 0, 0, 7]))
        );
        // Everything IPv4 is the mapping's /96, not all of IPv6.
        assert_eq!(range_key_of("0.0.0.0".parse().expect("ip"), 0).0, 96);
    }
}
