//! shunt's developer tasks. `cargo xtask --help` lists them.

mod demo;
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
        Command::Lint => test::lint(),
    }
}
