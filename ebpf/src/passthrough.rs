//! The passthrough fast path: an enrolled pod's connect to a destination the
//! proxy has no business with (neither a mesh workload nor a service VIP)
//! is not redirected; it goes direct, and sockops reports it (opened,
//! closed with the bytes moved) through a ring buffer, so that the agent
//! still counts and logs it as the proxy would have.
//!
//! The decision needs userspace's word twice: the pod allows it
//! (`PodConfig::FAST_PATH`) and the destination table is complete
//! (`FastPathState::VALID`): the addresses (`SHUNT_FP_DESTS`) and the
//! address ranges (`SHUNT_FP_RANGES`, a ServiceEntry's CIDR, longest
//! prefix) the proxy must see. Here a *missing* entry sends a flow direct, so
//! an incomplete table must not be used: userspace turns the switch off
//! before anything that could leave it incomplete, and on only once it holds
//! the whole set. Every failure here (no state, no record kept) sends the
//! connect to the proxy, as without the fast path.
//!
//! Byte counts come from the socket at close: `bytes_acked` (what the pod
//! sent and the peer acknowledged) and `bytes_received`, less what the
//! kernel counts in them that is no payload — the SYN (the value at
//! establishment is the base), our FIN once acknowledged, the peer's FIN
//! once received. Which FINs were counted is read from the state changes
//! (see `on_state_change`).
//!
//! Events do not wake the agent one by one (a wake-up costs the agent more
//! than the event): each is submitted without a wake-up until the ring holds
//! `WAKE_AT_BYTES` unread, and the agent reads the ring on a timer besides
//! (`fastpath::report`): every 20 ms while events come, backing off to once
//! a second while none do, so an event waits at most a second (20 ms under
//! load) and an idle agent is not woken 50 times a second.
//!
//! Flow 2 (`mesh_local.rs`, same-node mesh connections) keeps its records
//! here too, marked `MESH_LOCAL`: the same events and byte accounting, and
//! its flow entry is written at the SYN and deleted at the close; through
//! a service VIP (`mesh_service.rs`, `VIA_SERVICE`) its events name the
//! VIP dialled, whose record goes at the close.

use aya_ebpf::{
    bindings::{
        BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP,
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_STATE_CB, BPF_SOCK_OPS_STATE_CB_FLAG,
        BPF_SOCK_OPS_TCP_CONNECT_CB, BPF_TCP_CLOSE, BPF_TCP_CLOSE_WAIT, BPF_TCP_CLOSING,
        BPF_TCP_FIN_WAIT1, BPF_TCP_FIN_WAIT2, BPF_TCP_LAST_ACK,
    },
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_ktime_get_ns},
    maps::lpm_trie::Key,
    programs::{SockAddrContext, SockOpsContext},
};
use shunt_common::{
    FastPathDest, FastPathEvent, FastPathSock, FastPathState, FastPathStats, PodConfig,
};

use crate::maps::{
    FAST_PATH_DESTS, FAST_PATH_EVENTS, FAST_PATH_RANGES, FAST_PATH_SOCKS, FAST_PATH_STATE,
    FAST_PATH_STATS,
};

const AF_INET: u32 = 2;

/// Unread bytes in `SHUNT_FP_EVENTS` (256 KiB) at which a submit wakes the
/// agent: about 250 events, an eighth of the ring, so a burst between two of
/// the agent's timed reads never fills it.
const WAKE_AT_BYTES: u64 = 32 * 1024;

/// Called by connect4/6 for a connect they would redirect: true when it
/// goes direct instead (the pod allows the fast path, the table is valid,
/// `dst` is neither in it nor in one of its ranges, and the connection's
/// record was kept for sockops).
/// `dst` as the table keys it (IPv4 mapped into IPv6).
#[inline(always)]
pub fn goes_direct(
    ctx: &SockAddrContext,
    slot: u32,
    config: &PodConfig,
    dst: &FastPathDest,
) -> bool {
    if config.flags & PodConfig::FAST_PATH == 0 {
        return false;
    }
    let Some(stats) = stats() else {
        return false;
    };
    let flags = FAST_PATH_STATE.get(0).map_or(0, |s| s.flags);
    if flags & FastPathState::VALID == 0 {
        stats.table_invalid += 1;
        return false;
    }
    // SAFETY: plain value read out of the map.
    if unsafe { FAST_PATH_DESTS.get(dst) }.is_some() {
        return false;
    }
    // A ServiceEntry's CIDR: the proxy must see a connect into it (its
    // service, its waypoint). The trie is looked up only while it holds
    // a range, so a node without any pays nothing for it.
    if flags & FastPathState::RANGES != 0 && FAST_PATH_RANGES.get(Key::new(128, *dst)).is_some() {
        return false;
    }
    // SAFETY: the helpers only read the socket behind the context.
    let (cookie, netns_cookie) = unsafe {
        (
            bpf_get_socket_cookie(ctx.sock_addr.cast()),
            bpf_get_netns_cookie(ctx.sock_addr.cast()),
        )
    };
    let record = FastPathSock {
        netns_cookie,
        // SAFETY: no argument.
        started_ns: unsafe { bpf_ktime_get_ns() },
        slot,
        ..FastPathSock::default()
    };
    if FAST_PATH_SOCKS.insert(cookie, &record, 0).is_err() {
        // Unreported would be worse than slower.
        stats.untracked += 1;
        return false;
    }
    stats.direct += 1;
    true
}

/// Called first by sockops: handles the ops of a fast-path socket and
/// returns true when it did (the caller then stops). Matches (1) the SYN of
/// a recorded connect: asks for state callbacks; (2) its establishment:
/// sends an opened event; (3) its state changes: notes FINs, and at CLOSE
/// sends a closed event with the bytes and forgets the socket. Miss path
/// (any socket not recorded): false, nothing done.
#[inline(always)]
pub fn on_sock_ops(ctx: &SockOpsContext) -> bool {
    let op = ctx.op();
    if op != BPF_SOCK_OPS_TCP_CONNECT_CB
        && op != BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB
        && op != BPF_SOCK_OPS_STATE_CB
    {
        return false;
    }
    // SAFETY: the helper only reads the socket behind the context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.ops.cast()) };
    let Some(record) = FAST_PATH_SOCKS.get_ptr_mut(cookie) else {
        return false;
    };
    // SAFETY: map value; sockops runs under the socket's lock, the only
    // writer of this socket's record after connect.
    let record = unsafe { &mut *record };
    match op {
        BPF_SOCK_OPS_TCP_CONNECT_CB => {
            // From the SYN on, the move to CLOSE is seen, refused or not.
            let _ = ctx.set_cb_flags((ctx.cb_flags() | BPF_SOCK_OPS_STATE_CB_FLAG) as i32);
            crate::mesh_local::on_connect(ctx, record);
        }
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB => {
            // SAFETY: the context's fields are read as the verifier allows.
            let ops = unsafe { &*ctx.ops };
            record.acked_base = ops.bytes_acked;
            record.received_base = ops.bytes_received;
            record.flags |= FastPathSock::ESTABLISHED;
            emit(ctx, cookie, record, FastPathEvent::OPENED, 0, 0, 0);
        }
        _ => on_state_change(ctx, cookie, record),
    }
    true
}

/// A state change of a fast-path socket. FINs counted by the kernel in the
/// byte counters: ours once acknowledged (FIN_WAIT1 → FIN_WAIT2, or a move
/// to CLOSE from CLOSING or LAST_ACK with nothing left unacknowledged), the
/// peer's once received (→ CLOSE_WAIT, → CLOSING, or FIN_WAIT2 → CLOSE
/// with `rcv_nxt` moved since FIN_WAIT2 began and no close() by the
/// application in FIN_WAIT2, which the kernel shows as FIN_WAIT2 →
/// FIN_WAIT2). A reset in FIN_WAIT2 after data arrived there is taken for
/// a FIN: the received count is then one short.
#[inline(always)]
fn on_state_change(ctx: &SockOpsContext, cookie: u64, record: &mut FastPathSock) {
    let (old, new) = (ctx.arg(0), ctx.arg(1));
    // SAFETY: the context's fields are read as the verifier allows.
    let ops = unsafe { &*ctx.ops };
    if new == BPF_TCP_CLOSE_WAIT || new == BPF_TCP_CLOSING {
        record.flags |= FastPathSock::PEER_FIN;
    }
    if new == BPF_TCP_FIN_WAIT2 {
        if old == BPF_TCP_FIN_WAIT1 {
            record.flags |= FastPathSock::FIN_ACKED;
            record.rcv_nxt_fin_wait2 = ops.rcv_nxt;
        } else if old == BPF_TCP_FIN_WAIT2 {
            record.flags |= FastPathSock::CLOSED_IN_FIN_WAIT2;
        }
    }
    if new != BPF_TCP_CLOSE {
        return;
    }
    if (old == BPF_TCP_CLOSING || old == BPF_TCP_LAST_ACK) && ops.snd_una == ops.snd_nxt {
        record.flags |= FastPathSock::FIN_ACKED;
    }
    if old == BPF_TCP_FIN_WAIT2
        && record.flags & FastPathSock::CLOSED_IN_FIN_WAIT2 == 0
        && ops.rcv_nxt != record.rcv_nxt_fin_wait2
    {
        record.flags |= FastPathSock::PEER_FIN;
    }
    let (sent, received, failed) = if record.flags & FastPathSock::ESTABLISHED != 0 {
        let fin_acked = u64::from(record.flags & FastPathSock::FIN_ACKED != 0);
        let peer_fin = u64::from(record.flags & FastPathSock::PEER_FIN != 0);
        (
            ops.bytes_acked
                .saturating_sub(record.acked_base)
                .saturating_sub(fin_acked),
            ops.bytes_received
                .saturating_sub(record.received_base)
                .saturating_sub(peer_fin),
            0,
        )
    } else {
        (0, 0, FastPathEvent::FAILED)
    };
    emit(
        ctx,
        cookie,
        record,
        FastPathEvent::CLOSED,
        sent,
        received,
        failed,
    );
    crate::mesh_local::on_close(ctx, record);
    crate::mesh_service::forget(cookie, record);
    let _ = FAST_PATH_SOCKS.remove(cookie);
}

/// Sends one event; a full ring buffer drops it and counts the drop.
#[inline(always)]
fn emit(
    ctx: &SockOpsContext,
    cookie: u64,
    record: &FastPathSock,
    kind: u32,
    bytes_sent: u64,
    bytes_received: u64,
    flags: u32,
) {
    let Some(mut entry) = FAST_PATH_EVENTS.reserve::<FastPathEvent>(0) else {
        if let Some(stats) = stats() {
            stats.events_dropped += 1;
        }
        return;
    };
    let family = ctx.family();
    let (src_addr, dst_addr) = if family == AF_INET {
        ([ctx.local_ip4(), 0, 0, 0], [ctx.remote_ip4(), 0, 0, 0])
    } else {
        ip6_of(ctx)
    };
    // SAFETY: no argument.
    let now = unsafe { bpf_ktime_get_ns() };
    let mesh_local = if record.flags & FastPathSock::MESH_LOCAL != 0 {
        FastPathEvent::MESH_LOCAL
    } else {
        0
    };
    // Flow 2 through a VIP: the service the application dialled.
    let service = if record.flags & FastPathSock::VIA_SERVICE != 0 {
        crate::mesh_service::dialled(cookie)
    } else {
        None
    };
    let (service_addr, service_port, service_family) =
        service.map_or(([0; 4], 0, 0), |s| (s.addr, s.port, s.family));
    entry.write(FastPathEvent {
        kind,
        slot: record.slot,
        netns_cookie: record.netns_cookie,
        socket_cookie: cookie,
        src_addr,
        dst_addr,
        src_port: ctx.local_port(),
        // Network order in the upper half of the field.
        dst_port: u32::from(u16::from_be((ctx.remote_port() >> 16) as u16)),
        family,
        flags: flags | mesh_local,
        bytes_sent,
        bytes_received,
        duration_ns: now.saturating_sub(record.started_ns),
        service_addr,
        service_port,
        service_family,
    });
    let wake = if FAST_PATH_EVENTS.query(u64::from(BPF_RB_AVAIL_DATA)) >= WAKE_AT_BYTES {
        BPF_RB_FORCE_WAKEUP
    } else {
        BPF_RB_NO_WAKEUP
    };
    entry.submit(u64::from(wake));
}

/// The local and remote IPv6 addresses, each word read on its own: the
/// verifier refuses a load through a context pointer moved by an offset,
/// which copying the arrays whole can compile to.
#[inline(always)]
pub fn ip6_of(ctx: &SockOpsContext) -> ([u32; 4], [u32; 4]) {
    use core::ptr::{addr_of, read_volatile};
    let ops = ctx.ops;
    // SAFETY: in-bounds fields of the context, read as the verifier allows.
    unsafe {
        (
            [
                read_volatile(addr_of!((*ops).local_ip6[0])),
                read_volatile(addr_of!((*ops).local_ip6[1])),
                read_volatile(addr_of!((*ops).local_ip6[2])),
                read_volatile(addr_of!((*ops).local_ip6[3])),
            ],
            [
                read_volatile(addr_of!((*ops).remote_ip6[0])),
                read_volatile(addr_of!((*ops).remote_ip6[1])),
                read_volatile(addr_of!((*ops).remote_ip6[2])),
                read_volatile(addr_of!((*ops).remote_ip6[3])),
            ],
        )
    }
}

#[inline(always)]
fn stats() -> Option<&'static mut FastPathStats> {
    let ptr = FAST_PATH_STATS.get_ptr_mut(0)?;
    // SAFETY: per-CPU value; only this CPU writes it while the program runs.
    Some(unsafe { &mut *ptr })
}
