//! What the proxy would have reported for a passthrough connection, for
//! the connections that went direct: the kernel's events (opened, closed
//! with the bytes each way) become Istio's TCP metrics through the same
//! observer the proxy feeds — so the labels are the proxy's, by
//! construction — and an access log line like the proxy's.

use std::{
    collections::HashMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::{Arc, RwLock},
    time::{Duration, Instant},
};

use shunt_common::{FastPathEvent, FastPathStats, MeshLocalStats};
use tokio::{
    io::{Interest, unix::AsyncFd},
    sync::watch,
};
use tracing::warn;

use crate::{
    metrics::{FastPathMetrics, KernelConnections, PodFastPathKind, TcpSeries},
    proxy::{
        ConnectionClose, ConnectionInfo, ConnectionObserver, ConnectionOutcome, Direction,
        WorkloadLookup, access_log,
    },
    redirect::ebpf::{FastPathCounters, FastPathEvents},
    state::{TrustDomain, WorkloadKey},
    store::WorkloadStore,
};

/// How often the kernel's counters are copied into the metrics when no
/// event was read.
const COUNTERS_EVERY: Duration = Duration::from_secs(1);

/// How often the ring buffer is read without a wake-up while events come:
/// the programs wake the agent only once the ring holds a batch
/// (`ebpf/src/passthrough.rs`), so under load this is the longest an event
/// waits to be counted.
const POLL_EVERY: Duration = Duration::from_millis(20);

/// The longest wait between two reads of the ring: each read that finds
/// nothing doubles the wait from [`POLL_EVERY`] up to this, and a read that
/// finds an event starts again at [`POLL_EVERY`]. So an idle agent reads
/// the ring once a second instead of 50 times (one wake-up, which also
/// copies the kernel's counters: [`COUNTERS_EVERY`]), and the first event
/// after a quiet spell waits at most this long to be counted and logged —
/// well inside a 15 s metrics scrape. Under load nothing changes: every
/// read finds events, so the ring is read every [`POLL_EVERY`] (and on the
/// programs' wake-up at a full batch), never once per connection.
const POLL_IDLE_MAX: Duration = Duration::from_secs(1);

/// (source, destination) pairs whose labels are kept; past it the cache
/// starts again (passthrough destinations are any address).
const MAX_RESOLVED: usize = 4096;

/// Who the reports name and where they go.
pub struct Reporter {
    /// The proxy's observer: a failed connection is counted through it
    /// (rare; its series differ by `response_flags`).
    pub observer: Arc<dyn ConnectionObserver>,
    /// Istio's TCP series, resolved once per (source, destination).
    pub connections: KernelConnections,
    pub store: Arc<RwLock<WorkloadStore>>,
    pub trust_domain: TrustDomain,
    pub metrics: FastPathMetrics,
    /// The store owner's applied views: the resolved labels are dropped
    /// when it moves (a workload's name or identity may have changed).
    pub applied: watch::Receiver<u64>,
}

/// Reads `events` until the ring buffer fails; copies `counters` into the
/// metrics as it goes.
pub async fn report_events(
    events: FastPathEvents,
    counters: FastPathCounters,
    mut reporter: Reporter,
) {
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
    let mut labels = Resolved::default();
    let mut backoff = PollBackoff::default();
    let poll = tokio::time::sleep(POLL_EVERY);
    tokio::pin!(poll);
    let mut counters_copied: Option<Instant> = None;
    loop {
        tokio::select! {
            ready = events.readable_mut() => {
                let Ok(mut guard) = ready else { return };
                // Cleared before reading: a wake-up during the read is kept.
                guard.clear_ready();
            }
            () = &mut poll => {}
        }
        if reporter.applied.has_changed().unwrap_or(false) {
            reporter.applied.borrow_and_update();
            labels.clear();
        }
        let mut read_any = false;
        while let Some(event) = events.get_mut().next_event() {
            reporter.handle(&mut labels, &event);
            read_any = true;
        }
        // With the events (at most once per read of a batch, so the
        // kernel's counts move with the connections they name), else once
        // a second.
        if read_any || counters_copied.is_none_or(|at| at.elapsed() >= COUNTERS_EVERY) {
            copied = reporter.copy_counters(&counters.read(), copied);
            copied_mesh = reporter.copy_mesh_counters(&counters.read_mesh_local(), copied_mesh);
            reporter
                .metrics
                .mesh_local_on
                .set(i64::from(counters.mesh_local_on()));
            counters_copied = Some(Instant::now());
        }
        let wait = backoff.next(read_any);
        poll.as_mut().reset(tokio::time::Instant::now() + wait);
    }
}

/// The wait before the next read of the ring: [`POLL_EVERY`] after a read
/// that found events, doubled after each that found none, at most
/// [`POLL_IDLE_MAX`].
#[derive(Debug)]
struct PollBackoff {
    wait: Duration,
}

impl Default for PollBackoff {
    fn default() -> Self {
        Self { wait: POLL_EVERY }
    }
}

impl PollBackoff {
    fn next(&mut self, read_any: bool) -> Duration {
        self.wait = if read_any {
            POLL_EVERY
        } else {
            (self.wait * 2).min(POLL_IDLE_MAX)
        };
        self.wait
    }
}

/// One end's report of a connection: who it names and its series.
struct Side {
    direction: Direction,
    pod: Option<WorkloadKey>,
    src_identity: Option<String>,
    dst_identity: Option<String>,
    /// The service whose VIP the source dialled (the source's end only, as
    /// the proxy reports it).
    dst_service: Option<WorkloadKey>,
    series: TcpSeries,
}

/// What a connection's labels depend on: flow 2 or not, the source and
/// destination addresses, the service VIP and port dialled.
type PairKey = (bool, IpAddr, IpAddr, Option<SocketAddr>);

/// The resolved reports, by [`PairKey`].
#[derive(Default)]
pub struct Resolved {
    pairs: HashMap<PairKey, Vec<Side>>,
}

impl Resolved {
    fn clear(&mut self) {
        self.pairs.clear();
    }
}

impl Reporter {
    /// One event: an opened connection counts as opened; a closed one as
    /// closed with its bytes (a connection that never became established
    /// counts as opened and closed with `response_flags="CONNECT"`, as the
    /// proxy counts a passthrough it could not connect).
    pub fn handle(&self, resolved: &mut Resolved, event: &FastPathEvent) {
        let src = socket_addr(event.family, event.src_addr, event.src_port);
        let dst = socket_addr(event.family, event.dst_addr, event.dst_port);
        let mesh_local = event.flags & FastPathEvent::MESH_LOCAL != 0;
        let service = (event.service_family != 0)
            .then(|| socket_addr(event.service_family, event.service_addr, event.service_port));
        let key = (mesh_local, src.ip(), dst.ip(), service);
        if !resolved.pairs.contains_key(&key) && resolved.pairs.len() >= MAX_RESOLVED {
            resolved.clear();
        }
        let sides = resolved
            .pairs
            .entry(key)
            .or_insert_with(|| self.resolve(mesh_local, src, dst, service));
        for side in sides {
            self.report(event, side, src, dst);
        }
    }

    /// Both ends of a same-node mesh connection (reported as both proxies
    /// report a same-node HBONE connection, once by each end, with both
    /// identities; the source's names the service whose VIP `service` was
    /// dialled, as the proxy's outbound report does); the source's alone of
    /// a passthrough one.
    fn resolve(
        &self,
        mesh_local: bool,
        src: SocketAddr,
        dst: SocketAddr,
        service: Option<SocketAddr>,
    ) -> Vec<Side> {
        let (source, destination, dst_service, inbound_service) = {
            let store = self.store.read().unwrap_or_else(|p| p.into_inner());
            let named = |ip| {
                store
                    .by_ip(ip)
                    .map(|w| (w.key(), w.identity(&self.trust_domain).to_string()))
            };
            let dialled = service.and_then(|vip| store.services().by_addr(vip));
            // The destination's side names the service as a proxy's
            // inbound would (the outbound's `forwarded` host= is the
            // dialled service's hostname).
            let inbound_service = store.by_ip(dst.ip()).and_then(|target| {
                let host = dialled.map(|s| s.hostname.as_str());
                crate::proxy::inbound_service::guess(&store, target, host, dst.port())
            });
            (
                named(src.ip()),
                if mesh_local { named(dst.ip()) } else { None },
                dialled.map(|s| s.id()),
                inbound_service,
            )
        };
        let src_identity = source.as_ref().map(|(_, id)| id.clone());
        let dst_identity = destination.as_ref().map(|(_, id)| id.clone());
        let ends = if mesh_local {
            vec![
                (Direction::KernelOutbound, source.map(|(key, _)| key)),
                (Direction::KernelInbound, destination.map(|(key, _)| key)),
            ]
        } else {
            vec![(Direction::Passthrough, source.map(|(key, _)| key))]
        };
        ends.into_iter()
            .map(|(direction, pod)| {
                let dst_service = match direction {
                    Direction::KernelInbound => inbound_service.clone(),
                    _ => dst_service.clone(),
                };
                let info = ConnectionInfo {
                    direction,
                    pod: pod.as_ref(),
                    src_addr: src,
                    src_identity: src_identity.as_deref(),
                    dst_addr: dst,
                    dst_identity: dst_identity.as_deref(),
                    dst_workload: None,
                    dst_service: dst_service.as_ref(),
                    derived_source: None,
                    src_through_gateway: false,
                    derived_destination: None,
                };
                let series = self.connections.series(&info);
                Side {
                    direction,
                    pod,
                    src_identity: src_identity.clone(),
                    dst_identity: dst_identity.clone(),
                    dst_service,
                    series,
                }
            })
            .collect()
    }

    fn report(&self, event: &FastPathEvent, side: &mut Side, src: SocketAddr, dst: SocketAddr) {
        let info = ConnectionInfo {
            direction: side.direction,
            pod: side.pod.as_ref(),
            src_addr: src,
            src_identity: side.src_identity.as_deref(),
            dst_addr: dst,
            dst_identity: side.dst_identity.as_deref(),
            dst_workload: None,
            dst_service: side.dst_service.as_ref(),
            derived_source: None,
            src_through_gateway: false,
            derived_destination: None,
        };
        match event.kind {
            FastPathEvent::OPENED => {
                side.series.opened();
                if let Some(pod) = &side.pod {
                    let kind = match side.direction {
                        Direction::KernelOutbound => PodFastPathKind::MeshOutbound,
                        Direction::KernelInbound => PodFastPathKind::MeshInbound,
                        _ => PodFastPathKind::Passthrough,
                    };
                    self.metrics.count_pod(pod, kind);
                }
            }
            FastPathEvent::CLOSED => {
                let failed = event.flags & FastPathEvent::FAILED != 0;
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
                if failed {
                    self.observer.opened(&info).closed(&close);
                } else {
                    side.series
                        .closed(close.bytes_to_target, close.bytes_from_target);
                }
                write_access_line(self.store.as_ref(), &info, &close, event);
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
fn write_access_line(
    workloads: &dyn WorkloadLookup,
    info: &ConnectionInfo<'_>,
    close: &ConnectionClose,
    event: &FastPathEvent,
) {
    if !access_log::line_enabled(close.outcome == ConnectionOutcome::Success) {
        return;
    }
    // Both ends are pods of this node's (or, passthrough, none).
    let src = access_log::End::source(workloads, Some(info.src_addr.ip()), None);
    let dst = access_log::End::destination(workloads, info.dst_addr.ip(), None);
    let duration = access_log::duration_field(close.duration);
    let result = match close.outcome {
        ConnectionOutcome::Success => "success",
        _ => "failed",
    };
    let reason = if close.outcome == ConnectionOutcome::Success {
        ""
    } else {
        "connect failed (the connection never became established)"
    };
    // ztunnel's: the service's hostname, left out when there is none.
    let dst_service = info.dst_service.map(|key| workloads.service_hostname(key));
    macro_rules! line {
        ($level:ident) => {
            tracing::$level!(
                target: access_log::TARGET,
                direction = info.direction.as_str(),
                src.addr = %info.src_addr,
                src.workload = src.workload(),
                src.namespace = src.namespace(),
                src.identity = info.src_identity,
                src.cluster = src.cluster(),
                dst.addr = %info.dst_addr,
                dst.service = dst_service.as_deref(),
                dst.workload = dst.workload(),
                dst.namespace = dst.namespace(),
                dst.identity = info.dst_identity,
                dst.cluster = dst.cluster(),
                bytes_sent = close.bytes_to_target,
                bytes_recv = close.bytes_from_target,
                duration = duration.as_str(),
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
    fn the_poll_backs_off_while_idle_and_returns_with_an_event() {
        let mut backoff = PollBackoff::default();
        let idle: Vec<Duration> = (0..8).map(|_| backoff.next(false)).collect();
        let ms: Vec<u128> = idle.iter().map(Duration::as_millis).collect();
        assert_eq!(
            ms,
            [40, 80, 160, 320, 640, 1000, 1000, 1000],
            "an idle reader doubles its wait up to once a second"
        );
        assert_eq!(
            backoff.next(true),
            POLL_EVERY,
            "an event brings the short poll back"
        );
        assert_eq!(
            backoff.next(true),
            POLL_EVERY,
            "and it stays while events come"
        );
        assert_eq!(backoff.next(false), POLL_EVERY * 2);
    }

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
