//! ZDS messages as shunt sends and reads them (Istio's `zds.proto`,
//! compiled in `shunt-proto`): what each request carries, and what a
//! well-formed hello and ack from ztunnel are.

use prost::Message as _;
use shunt_proto::istio::zds::{
    AddWorkload, DelWorkload, KeepWorkload, SnapshotSent, Version, WorkloadInfo, WorkloadRequest,
    WorkloadResponse, ZdsHello, workload_request::Payload, workload_response,
};

use super::ZdsPod;

/// What was wrong with a message from ztunnel.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProtocolError {
    #[error("the first message is not a ZdsHello: {0}")]
    HelloUndecodable(String),
    #[error("ZdsHello version {0} is not V1 (the only version this agent speaks)")]
    HelloVersion(i32),
    #[error("malformed WorkloadResponse: {0}")]
    ResponseUndecodable(String),
    #[error("WorkloadResponse without an ack")]
    ResponseWithoutAck,
}

/// The requests, by what they do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request<'a> {
    /// Serve the pod (its netns travels as the packet's fd).
    Add(&'a ZdsPod),
    /// Keep the pod with this uid if it is served already.
    Keep(&'a str),
    /// Stop serving the pod with this uid.
    Del(&'a str),
    SnapshotSent,
}

impl Request<'_> {
    /// The message's name in logs.
    pub fn name(&self) -> &'static str {
        match self {
            Request::Add(_) => "AddWorkload",
            Request::Keep(_) => "KeepWorkload",
            Request::Del(_) => "DelWorkload",
            Request::SnapshotSent => "SnapshotSent",
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let payload = match self {
            Request::Add(pod) => Payload::Add(AddWorkload {
                uid: pod.uid.clone(),
                workload_info: Some(WorkloadInfo {
                    name: pod.name.clone(),
                    namespace: pod.namespace.clone(),
                    service_account: pod.service_account.clone(),
                }),
            }),
            Request::Keep(uid) => Payload::Keep(KeepWorkload {
                uid: (*uid).to_owned(),
            }),
            Request::Del(uid) => Payload::Del(DelWorkload {
                uid: (*uid).to_owned(),
            }),
            Request::SnapshotSent => Payload::SnapshotSent(SnapshotSent {}),
        };
        WorkloadRequest {
            payload: Some(payload),
        }
        .encode_to_vec()
    }
}

/// Checks ztunnel's first packet: a `ZdsHello` saying V1.
pub fn check_hello(packet: &[u8]) -> Result<(), ProtocolError> {
    let hello =
        ZdsHello::decode(packet).map_err(|e| ProtocolError::HelloUndecodable(e.to_string()))?;
    if hello.version != Version::V1 as i32 {
        return Err(ProtocolError::HelloVersion(hello.version));
    }
    Ok(())
}

/// Reads ztunnel's answer to a request: `Ok(Ok(()))` for an ack with an
/// empty error, `Ok(Err(text))` for an ack carrying ztunnel's error.
pub fn read_ack(packet: &[u8]) -> Result<Result<(), String>, ProtocolError> {
    let response = WorkloadResponse::decode(packet)
        .map_err(|e| ProtocolError::ResponseUndecodable(e.to_string()))?;
    match response.payload {
        Some(workload_response::Payload::Ack(ack)) if ack.error.is_empty() => Ok(Ok(())),
        Some(workload_response::Payload::Ack(ack)) => Ok(Err(ack.error)),
        None => Err(ProtocolError::ResponseWithoutAck),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_must_say_v1() {
        assert_eq!(check_hello(&[0x08, 1]), Ok(()));
        assert_eq!(check_hello(&[0x08, 2]), Err(ProtocolError::HelloVersion(2)));
        assert!(matches!(
            check_hello(&[0xff, 0xff]),
            Err(ProtocolError::HelloUndecodable(_))
        ));
    }

    #[test]
    fn acks_are_read_with_their_error() {
        assert_eq!(read_ack(&[0x0a, 0]), Ok(Ok(())));
        assert_eq!(
            read_ack(&[0x0a, 3, 0x0a, 1, b'e']),
            Ok(Err("e".to_string()))
        );
        assert_eq!(read_ack(&[]), Err(ProtocolError::ResponseWithoutAck));
        assert!(matches!(
            read_ack(&[0x0a, 9]),
            Err(ProtocolError::ResponseUndecodable(_))
        ));
    }
}
