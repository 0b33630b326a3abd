//! Recovering the original destination of a redirected connection, for the
//! proxy: the peer of the socket it accepted on 15001 is the application's
//! local end, which `sockops` recorded with the original destination.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream},
    os::fd::AsFd,
    path::Path,
};

use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use shunt_common::{OriginalDst as Recorded, SockKey, maps};

use super::LoadError;
use crate::redirect::{OriginalDst, OriginalDstError};

const AF_INET: u16 = 2;
const AF_INET6: u16 = 10;

/// Reads `SHUNT_ORIG_DST` through its own handle on the pinned map.
pub struct EbpfOriginalDst {
    map: BpfHashMap<MapData, SockKey, Recorded>,
}

impl EbpfOriginalDst {
    pub fn open(pin_dir: &Path) -> Result<Self, LoadError> {
        let path = pin_dir.join(maps::ORIGINAL_DST);
        let data = MapData::from_pin(&path).map_err(|e| LoadError::Map {
            name: maps::ORIGINAL_DST,
            detail: format!("opening {}: {e}", path.display()),
        })?;
        let map = BpfHashMap::try_from(Map::LruHashMap(data)).map_err(|e| LoadError::Map {
            name: maps::ORIGINAL_DST,
            detail: e.to_string(),
        })?;
        Ok(Self { map })
    }
}

impl OriginalDst for EbpfOriginalDst {
    fn original_dst(&self, accepted: &TcpStream) -> Result<SocketAddr, OriginalDstError> {
        let peer = accepted.peer_addr()?;
        let key = SockKey {
            netns_cookie: crate::netns::socket_netns_cookie(accepted.as_fd())?,
            addr: to_words(peer.ip()),
            port: u32::from(peer.port()),
            family: if peer.is_ipv4() { 2 } else { 10 },
        };
        let recorded = self
            .map
            .get(&key, 0)
            .map_err(|_| OriginalDstError::NotRedirected { peer })?;
        from_recorded(&recorded).ok_or(OriginalDstError::NotRedirected { peer })
    }
}

/// Addresses as the kernel hands them to the programs: network-order words,
/// IPv4 in the first. A v4-mapped IPv6 peer (an IPv4 client on a dual-stack
/// listener) is the IPv4 address its socket has.
fn to_words(ip: IpAddr) -> [u32; 4] {
    let ip = match ip {
        IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map(IpAddr::V4)
            .unwrap_or(IpAddr::V6(v6)),
        v4 => v4,
    };
    match ip {
        IpAddr::V4(v4) => [u32::from_ne_bytes(v4.octets()), 0, 0, 0],
        IpAddr::V6(v6) => {
            let o = v6.octets();
            let word = |i: usize| u32::from_ne_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
            [word(0), word(4), word(8), word(12)]
        }
    }
}

fn from_recorded(recorded: &Recorded) -> Option<SocketAddr> {
    let ip = match recorded.family {
        AF_INET => IpAddr::V4(Ipv4Addr::from(recorded.addr[0].to_ne_bytes())),
        AF_INET6 => {
            let mut octets = [0u8; 16];
            for (i, word) in recorded.addr.iter().enumerate() {
                octets[i * 4..i * 4 + 4].copy_from_slice(&word.to_ne_bytes());
            }
            let v6 = Ipv6Addr::from(octets);
            // A dual-stack socket's connect to ::ffff:a.b.c.d means a.b.c.d.
            v6.to_ipv4_mapped()
                .map(IpAddr::V4)
                .unwrap_or(IpAddr::V6(v6))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, recorded.port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_round_trip_through_kernel_words() {
        for addr in ["198.18.1.2:8080", "[2001:db8::1]:443"] {
            let addr: SocketAddr = addr.parse().unwrap();
            let recorded = Recorded {
                addr: to_words(addr.ip()),
                port: addr.port(),
                family: if addr.is_ipv4() { AF_INET } else { AF_INET6 },
            };
            assert_eq!(from_recorded(&recorded), Some(addr));
        }
    }

    #[test]
    fn v4_mapped_destination_is_reported_as_ipv4() {
        let mapped: IpAddr = "::ffff:198.18.1.2".parse().unwrap();
        let v6 = match mapped {
            IpAddr::V6(v6) => v6,
            IpAddr::V4(_) => unreachable!(),
        };
        let o = v6.octets();
        let word = |i: usize| u32::from_ne_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
        let recorded = Recorded {
            addr: [word(0), word(4), word(8), word(12)],
            port: 80,
            family: AF_INET6,
        };
        assert_eq!(
            from_recorded(&recorded),
            Some("198.18.1.2:80".parse().unwrap())
        );
    }
}
