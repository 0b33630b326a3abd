//! Compiles the `.proto` files with protox (a protobuf compiler written in
//! Rust, so no `protoc` binary is needed) and generates prost messages and
//! tonic client/server code from the result.

use std::path::Path;

const PROTOS: &[&str] = &[
    "istio/ca.proto",
    "istio/workload.proto",
    "istio/authorization.proto",
    "istio/zds.proto",
    "envoy/service/discovery/v3/discovery.proto",
    "cri/runtime.proto",
];

/// Imported by the files above; listed so that edits rebuild.
const IMPORTED: &[&str] = &["envoy/config/core/v3/base.proto", "google/rpc/status.proto"];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Read when the script runs, not compiled in: a build script built in
    // another checkout sharing the target directory would look there.
    let root = std::env::var_os("CARGO_MANIFEST_DIR").ok_or("CARGO_MANIFEST_DIR is not set")?;
    let root = Path::new(&root);
    for proto in PROTOS.iter().chain(IMPORTED) {
        println!("cargo:rerun-if-changed={}", root.join(proto).display());
    }
    // protox ships google/protobuf/*.proto itself; only our own directory
    // needs to be on the include path.
    let descriptors = protox::compile(PROTOS, [root])?;
    tonic_prost_build::configure()
        // Clients for the agent, servers for the in-test fakes.
        .build_client(true)
        .build_server(true)
        // The agent brings its own TLS channel; generated `connect()`
        // helpers would pull in tonic's transport for every user.
        .build_transport(false)
        .compile_fds(descriptors)?;
    Ok(())
}
