//! Limits a hostile peer cannot exhaust, and the count of every refusal.
//!
//! Inbound connections (15008 and 15006) pass [`Limits::admit`] right after
//! `accept`, before any byte is read:
//!
//! - **per source IP**: at most [`LimitsConfig::max_connections_per_source`]
//!   open at once (both ports together, every pod of the node together);
//!   the next one is reset at once;
//! - **file descriptors**: the agent keeps [`LimitsConfig::fd_reserve`] fds
//!   free for the listeners' own work. `accept` hands out the lowest free
//!   fd, so an accepted fd numbered at or above `soft limit - reserve`
//!   proves that every fd below it is taken. Then the oldest HBONE
//!   connection still in its handshake (no first CONNECT yet: nothing of
//!   value is lost) is closed to make room; with none, the new connection
//!   is reset. A well-behaved client therefore gets through even while
//!   idle handshakes fill the table: they are the ones shed.
//! - when `accept` itself fails (EMFILE, ENFILE, ENOBUFS), the listener
//!   sheds a pending handshake and backs off (5 ms doubling to 1 s) instead
//!   of spinning; the kernel's backlog holds new connections meanwhile.
//!
//! Every refusal, whichever layer makes it, is counted by [`RefusalReason`]
//! (`/status`, `shunt_proxy_refusals_total{reason}` on `/metrics`) and
//! written to the access log; lines for refusals a peer can cause in bulk
//! (connection limits, HTTP/2 resets) are rate-limited, the counters never.

use std::{
    collections::{BTreeMap, HashMap},
    net::{IpAddr, SocketAddr},
    os::fd::AsRawFd,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

use super::{AccessLog, PodState, Shared, h2_refusals::H2Refusal};
use crate::state::WorkloadKey;

/// Default of [`LimitsConfig::max_connections_per_source`]: generous for a
/// node's worth of clients behind one address (a peer node's pooled HBONE
/// connections carry 100 streams each; plaintext clients behind SNAT share
/// an IP), small next to the fds a node agent gets (its hard limit, often
/// 1M).
pub const DEFAULT_MAX_CONNECTIONS_PER_SOURCE: u32 = 1024;

/// HTTP/2 streams one inbound HBONE connection may have open at once
/// (`SETTINGS_MAX_CONCURRENT_STREAMS`, ztunnel's value); the next is refused
/// with `RST_STREAM(REFUSED_STREAM)` by h2.
pub const MAX_CONCURRENT_STREAMS: u32 = 100;

/// Limits on inbound connections (see the module doc).
#[derive(Clone, Debug)]
pub struct LimitsConfig {
    /// Inbound connections (15008 and 15006 together) open at once from one
    /// source IP; 0: no limit.
    pub max_connections_per_source: u32,
    /// File descriptors kept free for the listeners' own work; 0: automatic
    /// (a sixteenth of the soft limit, between 64 and 4096).
    pub fd_reserve: u64,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            max_connections_per_source: DEFAULT_MAX_CONNECTIONS_PER_SOURCE,
            fd_reserve: 0,
        }
    }
}

/// Why the proxy refused a connection or a stream: the `reason` label of
/// `shunt_proxy_refusals_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RefusalReason {
    /// More connections from the source IP than the per-source limit.
    SourceLimit,
    /// File descriptors short and no pending handshake to shed.
    FdBudget,
    /// A pending handshake closed to make room for a new connection.
    HandshakeEvicted,
    /// `accept` failed (fd table full or kernel memory short).
    AcceptFailed,
    /// TLS handshake, HTTP/2 handshake or the first CONNECT not done in
    /// time.
    HandshakeTimeout,
    /// The TLS handshake failed (certificate, ALPN, not TLS).
    Tls,
    /// h2: over `SETTINGS_MAX_CONCURRENT_STREAMS` (`REFUSED_STREAM`).
    H2RefusedStream,
    /// h2: request headers over `max_header_list_size` (431).
    H2HeadersTooLarge,
    /// h2: a malformed request reset by the codec (`PROTOCOL_ERROR`), e.g.
    /// an unparsable `:authority`.
    H2Malformed,
    /// h2: any other stream reset h2 sent on its own.
    H2StreamError,
    /// h2: GOAWAY `too_many_resets` (rapid reset).
    H2RapidReset,
    /// h2: GOAWAY `too_many_continuations` (CONTINUATION flood).
    H2ContinuationFlood,
    /// h2: GOAWAY `header_list_way_too_large`.
    H2HeaderFlood,
    /// h2: any other GOAWAY with an error (protocol errors, other floods).
    H2GoAway,
    /// The proxy's own checks of a CONNECT or a plaintext connection
    /// (target, original destination, the node-wide plaintext switch).
    Request,
    /// An authorization policy.
    Policy,
    /// An inbound connection before the first complete cluster view
    /// (workloads and policies) was applied: refused at once, fail closed
    /// (`accept.rs`).
    NotSynced,
}

impl RefusalReason {
    pub const ALL: [RefusalReason; 17] = [
        RefusalReason::SourceLimit,
        RefusalReason::FdBudget,
        RefusalReason::HandshakeEvicted,
        RefusalReason::AcceptFailed,
        RefusalReason::HandshakeTimeout,
        RefusalReason::Tls,
        RefusalReason::H2RefusedStream,
        RefusalReason::H2HeadersTooLarge,
        RefusalReason::H2Malformed,
        RefusalReason::H2StreamError,
        RefusalReason::H2RapidReset,
        RefusalReason::H2ContinuationFlood,
        RefusalReason::H2HeaderFlood,
        RefusalReason::H2GoAway,
        RefusalReason::Request,
        RefusalReason::Policy,
        RefusalReason::NotSynced,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RefusalReason::SourceLimit => "source_limit",
            RefusalReason::FdBudget => "fd_budget",
            RefusalReason::HandshakeEvicted => "handshake_evicted",
            RefusalReason::AcceptFailed => "accept_failed",
            RefusalReason::HandshakeTimeout => "handshake_timeout",
            RefusalReason::Tls => "tls",
            RefusalReason::H2RefusedStream => "h2_refused_stream",
            RefusalReason::H2HeadersTooLarge => "h2_headers_too_large",
            RefusalReason::H2Malformed => "h2_malformed",
            RefusalReason::H2StreamError => "h2_stream_error",
            RefusalReason::H2RapidReset => "h2_rapid_reset",
            RefusalReason::H2ContinuationFlood => "h2_continuation_flood",
            RefusalReason::H2HeaderFlood => "h2_header_flood",
            RefusalReason::H2GoAway => "h2_goaway",
            RefusalReason::Request => "request",
            RefusalReason::Policy => "policy",
            RefusalReason::NotSynced => "not_synced",
        }
    }

    fn index(self) -> usize {
        Self::ALL.iter().position(|r| *r == self).unwrap_or(0)
    }
}

/// At most [`LINES_PER_SECOND`] lines a second for refusals a peer can
/// cause in bulk; the rest are counted, and the next line says how many
/// were left out.
const LINES_PER_SECOND: u32 = 20;

/// Which inbound listener a connection came through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Inbound {
    Hbone,
    Plaintext,
}

/// Why [`Limits::admit`] refused a connection.
#[derive(Debug)]
pub(crate) enum Refused {
    SourceLimit { open: u32, limit: u32 },
    FdBudget { fd: u64, soft: u64, reserve: u64 },
}

impl Refused {
    pub fn reason(&self) -> RefusalReason {
        match self {
            Refused::SourceLimit { .. } => RefusalReason::SourceLimit,
            Refused::FdBudget { .. } => RefusalReason::FdBudget,
        }
    }
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::SourceLimit { open, limit } => write!(
                f,
                "the source has {open} connections open, the limit (--max-connections-per-source) is {limit}"
            ),
            Refused::FdBudget { fd, soft, reserve } => write!(
                f,
                "file descriptors short: accepted fd {fd} is in the reserve of {reserve} below the limit of {soft}, and no pending handshake could be shed"
            ),
        }
    }
}

/// The limits' shared state: one per proxy.
#[derive(Debug)]
pub(crate) struct Limits {
    state: Arc<State>,
}

#[derive(Debug)]
struct State {
    config: LimitsConfig,
    /// Open inbound connections per source IP (entries at 0 are removed).
    per_source: Mutex<HashMap<IpAddr, u32>>,
    /// HBONE connections still in their handshake, oldest first.
    pending: Mutex<BTreeMap<u64, CancellationToken>>,
    next_pending: AtomicU64,
    refusals: [AtomicU64; RefusalReason::ALL.len()],
    lines: crate::logging::LineBudget,
}

impl Limits {
    pub fn new(config: LimitsConfig) -> Self {
        Self {
            state: Arc::new(State {
                config,
                per_source: Mutex::new(HashMap::new()),
                pending: Mutex::new(BTreeMap::new()),
                next_pending: AtomicU64::new(0),
                refusals: std::array::from_fn(|_| AtomicU64::new(0)),
                lines: crate::logging::LineBudget::new(LINES_PER_SECOND),
            }),
        }
    }

    /// Counts one refusal.
    pub fn count(&self, reason: RefusalReason) {
        self.state.refusals[reason.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// Every reason with its count so far.
    pub fn refusals(&self) -> BTreeMap<String, u64> {
        RefusalReason::ALL
            .iter()
            .map(|r| {
                (
                    r.as_str().to_string(),
                    self.state.refusals[r.index()].load(Ordering::Relaxed),
                )
            })
            .collect()
    }

    /// Whether a rate-limited line may be written now: `Some(lines left
    /// out before it)`.
    pub fn line_allowed(&self) -> Option<u64> {
        self.state.lines.allow()
    }

    /// Checks a connection just accepted on 15008 or 15006 (see the module
    /// doc). The admission must live as long as the connection.
    pub fn admit(
        &self,
        kind: Inbound,
        stream: &tokio::net::TcpStream,
        peer: SocketAddr,
    ) -> Result<Admission, Refused> {
        let source = peer.ip();
        let limit = self.state.config.max_connections_per_source;
        {
            let mut per_source = self
                .state
                .per_source
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let open = per_source.entry(source).or_insert(0);
            if limit > 0 && *open >= limit {
                return Err(Refused::SourceLimit { open: *open, limit });
            }
            *open += 1;
        }
        // From here the admission owns the per-source slot: dropping it
        // (also on refusal) gives the slot back.
        let mut admission = Admission {
            state: self.state.clone(),
            source,
            pending: None,
            evict: CancellationToken::new(),
        };
        let fd = stream.as_raw_fd().max(0) as u64;
        let soft = open_files_limit().0;
        let reserve = fd_reserve(&self.state.config, soft);
        if fd >= soft.saturating_sub(reserve) && !self.shed_pending_handshake() {
            return Err(Refused::FdBudget { fd, soft, reserve });
        }
        if kind == Inbound::Hbone {
            let id = self.state.next_pending.fetch_add(1, Ordering::Relaxed);
            self.state
                .pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(id, admission.evict.clone());
            admission.pending = Some(id);
        }
        Ok(admission)
    }

    /// Closes the oldest HBONE connection still in its handshake (its task
    /// sees [`Admission::evicted`] and logs it). Returns whether there was
    /// one.
    pub fn shed_pending_handshake(&self) -> bool {
        let oldest = self
            .state
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .pop_first();
        match oldest {
            Some((_, token)) => {
                token.cancel();
                true
            }
            None => false,
        }
    }

    /// Open inbound connections from `source` now.
    #[cfg(test)]
    fn open_from(&self, source: IpAddr) -> u32 {
        self.state
            .per_source
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&source)
            .copied()
            .unwrap_or(0)
    }
}

/// One admitted inbound connection: holds its per-source slot, and while
/// it is an HBONE connection in its handshake, its place among those that
/// may be shed.
#[derive(Debug)]
pub(crate) struct Admission {
    state: Arc<State>,
    source: IpAddr,
    pending: Option<u64>,
    evict: CancellationToken,
}

impl Admission {
    /// The connection got its first CONNECT: it is no longer shed to make
    /// room.
    pub fn established(&mut self) {
        if let Some(id) = self.pending.take() {
            self.state
                .pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&id);
        }
    }

    pub fn is_established(&self) -> bool {
        self.pending.is_none()
    }

    /// Resolves when the connection is shed to make room (only while it is
    /// in its handshake).
    pub fn evicted(&self) -> WaitForCancellationFuture<'_> {
        self.evict.cancelled()
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.established();
        let mut per_source = self
            .state
            .per_source
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(open) = per_source.get_mut(&self.source) {
            *open = open.saturating_sub(1);
            if *open == 0 {
                per_source.remove(&self.source);
            }
        }
    }
}

/// How long a listener waits after `accept` failed, given the previous
/// wait: 5 ms, doubling to 1 s.
pub(crate) fn accept_backoff(previous: Option<Duration>) -> Duration {
    match previous {
        None => Duration::from_millis(5),
        Some(d) => (d * 2).min(Duration::from_secs(1)),
    }
}

/// Whether an `accept` error means the process or the kernel is out of a
/// resource (as opposed to one connection's failure, e.g. ECONNABORTED).
pub(crate) fn out_of_resources(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE) | Some(libc::ENFILE) | Some(libc::ENOBUFS) | Some(libc::ENOMEM)
    )
}

/// The open-files limit now: (soft, hard).
pub fn open_files_limit() -> (u64, u64) {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit only writes the struct it is given.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
    if rc != 0 {
        // Cannot happen for RLIMIT_NOFILE; the classic default then.
        return (1024, 1024);
    }
    (limit.rlim_cur, limit.rlim_max)
}

/// The reserve for a soft limit of `soft`.
fn fd_reserve(config: &LimitsConfig, soft: u64) -> u64 {
    match config.fd_reserve {
        0 => (soft / 16).clamp(64, 4096),
        n => n,
    }
}

/// What [`raise_open_files_limit`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpenFiles {
    pub before: u64,
    pub soft: u64,
    pub hard: u64,
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (a proxy holds two fds
/// per connection and more per HBONE stream; the usual soft default of 1024
/// is far too few). Called once at start.
pub fn raise_open_files_limit() -> std::io::Result<OpenFiles> {
    let (before, hard) = open_files_limit();
    if before < hard {
        let limit = libc::rlimit {
            rlim_cur: hard as libc::rlim_t,
            rlim_max: hard as libc::rlim_t,
        };
        // SAFETY: setrlimit only reads the struct it is given.
        let rc = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    let (soft, hard) = open_files_limit();
    Ok(OpenFiles { before, soft, hard })
}

/// The reserve the proxy keeps now (for the log and `/status`).
pub fn fd_reserve_now(config: &LimitsConfig) -> u64 {
    fd_reserve(config, open_files_limit().0)
}

/// Runs [`Limits::admit`] for a connection just accepted: an admitted one
/// comes back with its admission; a refused one is reset, counted and
/// logged (rate-limited), and `None` comes back.
pub(crate) fn admit_or_refuse(
    shared: &Shared,
    pod: &PodState,
    kind: Inbound,
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
) -> Option<(tokio::net::TcpStream, Admission)> {
    let refused = match shared.limits.admit(kind, &stream, peer) {
        Ok(admission) => return Some((stream, admission)),
        Err(refused) => refused,
    };
    super::reset(&stream);
    let local = stream.local_addr().unwrap_or(peer);
    drop(stream);
    let direction = match kind {
        Inbound::Hbone => "inbound",
        Inbound::Plaintext => "inbound_plaintext",
    };
    let mut log = AccessLog {
        pod: Some(&pod.key),
        dst_identity: Some(pod.identity.as_str()),
        refusal: Some(refused.reason()),
        ..AccessLog::new(direction, peer, local)
    };
    quiet_unless_allowed(shared, &mut log, format!("refused at accept: {refused}"));
    log.emit(shared);
    None
}

/// Refuses an inbound connection accepted before the first complete
/// cluster view: no policy is known, so none can be applied (fail closed).
/// Reset at once rather than held: ztunnel binds no pod listener before its
/// first xDS update, so its peers see a refusal at once too; a client
/// retries, and a held connection would only delay that.
pub(crate) fn refuse_unsynced(
    shared: &Shared,
    pod: &PodState,
    kind: Inbound,
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
) {
    super::reset(&stream);
    let local = stream.local_addr().unwrap_or(peer);
    drop(stream);
    let direction = match kind {
        Inbound::Hbone => "inbound",
        Inbound::Plaintext => "inbound_plaintext",
    };
    let mut log = AccessLog {
        pod: Some(&pod.key),
        dst_identity: Some(pod.identity.as_str()),
        refusal: Some(RefusalReason::NotSynced),
        // ztunnel holds such a connection unanswered: none of its TCP
        // metrics counts it.
        early: true,
        ..AccessLog::new(direction, peer, local)
    };
    quiet_unless_allowed(
        shared,
        &mut log,
        "refused at accept: no complete cluster view (workloads and policies) yet".into(),
    );
    log.emit(shared);
}

/// Sets `log`'s reason, and makes it quiet when too many such lines were
/// written this second (the line written next says how many were not).
pub(crate) fn quiet_unless_allowed(shared: &Shared, log: &mut AccessLog<'_>, reason: String) {
    match shared.limits.line_allowed() {
        Some(0) => log.reason = Some(reason),
        Some(left_out) => {
            log.reason = Some(format!(
                "{reason} ({left_out} similar lines left out in the last second)"
            ))
        }
        None => {
            log.reason = Some(reason);
            log.quiet = true;
        }
    }
}

/// `accept` failed on a listener: counted, logged (rate-limited); when the
/// process is out of fds, the oldest pending handshake is shed so that the
/// next `accept` can succeed.
pub(crate) fn accept_failed(
    shared: &Shared,
    pod: &WorkloadKey,
    listener: &'static str,
    e: &std::io::Error,
    wait: Duration,
) {
    shared.limits.count(RefusalReason::AcceptFailed);
    let shed = out_of_resources(e) && shared.limits.shed_pending_handshake();
    if let Some(left_out) = shared.limits.line_allowed() {
        let (soft, _) = open_files_limit();
        tracing::warn!(pod = %pod, listener, error = %e, open_files_limit = soft, shed_a_pending_handshake = shed,
            left_out, retry_in = ?wait, "accept failed; backing off (the backlog holds new connections)");
    }
}

/// What a [`FrameTap`](super::h2_refusals::FrameTap) on one inbound HBONE
/// connection reports its refusals with.
pub(crate) struct H2Context {
    pub shared: Arc<Shared>,
    pub pod: WorkloadKey,
    pub peer: SocketAddr,
    pub arrival: SocketAddr,
    pub peer_identity: Option<Arc<str>>,
}

impl H2Context {
    /// One refusal h2 made: counted, in the access log (rate-limited).
    pub fn refused(&self, refusal: H2Refusal) {
        let mut log = AccessLog {
            src_identity: self.peer_identity.as_deref(),
            pod: Some(&self.pod),
            refusal: Some(refusal.reason),
            ..AccessLog::new("inbound", self.peer, self.arrival)
        };
        quiet_unless_allowed(&self.shared, &mut log, refusal.detail);
        log.emit(&self.shared);
    }
}

#[cfg(test)]
#[path = "limits_tests.rs"]
mod tests;
