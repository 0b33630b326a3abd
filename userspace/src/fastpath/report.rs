//! What the proxy would have reported for a passthrough connection, for
//! the connections that went direct: the kernel's events (opened, closed
//! with the bytes each way) become Istio's TCP metrics through the same
//! observer the proxy feeds — so the labels are the proxy's, by
//! construction — and an access log line like the proxy's.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::{Arc, RwLock},
    time::Duration,
};

use shunt_common::{FastPathEvent, FastPathStats, MeshLocalStats};
use tokio::io::{Interest, unix::AsyncFd};
use tracing::warn;

use crate::{
    metrics::FastPathMetrics,
    proxy::{ConnectionClose, ConnectionInfo, ConnectionObserver, ConnectionOutcome, Direction},
    redirect::ebpf::{FastPathCounters, FastPathEvents},
    state::TrustDomain,
    store::WorkloadStore,
};

/// How often the kernel's counters are copied into the metrics when no
/// event wakes the task.
const COUNTERS_EVERY: Duration = Duration::from_secs(1);

/// Who the reports name and where they go.
pub struct Reporter {
    pub observer: Arc<dyn ConnectionObserver>,
    pub store: Arc<RwLock<WorkloadStore>>,
    pub trust_domain: TrustDomain,
    pub metrics: FastPathMetrics,
}

/// Reads `events` until the ring buffer fails; copies `counters` into the
/// metrics as it goes.
pub async fn report_events(events: FastPathEvents, counters: FastPathCounters, reporter: Reporter) {
    // SAFETY: `FastPathEvents` owns the ring buffer's fd and keeps it open,
    // with the same value, until it is dropped together with the AsyncFd.
    let registered = unsafe { AsyncFd::register_with_interest(events, Interest::READABLE) };
    let mut events = match registered {
        Ok(fd) => fd,
        Err(e) => {
            warn!(error = %e, "cannot watch the fast path's event ring buffer: its connections are not reported");
            return;
        }
    };
    let mut copied = FastPathStats::default();
    let mut copied_mesh = MeshLocalStats::default();
    let mut tick = tokio::time::interval(COUNTERS_EVERY);
    loop {
        tokio::select! {
            ready = events.readable_mut() => {
                let Ok(mut guard) = ready else { return };
                while let Some(event) = guard.get_inner_mut().next_event() {
                    reporter.handle(&event);
                }
                guard.clear_ready();
            }
            _ = tick.tick() => {}
        }
        copied = reporter.copy_counters(&counters.read(), copied);
        copied_mesh = reporter.copy_mesh_counters(&counters.read_mesh_local(), copied_mesh);
        reporter
            .metrics
            .mesh_local_on
            .set(i64::from(counters.mesh_local_on()));
    }
}

impl Reporter {
    /// One event: an opened connection counts as opened; a closed one as
    /// closed with its bytes (a connection that never became established
    /// counts as opened and closed with `response_flags="CONNECT"`, as the
    /// proxy counts a passthrough it could not connect).
    pub fn handle(&self, event: &FastPathEvent) {
        let src = socket_addr(event.family, event.src_addr, event.src_port);
        let dst = socket_addr(event.family, event.dst_addr, event.dst_port);
        let mesh_local = event.flags & FastPathEvent::MESH_LOCAL != 0;
        let (source, destination) = {
            let store = self.store.read().unwrap_or_else(|p| p.into_inner());
            let named = |ip| {
                store
                    .by_ip(ip)
                    .map(|w| (w.key(), w.identity(&self.trust_domain).to_string()))
            };
            (
                named(src.ip()),
                if mesh_local { named(dst.ip()) } else { None },
            )
        };
        let info = ConnectionInfo {
            direction: Direction::Passthrough,
            pod: source.as_ref().map(|(key, _)| key),
            src_addr: src,
            src_identity: source.as_ref().map(|(_, id)| id.as_str()),
            dst_addr: dst,
            dst_identity: None,
            dst_service: None,
            derived_source: None,
        };
        if mesh_local {
            // Both ends are this node's: reported as both proxies report a
            // same-node HBONE connection, once by each end.
            let outbound = ConnectionInfo {
                direction: Direction::KernelOutbound,
                dst_identity: destination.as_ref().map(|(_, id)| id.as_str()),
                ..info
            };
            let inbound = ConnectionInfo {
                direction: Direction::KernelInbound,
                pod: destination.as_ref().map(|(key, _)| key),
                ..outbound
            };
            self.report(event, &outbound);
            self.report(event, &inbound);
            return;
        }
        self.report(event, &info);
    }

    fn report(&self, event: &FastPathEvent, info: &ConnectionInfo<'_>) {
        let info = *info;
        match event.kind {
            FastPathEvent::OPENED => self.observer.opened(&info),
            FastPathEvent::CLOSED => {
                let failed = event.flags & FastPathEvent::FAILED != 0;
                if failed {
                    self.observer.opened(&info);
                }
                let close = ConnectionClose {
                    bytes_to_target: event.bytes_sent,
                    bytes_from_target: event.bytes_received,
                    duration: Duration::from_nanos(event.duration_ns),
                    outcome: if failed {
                        ConnectionOutcome::Failed
                    } else {
                        ConnectionOutcome::Success
                    },
                };
                self.observer.closed(&info, &close);
                access_log(&info, &close, event);
            }
            _ => {}
        }
    }

    /// As [`Reporter::copy_counters`], for flow 2's counters.
    fn copy_mesh_counters(&self, now: &MeshLocalStats, before: MeshLocalStats) -> MeshLocalStats {
        let m = &self.metrics;
        m.mesh_local
            .inc_by(now.carried.saturating_sub(before.carried));
        m.proxied_for("mesh_off")
            .inc_by(now.off.saturating_sub(before.off));
        m.proxied_for("mesh_untracked")
            .inc_by(now.untracked.saturating_sub(before.untracked));
        let unrecorded = now.flows_unrecorded.saturating_sub(before.flows_unrecorded);
        if unrecorded > 0 {
            warn!(
                unrecorded,
                "same-node mesh connections whose SYN entry could not be written: their destination's proxy got them as plaintext"
            );
        }
        m.proxied_for("mesh_flow_unrecorded").inc_by(unrecorded);
        *now
    }

    /// Adds what the kernel counted since `before` to the metrics; returns
    /// the new totals.
    fn copy_counters(&self, now: &FastPathStats, before: FastPathStats) -> FastPathStats {
        let m = &self.metrics;
        m.direct.inc_by(now.direct.saturating_sub(before.direct));
        m.proxied_for("table_invalid")
            .inc_by(now.table_invalid.saturating_sub(before.table_invalid));
        m.proxied_for("untracked")
            .inc_by(now.untracked.saturating_sub(before.untracked));
        let dropped = now.events_dropped.saturating_sub(before.events_dropped);
        if dropped > 0 {
            warn!(
                dropped,
                "fast-path events lost (ring buffer full): those connections are missing from the metrics"
            );
        }
        m.events_dropped.inc_by(dropped);
        *now
    }
}

/// The proxy's access log line (`shunt::access`), for a connection the
/// kernel carried.
fn access_log(info: &ConnectionInfo<'_>, close: &ConnectionClose, event: &FastPathEvent) {
    let result = match close.outcome {
        ConnectionOutcome::Success => "success",
        _ => "failed",
    };
    let reason = if close.outcome == ConnectionOutcome::Success {
        ""
    } else {
        "connect failed (the connection never became established)"
    };
    macro_rules! line {
        ($level:ident) => {
            tracing::$level!(
                target: "shunt::access",
                direction = info.direction.as_str(),
                src.addr = %info.src_addr,
                src.identity = info.src_identity.unwrap_or("-"),
                dst.addr = %info.dst_addr,
                dst.identity = info.dst_identity.unwrap_or("-"),
                dst.service = "-",
                bytes_sent = close.bytes_to_target,
                bytes_received = close.bytes_from_target,
                duration_ms = close.duration.as_millis() as u64,
                result,
                policy = "-",
                reason,
                path = "fast",
                slot = event.slot,
                netns_cookie = event.netns_cookie,
                "connection complete"
            )
        };
    }
    if close.outcome == ConnectionOutcome::Success {
        line!(info);
    } else {
        line!(warn);
    }
}

/// An address as the programs give it (network-order words, IPv4 in the
/// first), IPv4-mapped IPv6 as IPv4 (as the store keys it).
fn socket_addr(family: u32, words: [u32; 4], port: u32) -> SocketAddr {
    const AF_INET: u32 = 2;
    let ip = if family == AF_INET {
        IpAddr::V4(Ipv4Addr::from(words[0].to_ne_bytes()))
    } else {
        let mut octets = [0u8; 16];
        for (chunk, word) in octets.chunks_exact_mut(4).zip(words) {
            chunk.copy_from_slice(&word.to_ne_bytes());
        }
        Ipv6Addr::from(octets).to_canonical()
    };
    SocketAddr::new(ip, port as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_read_as_the_programs_write_them() {
        let v4 = socket_addr(2, [u32::from_ne_bytes([198, 18, 1, 10]), 0, 0, 0], 40000);
        assert_eq!(v4, "198.18.1.10:40000".parse().expect("addr"));
        let mapped = crate::redirect::ebpf::fast_path_key("198.18.2.10".parse().expect("ip"));
        assert_eq!(
            socket_addr(10, mapped.addr, 8080),
            "198.18.2.10:8080".parse().expect("addr"),
            "a dual-stack socket's IPv4 peer is named as IPv4"
        );
    }
}
