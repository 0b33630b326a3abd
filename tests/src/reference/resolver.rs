//! The DNS server a case's names resolve at, for the client's proxy (a
//! DNS-resolved ServiceEntry's endpoints): an in-test [`DnsResponder`] on
//! the east-west pod's port 53, and a resolv.conf naming it, which the
//! proxy is given (shunt: `--dns-resolv-conf`; ztunnel: bound over its
//! `/etc/resolv.conf`, `ztunnel_process.rs`).

use std::{
    net::{IpAddr, SocketAddr},
    path::Path,
};

use crate::{Pod, Result, TestbedError, dns::DnsResponder};

/// Serves until dropped.
pub(super) struct CaseResolver {
    _server: DnsResponder,
    conf: tempfile::NamedTempFile,
}

impl CaseResolver {
    /// Serves `names` (name → IPv4 address) on `pod`'s address, port 53.
    pub(super) fn start(pod: &Pod, names: &[(&str, [u8; 4])]) -> Result<CaseResolver> {
        let zone = names
            .iter()
            .map(|(name, ip)| (name.to_string(), vec![IpAddr::from(*ip)]))
            .collect();
        let addr = SocketAddr::new(pod.ip().into(), 53);
        let server = DnsResponder::start(pod, addr, zone, false)?;
        let conf =
            tempfile::NamedTempFile::new().map_err(|e| TestbedError::io("resolv.conf", e))?;
        std::fs::write(conf.path(), format!("nameserver {}\n", pod.ip()))
            .map_err(|e| TestbedError::io("resolv.conf", e))?;
        Ok(CaseResolver {
            _server: server,
            conf,
        })
    }

    /// The resolv.conf naming the server.
    pub(super) fn conf(&self) -> &Path {
        self.conf.path()
    }
}
