//! HBONE CONNECT to a hostname authority (issue 34 item 10), as waypoints
//! send it: `web.default.svc.cluster.local:80`, the server an endpoint of
//! that Service (port 80 to 8080).

use super::{Case, SLEEP, row, row_to_host};
use crate::reference::{
    probe::Outcome::{Allowed, Refused},
    resources::{encode, service},
};

const WEB: &str = "web.default.svc.cluster.local";

pub fn cases() -> Vec<Case> {
    let mut case = Case::authz(
        "CONNECT web.default.svc.cluster.local:80",
        Vec::new(),
        vec![
            row_to_host(SLEEP, WEB, 80, Allowed),
            // A port the Service does not have.
            row_to_host(SLEEP, WEB, 81, Refused),
            row(SLEEP, 8080, Allowed),
        ],
    );
    case.addresses = vec![encode(service("web", WEB, [198, 19, 100, 47]))];
    case.server_services = vec!["default/web.default.svc.cluster.local"];
    vec![case]
}
