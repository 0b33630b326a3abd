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

use std::time::{Duration, Instant};

use anyhow::{Context as _, ensure};
use clap::Parser;
use prost::Message as _;
use shunt::xds::{ADDRESS_TYPE_URL, XdsState};
use shunt_proto::{
    envoy::service::discovery::v3::{DeltaDiscoveryResponse, Resource},
    istio::workload as pb,
};

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
        let s = w % services.max(1);
        let ns = format!("ns-{}", s % 50);
        let name = format!("pod-{w}");
        let uid = format!("Kubernetes//Pod/{ns}/{name}");
        let workload = pb::Workload {
            uid: uid.clone(),
            name,
            namespace: ns.clone(),
            addresses: vec![[198, 18, (w >> 8) as u8, w as u8].to_vec()],
            tunnel_protocol: pb::TunnelProtocol::Hbone as i32,
            service_account: format!("sa-{s}"),
            node: format!("node-{}", w % 100),
            canonical_name: format!("svc-{s}"),
            canonical_revision: "v1".into(),
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
        resources.push(any(
            uid,
            pb::Address {
                r#type: Some(pb::address::Type::Workload(workload)),
            },
        ));
    }
    DeltaDiscoveryResponse {
        system_version_info: "bench".into(),
        type_url: ADDRESS_TYPE_URL.into(),
        nonce: "n1".into(),
        resources,
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
    state.apply(&response).map_err(|e| anyhow::anyhow!("{e}"))?;
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
    Ok(())
}
