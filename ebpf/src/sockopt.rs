//! `getsockopt(SO_ORIGINAL_DST)` without netfilter: a stock proxy (Istio's
//! ztunnel, Envoy) asks the socket it accepted on its outbound listener
//! where the application was connecting to, with `SOL_IP`/`SO_ORIGINAL_DST`
//! (or `SOL_IPV6`/`IP6T_SO_ORIGINAL_DST`), which only conntrack answers —
//! and in the eBPF mode nothing was NATed. This program answers it from
//! `SHUNT_ORIG_DST`, the record `connect4/6` made and `sockops` keyed by the
//! application socket's local address: the accepted socket's peer.
//!
//! Also here, called from `sockops`: forgetting a stale record when a
//! connection to the outbound listener was *not* redirected (an application
//! connecting to 127.0.0.1:15001 itself), so that the answer can never be a
//! previous connection's that used the same local port.

use aya_ebpf::{
    bindings::bpf_sock,
    helpers::bpf_get_netns_cookie,
    macros::cgroup_sockopt,
    programs::{SockOpsContext, SockoptContext},
};
use shunt_common::{OriginalDst, PORT_OUTBOUND, SockKey};

use crate::maps::ORIGINAL_DST;

/// getsockopt() returns whatever `retval` says (the program never refuses).
const PROCEED: i32 = 1;

const SOL_IP: i32 = 0;
const SOL_IPV6: i32 = 41;
/// `SO_ORIGINAL_DST` (linux/netfilter_ipv4.h) and `IP6T_SO_ORIGINAL_DST`
/// (linux/netfilter_ipv6/ip6_tables.h) share the number.
const SO_ORIGINAL_DST: i32 = 80;

const AF_INET: u32 = 2;
const AF_INET6: u32 = 10;

/// `struct sockaddr_in` as the kernel lays it out (also what connect4
/// hands `bpf_bind`).
#[repr(C)]
pub struct SockaddrIn {
    pub family: u16,
    /// Network order.
    pub port: u16,
    /// Network order.
    pub addr: u32,
    pub zero: [u8; 8],
}

/// `struct sockaddr_in6` as the kernel lays it out.
#[repr(C)]
pub struct SockaddrIn6 {
    pub family: u16,
    /// Network order.
    pub port: u16,
    pub flowinfo: u32,
    /// Network order words.
    pub addr: [u32; 4],
    pub scope_id: u32,
}

/// Hook: `cgroup/getsockopt` on the cgroup root, after the kernel's own
/// getsockopt ran. Matches `SOL_IP`/`SO_ORIGINAL_DST` and
/// `SOL_IPV6`/`IP6T_SO_ORIGINAL_DST` on a TCP socket whose local port is
/// the outbound listener's (15001) and whose peer — the application's end
/// of a connect that `connect4/6` redirected — has a record in
/// `SHUNT_ORIG_DST` for this netns. Action: writes the original destination
/// into optval as `struct sockaddr_in` (16 bytes; an IPv4 or v4-mapped
/// original, asked at `SOL_IP`) or `struct sockaddr_in6` (28 bytes; a native
/// IPv6 original, asked at `SOL_IPV6`), port and address in network order,
/// sets optlen to that size and retval to 0. Miss path (any other option,
/// socket or level, no record, an optval buffer too small): the kernel's
/// own answer untouched (typically ENOENT or ENOPROTOOPT), returns 1.
#[cgroup_sockopt(getsockopt)]
pub fn shunt_getsockopt(ctx: SockoptContext) -> i32 {
    // SAFETY: the context pointer is valid for the program's run.
    let opt = unsafe { &mut *ctx.sockopt };
    if opt.optname != SO_ORIGINAL_DST || (opt.level != SOL_IP && opt.level != SOL_IPV6) {
        return PROCEED;
    }
    // SAFETY: `sk` is set for every getsockopt; checked for null anyway.
    let sk = unsafe { opt.__bindgen_anon_1.sk };
    if sk.is_null() {
        return PROCEED;
    }
    // SAFETY: non-null socket pointer from the context.
    let Some(key) = peer_key(&ctx, unsafe { &*sk }) else {
        return PROCEED;
    };
    // SAFETY: plain value copied out of the map.
    let Some(original) = (unsafe { ORIGINAL_DST.get(&key) }).copied() else {
        return PROCEED;
    };
    let v4 = match original.family as u32 {
        AF_INET => Some(original.addr[0]),
        AF_INET6 if is_v4_mapped(&original.addr) => Some(original.addr[3]),
        _ => None,
    };
    let written = match (opt.level, v4) {
        (SOL_IP, Some(addr)) => write(
            opt,
            SockaddrIn {
                family: AF_INET as u16,
                port: original.port.to_be(),
                addr,
                zero: [0; 8],
            },
        ),
        (SOL_IPV6, None) => write(
            opt,
            SockaddrIn6 {
                family: AF_INET6 as u16,
                port: original.port.to_be(),
                flowinfo: 0,
                addr: original.addr,
                scope_id: 0,
            },
        ),
        // The other family's option: the kernel's answer (a dual-stack
        // caller asks both, as ztunnel does).
        _ => false,
    };
    if written {
        opt.retval = 0;
    }
    PROCEED
}

/// The key `sockops` recorded the connection under: the accepted socket's
/// peer, in the socket's netns. `None` unless the socket's local port is
/// the outbound listener's.
#[inline(always)]
fn peer_key(ctx: &SockoptContext, sk: &bpf_sock) -> Option<SockKey> {
    if sk.src_port != u32::from(PORT_OUTBOUND) {
        return None;
    }
    let port = u32::from(u16::from_be(sk.dst_port));
    let (family, addr) = match sk.family {
        AF_INET => (AF_INET, [sk.dst_ip4, 0, 0, 0]),
        AF_INET6 => {
            // One 4-byte load per word: the verifier allows no wider
            // access to `bpf_sock`.
            // SAFETY: reads of the context's fields.
            let ip6 = unsafe {
                [
                    core::ptr::read_volatile(&sk.dst_ip6[0]),
                    core::ptr::read_volatile(&sk.dst_ip6[1]),
                    core::ptr::read_volatile(&sk.dst_ip6[2]),
                    core::ptr::read_volatile(&sk.dst_ip6[3]),
                ]
            };
            // An IPv4 application on a dual-stack listener: sockops keyed
            // it as IPv4.
            if is_v4_mapped(&ip6) {
                (AF_INET, [ip6[3], 0, 0, 0])
            } else {
                (AF_INET6, ip6)
            }
        }
        _ => return None,
    };
    // SAFETY: the helper only reads the socket behind the context.
    let netns_cookie = unsafe { bpf_get_netns_cookie(ctx.sockopt.cast()) };
    Some(SockKey {
        netns_cookie,
        addr,
        port,
        family,
    })
}

#[inline(always)]
fn is_v4_mapped(addr: &[u32; 4]) -> bool {
    addr[0] == 0 && addr[1] == 0 && u32::from_be(addr[2]) == 0xffff
}

/// Writes `value` at the start of optval if it fits, and sets optlen.
#[inline(always)]
fn write<T>(opt: &mut aya_ebpf::bindings::bpf_sockopt, value: T) -> bool {
    let size = core::mem::size_of::<T>();
    // SAFETY: reading the context's buffer bounds.
    let (start, end) = unsafe {
        (
            opt.__bindgen_anon_2.optval as usize,
            opt.__bindgen_anon_3.optval_end as usize,
        )
    };
    if start + size > end {
        return false;
    }
    // SAFETY: [start, start + size) lies within the buffer (checked above).
    // Unaligned: a small optval lives in a byte array on the kernel stack.
    unsafe { core::ptr::write_unaligned(start as *mut T, value) };
    opt.optlen = size as i32;
    true
}

/// Called by `sockops` for the active side of a connection that was not
/// redirected: if it is connected to the outbound listener's port on
/// loopback, any record under its local address is a previous connection's
/// (the LRU keeps records after close) and is removed, so `getsockopt` on
/// the accepted end answers with the kernel's error. No-op otherwise.
#[inline(always)]
pub fn forget_unredirected(ctx: &SockOpsContext) {
    let remote_port = u16::from_be((ctx.remote_port() >> 16) as u16);
    if remote_port != PORT_OUTBOUND {
        return;
    }
    let (family, addr, loopback) = if ctx.family() == AF_INET {
        let local = ctx.local_ip4();
        (
            AF_INET,
            [local, 0, 0, 0],
            u32::from_be(ctx.remote_ip4()) >> 24 == 127,
        )
    } else {
        let local = ctx.local_ip6();
        let remote = ctx.remote_ip6();
        let loopback = if is_v4_mapped(&remote) {
            u32::from_be(remote[3]) >> 24 == 127
        } else {
            remote[0] == 0 && remote[1] == 0 && remote[2] == 0 && u32::from_be(remote[3]) == 1
        };
        if is_v4_mapped(&local) {
            (AF_INET, [local[3], 0, 0, 0], loopback)
        } else {
            (AF_INET6, local, loopback)
        }
    };
    if !loopback {
        return;
    }
    // SAFETY: the helper only reads the socket behind the context.
    let netns_cookie = unsafe { bpf_get_netns_cookie(ctx.ops.cast()) };
    let key = SockKey {
        netns_cookie,
        addr,
        port: ctx.local_port(),
        family,
    };
    let _ = ORIGINAL_DST.remove(&key);
}

// Keeps the layouts honest: the kernel's sizes.
const _: () = assert!(core::mem::size_of::<SockaddrIn>() == 16);
const _: () = assert!(core::mem::size_of::<SockaddrIn6>() == 28);
const _: () = assert!(core::mem::size_of::<OriginalDst>() == 20);
