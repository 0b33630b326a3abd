//! Looking at kernel state the way an operator would, to assert on it:
//! interface counters (`ip -s link`), TC filters and qdiscs (`tc`), and the
//! agent's pinned maps (opened from bpffs, independently of the agent).

use std::{collections::BTreeMap, path::Path};

use aya::maps::{Array, HashMap as BpfHashMap, Map, MapData, PerCpuArray};
use serde_json::Value;
use shunt_common::{PodConfig, PodCounters, PodSlot, PolicyVerdict, PolicyVerdictKey, maps};

use crate::{Result, TestbedError, cmd};

/// Byte and packet counters of an interface, as the kernel keeps them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkStats {
    pub rx_packets: u64,
    pub rx_bytes: u64,
    pub tx_packets: u64,
    pub tx_bytes: u64,
}

/// `ip -j -s link show dev IF` inside the netns at `netns`.
pub fn link_stats(netns: &Path, interface: &str) -> Result<LinkStats> {
    let json = json_in(netns, "ip", &["-j", "-s", "link", "show", "dev", interface])?;
    let stats = &json[0]["stats64"];
    let field = |dir: &str, name: &str| stats[dir][name].as_u64().unwrap_or(0);
    Ok(LinkStats {
        rx_packets: field("rx", "packets"),
        rx_bytes: field("rx", "bytes"),
        tx_packets: field("tx", "packets"),
        tx_bytes: field("tx", "bytes"),
    })
}

/// A TC filter as `tc -j filter show` reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcFilter {
    pub priority: u64,
    /// The BPF program's name (e.g. `shunt_tc_ingress`), if it is a BPF filter.
    pub program: Option<String>,
    /// The kernel's id of the BPF program the filter runs.
    pub program_id: Option<u64>,
    /// The minor of the filter's classid (`flowid` in `tc`), if it has one.
    pub classid_minor: Option<u32>,
}

/// The filters on `interface`'s clsact `hook` (`ingress` or `egress`) inside
/// the netns at `netns`.
pub fn tc_filters(netns: &Path, interface: &str, hook: &str) -> Result<Vec<TcFilter>> {
    let json = json_in(
        netns,
        "tc",
        &["-j", "filter", "show", "dev", interface, hook],
    )?;
    Ok(json
        .as_array()
        .map(|filters| {
            filters
                .iter()
                // The first entry of each priority is a header without options.
                .filter(|f| f.get("options").is_some())
                .map(|f| TcFilter {
                    priority: f["pref"].as_u64().unwrap_or(0),
                    program: f["options"]["bpf_name"].as_str().map(str::to_string),
                    program_id: f["options"]["prog"]["id"].as_u64(),
                    // `tc` prints a classid as "MAJOR:MINOR" in hex (":3"
                    // when the major is 0).
                    classid_minor: f["options"]["flowid"]
                        .as_str()
                        .and_then(|id| id.rsplit(':').next())
                        .and_then(|minor| u32::from_str_radix(minor, 16).ok()),
                })
                .collect()
        })
        .unwrap_or_default())
}

/// The kinds of the qdiscs on `interface` (e.g. `noqueue`, `clsact`) inside
/// the netns at `netns`.
pub fn qdisc_kinds(netns: &Path, interface: &str) -> Result<Vec<String>> {
    let json = json_in(netns, "tc", &["-j", "qdisc", "show", "dev", interface])?;
    Ok(json
        .as_array()
        .map(|qdiscs| {
            qdiscs
                .iter()
                .filter_map(|q| q["kind"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default())
}

/// The enrolment map pinned under `pin_dir`: netns cookie → slot.
pub fn enrolled_entries(pin_dir: &Path) -> Result<BTreeMap<u64, u32>> {
    let map = open_pinned(pin_dir, maps::ENROLLED)?;
    let map: BpfHashMap<MapData, u64, PodSlot> = BpfHashMap::try_from(Map::HashMap(map))
        .map_err(|e| TestbedError::Invalid(format!("{}: {e}", maps::ENROLLED)))?;
    let mut entries = BTreeMap::new();
    for entry in map.iter() {
        let (cookie, slot) =
            entry.map_err(|e| TestbedError::Invalid(format!("{}: {e}", maps::ENROLLED)))?;
        entries.insert(cookie, slot.slot);
    }
    Ok(entries)
}

/// The pod counters in `slot`, summed over CPUs, read from the pinned map.
pub fn slot_counters(pin_dir: &Path, slot: u32) -> Result<PodCounters> {
    let map = open_pinned(pin_dir, maps::POD_COUNTERS)?;
    let map: PerCpuArray<MapData, PodCounters> = PerCpuArray::try_from(Map::PerCpuArray(map))
        .map_err(|e| TestbedError::Invalid(format!("{}: {e}", maps::POD_COUNTERS)))?;
    let per_cpu = map
        .get(&slot, 0)
        .map_err(|e| TestbedError::Invalid(format!("{} slot {slot}: {e}", maps::POD_COUNTERS)))?;
    let mut total = PodCounters::default();
    for cpu in per_cpu.iter() {
        total.add(cpu);
    }
    Ok(total)
}

/// Kubelet's probes in the eBPF mode, summed over CPUs: (connections the
/// node opened to enrolled pods, packets rewritten), from the pinned map.
pub fn host_probe_stats(pin_dir: &Path) -> Result<(u64, u64)> {
    let map = open_pinned(pin_dir, maps::HOST_PROBE_STATS)?;
    let map: PerCpuArray<MapData, shunt_common::HostProbeStats> =
        PerCpuArray::try_from(Map::PerCpuArray(map))
            .map_err(|e| TestbedError::Invalid(format!("{}: {e}", maps::HOST_PROBE_STATS)))?;
    let per_cpu = map
        .get(&0, 0)
        .map_err(|e| TestbedError::Invalid(format!("{}: {e}", maps::HOST_PROBE_STATS)))?;
    Ok(per_cpu.iter().fold((0, 0), |(c, p), s| {
        (c + s.connections, p + s.packets_rewritten)
    }))
}

/// The settings the programs read for `slot`, from the pinned map.
pub fn slot_config(pin_dir: &Path, slot: u32) -> Result<PodConfig> {
    let map = open_pinned(pin_dir, maps::POD_CONFIG)?;
    let map: Array<MapData, PodConfig> = Array::try_from(Map::Array(map))
        .map_err(|e| TestbedError::Invalid(format!("{}: {e}", maps::POD_CONFIG)))?;
    map.get(&slot, 0)
        .map_err(|e| TestbedError::Invalid(format!("{} slot {slot}: {e}", maps::POD_CONFIG)))
}

/// The kernel's authorization verdicts, IPv4 entries only: (source slot,
/// destination, port; 0 = any other port) → (denied, the agent's number of
/// the deciding policy).
pub type PolicyVerdicts = BTreeMap<(u32, std::net::Ipv4Addr, u16), (bool, u32)>;

/// The kernel's authorization verdicts pinned under `pin_dir`.
pub fn policy_verdicts(pin_dir: &Path) -> Result<PolicyVerdicts> {
    let map = open_pinned(pin_dir, maps::POLICY_VERDICTS)?;
    let map: BpfHashMap<MapData, PolicyVerdictKey, PolicyVerdict> =
        BpfHashMap::try_from(Map::HashMap(map))
            .map_err(|e| TestbedError::Invalid(format!("{}: {e}", maps::POLICY_VERDICTS)))?;
    let mut entries = BTreeMap::new();
    for entry in map.iter() {
        let (key, verdict) =
            entry.map_err(|e| TestbedError::Invalid(format!("{}: {e}", maps::POLICY_VERDICTS)))?;
        if key.family != 2 {
            continue;
        }
        let addr = std::net::Ipv4Addr::from(key.addr[0].to_ne_bytes());
        entries.insert(
            (key.slot, addr, key.port),
            (verdict.action == PolicyVerdict::DENY, verdict.policy),
        );
    }
    Ok(entries)
}

fn open_pinned(pin_dir: &Path, name: &str) -> Result<MapData> {
    let path = pin_dir.join(name);
    MapData::from_pin(&path)
        .map_err(|e| TestbedError::Invalid(format!("opening pinned map {}: {e}", path.display())))
}

/// Runs `program args…` inside the netns at `netns` (nsenter keeps /sys) and
/// parses its JSON output.
fn json_in(netns: &Path, program: &str, args: &[&str]) -> Result<Value> {
    let net = format!("--net={}", netns.display());
    let mut full: Vec<&str> = vec![net.as_str(), "--", program];
    full.extend_from_slice(args);
    let out = cmd::run("nsenter", &full)?;
    if out.trim().is_empty() {
        return Ok(Value::Array(Vec::new()));
    }
    serde_json::from_str(&out).map_err(|e| {
        TestbedError::Invalid(format!(
            "unparsable JSON from {program} {}: {e}: {out}",
            args.join(" ")
        ))
    })
}
