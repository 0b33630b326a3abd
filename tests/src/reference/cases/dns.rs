//! DNS by network (issue 34 item 8): the client pod asks its proxy's DNS
//! server for Service hostnames whose VIPs are on a network.

use shunt_proto::istio::workload as wl;

use super::{Case, DnsRow};
use crate::reference::resources::{encode, service};

/// A Service `default/<name>` whose only VIP is `network`/`vip`.
fn on_network(name: &str, network: &str, vip: [u8; 4]) -> wl::Address {
    let mut address = service(name, &format!("{name}.default.svc.cluster.local"), vip);
    if let Some(wl::address::Type::Service(svc)) = &mut address.r#type {
        for a in &mut svc.addresses {
            a.network = network.into();
        }
    }
    address
}

pub fn cases() -> Vec<Case> {
    let mut by_network = Case::authz("a client on network1 asks for VIPs", Vec::new(), Vec::new());
    by_network.client_network = "network1";
    by_network.addresses = vec![
        encode(on_network("same", "network1", [198, 19, 100, 48])),
        encode(on_network("unnamed", "", [198, 19, 100, 49])),
    ];
    by_network.dns = vec![
        DnsRow {
            name: "same.default.svc.cluster.local.",
            expect: &[[198, 19, 100, 48]],
        },
        DnsRow {
            name: "unnamed.default.svc.cluster.local.",
            expect: &[],
        },
    ];
    vec![by_network]
}
