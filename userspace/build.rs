//! Builds the eBPF programs (`ebpf/`) for `bpfel-unknown-none` with the nightly
//! toolchain and bpf-linker (see shared/TOOLCHAIN.md); the agent embeds the
//! resulting object with `include_bytes_aligned!`.
use anyhow::{Context as _, anyhow};

fn main() -> anyhow::Result<()> {
    let cargo_metadata::Metadata { packages, .. } = cargo_metadata::MetadataCommand::new()
        .no_deps()
        .exec()
        .context("reading the workspace metadata")?;
    let ebpf = packages
        .into_iter()
        .find(|p| p.name.as_str() == "shunt-ebpf")
        .ok_or_else(|| anyhow!("the shunt-ebpf package is not in the workspace"))?;
    let root_dir = ebpf
        .manifest_path
        .parent()
        .ok_or_else(|| anyhow!("{} has no parent directory", ebpf.manifest_path))?;
    aya_build::build_ebpf(
        [aya_build::Package {
            name: ebpf.name.as_str(),
            root_dir: root_dir.as_str(),
            ..Default::default()
        }],
        aya_build::Toolchain::default(),
    )
    .context("building the eBPF programs: run `cargo xtask setup` first (it installs bpf-linker and the nightly's rust-src)")
}
