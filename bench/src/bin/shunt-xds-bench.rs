//! How long the istiod source takes to apply a large response: one
//! `DeltaDiscoveryResponse` with N workloads (default 10,000, spread over
//! 1,000 services, as istiod sends the first push of a big mesh), from the
//! bytes on the wire to the complete cluster view the agent gets:
//! decoding the response, decoding and translating every resource, the
//! atomic commit, and building the view with every service's endpoints.
//!
//! `cargo run --release -p shunt-bench --bin shunt-xds-bench -- --workloads 10000`
//!
//! Prints the median and worst of `--rounds` fresh applies (a new state
//! each round: the first push, the worst case), and one re-apply of the
//! same response to a full state (istiod's resend after a reconnect).
//!
//! Then, on that full state, the steady-state costs (issue 34, item 11):
//! - `--deltas` one-workload deltas (one pod's revision changes), each
//!   timed from the bytes to the agent's store holding it (decode, apply,
//!   the delta the source hands over, the store's update under its write
//!   lock), p50/p99/max, and the longest the write lock was held; then the
//!   revision checked in the store;
//! - the status record after a response (`/config_dump`'s), alone, and a
//!   one-workload delta with its status published, as the source does
//!   per response;
//! - the proxy's per-connection lookup (the workload at a peer IP, as
//!   `proxy/lookup.rs` does it), timed and with its heap allocations
//!   counted by a counting global allocator.

use std::{
    alloc::{GlobalAlloc, Layout, System},
    net::IpAddr,
    sync::{
        RwLock,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context as _, ensure};
use clap::Parser;
use prost::Message as _;
use shunt::{
    authz::PolicySet,
    control::ClusterDelta,
    store::WorkloadStore,
    xds::{ADDRESS_TYPE_URL, XdsState},
};
use shunt_proto::{
    envoy::service::discovery::v3::{DeltaDiscoveryResponse, Resource},
    istio::workload as pb,
};

/// Counts heap allocations (all threads; the bench is single-threaded).
struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract is passed on as is.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[derive(Parser)]
struct Args {
    /// Workloads in the one response.
    #[arg(long, default_value_t = 10_000)]
    workloads: u32,
    /// Services they back (each workload backs one).
    #[arg(long, default_value_t = 1_000)]
    services: u32,
    /// Fresh applies to time.
    #[arg(long, default_value_t = 10)]
    rounds: u32,
    /// One-workload deltas to time on the full state.
    #[arg(long, default_value_t = 500)]
    deltas: u32,
    /// Per-connection lookups to time (each at another peer IP).
    #[arg(long, default_value_t = 100_000)]
    lookups: u32,
}

fn any(name: String, address: pb::Address) -> Resource {
    Resource {
        name,
        version: "1".into(),
        resource: Some(prost_types::Any {
            type_url: ADDRESS_TYPE_URL.into(),
            value: address.encode_to_vec(),
        }),
        ..Default::default()
    }
}

/// A response shaped like istiod's: pods with two addresses' worth of
/// fields filled, services with a VIP and two ports.
fn big_response(workloads: u32, services: u32) -> DeltaDiscoveryResponse {
    let mut resources = Vec::with_capacity((workloads + services) as usize);
    for s in 0..services {
        let hostname = format!("svc-{s}.ns-{}.svc.cluster.local", s % 50);
        let service = pb::Service {
            name: format!("svc-{s}"),
            namespace: format!("ns-{}", s % 50),
            hostname: hostname.clone(),
            addresses: vec![pb::NetworkAddress {
                network: String::new(),
                address: [198, 19, (s >> 8) as u8, s as u8].to_vec(),
                ..Default::default()
            }],
            ports: vec![
                pb::Port {
                    service_port: 80,
                    target_port: 8080,
                    ..Default::default()
                },
                pb::Port {
                    service_port: 443,
                    target_port: 0,
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        resources.push(any(
            format!("ns-{}/{hostname}", s % 50),
            pb::Address {
                r#type: Some(pb::address::Type::Service(service)),
            },
        ));
    }
    for w in 0..workloads {
        resources.push(workload_resource(w, services, "v1", "1"));
    }
    DeltaDiscoveryResponse {
        system_version_info: "bench".into(),
        type_url: ADDRESS_TYPE_URL.into(),
        nonce: "n1".into(),
        resources,
        removed_resources: Vec::new(),
    }
}

/// The IP of workload number `w`.
fn workload_ip(w: u32) -> [u8; 4] {
    [198, 18, (w >> 8) as u8, w as u8]
}

/// Workload number `w` at `revision`, as the resource istiod sends.
fn workload_resource(w: u32, services: u32, revision: &str, version: &str) -> Resource {
    let s = w % services.max(1);
    let ns = format!("ns-{}", s % 50);
    let name = format!("pod-{w}");
    let uid = format!("Kubernetes//Pod/{ns}/{name}");
    {
        let workload = pb::Workload {
            uid: uid.clone(),
            name,
            namespace: ns.clone(),
            addresses: vec![workload_ip(w).to_vec()],
            tunnel_protocol: pb::TunnelProtocol::Hbone as i32,
            service_account: format!("sa-{s}"),
            node: format!("node-{}", w % 100),
            canonical_name: format!("svc-{s}"),
            canonical_revision: revision.into(),
            workload_name: format!("svc-{s}"),
            workload_type: pb::WorkloadType::Pod as i32,
            cluster_id: "Kubernetes".into(),
            services: [(
                format!("{ns}/svc-{s}.{ns}.svc.cluster.local"),
                pb::PortList {
                    ports: vec![
                        pb::Port {
                            service_port: 80,
                            target_port: 0,
                            ..Default::default()
                        },
                        pb::Port {
                            service_port: 443,
                            target_port: 8443,
                            ..Default::default()
                        },
                    ],
                },
            )]
            .into(),
            ..Default::default()
        };
        let mut resource = any(
            uid,
            pb::Address {
                r#type: Some(pb::address::Type::Workload(workload)),
            },
        );
        resource.version = version.into();
        resource
    }
}

/// A response carrying one changed workload, as istiod sends after a pod
/// update.
fn one_workload_delta(w: u32, services: u32, round: u32) -> DeltaDiscoveryResponse {
    let revision = format!("r{round}");
    DeltaDiscoveryResponse {
        system_version_info: "bench".into(),
        type_url: ADDRESS_TYPE_URL.into(),
        nonce: format!("d{round}"),
        resources: vec![workload_resource(
            w,
            services,
            &revision,
            &format!("{}", round + 2),
        )],
        removed_resources: Vec::new(),
    }
}

/// Decode from bytes (what the gRPC codec does), apply, build the view.
fn apply_once(
    state: &mut XdsState,
    wire: &[u8],
    expect_workloads: usize,
) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let response = DeltaDiscoveryResponse::decode(wire).context("decode")?;
    let applied = state.apply(&response).map_err(|e| anyhow::anyhow!("{e}"))?;
    ensure!(applied.rejected.is_empty(), "{:?}", applied.nack_reason());
    let (view, _) = state.view();
    let elapsed = start.elapsed();
    ensure!(
        view.workloads.len() == expect_workloads,
        "view has {} workloads",
        view.workloads.len()
    );
    ensure!(
        view.services.iter().all(|s| !s.endpoints.is_empty()),
        "a service without endpoints"
    );
    Ok(elapsed)
}

/// Percentile `p` (0-100) of sorted `times`.
fn percentile(times: &[Duration], p: usize) -> Duration {
    times[(times.len() * p / 100).min(times.len() - 1)]
}

/// What the store's owner does with a view (`app/store.rs`'s `apply`):
/// the difference worked out under the read lock, applied under the write
/// lock. Returns how long the write lock was held.
fn view_to_store(view: shunt::control::ClusterView, store: &RwLock<WorkloadStore>) -> Duration {
    let diff = store
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .diff(view.workloads);
    let services = shunt::state::ServiceStore::from_services(view.services);
    let start = Instant::now();
    let mut store = store.write().unwrap_or_else(|p| p.into_inner());
    store.apply_diff(diff);
    store.set_services(services);
    store.replace_policies(view.policies);
    drop(store);
    start.elapsed()
}

/// The whole held state into `store`.
fn full_to_store(state: &mut XdsState, store: &RwLock<WorkloadStore>) -> anyhow::Result<()> {
    let (view, _) = state.view();
    view_to_store(view, store);
    Ok(())
}

/// What the store's owner does with a delta (`app/store.rs`'s
/// `apply_delta`): only the ids it names, under the write lock. Returns
/// how long the write lock was held.
fn delta_into_store(delta: ClusterDelta, store: &RwLock<WorkloadStore>) -> Duration {
    let ClusterDelta {
        workloads,
        services,
        policies,
    } = delta;
    let policies = policies.map(PolicySet::new);
    let start = Instant::now();
    let mut store = store.write().unwrap_or_else(|p| p.into_inner());
    store.apply_delta(workloads, services);
    if let Some(policies) = policies {
        store.set_policies(policies);
    }
    drop(store);
    start.elapsed()
}

/// One delta from the wire into `store`, as the xDS source hands it over
/// after the first view: (total, write lock held).
fn delta_to_store(
    state: &mut XdsState,
    store: &RwLock<WorkloadStore>,
    wire: &[u8],
) -> anyhow::Result<(Duration, Duration)> {
    let start = Instant::now();
    let response = DeltaDiscoveryResponse::decode(wire).context("decode")?;
    let applied = state.apply(&response).map_err(|e| anyhow::anyhow!("{e}"))?;
    ensure!(applied.rejected.is_empty(), "{:?}", applied.nack_reason());
    let (delta, _) = state.delta();
    ensure!(
        delta.workloads.len() == 1,
        "a one-workload response made a delta of {} workloads",
        delta.workloads.len()
    );
    let lock = delta_into_store(delta, store);
    Ok((start.elapsed(), lock))
}

/// The proxy's lookup per connection (`proxy/lookup.rs`): a shared entry.
fn lookup(
    store: &RwLock<WorkloadStore>,
    ip: IpAddr,
) -> Option<std::sync::Arc<shunt::state::Workload>> {
    store
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .by_ip_shared(ip)
        .cloned()
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let wire = big_response(args.workloads, args.services).encode_to_vec();
    println!(
        "one response: {} workloads, {} services, {:.1} MiB on the wire",
        args.workloads,
        args.services,
        wire.len() as f64 / (1 << 20) as f64
    );
    let mut times = Vec::with_capacity(args.rounds as usize);
    let mut state = XdsState::default();
    for _ in 0..args.rounds.max(1) {
        state = XdsState::new("bench", "bench");
        times.push(apply_once(&mut state, &wire, args.workloads as usize)?);
    }
    times.sort();
    let median = times[times.len() / 2];
    let worst = times[times.len() - 1];
    let again = apply_once(&mut state, &wire, args.workloads as usize)?;
    println!(
        "first push (fresh state), {} rounds: median {median:.2?}, worst {worst:.2?}",
        times.len()
    );
    println!("same response again (full state, nothing changes): {again:.2?}");

    // Steady state: the full state handed to a store, then deltas.
    let store = RwLock::new(WorkloadStore::new());
    full_to_store(&mut state, &store)?;
    let mut totals = Vec::with_capacity(args.deltas as usize);
    let mut locks = Vec::with_capacity(args.deltas as usize);
    for round in 0..args.deltas.max(1) {
        let w = (round * 7919) % args.workloads.max(1);
        let wire = one_workload_delta(w, args.services, round).encode_to_vec();
        let (total, lock) = delta_to_store(&mut state, &store, &wire)?;
        totals.push(total);
        locks.push(lock);
        let expected = format!("r{round}");
        let held = lookup(&store, IpAddr::from(workload_ip(w)));
        ensure!(
            held.as_ref()
                .is_some_and(|h| h.canonical_revision == expected),
            "after delta {round} the store holds {:?} for workload {w}, not revision {expected}",
            held.map(|h| h.canonical_revision.clone())
        );
    }
    totals.sort();
    locks.sort();
    println!(
        "one-workload delta at {} workloads, {} deltas: p50 {:.2?}, p99 {:.2?}, max {:.2?}; write lock held p50 {:.2?}, p99 {:.2?}, max {:.2?}",
        args.workloads,
        totals.len(),
        percentile(&totals, 50),
        percentile(&totals, 99),
        totals[totals.len() - 1],
        percentile(&locks, 50),
        percentile(&locks, 99),
        locks[locks.len() - 1],
    );

    // What the source also does after each response (`/config_dump`'s
    // record), off the store's path.
    let mut status_times = Vec::with_capacity(20);
    for _ in 0..20 {
        let start = Instant::now();
        let status = state.status();
        status_times.push(start.elapsed());
        ensure!(status.resources.len() == (args.workloads + args.services) as usize);
    }
    status_times.sort();
    println!(
        "status record after a response ({} resources): p50 {:.2?}, max {:.2?}",
        args.workloads + args.services,
        percentile(&status_times, 50),
        status_times[status_times.len() - 1],
    );

    // The source's whole work per response, as `xds/client.rs` does it:
    // apply, hand over the delta, publish the status (the previous one
    // held until then, as the status handle holds it).
    let mut published = state.status();
    let mut response_times = Vec::with_capacity(args.deltas as usize);
    for round in 0..args.deltas.max(1) {
        let w = (round * 7919) % args.workloads.max(1);
        let wire = one_workload_delta(w, args.services, args.deltas + round).encode_to_vec();
        let start = Instant::now();
        let response = DeltaDiscoveryResponse::decode(wire.as_slice()).context("decode")?;
        let applied = state.apply(&response).map_err(|e| anyhow::anyhow!("{e}"))?;
        ensure!(applied.rejected.is_empty(), "{:?}", applied.nack_reason());
        let (delta, _) = state.delta();
        published = state.status();
        response_times.push(start.elapsed());
        ensure!(delta.workloads.len() == 1);
    }
    ensure!(published.resources.len() == (args.workloads + args.services) as usize);
    response_times.sort();
    println!(
        "one-workload delta with its status published, {} deltas: p50 {:.2?}, p99 {:.2?}, max {:.2?}",
        response_times.len(),
        percentile(&response_times, 50),
        percentile(&response_times, 99),
        response_times[response_times.len() - 1],
    );

    let ips: Vec<IpAddr> = (0..args.workloads.max(1))
        .map(|w| IpAddr::from(workload_ip(w)))
        .collect();
    let lookups = args.lookups.max(1);
    let mut found = 0usize;
    let allocations_before = ALLOCATIONS.load(Ordering::Relaxed);
    let start = Instant::now();
    for n in 0..lookups {
        let ip = ips[n as usize % ips.len()];
        if lookup(&store, ip).is_some() {
            found += 1;
        }
    }
    let elapsed = start.elapsed();
    let allocations = ALLOCATIONS.load(Ordering::Relaxed) - allocations_before;
    ensure!(
        found == lookups as usize,
        "{found} of {lookups} lookups found their workload"
    );
    println!(
        "per-connection lookup (workload by peer IP): {lookups} lookups, {:.0} ns each, {:.2} heap allocations each",
        elapsed.as_nanos() as f64 / f64::from(lookups),
        allocations as f64 / f64::from(lookups),
    );
    Ok(())
}
