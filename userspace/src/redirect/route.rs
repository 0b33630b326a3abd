//! The policy route for the proxy's transparent inbound connections, through
//! rtnetlink in the calling thread's network namespace:
//!
//! ```text
//! ip rule add pref 32764 fwmark 0x111/0xfff lookup 1337
//! ip route add local 0.0.0.0/0 dev lo table 1337     (and ::/0 for IPv6)
//! ```
//!
//! Replies of the app to a connection the proxy made from a foreign source
//! address carry mark 0x111 (iptables mode: restored from the connmark by the
//! mangle rules; eBPF mode: set by the TC egress program, which sends them
//! back in through `lo`); this rule sends them to `lo`, where the proxy's
//! transparent socket gets them, instead of out of `eth0` towards the real
//! client. Both redirection modes install it; this module owns it.
//!
//! Istio uses table 100; shunt uses its own table number so that it never
//! collides with a table 100 the pod or its CNI may already use.

use std::io;

use netlink_packet_core::{
    NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REPLACE, NLM_F_REQUEST, NetlinkHeader,
    NetlinkMessage, NetlinkPayload,
};
use netlink_packet_route::{
    AddressFamily, RouteNetlinkMessage,
    route::{RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope, RouteType},
    rule::{RuleAction, RuleAttribute, RuleMessage},
};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

use shunt_common::{MARK_MASK, REPLY_MARK as CONN_MARK};

/// An address family: the policy route, like iptables and ip6tables' rule
/// sets, exists once per family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub fn label(self) -> &'static str {
        match self {
            Family::V4 => "ipv4",
            Family::V6 => "ipv6",
        }
    }
}

/// The routing table holding the local default route (0x539 in decimal, the
/// proxy mark, so that it is recognisably shunt's).
pub const ROUTE_TABLE: u32 = 1337;
/// Priority of the fwmark rule (Istio's): before `main` (32766).
pub const RULE_PRIORITY: u32 = 32764;
/// Istio's own table for the same route, used where shunt applies Istio's
/// in-pod rules as they are (`--proxy ztunnel` in the iptables mode).
pub const ISTIO_ROUTE_TABLE: u32 = 100;

/// How the policy route reads in `ip rule`/`ip route` terms, for hooks and
/// drift messages.
pub fn describe(family: Family) -> String {
    describe_table(family, ROUTE_TABLE)
}

/// [`describe`] for the route in `table`.
pub fn describe_table(family: Family, table: u32) -> String {
    let any = match family {
        Family::V4 => "0.0.0.0/0",
        Family::V6 => "::/0",
    };
    format!(
        "ip rule pref {RULE_PRIORITY} fwmark 0x{CONN_MARK:x}/0x{MARK_MASK:x} lookup {table}; ip route local {any} dev lo table {table}"
    )
}

/// Which halves of the policy route are in place.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Present {
    pub rule: bool,
    pub route: bool,
}

/// Whether IPv6 is usable on `lo` in the calling thread's netns: the route
/// cannot be added otherwise (and is not needed: no IPv6 traffic).
pub fn ipv6_on_lo() -> bool {
    std::fs::read_to_string("/proc/sys/net/ipv6/conf/lo/disable_ipv6")
        .map(|v| v.trim() == "0")
        .unwrap_or(false)
}

/// The families whose policy route a pod needs, in the calling thread's
/// netns: IPv4, and IPv6 where `lo` has it.
pub fn families() -> Vec<Family> {
    let mut families = vec![Family::V4];
    if ipv6_on_lo() {
        families.push(Family::V6);
    }
    families
}

/// Sets `net.ipv4.conf.lo.accept_local=1` in the calling thread's netns.
///
/// eBPF mode only: its replies enter through `lo`'s ingress (a TC redirect)
/// without the route loopback packets normally keep, so the kernel routes
/// them as arriving packets and, finding their source (the pod's own
/// address) local, would drop them as martians. iptables mode needs none:
/// its replies are re-routed on output and keep their route over `lo`.
/// Accepting local sources on `lo` admits nothing new from outside the pod.
pub fn accept_local_on_lo() -> io::Result<()> {
    const PATH: &str = "/proc/sys/net/ipv4/conf/lo/accept_local";
    if std::fs::read_to_string(PATH)?.trim() == "1" {
        return Ok(());
    }
    std::fs::write(PATH, "1")
}

/// Adds the rule and the route; both already present is not an error.
pub fn add(family: Family) -> io::Result<()> {
    add_to(family, ROUTE_TABLE)
}

/// [`add`] with the route in `table`.
pub fn add_to(family: Family, table: u32) -> io::Result<()> {
    let lo = lo_index()?;
    match request(
        RouteNetlinkMessage::NewRule(rule_message(family, table)),
        NLM_F_CREATE | NLM_F_EXCL,
    ) {
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
        other => other?,
    }
    request(
        RouteNetlinkMessage::NewRoute(route_message(family, lo, table)),
        NLM_F_CREATE | NLM_F_REPLACE,
    )
}

/// Deletes the rule and the route; either already gone is not an error.
pub fn delete(family: Family) -> io::Result<()> {
    delete_from(family, ROUTE_TABLE)
}

/// [`delete`] for the route in `table`.
pub fn delete_from(family: Family, table: u32) -> io::Result<()> {
    let gone = |e: &io::Error| matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ESRCH));
    // Delete every copy: a rule added by hand with the same selector would
    // otherwise keep routing marked replies to our (deleted) table.
    for _ in 0..16 {
        match request(RouteNetlinkMessage::DelRule(rule_message(family, table)), 0) {
            Ok(()) => continue,
            Err(e) if gone(&e) => break,
            Err(e) => return Err(e),
        }
    }
    let lo = lo_index()?;
    match request(
        RouteNetlinkMessage::DelRoute(route_message(family, lo, table)),
        0,
    ) {
        Err(e) if gone(&e) => Ok(()),
        other => other,
    }
}

/// Reads which halves are in place.
pub fn present(family: Family) -> io::Result<Present> {
    present_in(family, ROUTE_TABLE)
}

/// [`present`] for the route in `table`.
pub fn present_in(family: Family, table: u32) -> io::Result<Present> {
    let lo = lo_index()?;
    let mut present = Present::default();
    let mut rule = RuleMessage::default();
    rule.header.family = address_family(family);
    for reply in dump(RouteNetlinkMessage::GetRule(rule))? {
        if let RouteNetlinkMessage::NewRule(rule) = reply
            && is_our_rule(&rule, table)
        {
            present.rule = true;
        }
    }
    let mut route = RouteMessage::default();
    route.header.address_family = address_family(family);
    for reply in dump(RouteNetlinkMessage::GetRoute(route))? {
        if let RouteNetlinkMessage::NewRoute(route) = reply
            && is_our_route(&route, lo, table)
        {
            present.route = true;
        }
    }
    Ok(present)
}

fn address_family(family: Family) -> AddressFamily {
    match family {
        Family::V4 => AddressFamily::Inet,
        Family::V6 => AddressFamily::Inet6,
    }
}

fn lo_index() -> io::Result<u32> {
    nix::net::if_::if_nametoindex("lo").map_err(io::Error::from)
}

fn rule_message(family: Family, table: u32) -> RuleMessage {
    let mut rule = RuleMessage::default();
    rule.header.family = address_family(family);
    rule.header.action = RuleAction::ToTable;
    // Tables above 255 only fit the attribute; the header says "see there".
    rule.header.table = 0;
    rule.attributes = vec![
        RuleAttribute::Priority(RULE_PRIORITY),
        RuleAttribute::FwMark(CONN_MARK),
        RuleAttribute::FwMask(MARK_MASK),
        RuleAttribute::Table(table),
    ];
    rule
}

fn route_message(family: Family, lo: u32, table: u32) -> RouteMessage {
    let mut route = RouteMessage::default();
    route.header = RouteHeader {
        address_family: address_family(family),
        destination_prefix_length: 0,
        table: 0,
        protocol: RouteProtocol::Static,
        scope: RouteScope::Host,
        kind: RouteType::Local,
        ..RouteHeader::default()
    };
    route.attributes = vec![RouteAttribute::Table(table), RouteAttribute::Oif(lo)];
    route
}

fn is_our_rule(rule: &RuleMessage, wanted_table: u32) -> bool {
    let has = |wanted: &RuleAttribute| rule.attributes.iter().any(|a| a == wanted);
    let table = rule
        .attributes
        .iter()
        .find_map(|a| match a {
            RuleAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .unwrap_or(u32::from(rule.header.table));
    table == wanted_table
        && has(&RuleAttribute::Priority(RULE_PRIORITY))
        && has(&RuleAttribute::FwMark(CONN_MARK))
        && has(&RuleAttribute::FwMask(MARK_MASK))
}

fn is_our_route(route: &RouteMessage, lo: u32, wanted_table: u32) -> bool {
    let table = route
        .attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .unwrap_or(u32::from(route.header.table));
    table == wanted_table
        && route.header.kind == RouteType::Local
        && route.header.destination_prefix_length == 0
        && route.attributes.contains(&RouteAttribute::Oif(lo))
}

fn socket() -> io::Result<Socket> {
    let mut socket = Socket::new(NETLINK_ROUTE)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    // The kernel answers at once; a bound keeps a wedged kernel from
    // hanging the agent's reconcile.
    nix::sys::socket::setsockopt(
        &socket,
        nix::sys::socket::sockopt::ReceiveTimeout,
        &nix::sys::time::TimeVal::new(5, 0),
    )
    .map_err(io::Error::from)?;
    Ok(socket)
}

fn send(socket: &Socket, payload: RouteNetlinkMessage, flags: u16) -> io::Result<()> {
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | flags;
    header.sequence_number = 1;
    let mut message = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(payload));
    message.finalize();
    let mut buf = vec![0; message.buffer_len()];
    message.serialize(&mut buf);
    socket.send(&buf, 0)?;
    Ok(())
}

/// Sends a change and waits for the kernel's acknowledgement.
fn request(payload: RouteNetlinkMessage, flags: u16) -> io::Result<()> {
    let socket = socket()?;
    send(&socket, payload, flags | NLM_F_ACK)?;
    let mut result = None;
    receive(&socket, |reply| match reply {
        NetlinkPayload::Error(error) if error.code.is_some() => {
            result = Some(Err(error.to_io()));
            true
        }
        // An error message with code 0 is the acknowledgement.
        NetlinkPayload::Error(_) | NetlinkPayload::Done(_) => {
            result = Some(Ok(()));
            true
        }
        _ => false,
    })?;
    result.unwrap_or_else(|| Err(io::Error::other("no acknowledgement from the kernel")))
}

/// Runs a dump request in the calling thread's netns and returns every
/// message of the answer (also used by `tc_dump`).
pub(super) fn dump(payload: RouteNetlinkMessage) -> io::Result<Vec<RouteNetlinkMessage>> {
    let socket = socket()?;
    send(&socket, payload, NLM_F_DUMP)?;
    let mut messages = Vec::new();
    let mut failure = None;
    receive(&socket, |reply| match reply {
        NetlinkPayload::Done(_) => true,
        NetlinkPayload::Error(error) => {
            failure = Some(error.to_io());
            true
        }
        NetlinkPayload::InnerMessage(message) => {
            messages.push(message);
            false
        }
        _ => false,
    })?;
    match failure {
        Some(error) => Err(error),
        None => Ok(messages),
    }
}

/// Reads replies, handing each to `done` until it returns true. Bounded: a
/// dump of one netns's rules or routes is a handful of datagrams.
fn receive(
    socket: &Socket,
    mut done: impl FnMut(NetlinkPayload<RouteNetlinkMessage>) -> bool,
) -> io::Result<()> {
    for _ in 0..4096 {
        let (data, _) = socket.recv_from_full()?;
        let mut offset = 0;
        while offset < data.len() {
            let reply = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&data[offset..])
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
            let length = reply.header.length as usize;
            if done(reply.payload) {
                return Ok(());
            }
            if length == 0 {
                break;
            }
            offset += length;
        }
    }
    Err(io::Error::other(
        "netlink answer did not end within 4096 datagrams",
    ))
}
