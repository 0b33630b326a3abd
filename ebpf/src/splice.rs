//! Splice: payload between an application and the proxy inside its pod
//! skips the TCP/IP stack. Both ends of each such connection join
//! `SHUNT_SPLICE_SOCKS` — an application's redirected connect to 15001 and
//! the proxy's accepted end; the proxy's connection delivering an inbound
//! connection to the pod's own address and the application's accepted end
//! — and the `sk_msg` program moves each send straight into the peer
//! socket's receive queue.
//!
//! The kernel bounds none of this: a redirected send is charged to global
//! TCP memory only, never to the receiver's buffer, so a reader that falls
//! behind would let the queue grow until the machine runs out. shunt bounds
//! it per direction: the sender's program counts what it spliced, a hook on
//! the receive side counts what was read, and once the difference would pass
//! `GlobalConfig::splice_backlog` that direction falls back to the TCP
//! stack — for good, because bytes already queued by the splice are read
//! before bytes that arrive by TCP, never after.
//!
//! Before a direction falls back, every byte its receiver reads came through
//! the splice, so "read" is simply everything the receiver's `recvmsg`
//! returns (the `sock_recv_length` tracepoint; a raw tracepoint because it
//! needs no tracefs and works where fentry/fexit are locked down).
//!
//! Every failure leaves a direction on the TCP stack: a peer that is not in
//! the map yet, an evicted flow, a missing receive hook (then nothing is ever
//! counted as read and the backlog limit trips).
//!
//! Limits of the kernel's sockmap receive path that apply to any spliced
//! socket (why `--splice` is off by default): a blocking `read()` woken
//! without data returns EAGAIN instead of waiting on, and `splice(2)` from
//! the socket sees only bytes that came by TCP.

use aya_ebpf::{
    bindings::{
        BPF_ANY, BPF_F_INGRESS, BPF_SOCK_OPS_STATE_CB_FLAG, BPF_TCP_CLOSE, sk_action::SK_PASS,
    },
    helpers::bpf_get_netns_cookie,
    macros::{raw_tracepoint, sk_msg},
    programs::{RawTracePointContext, SkMsgContext, SockOpsContext},
};
use shunt_common::{
    DEFAULT_SPLICE_BACKLOG, GlobalConfig, PROXY_MARK, PodAddrs, PodConfig, SpliceFlow, SpliceKey,
};

use crate::maps::{
    ENROLLED, POD_ADDRS, POD_CONFIG, SPLICE_FLOWS, SPLICE_KEYS, SPLICE_SOCKS, counters,
    global_config,
};

const AF_INET: u32 = 2;
const AF_INET6: u32 = 10;
/// `recvmsg` flag: the bytes stay queued.
const MSG_PEEK: i32 = 2;

/// Hook: `sk_msg` on `SHUNT_SPLICE_SOCKS` (every send of a socket in it).
/// Matches sends whose receiving end is still splicing and whose backlog
/// stays within the limit; redirects them into the peer's receive queue and
/// counts them. Miss path: `SK_PASS` without a redirect, i.e. the normal TCP
/// send, after marking the direction fallen back.
#[sk_msg]
pub fn shunt_splice_msg(ctx: SkMsgContext) -> u32 {
    // SAFETY: the context pointer is valid for the program's run.
    let md = unsafe { &*ctx.msg };
    // SAFETY: the helper only reads the socket behind the context.
    let netns_cookie = unsafe { bpf_get_netns_cookie(ctx.msg.cast()) };
    let sender = key_of(
        netns_cookie,
        md.family,
        (md.local_ip4, md.local_ip6),
        (md.remote_ip4, md.remote_ip6),
        md.local_port,
        md.remote_port,
    );
    let mut receiver = sender.peer();
    let Some(flow) = SPLICE_FLOWS.get_ptr_mut(receiver) else {
        return SK_PASS;
    };
    // SAFETY: map value; only this sender's program (serialised by its
    // socket lock) writes `spliced` and `fallen_back`.
    let flow = unsafe { &mut *flow };
    if flow.fallen_back != 0 {
        return SK_PASS;
    }
    let size = u64::from(ctx.size());
    let limit = global_config().map_or(DEFAULT_SPLICE_BACKLOG, |c| c.splice_backlog);
    // `consumed` may lag a moment behind the reader; that only errs towards
    // falling back early.
    let backlog = flow.spliced.saturating_sub(flow.consumed);
    if backlog + size > u64::from(limit)
        || SPLICE_SOCKS.redirect_msg(&ctx, &mut receiver, u64::from(BPF_F_INGRESS))
            != i64::from(SK_PASS)
    {
        fall_back(flow);
        return SK_PASS;
    }
    flow.spliced += size;
    if let Some(counters) = counters(flow.slot) {
        counters.spliced_bytes += size;
    }
    SK_PASS
}

/// Hook: raw tracepoint `sock_recv_length` (every `recvmsg` returning, on
/// any socket). Matches reads by a socket that joined the splice; adds the
/// bytes read to its flow's `consumed`. Miss path (other sockets, peeks,
/// errors): nothing, returns 0.
#[raw_tracepoint(tracepoint = "sock_recv_length")]
pub fn shunt_splice_recv(ctx: RawTracePointContext) -> i32 {
    // TP_PROTO(struct sock *sk, int ret, int flags)
    let sk: u64 = ctx.arg(0);
    let copied = ctx.arg::<u64>(1) as i32;
    let flags = ctx.arg::<u64>(2) as i32;
    if copied <= 0 || flags & MSG_PEEK != 0 {
        return 0;
    }
    // SAFETY: plain value copied out of the map.
    let Some(key) = (unsafe { SPLICE_KEYS.get(sk) }).copied() else {
        return 0;
    };
    if let Some(flow) = SPLICE_FLOWS.get_ptr_mut(key) {
        // SAFETY: map value; only reads of this socket write `consumed`.
        // The tracepoint fires after the socket lock is released, so two
        // threads reading one socket at once may lose an update: that only
        // undercounts what was read, i.e. errs towards falling back early.
        unsafe { (*flow).consumed += copied as u64 };
    }
    0
}

/// Called by `sockops` when the application's end of a connect that
/// `connect4/6` redirected is established: starts both directions' flows
/// and joins the socket to the splice map. Runs before the application can
/// send, and before the proxy's end exists, which joins on its own
/// establishment.
#[inline(always)]
pub fn join_application_end(ctx: &SockOpsContext, netns_cookie: u64) {
    if let Some((slot, _)) = splicing_pod(netns_cookie) {
        start(ctx, key_of_sock_ops(ctx, netns_cookie), slot);
    }
}

/// Called by `sockops` when any other actively opened connection is
/// established: if it is the proxy's connection delivering an inbound
/// connection to its pod's application (the proxy's mark, to the pod's own
/// address), starts both directions' flows and joins, as for an
/// application's end; the application's accepted end joins on its own
/// establishment. Miss path (upstream connections of the proxy, the
/// applications' own unredirected connects): nothing.
#[inline(always)]
pub fn join_delivery_end(ctx: &SockOpsContext) {
    // SAFETY: the helper only reads the socket behind the context.
    let netns_cookie = unsafe { bpf_get_netns_cookie(ctx.ops.cast()) };
    let Some((slot, _)) = splicing_pod(netns_cookie) else {
        return;
    };
    if !has_proxy_mark(ctx) {
        return;
    }
    let Some(own) = POD_ADDRS.get(slot) else {
        return;
    };
    if !to_own_address(ctx, own) {
        return;
    }
    start(ctx, key_of_sock_ops(ctx, netns_cookie), slot);
}

/// Called by `sockops` when a passively opened connection is established:
/// joins it to the splice map if its active end (an application's
/// redirected connect, or the proxy delivering to its pod) started a flow
/// for it. Miss path: nothing.
#[inline(always)]
pub fn join_passive_end(ctx: &SockOpsContext) {
    if splicing().is_none() {
        return;
    }
    // SAFETY: the helper only reads the socket behind the context.
    let netns_cookie = unsafe { bpf_get_netns_cookie(ctx.ops.cast()) };
    let key = key_of_sock_ops(ctx, netns_cookie);
    // SAFETY: only checks presence.
    if unsafe { SPLICE_FLOWS.get(key) }.is_none() {
        return;
    }
    join(ctx, key);
}

/// The slot and settings of the enrolled pod owning `netns_cookie`, if
/// splicing is on and the pod may be spliced.
#[inline(always)]
fn splicing_pod(netns_cookie: u64) -> Option<(u32, PodConfig)> {
    splicing()?;
    // SAFETY: plain value copied out of the map.
    let pod = (unsafe { ENROLLED.get(netns_cookie) }).copied()?;
    // A pod that opted out (its applications read in blocking mode) never
    // starts a flow, so none of its sockets joins.
    let config = POD_CONFIG.get(pod.slot).copied()?;
    if config.flags & PodConfig::NO_SPLICE != 0 {
        return None;
    }
    Some((pod.slot, config))
}

/// Starts both directions' flows of the connection whose active end is
/// `key` afresh (a reused 4-tuple must not inherit an old flow) and joins
/// that end to the splice map.
#[inline(always)]
fn start(ctx: &SockOpsContext, key: SpliceKey, slot: u32) {
    let flow = SpliceFlow {
        slot,
        ..SpliceFlow::default()
    };
    if SPLICE_FLOWS.insert(key, flow, u64::from(BPF_ANY)).is_err()
        || SPLICE_FLOWS
            .insert(key.peer(), flow, u64::from(BPF_ANY))
            .is_err()
    {
        return;
    }
    join(ctx, key);
}

/// Whether the socket carries the proxy's mark.
#[inline(always)]
fn has_proxy_mark(ctx: &SockOpsContext) -> bool {
    // SAFETY: the context pointer is valid for the program's run.
    let sk = unsafe { (*ctx.ops).__bindgen_anon_2.sk };
    if sk.is_null() {
        return false;
    }
    // SAFETY: non-null socket pointer from the context; the verifier checks
    // the field access.
    unsafe { (*sk).mark == PROXY_MARK }
}

/// Whether the connection goes to the pod's own address (IPv4, v4-mapped
/// or IPv6).
#[inline(always)]
fn to_own_address(ctx: &SockOpsContext, own: &PodAddrs) -> bool {
    if ctx.family() == AF_INET {
        return own.ipv4 != 0 && ctx.remote_ip4() == own.ipv4;
    }
    let remote = ctx.remote_ip6();
    if remote[0] == 0 && remote[1] == 0 && u32::from_be(remote[2]) == 0xffff {
        return own.ipv4 != 0 && remote[3] == own.ipv4;
    }
    own.ipv6 != [0; 4] && remote == own.ipv6
}

/// Called by `sockops` when a socket that joined changes state: once it is
/// closed, forgets its address (a new socket may be allocated there) and
/// its flow.
#[inline(always)]
pub fn leave_on_close(ctx: &SockOpsContext) {
    if ctx.arg(1) != BPF_TCP_CLOSE {
        return;
    }
    let sk = socket_address(ctx);
    // SAFETY: plain value copied out of the map.
    if let Some(key) = (unsafe { SPLICE_KEYS.get(sk) }).copied() {
        let _ = SPLICE_FLOWS.remove(key);
        let _ = SPLICE_KEYS.remove(sk);
    }
}

/// The kernel address of the socket behind a `sock_ops` context: the only
/// name for it that the receive tracepoint also has.
#[inline(always)]
fn socket_address(ctx: &SockOpsContext) -> u64 {
    // SAFETY: the context pointer is valid for the program's run; the
    // pointer is only used as a number.
    unsafe { (*ctx.ops).__bindgen_anon_2.sk as u64 }
}

/// The agent-wide settings, if splicing is on.
#[inline(always)]
fn splicing() -> Option<GlobalConfig> {
    global_config().filter(|c| c.flags & GlobalConfig::SPLICE != 0)
}

#[inline(always)]
fn join(ctx: &SockOpsContext, mut key: SpliceKey) {
    // The address first: once the socket is in the map, reads must count.
    let sk = socket_address(ctx);
    if sk == 0 || SPLICE_KEYS.insert(sk, key, u64::from(BPF_ANY)).is_err() {
        return;
    }
    // Closing must clean up (see `leave_on_close`).
    let _ = ctx.set_cb_flags(BPF_SOCK_OPS_STATE_CB_FLAG as i32);
    // SAFETY: the context pointer is valid for the program's run.
    let ops = unsafe { &mut *ctx.ops };
    // A socket that cannot join simply is not spliced: its peer's sends
    // find no target and fall back.
    let _ = SPLICE_SOCKS.update(&mut key, ops, u64::from(BPF_ANY));
}

#[inline(always)]
fn fall_back(flow: &mut SpliceFlow) {
    flow.fallen_back = 1;
    if let Some(counters) = counters(flow.slot) {
        counters.splice_fallbacks += 1;
    }
}

#[inline(always)]
fn key_of_sock_ops(ctx: &SockOpsContext, netns_cookie: u64) -> SpliceKey {
    key_of(
        netns_cookie,
        ctx.family(),
        (ctx.local_ip4(), ctx.local_ip6()),
        (ctx.remote_ip4(), ctx.remote_ip6()),
        ctx.local_port(),
        ctx.remote_port(),
    )
}

/// The splice key of a socket end as `sock_ops` and `sk_msg` describe it:
/// `local_port` in host order, `remote_port` as the kernel gives it (the
/// network-order port in the upper 16 bits). A v4-mapped IPv6 socket
/// (`::ffff:a.b.c.d`) is keyed as IPv4, because its peer — accepted on the
/// IPv4 listener — sees it that way.
#[inline(always)]
fn key_of(
    netns_cookie: u64,
    family: u32,
    local: (u32, [u32; 4]),
    remote: (u32, [u32; 4]),
    local_port: u32,
    remote_port_raw: u32,
) -> SpliceKey {
    let remote_port = u32::from(u16::from_be((remote_port_raw >> 16) as u16));
    let v4_mapped = |a: [u32; 4]| a[0] == 0 && a[1] == 0 && u32::from_be(a[2]) == 0xffff;
    let (family, local_addr, remote_addr) = if family == AF_INET6 {
        if v4_mapped(local.1) && v4_mapped(remote.1) {
            (AF_INET, [local.1[3], 0, 0, 0], [remote.1[3], 0, 0, 0])
        } else {
            (AF_INET6, local.1, remote.1)
        }
    } else {
        (AF_INET, [local.0, 0, 0, 0], [remote.0, 0, 0, 0])
    };
    SpliceKey {
        netns_cookie,
        local_addr,
        remote_addr,
        local_port,
        remote_port,
        family,
        reserved: 0,
    }
}
