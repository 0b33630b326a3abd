//! The comparison tables: rows of (xDS resources sent, probe, expected
//! outcome), one file per concern, data only. Expected outcomes are what
//! the real ztunnel does (each row was run against it).

use shunt_proto::{envoy::service::discovery::v3::Resource, istio::security as sec};

use super::probe::{Caller, Outcome};

pub mod authz;
pub mod dns;
pub mod hostname;
pub mod routing;
pub mod sync;
pub mod xds;

/// One probe of a case and the outcome ztunnel gives it.
#[derive(Clone, Copy, Debug)]
pub struct Row {
    pub caller: Caller,
    /// The server workload's port (an echo server listens on 8080 and 9090),
    /// or, with `host`, the service port.
    pub port: u16,
    /// A hostname for the CONNECT authority (`host:port`) instead of the
    /// server's IP (HBONE callers only).
    pub host: Option<&'static str>,
    pub expect: Outcome,
}

/// One connection the client pod's application makes to a Service VIP or
/// a pod IP (through the client's proxy), and ztunnel's outcome for it.
#[derive(Clone, Copy, Debug)]
pub struct OutboundRow {
    pub dst: [u8; 4],
    pub port: u16,
    pub expect: Outcome,
}

/// One DNS question (A) the client pod asks its proxy's DNS server on
/// 127.0.0.1:15053, and the addresses ztunnel answers (none: no address
/// in the answer, whatever its code).
#[derive(Clone, Copy, Debug)]
pub struct DnsRow {
    pub name: &'static str,
    pub expect: &'static [[u8; 4]],
}

/// How a peer answers the response carrying a case's addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XdsAnswer {
    Ack,
    /// A NACK whose message names this resource.
    NackNaming(&'static str),
}

/// Resources sent to a fresh peer (besides the bed's own workloads), and
/// the rows probed once it is ready.
#[derive(Clone, Debug)]
pub struct Case {
    pub name: &'static str,
    /// Address resources besides the bed's server and client workloads,
    /// in the same response.
    pub addresses: Vec<Resource>,
    /// A second address response, sent once the first is answered (after
    /// a NACK: ztunnel is unready until a response of the type is ACKed).
    pub then_addresses: Vec<Resource>,
    /// The policies the server workload names (`authorization_policies`:
    /// the WORKLOAD_SELECTOR ones selecting it).
    pub server_policies: Vec<&'static str>,
    /// The services (`namespace/hostname`) the server workload is an
    /// endpoint of, on service port 80 to 8080 (istiod fills the endpoint's target port;
    /// ztunnel takes 0 as is).
    pub server_services: Vec<&'static str>,
    pub authorizations: Vec<sec::Authorization>,
    /// ztunnel's answer to the address response (policies are always
    /// ACKed in these tables).
    pub addresses_answer: XdsAnswer,
    pub rows: Vec<Row>,
    /// Rows probed before the peer's first xDS update (istiod holds its
    /// responses until they ran); empty: no holding.
    pub before_sync: Vec<Row>,
    /// Probes through the client's proxy (the client pod gets one then:
    /// a second ztunnel, or node-a's agent).
    pub outbound: Vec<OutboundRow>,
    /// DNS questions to the client's proxy (which it gets then too).
    pub dns: Vec<DnsRow>,
    /// The client workload's network ("" by default).
    pub client_network: &'static str,
    /// The server workload's network ("" by default), and the address of
    /// the gateway istiod names for it on that network (`network_gateway`,
    /// HBONE port 15008), if any.
    pub server_network: &'static str,
    pub server_gateway: Option<[u8; 4]>,
    /// The outer CONNECTs the bed's east-west gateway gets: one per
    /// allowed outbound row, each for this authority, from the client's
    /// identity; none when `None`.
    pub gateway_authority: Option<&'static str>,
    /// The host those CONNECTs' `forwarded` names (the service the client
    /// addressed); `None`: the authority's host.
    pub forwarded_host: Option<&'static str>,
    /// The server and client as istiod sends the pods of Deployments: an
    /// owner, a canonical service and revision other than the pod's name,
    /// and a locality (`false`: each named by its pod alone).
    pub deployed: bool,
    /// The client pod's packets to the server's HBONE port are dropped
    /// during the outbound rows, as a NetworkPolicy that does not allow
    /// 15008 drops them (its SYNs retried once, so a connect times out in
    /// about 3 s instead of 2 minutes).
    pub hbone_port_dropped: bool,
    /// Names the client's proxy resolves (a DNS-resolved ServiceEntry's
    /// endpoints) and their addresses, served by the bed's DNS server
    /// (`resolver.rs`); empty: none runs.
    pub resolves: Vec<(&'static str, [u8; 4])>,
}

impl Case {
    /// A case of policies only.
    pub fn authz(
        name: &'static str,
        authorizations: Vec<sec::Authorization>,
        rows: Vec<Row>,
    ) -> Case {
        Case {
            name,
            addresses: Vec::new(),
            then_addresses: Vec::new(),
            server_policies: Vec::new(),
            server_services: Vec::new(),
            authorizations,
            addresses_answer: XdsAnswer::Ack,
            rows,
            before_sync: Vec::new(),
            outbound: Vec::new(),
            dns: Vec::new(),
            client_network: "",
            server_network: "",
            server_gateway: None,
            gateway_authority: None,
            forwarded_host: None,
            deployed: false,
            hbone_port_dropped: false,
            resolves: Vec::new(),
        }
    }
}

/// The callers the tables use.
pub const SLEEP: Caller = Caller::Mesh {
    namespace: "default",
    service_account: "sleep",
};
pub const OTHER: Caller = Caller::Mesh {
    namespace: "default",
    service_account: "other",
};
pub const FOREIGN: Caller = Caller::Mesh {
    namespace: "foreign",
    service_account: "sleep",
};
pub const PLAINTEXT: Caller = Caller::Plaintext;

pub const fn row(caller: Caller, port: u16, expect: Outcome) -> Row {
    Row {
        caller,
        port,
        host: None,
        expect,
    }
}

/// A row whose CONNECT names `host:port` (a service hostname).
pub const fn row_to_host(caller: Caller, host: &'static str, port: u16, expect: Outcome) -> Row {
    Row {
        caller,
        port,
        host: Some(host),
        expect,
    }
}
