//! The kernel form of a pod's settings: what `enrol` writes into the pod's
//! slot of `SHUNT_POD_CONFIG` and `SHUNT_POD_ADDRS` (`common/src/pod.rs`),
//! checked against the kernel side's fixed sizes.

use std::net::IpAddr;

use shunt_common::{Cidr4, MAX_EXCLUDED_CIDRS, MAX_EXCLUDED_PORTS, PodAddrs, PodConfig};

use super::{PodTarget, RedirectError, SpliceMode};

/// The kernel form of a pod's capture settings.
pub(super) fn pod_config(
    target: &PodTarget,
    splice: SpliceMode,
    preserve_source: bool,
    fast_path: bool,
) -> Result<PodConfig, RedirectError> {
    let (pod, capture) = (&target.key, &target.capture);
    let invalid = |problem: String| RedirectError::InvalidCapture {
        pod: pod.clone(),
        problem,
    };
    let mut config = PodConfig::default();
    if capture.outbound {
        config.flags |= PodConfig::REDIRECT_OUTBOUND;
    }
    if capture.inbound {
        config.flags |= PodConfig::REDIRECT_INBOUND;
    }
    if preserve_source {
        config.flags |= PodConfig::REPLY_TO_PROXY;
    }
    if !splice.splices(capture.splice) {
        config.flags |= PodConfig::NO_SPLICE;
    }
    if fast_path && capture.outbound && capture.fast_path != Some(false) {
        config.flags |= PodConfig::FAST_PATH;
    }
    if capture.dns {
        config.flags |= PodConfig::DNS_CAPTURE;
    }
    let ports = |ports: &[u16], into: &mut [u16; MAX_EXCLUDED_PORTS], what: &str| {
        if ports.len() > MAX_EXCLUDED_PORTS {
            return Err(invalid(format!(
                "{} excluded {what} ports given, at most {MAX_EXCLUDED_PORTS} are supported",
                ports.len()
            )));
        }
        into[..ports.len()].copy_from_slice(ports);
        Ok(())
    };
    ports(
        &capture.excluded_outbound_ports,
        &mut config.excluded_outbound_ports,
        "outbound",
    )?;
    ports(
        &capture.excluded_inbound_ports,
        &mut config.excluded_inbound_ports,
        "inbound",
    )?;
    if capture.excluded_outbound_cidrs.len() > MAX_EXCLUDED_CIDRS {
        return Err(invalid(format!(
            "{} excluded outbound CIDRs given, at most {MAX_EXCLUDED_CIDRS} are supported",
            capture.excluded_outbound_cidrs.len()
        )));
    }
    for (i, (addr, prefix)) in capture.excluded_outbound_cidrs.iter().enumerate() {
        if *prefix > 32 {
            return Err(invalid(format!(
                "excluded CIDR {addr}/{prefix}: prefix longer than 32"
            )));
        }
        let mask = if *prefix == 0 {
            0
        } else {
            u32::MAX << (32 - prefix)
        };
        config.excluded_cidrs_v4[i] = Cidr4 {
            addr: u32::from_ne_bytes(addr.octets()),
            mask: u32::from_ne_bytes(mask.to_be_bytes()),
        };
    }
    config.excluded_cidr_count = capture.excluded_outbound_cidrs.len() as u32;
    Ok(config)
}

/// The kernel form of a pod's own addresses: its first IPv4 and first IPv6
/// one, in network order.
pub(super) fn pod_addrs(ips: &[IpAddr]) -> PodAddrs {
    let mut addrs = PodAddrs::default();
    for ip in ips {
        match ip {
            IpAddr::V4(v4) if addrs.ipv4 == 0 => addrs.ipv4 = u32::from_ne_bytes(v4.octets()),
            IpAddr::V6(v6) if addrs.ipv6 == [0; 4] => {
                for (word, chunk) in addrs.ipv6.iter_mut().zip(v6.octets().chunks_exact(4)) {
                    *word = u32::from_ne_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
                }
            }
            _ => {}
        }
    }
    addrs
}
