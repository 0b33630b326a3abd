//! ZDS messages from ztunnel: its hello, and its answers to our requests.

use proptest::prelude::*;
use prost::Message as _;
use shunt_proto::istio::zds::{Ack, Version, WorkloadResponse, ZdsHello, workload_response};

use super::{edits, mutate};
use crate::inpod::protocol::{ProtocolError, check_hello, read_ack};

fn hello() -> Vec<u8> {
    ZdsHello {
        version: Version::V1 as i32,
    }
    .encode_to_vec()
}

fn ack(error: &str) -> Vec<u8> {
    WorkloadResponse {
        payload: Some(workload_response::Payload::Ack(Ack {
            error: error.into(),
        })),
    }
    .encode_to_vec()
}

#[test]
fn the_seeds_are_valid() {
    assert_eq!(check_hello(&hello()), Ok(()));
    assert_eq!(read_ack(&ack("")), Ok(Ok(())));
    assert_eq!(read_ack(&ack("no netns")), Ok(Err("no netns".into())));
}

proptest! {
    #[test]
    fn a_mutated_hello_is_accepted_or_refused_saying_why(edits in edits()) {
        if let Err(e) = check_hello(&mutate(&hello(), &edits)) {
            prop_assert!(matches!(e, ProtocolError::HelloUndecodable(_) | ProtocolError::HelloVersion(_)));
            prop_assert!(e.to_string().contains("ZdsHello"), "{e}");
        }
    }

    #[test]
    fn a_mutated_ack_is_read_or_refused_saying_why(edits in edits(), error in "[a-z ]{0,12}") {
        if let Err(e) = read_ack(&mutate(&ack(&error), &edits)) {
            prop_assert!(e.to_string().contains("WorkloadResponse"), "{e}");
        }
    }

    #[test]
    fn any_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
        let _ = check_hello(&bytes);
        let _ = read_ack(&bytes);
    }
}
