//! What an agent has pinned (`/debug/bpf` of the admin API): every map
//! under its pin dir with its type, sizes and how full it is, and every
//! pinned link with the program it holds. Read-only: objects are opened by
//! their pins and closed again.

use std::{
    collections::HashMap,
    os::fd::{AsFd as _, AsRawFd as _},
    path::{Path, PathBuf},
};

use aya::maps::{MapInfo, MapType};
use serde::Serialize;

/// One pinned map.
#[derive(Clone, Debug, Serialize)]
pub struct MapReport {
    /// Pin path.
    pub pin: PathBuf,
    pub name: String,
    pub id: u32,
    pub map_type: String,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
    /// Keys present (hash-like maps; arrays always hold `max_entries`).
    pub entries: Option<u32>,
    /// `entries / max_entries` in percent.
    pub fill_percent: Option<f64>,
}

/// One pinned link.
#[derive(Clone, Debug, Serialize)]
pub struct LinkReport {
    pub pin: PathBuf,
    pub id: u32,
    pub link_type: String,
    pub program_id: u32,
    pub program_name: Option<String>,
}

/// A pinned object that could not be read as a map or a link.
#[derive(Clone, Debug, Serialize)]
pub struct Unreadable {
    pub pin: PathBuf,
    pub error: String,
}

/// Everything pinned under a pin dir.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PinReport {
    pub pin_dir: PathBuf,
    pub maps: Vec<MapReport>,
    pub links: Vec<LinkReport>,
    pub unreadable: Vec<Unreadable>,
    /// What this agent's load kept, replaced and migrated of what it found
    /// pinned (`upgrade.rs`); `None` in a process that loaded nothing.
    pub upgrade: Option<super::upgrade::UpgradeReport>,
}

/// Reads every object pinned below `pin_dir` (recursively, bounded).
pub fn pin_report(pin_dir: &Path) -> PinReport {
    let mut report = PinReport {
        pin_dir: pin_dir.to_path_buf(),
        upgrade: super::upgrade::published(),
        ..Default::default()
    };
    let mut pins = Vec::new();
    collect(pin_dir, 0, &mut pins);
    pins.sort();
    let mut program_names: Option<HashMap<u32, String>> = None;
    for pin in pins {
        // Info about an object is read by fd whatever its kind: the kind
        // must be known first, or a link's info is read as a map's.
        let read = match object_kind(&pin) {
            Ok(Kind::Map) => MapInfo::from_pin(&pin)
                .map(|info| report.maps.push(map_report(pin.clone(), &info)))
                .map_err(|e| e.to_string()),
            Ok(Kind::Link) => {
                link_report(&pin, &mut program_names).map(|link| report.links.push(link))
            }
            Ok(Kind::Other(kind)) => Err(format!("a pinned {kind}")),
            Err(e) => Err(e.to_string()),
        };
        if let Err(error) = read {
            report.unreadable.push(Unreadable { pin, error });
        }
    }
    report
}

enum Kind {
    Map,
    Link,
    Other(String),
}

/// Opens the pin (`BPF_OBJ_GET`) and tells the object's kind from its
/// anonymous inode (`anon_inode:bpf-map`, `anon_inode:bpf-link`, ...).
fn object_kind(pin: &Path) -> std::io::Result<Kind> {
    let fd = super::sys::obj_get(pin)?;
    let target = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))?;
    let target = target.to_string_lossy();
    Ok(match target.trim_start_matches("anon_inode:") {
        "bpf-map" => Kind::Map,
        "bpf-link" | "bpf_link" => Kind::Link,
        other => Kind::Other(other.to_string()),
    })
}

fn collect(dir: &Path, depth: usize, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten().take(4096) {
        let path = entry.path();
        match entry.file_type() {
            Ok(t) if t.is_dir() && depth < 4 => collect(&path, depth + 1, out),
            Ok(t) if t.is_file() => out.push(path),
            _ => {}
        }
    }
}

fn map_report(pin: PathBuf, info: &MapInfo) -> MapReport {
    let map_type = info.map_type();
    let countable = matches!(
        map_type,
        Ok(MapType::Hash
            | MapType::LruHash
            | MapType::PerCpuHash
            | MapType::LruPerCpuHash
            | MapType::LpmTrie
            | MapType::SockHash
            | MapType::HashOfMaps)
    );
    let entries = if countable {
        info.fd()
            .ok()
            .and_then(|fd| count_keys(fd.as_fd().as_raw_fd(), info.key_size(), info.max_entries()))
    } else {
        None
    };
    MapReport {
        name: info.name_as_str().unwrap_or_default().to_string(),
        id: info.id(),
        map_type: match map_type {
            Ok(t) => format!("{t:?}"),
            Err(e) => format!("unknown ({e})"),
        },
        key_size: info.key_size(),
        value_size: info.value_size(),
        max_entries: info.max_entries(),
        fill_percent: entries
            .filter(|_| info.max_entries() > 0)
            .map(|n| (f64::from(n) * 10000.0 / f64::from(info.max_entries())).round() / 100.0),
        entries,
        pin,
    }
}

fn link_report(
    pin: &Path,
    program_names: &mut Option<HashMap<u32, String>>,
) -> Result<LinkReport, String> {
    let link = aya::programs::links::PinnedLink::from_pin(pin).map_err(|e| e.to_string())?;
    let info = aya::programs::links::FdLink::from(link)
        .info()
        .map_err(|e| e.to_string())?;
    let names = program_names.get_or_insert_with(|| {
        aya::programs::loaded_programs()
            .filter_map(Result::ok)
            .filter_map(|p| Some((p.id(), p.name_as_str()?.to_string())))
            .collect()
    });
    Ok(LinkReport {
        pin: pin.to_path_buf(),
        id: info.id(),
        link_type: match info.link_type() {
            Ok(t) => format!("{t:?}"),
            Err(e) => format!("unknown ({e})"),
        },
        program_id: info.program_id(),
        program_name: names.get(&info.program_id()).cloned(),
    })
}

/// Counts a map's keys with `BPF_MAP_GET_NEXT_KEY` (at most `max + 1`
/// calls). `None` when the map does not support iteration.
fn count_keys(fd: i32, key_size: u32, max: u32) -> Option<u32> {
    /// `union bpf_attr` as the map element commands use it.
    #[repr(C)]
    struct MapElemAttr {
        map_fd: u32,
        _pad: u32,
        key: u64,
        next_key: u64,
        flags: u64,
    }
    const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
    let size = key_size.max(1) as usize;
    let mut key = vec![0u8; size];
    let mut next = vec![0u8; size];
    let mut count = 0u32;
    let mut first = true;
    while count <= max {
        let attr = MapElemAttr {
            map_fd: fd as u32,
            _pad: 0,
            key: if first { 0 } else { key.as_ptr() as u64 },
            next_key: next.as_mut_ptr() as u64,
            flags: 0,
        };
        // SAFETY: `attr` points at buffers of the map's key size that live
        // across the call; the kernel writes at most key_size bytes to
        // `next_key`.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_MAP_GET_NEXT_KEY,
                &attr as *const MapElemAttr,
                std::mem::size_of::<MapElemAttr>(),
            )
        };
        if rc != 0 {
            let errno = std::io::Error::last_os_error().raw_os_error();
            return (errno == Some(libc::ENOENT)).then_some(count);
        }
        count += 1;
        first = false;
        std::mem::swap(&mut key, &mut next);
    }
    Some(count)
}
