//! The comparison tables: rows of (xDS resources sent, probe, expected
//! outcome), one file per concern, data only. Expected outcomes are what
//! the real ztunnel does (each row was run against it).

use shunt_proto::istio::security as sec;

use super::probe::{Caller, Outcome};

pub mod authz;

/// One probe of a case and the outcome ztunnel gives it.
#[derive(Clone, Copy, Debug)]
pub struct Row {
    pub caller: Caller,
    /// The server workload's port (an echo server listens on 8080 and 9090).
    pub port: u16,
    pub expect: Outcome,
}

/// Resources sent to a fresh peer (besides the bed's own workloads), and
/// the rows probed once it is ready.
#[derive(Clone, Debug)]
pub struct Case {
    pub name: &'static str,
    pub authorizations: Vec<sec::Authorization>,
    pub rows: Vec<Row>,
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
        expect,
    }
}
