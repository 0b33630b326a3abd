//! Reading which BPF filters are attached to an interface's clsact hooks, with
//! a netlink dump (what `tc filter show dev IF ingress` does). Runs in the
//! calling thread's network namespace.

use std::io;

use aya::programs::TcAttachType;
use netlink_packet_route::{
    RouteNetlinkMessage,
    tc::{TcAttribute, TcFilterBpfOption, TcHandle, TcMessage, TcOption},
};

/// A BPF filter found on a clsact hook.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BpfFilter {
    pub priority: u16,
    pub handle: u32,
    /// The program's name as the kernel reports it (truncated to 15 bytes
    /// by the kernel for the BPF object name; the filter keeps the full
    /// section/function name given at attach time).
    pub program_name: String,
    pub program_id: Option<u32>,
}

/// Every BPF filter on `interface`'s clsact hook for `attach_type`.
pub fn bpf_filters(interface: &str, attach_type: TcAttachType) -> io::Result<Vec<BpfFilter>> {
    let index = nix::net::if_::if_nametoindex(interface).map_err(io::Error::from)?;
    let parent = TcHandle {
        major: TcHandle::CLSACT.major,
        minor: match attach_type {
            TcAttachType::Ingress => TcHandle::MIN_INGRESS,
            TcAttachType::Egress => TcHandle::MIN_EGRESS,
            TcAttachType::Custom(parent) => parent as u16,
        },
    };
    let mut request = TcMessage::with_index(index as i32);
    request.header.parent = parent;
    let filters = super::route::dump(RouteNetlinkMessage::GetTrafficFilter(request))?
        .iter()
        .filter_map(|message| match message {
            RouteNetlinkMessage::NewTrafficFilter(msg) => as_bpf_filter(msg),
            _ => None,
        })
        .collect();
    Ok(filters)
}

fn as_bpf_filter(msg: &TcMessage) -> Option<BpfFilter> {
    let mut program_name = None;
    let mut program_id = None;
    for attribute in &msg.attributes {
        if let TcAttribute::Options(options) = attribute {
            for option in options {
                match option {
                    TcOption::Bpf(TcFilterBpfOption::ProgName(name)) => {
                        program_name = Some(name.clone())
                    }
                    TcOption::Bpf(TcFilterBpfOption::ProgId(id)) => program_id = Some(*id),
                    _ => {}
                }
            }
        }
    }
    Some(BpfFilter {
        // tcm_info carries the priority in its upper 16 bits.
        priority: (msg.header.info >> 16) as u16,
        handle: u32::from(msg.header.handle),
        program_name: program_name?,
        program_id,
    })
}
