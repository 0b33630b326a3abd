//! One query in, at most one answer out: decoded with hickory-proto,
//! answered from the mesh's names (A/AAAA of a name the mesh knows) or
//! forwarded, encoded to fit the transport. Never panics on what a client
//! sends; a query that cannot be decoded gets FORMERR when its header can
//! be read, and nothing otherwise.

use std::{net::IpAddr, str::FromStr, sync::Arc, time::Instant};

use hickory_proto::{
    op::{Edns, Message, MessageType, Metadata, OpCode, Query, ResponseCode},
    rr::{
        DNSClass, Name, RData, Record, RecordType,
        rdata::{A, AAAA, CNAME},
    },
};
use tokio::sync::watch;
use tracing::debug;

use super::{
    DNS_TTL, PodDns,
    forward::Forwarder,
    metrics::{DnsLabels, DnsMetrics, Protocol},
    names::MeshNames,
};

/// The DNS header's size: shorter input cannot even be refused.
const HEADER_LEN: usize = 12;
/// The EDNS payload size the proxy advertises in its own answers (the
/// DNS flag day's safe UDP size).
const ADVERTISED_PAYLOAD: u16 = 1232;
/// What fits in one TCP frame.
const MAX_TCP_MESSAGE: usize = u16::MAX as usize;

/// What one pod's server answers with; shared by its UDP and TCP tasks.
pub(crate) struct Handler {
    pub(crate) pod: PodDns,
    pub(crate) names: watch::Receiver<Arc<MeshNames>>,
    pub(crate) forwarder: Arc<Forwarder>,
    pub(crate) metrics: Arc<DnsMetrics>,
}

impl Handler {
    /// The bytes to send back for `bytes` received over `protocol`, or
    /// `None` to send nothing.
    pub(crate) async fn handle(&self, bytes: &[u8], protocol: Protocol) -> Option<Vec<u8>> {
        let query = match Message::from_vec(bytes) {
            Ok(query) => query,
            Err(e) => {
                debug!(error = %e, len = bytes.len(), "malformed DNS query");
                return format_error_from_header(bytes);
            }
        };
        // Never answer an answer (a loop between two resolvers).
        if query.metadata.message_type != MessageType::Query {
            return None;
        }
        if query.metadata.op_code != OpCode::Query {
            return encode(&error(&query, ResponseCode::NotImp), &query, protocol);
        }
        let [question] = query.queries.as_slice() else {
            return encode(&error(&query, ResponseCode::FormErr), &query, protocol);
        };
        let labels = {
            // The store's view of the pod (the latest published), else
            // what the server was started with.
            let names = self.names.borrow();
            let (service, revision) = names
                .canonical(&self.pod.namespace, &self.pod.name)
                .unwrap_or((&self.pod.canonical_name, &self.pod.canonical_revision));
            DnsLabels::new(
                &question.query_type().to_string(),
                protocol,
                service,
                revision,
            )
        };
        self.metrics.request(&labels);
        let answer = match self.local_answer(&query, question) {
            Some(answer) => answer,
            None => self.forward(&query, question, protocol, &labels).await,
        };
        encode(&answer, &query, protocol)
    }

    /// The answer for an A/AAAA query of a name the mesh knows: its
    /// addresses of that family (none: NOERROR without answers, the name
    /// exists), TTL 30 s, authoritative.
    fn local_answer(&self, query: &Message, question: &Query) -> Option<Message> {
        let record_type = question.query_type();
        if question.query_class() != DNSClass::IN
            || !matches!(record_type, RecordType::A | RecordType::AAAA)
        {
            return None;
        }
        let names = self.names.borrow();
        let found = names.resolve(&question.name().to_ascii(), &self.pod)?;
        let mut answer = response(query);
        answer.metadata.authoritative = true;
        let mut owner = question.name().clone();
        if let Some(stripped) = found.stripped.as_deref().filter(|_| !found.wildcard) {
            // Asked `web.ns.svc.cluster.local.other.svc.cluster.local`:
            // a CNAME to the name meant, whose records follow.
            if let Ok(target) = Name::from_str(&format!("{stripped}.")) {
                answer.add_answer(Record::from_rdata(
                    owner.clone(),
                    DNS_TTL,
                    RData::CNAME(CNAME(target.clone())),
                ));
                owner = target;
            }
        }
        // A service VIP only to a client on its network (ztunnel's rule).
        let network = names.network(&self.pod.namespace, &self.pod.name);
        for addr in found.host.addrs_for(network) {
            let data = match (addr, record_type) {
                (IpAddr::V4(v4), RecordType::A) => RData::A(A(*v4)),
                (IpAddr::V6(v6), RecordType::AAAA) => RData::AAAA(AAAA(*v6)),
                _ => continue,
            };
            answer.add_answer(Record::from_rdata(owner.clone(), DNS_TTL, data));
        }
        debug!(name = %question.name(), r#type = %record_type, answers = answer.answers.len(), "answered from the mesh's names");
        Some(answer)
    }

    /// The upstream's answer, or SERVFAIL; counted as ztunnel counts.
    async fn forward(
        &self,
        query: &Message,
        question: &Query,
        protocol: Protocol,
        labels: &DnsLabels,
    ) -> Message {
        let started = Instant::now();
        let result = self
            .forwarder
            .forward(query, protocol == Protocol::Tcp)
            .await;
        self.metrics
            .forwarded(labels, started.elapsed(), result.is_err());
        match result {
            Ok(answer) => answer,
            Err(e) => {
                debug!(name = %question.name(), r#type = %question.query_type(), error = %e, "forwarding failed: SERVFAIL");
                error(query, ResponseCode::ServFail)
            }
        }
    }
}

/// An empty response to `query`: its id, question, RD and CD bits; RA set
/// (the proxy recurses through its upstreams); EDNS when the query had it.
fn response(query: &Message) -> Message {
    let mut answer = Message::new(query.metadata.id, MessageType::Response, OpCode::Query);
    answer.metadata = Metadata::response_from_request(&query.metadata);
    answer.metadata.recursion_available = true;
    answer.add_queries(query.queries.iter().cloned());
    if query.edns.is_some() {
        let mut edns = Edns::new();
        edns.set_max_payload(ADVERTISED_PAYLOAD);
        answer.set_edns(edns);
    }
    answer
}

fn error(query: &Message, code: ResponseCode) -> Message {
    let mut answer = response(query);
    answer.metadata.response_code = code;
    answer
}

/// FORMERR for input that is not a DNS message, when at least its header
/// (id, QR bit) can be read and it is not itself a response.
fn format_error_from_header(bytes: &[u8]) -> Option<Vec<u8>> {
    if bytes.len() < HEADER_LEN || bytes[2] & 0x80 != 0 {
        return None;
    }
    let id = u16::from_be_bytes([bytes[0], bytes[1]]);
    Message::error_msg(id, OpCode::Query, ResponseCode::FormErr)
        .to_vec()
        .ok()
}

/// `answer` encoded for `protocol`: over UDP, an answer larger than the
/// client can take (512 bytes, or its EDNS size) goes out without its
/// records and with TC set, so the client asks again over TCP.
fn encode(answer: &Message, query: &Message, protocol: Protocol) -> Option<Vec<u8>> {
    let limit = match protocol {
        Protocol::Udp => query.max_payload() as usize,
        Protocol::Tcp => MAX_TCP_MESSAGE,
    };
    match answer.to_vec() {
        Ok(bytes) if bytes.len() <= limit => Some(bytes),
        Ok(_) if protocol == Protocol::Udp => answer.truncate().to_vec().ok(),
        Ok(_) => error(query, ResponseCode::ServFail).to_vec().ok(),
        Err(e) => {
            debug!(error = %e, "cannot encode a DNS answer: SERVFAIL");
            error(query, ResponseCode::ServFail).to_vec().ok()
        }
    }
}
