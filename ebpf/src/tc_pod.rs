//! TC programs on an enrolled pod's `eth0` (inside the pod's netns).
//!
//! Every enrolled pod gets its own instance of these programs, loaded with
//! `POD_SLOT` fixed to the pod's counter slot. A per-packet map lookup cannot
//! find the pod instead: `bpf_get_netns_cookie()` on an skb answers for the
//! packet's socket, and arriving packets have none yet (measured: it returned
//! the wrong namespace on ingress), while ifindexes repeat across pod
//! namespaces. Baking the slot in costs one program load per pod and nothing
//! per packet.
//!
//! Today they count the pod's traffic in each direction; inbound steering to
//! the proxy (`bpf_sk_assign`) grows here.

use aya_ebpf::{
    Global,
    bindings::TC_ACT_OK,
    macros::{classifier, map},
    maps::{HashMap, PerCpuArray},
    programs::TcContext,
};
use aya_log_ebpf::debug;
use shunt_common::{MAX_PODS, PodCounters, PodSlot};

/// The counter slot of the pod this instance was loaded for (set by the
/// agent at load time; `u32::MAX` means "no pod").
#[unsafe(no_mangle)]
static POD_SLOT: Global<u32> = Global::new(u32::MAX);

/// netns cookie → counter slot: the record of which namespaces are enrolled,
/// written by the agent. The socket-level programs (connect, sockops) key on
/// it; the TC programs use their baked-in slot.
#[map(name = "SHUNT_ENROLLED")]
static ENROLLED: HashMap<u64, PodSlot> = HashMap::with_max_entries(MAX_PODS, 0);

/// Per-pod counters, per CPU (no atomics on the BPF target).
#[map(name = "SHUNT_POD_COUNTERS")]
static POD_COUNTERS: PerCpuArray<PodCounters> = PerCpuArray::with_max_entries(MAX_PODS, 0);

const ETH_HDR_LEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const IPPROTO_TCP: u8 = 6;
const TCP_FLAG_SYN: u8 = 0x02;
const TCP_FLAG_ACK: u8 = 0x10;

#[derive(Clone, Copy)]
enum Direction {
    In,
    Out,
}

/// Hook: TC ingress (clsact) on an enrolled pod's `eth0` — packets arriving
/// at the pod. Matches every packet and counts it in the pod's slot. Miss
/// path (an instance loaded without a slot): `TC_ACT_OK`, untouched. Never
/// drops or changes a packet.
#[classifier]
pub fn shunt_tc_ingress(ctx: TcContext) -> i32 {
    count(&ctx, Direction::In);
    TC_ACT_OK
}

/// Hook: TC egress (clsact) on an enrolled pod's `eth0` — packets the pod
/// sends. Same matching and counting as ingress; always `TC_ACT_OK`.
#[classifier]
pub fn shunt_tc_egress(ctx: TcContext) -> i32 {
    count(&ctx, Direction::Out);
    TC_ACT_OK
}

#[inline(always)]
fn count(ctx: &TcContext, direction: Direction) {
    let slot = POD_SLOT.load();
    // Out of range (including "no pod") fails the lookup: the miss path.
    let Some(counters) = POD_COUNTERS.get_ptr_mut(slot) else {
        return;
    };
    let len = u64::from(ctx.len());
    // SAFETY: per-CPU slot, only this CPU writes it while this program runs.
    let counters = unsafe { &mut *counters };
    match direction {
        Direction::In => {
            counters.packets_in += 1;
            counters.bytes_in += len;
        }
        Direction::Out => {
            counters.packets_out += 1;
            counters.bytes_out += len;
        }
    }
    if is_tcp_syn(ctx) {
        let dir = match direction {
            Direction::In => "in",
            Direction::Out => "out",
        };
        debug!(ctx, "pod slot {}: new TCP connection {}", slot, dir);
    }
}

/// True for the first segment of a TCP handshake (SYN without ACK), IPv4 or
/// IPv6 without extension headers. Used only to log connection starts.
#[inline(always)]
fn is_tcp_syn(ctx: &TcContext) -> bool {
    let Ok(eth_proto) = ctx.load::<u16>(12) else {
        return false;
    };
    let (proto, l4_offset) = match u16::from_be(eth_proto) {
        ETH_P_IP => {
            let Ok(ver_ihl) = ctx.load::<u8>(ETH_HDR_LEN) else {
                return false;
            };
            let Ok(proto) = ctx.load::<u8>(ETH_HDR_LEN + 9) else {
                return false;
            };
            (proto, ETH_HDR_LEN + usize::from(ver_ihl & 0x0f) * 4)
        }
        ETH_P_IPV6 => {
            let Ok(next_header) = ctx.load::<u8>(ETH_HDR_LEN + 6) else {
                return false;
            };
            (next_header, ETH_HDR_LEN + 40)
        }
        _ => return false,
    };
    if proto != IPPROTO_TCP {
        return false;
    }
    match ctx.load::<u8>(l4_offset + 13) {
        Ok(flags) => flags & (TCP_FLAG_SYN | TCP_FLAG_ACK) == TCP_FLAG_SYN,
        Err(_) => false,
    }
}
