//! shunt's developer tasks. `cargo xtask --help` lists them.

mod bench;
mod demo;
mod run;
mod setup;
mod test;
mod util;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    about = "Developer tasks for shunt: install the toolchain, run the local demo, run every test",
    long_about = None,
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Install everything the project needs (idempotent): Debian packages,
    /// the nightly's rust-src, and bpf-linker built against the nightly's LLVM.
    Setup,
    /// Run setup, then a whole node locally in network namespaces: an agent,
    /// two pods in the mesh and one outside, live traffic and counters.
    Demo(demo::DemoArgs),
    /// Run setup, then every test, the kernel tests included (needs root).
    Test(test::TestArgs),
    /// Run setup, then the long churn soak (needs root): 50 pods entering
    /// and leaving the mesh 10 times each under steady load, in both modes,
    /// with the leak figures printed (`SHUNT_SOAK_PODS`/`_ROUNDS` override).
    Soak,
    /// Run setup, then the benchmark: direct vs iptables+proxy vs
    /// eBPF+proxy, every path and workload, interleaved (needs root). Writes
    /// bench/results/latest.md and latest.svg.
    Bench(bench::BenchArgs),
    /// shunt on a local kind cluster: builds the image, deploys deploy/ and
    /// a sample client and server, and shows their traffic going through
    /// HBONE. Needs docker, kind and kubectl. `--delete` removes it all.
    Run(run::RunArgs),
    /// cargo fmt --check and cargo clippy with warnings denied.
    Lint,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Setup => setup::run(),
        Command::Demo(args) => {
            setup::run()?;
            demo::run(args)
        }
        Command::Test(args) => {
            setup::run()?;
            test::run(args)
        }
        Command::Soak => {
            setup::run()?;
            test::soak()
        }
        Command::Bench(args) => {
            setup::run()?;
            bench::run(args)
        }
        // No setup: the image builds its own toolchain.
        Command::Run(args) => run::run(args),
        Command::Lint => test::lint(),
    }
}
