//! Holding shunt against the real ztunnel (issue 34, "the real peer"): the
//! same xDS resources fed to both by an in-test istiod (delta ADS and
//! Istio's CA over TLS, [`istiod`]), the same probes from a client pod
//! ([`probe`]), and tables of expected outcomes taken from ztunnel
//! ([`cases`]). [`bed::Bed`] runs a case against a fresh peer: the shunt
//! agent, or the ztunnel binary named by `SHUNT_ZTUNNEL_BIN`
//! ([`ztunnel_peer`]). [`ztunnel_node`] runs that binary as the node's
//! in-pod proxy, served over ZDS by the agent; both run it through
//! [`ztunnel_process`]. [`config_dump`] holds shunt's `/config_dump`
//! against ztunnel's recorded one, [`metrics`] its `/metrics`,
//! [`access_lines`] its access lines. Not to be confused with the ZDS
//! stand-in `ztunnel.rs`.

pub mod access_lines;
pub mod bed;
pub mod cases;
pub mod compare;
pub mod config_dump;
pub mod istiod;
pub mod metrics;
pub mod pki;
pub mod probe;
mod resolver;
pub mod resources;
pub mod ztunnel_node;
pub mod ztunnel_peer;
mod ztunnel_process;

/// The record of case `name` in `expected/<folder>/` (in the source
/// tree): its name with every character but ASCII letters and digits a
/// `-`, then `suffix`.
fn record_file(folder: &str, name: &str, suffix: &str) -> std::path::PathBuf {
    let file: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("src/reference/expected")
        .join(folder)
        .join(format!("{file}{suffix}"))
}
