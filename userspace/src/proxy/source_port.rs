//! Which port the proxy's connection to the application leaves from when
//! it leaves from the client's address (source preservation).
//!
//! `bind` with port 0 reserves a port for every destination at once,
//! walking each candidate port's owners: with tens of thousands of
//! connections from one client in TIME_WAIT that walk cost milliseconds per
//! connection, then found no port at all (docs/BENCHMARKS.md, "Port choice
//! for the client's address"; ztunnel binds port 0). So the port is left to
//! `connect` (`IP_BIND_ADDRESS_NO_PORT`), which picks one free for this
//! destination by a lookup per port tried. A client of inbound plaintext
//! needs one port kept out of that choice (see [`SourcePort::Except`]); the
//! kernel takes a narrower range per socket (`IP_LOCAL_PORT_RANGE`, Linux
//! 6.3+), cut from the pod's own range on the side of that port with more
//! ports.

use std::{
    io,
    os::fd::AsRawFd,
    sync::{
        OnceLock,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use socket2::Socket;

/// Which port the proxy's connection to the application leaves from (the
/// address is the client's).
#[derive(Clone, Copy, Debug)]
pub(crate) enum SourcePort {
    /// Any the kernel finds free at `connect` for this destination: a
    /// tunnelled client (HBONE), whose own socket lives in another netns.
    AtConnect,
    /// Any but the client's own port: the client's connection ended in this
    /// netns (inbound plaintext), and the proxy's accepted socket holds
    /// podIP:appPort ⇄ client:port. The application's side of our
    /// connection would be that same 4-tuple, and `connect`'s own check
    /// cannot see the clash (it looks for our orientation of the tuple), so
    /// the kernel would deliver our SYN to the accepted socket.
    Except(u16),
}

/// `IP_LOCAL_PORT_RANGE` (uapi `linux/in.h`; not in the libc crate).
const IP_LOCAL_PORT_RANGE: libc::c_int = 51;

/// How long a read of the pod's port range is trusted. Limitation: a range
/// narrowed within this time to end exactly at a client's port lets the
/// kernel pick that port (the per-socket bounds outside the new range are
/// ignored), once.
const RANGE_FRESH: Duration = Duration::from_secs(1);

/// The pod's ephemeral port range (`net.ipv4.ip_local_port_range` of its
/// netns), read in the netns at most once per [`RANGE_FRESH`].
#[derive(Debug, Default)]
pub(crate) struct PortRangeCache {
    /// `lo | hi << 16 | read_at_ms << 32` (ms since [`epoch`], wrapping);
    /// 0: never read.
    packed: AtomicU64,
}

impl PortRangeCache {
    /// The range, read again when stale. Must run inside the pod's netns
    /// (`/proc/sys/net` answers for the reader's). `None` when it cannot be
    /// read or parsed.
    pub(crate) fn get_here(&self) -> Option<(u16, u16)> {
        let now = millis_since_epoch();
        let packed = self.packed.load(Ordering::Relaxed);
        let read_at = packed >> 32;
        if packed != 0 && (now.wrapping_sub(read_at) & 0xffff_ffff) < RANGE_FRESH.as_millis() as u64
        {
            return Some((packed as u16, (packed >> 16) as u16));
        }
        let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
        let (lo, hi) = parse_range(&text)?;
        let packed = u64::from(lo) | u64::from(hi) << 16 | (now & 0xffff_ffff) << 32;
        // Never 0: a range starts at port 1 or above.
        self.packed.store(packed, Ordering::Relaxed);
        Some((lo, hi))
    }
}

fn millis_since_epoch() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64
}

/// `"32768\t60999\n"` → `(32768, 60999)`.
fn parse_range(text: &str) -> Option<(u16, u16)> {
    let mut fields = text.split_whitespace();
    let lo = fields.next()?.parse::<u16>().ok()?;
    let hi = fields.next()?.parse::<u16>().ok()?;
    (lo >= 1 && lo <= hi).then_some((lo, hi))
}

/// The part of `range` a socket may take its port from so that it is not
/// `avoid`: the whole range when `avoid` is outside it, else the side of
/// `avoid` with more ports; `None` when `avoid` is the range's only port.
/// Both bounds lie inside `range`, which the kernel needs to apply them.
pub(crate) fn ports_without((lo, hi): (u16, u16), avoid: u16) -> Option<(u16, u16)> {
    if avoid < lo || avoid > hi {
        return Some((lo, hi));
    }
    let above = hi - avoid;
    let below = avoid - lo;
    if above == 0 && below == 0 {
        None
    } else if above >= below {
        Some((avoid + 1, hi))
    } else {
        Some((lo, avoid - 1))
    }
}

/// Narrows the ports `socket`'s `connect` may pick (`IP_LOCAL_PORT_RANGE`):
/// fails on kernels before 6.3.
pub(crate) fn set_local_port_range(socket: &Socket, (lo, hi): (u16, u16)) -> io::Result<()> {
    let value: u32 = u32::from(lo) | u32::from(hi) << 16;
    // SAFETY: a plain setsockopt on a socket we own, with a u32 value and
    // its size.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_IP,
            IP_LOCAL_PORT_RANGE,
            (&value as *const u32).cast(),
            std::mem::size_of::<u32>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_range_parses_as_procfs_writes_it() {
        assert_eq!(parse_range("32768\t60999\n"), Some((32768, 60999)));
        assert_eq!(parse_range("10000 65000"), Some((10000, 65000)));
        assert_eq!(parse_range("60999\t32768\n"), None);
        assert_eq!(parse_range("0\t10\n"), None);
        assert_eq!(parse_range("oops"), None);
    }

    #[test]
    fn the_avoided_port_is_cut_out_on_its_larger_side() {
        // Outside: the whole range.
        assert_eq!(ports_without((40000, 40003), 39999), Some((40000, 40003)));
        assert_eq!(ports_without((40000, 40003), 40004), Some((40000, 40003)));
        // At either edge: the rest.
        assert_eq!(ports_without((40000, 40003), 40000), Some((40001, 40003)));
        assert_eq!(ports_without((40000, 40003), 40003), Some((40000, 40002)));
        // Inside: the larger side (above on a tie).
        assert_eq!(ports_without((40000, 40003), 40001), Some((40002, 40003)));
        assert_eq!(ports_without((40000, 40003), 40002), Some((40000, 40001)));
        assert_eq!(ports_without((10000, 65000), 60000), Some((10000, 59999)));
        // The only port.
        assert_eq!(ports_without((40000, 40000), 40000), None);
        assert_eq!(ports_without((1, 65535), 65535), Some((1, 65534)));
    }
}
