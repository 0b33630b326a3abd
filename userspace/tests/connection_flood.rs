//! A connection flood from one client must not exhaust the agent (issue 20
//! part 5): 10,000 connections from the `flood` pod, a third idle on 15008,
//! a third half-way through a TLS ClientHello on 15008, a third idle to the
//! application's port (captured on 15006). The per-source limit keeps at
//! most 1,024 of them; the handshake timeout sheds the HBONE ones; a client
//! from another source gets through meanwhile, over HBONE and plaintext.
//!
//! The figures (fds the agent held, how long shedding took) are printed,
//! not asserted: only the bounds the limits guarantee are.
//!
//! Run as root: `cargo build -p shunt --bins && SHUNT_BIN=… cargo test -p
//! shunt --test connection_flood -- --nocapture`.

#[path = "support/agent_bed.rs"]
mod agent_bed;

use std::{
    io::Write as _,
    net::{SocketAddr, TcpStream as StdTcpStream},
    os::fd::AsRawFd,
    time::{Duration, Instant},
};

use agent_bed::{Bed, blocking, eventually, hbone_echo, plaintext_echo, raise_own_nofile};

const CONNECTIONS: usize = 10_000;
/// The agent's default `--max-connections-per-source`.
const PER_SOURCE: usize = shunt::proxy::DEFAULT_MAX_CONNECTIONS_PER_SOURCE as usize;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    /// Connected to 15008, nothing sent.
    HboneIdle,
    /// Connected to 15008, a TLS record header and one byte of a
    /// ClientHello sent, the rest never.
    HboneHalfHandshake,
    /// Connected to the application's port (captured on 15006), nothing
    /// sent.
    PlaintextIdle,
}

/// Whether the agent has closed (FIN or RST) the connection.
fn closed_by_peer(s: &StdTcpStream) -> bool {
    let mut byte = 0u8;
    // SAFETY: a 1-byte peek into a byte we own, on an fd we own.
    let n = unsafe {
        libc::recv(
            s.as_raw_fd(),
            (&mut byte as *mut u8).cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n == 0 {
        return true;
    }
    if n < 0 {
        let e = std::io::Error::last_os_error();
        return e.kind() != std::io::ErrorKind::WouldBlock;
    }
    // The agent sent something (never expected here): still open.
    false
}

fn open_counts(flood: &[(Kind, StdTcpStream)]) -> (usize, usize) {
    let open = |k: Kind| {
        flood
            .iter()
            .filter(|(kind, s)| *kind == k && !closed_by_peer(s))
            .count()
    };
    (
        open(Kind::HboneIdle) + open(Kind::HboneHalfHandshake),
        open(Kind::PlaintextIdle),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_idle_and_half_open_connections_do_not_exhaust_the_agent() {
    raise_own_nofile();
    let bed = Bed::start("flood", &[]).await;
    let ca = bed.ca();
    hbone_echo(&bed, &ca, &bed.good)
        .await
        .expect("warm-up over HBONE");
    plaintext_echo(&bed, &bed.good)
        .await
        .expect("warm-up over plaintext");
    let baseline = bed.agent_fds();

    // The flood, from one source.
    let hbone = bed.hbone();
    let app = bed.app();
    let started = Instant::now();
    let flood_pod = bed.flood.clone();
    let (flood, failed) = blocking(move || {
        flood_pod
            .run(move || {
                let mut flood = Vec::with_capacity(CONNECTIONS);
                let mut failed = 0usize;
                for i in 0..CONNECTIONS {
                    let kind = match i % 3 {
                        0 => Kind::HboneIdle,
                        1 => Kind::HboneHalfHandshake,
                        _ => Kind::PlaintextIdle,
                    };
                    let dst: SocketAddr = match kind {
                        Kind::PlaintextIdle => app,
                        _ => hbone,
                    };
                    match StdTcpStream::connect_timeout(&dst, Duration::from_secs(5)) {
                        Ok(mut s) => {
                            if kind == Kind::HboneHalfHandshake {
                                // A handshake record of 512 bytes, one sent.
                                let _ = s.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01]);
                            }
                            flood.push((kind, s));
                        }
                        Err(_) => failed += 1,
                    }
                }
                (flood, failed)
            })
            .expect("flood pod")
    })
    .await;
    let opened_in = started.elapsed();
    assert!(
        !flood.is_empty(),
        "no flood connection could be opened ({failed} failed)"
    );

    // Beyond the per-source limit the agent resets them at accept.
    let mut peak_fds = bed.agent_fds();
    let limited = eventually(Duration::from_secs(60), || {
        peak_fds = peak_fds.max(bed.agent_fds());
        let (hbone_open, plaintext_open) = open_counts(&flood);
        hbone_open + plaintext_open <= PER_SOURCE
    })
    .await;
    let limited_in = started.elapsed();
    let (hbone_open, plaintext_open) = open_counts(&flood);
    assert!(
        limited,
        "the agent kept more than {PER_SOURCE} connections from one source: {hbone_open} HBONE, {plaintext_open} plaintext"
    );
    let held_fds = bed.agent_fds();
    peak_fds = peak_fds.max(held_fds);
    // Each admitted connection costs the agent one fd, two when plaintext
    // (the application's side); a little more for the runtime's own.
    assert!(
        peak_fds <= baseline + 2 * PER_SOURCE + 64,
        "the agent held {peak_fds} fds under the flood (baseline {baseline})"
    );
    let source_limit = bed.refusals("source_limit");
    assert!(
        source_limit as usize >= flood.len() - PER_SOURCE,
        "refusals counted: {source_limit}"
    );

    // A well-behaved client from another source gets through meanwhile.
    hbone_echo(&bed, &ca, &bed.good)
        .await
        .unwrap_or_else(|e| panic!("HBONE from another source under the flood: {e}"));
    plaintext_echo(&bed, &bed.good)
        .await
        .unwrap_or_else(|e| panic!("plaintext from another source under the flood: {e}"));

    // The idle and half-open handshakes are shed by the handshake timeout.
    let shed = eventually(Duration::from_secs(60), || open_counts(&flood).0 == 0).await;
    let shed_in = started.elapsed();
    assert!(
        shed,
        "HBONE connections still open after 60 s: {:?}",
        open_counts(&flood)
    );
    let after_shed_fds = bed.agent_fds();

    // The client gives up: everything is released.
    let release_started = Instant::now();
    drop(flood);
    let released = eventually(Duration::from_secs(30), || bed.agent_fds() <= baseline + 16).await;
    let released_in = release_started.elapsed();
    assert!(
        released,
        "agent fds after the flood closed: {} (baseline {baseline})",
        bed.agent_fds()
    );
    hbone_echo(&bed, &ca, &bed.good)
        .await
        .expect("HBONE after the flood");

    eprintln!(
        "flood figures: {CONNECTIONS} connections opened in {opened_in:?} ({failed} failed to connect); \
         agent fds: baseline {baseline}, peak {peak_fds}, held once limited {held_fds}, after the handshakes were shed {after_shed_fds}; \
         kept open: {hbone_open} HBONE + {plaintext_open} plaintext (limit {PER_SOURCE}); refused at accept: {source_limit}; \
         excess reset within {limited_in:?} of the start; handshakes shed within {shed_in:?}; \
         fds back to baseline {released_in:?} after the client closed; handshake_timeout refusals {}",
        bed.refusals("handshake_timeout")
    );
    let logs = bed.agent.logs();
    assert!(
        logs.contains("--max-connections-per-source"),
        "the refusals at accept are logged"
    );
}
