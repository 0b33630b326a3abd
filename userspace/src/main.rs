//! The `shunt` binary: parses the command line and hands over to the library.

use std::process::ExitCode;

use clap::Parser;
use shunt::cli::{Cli, Command};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Agent(args) => {
            let log = match shunt::logging::init(&args.log) {
                Ok(guard) => guard,
                Err(message) => {
                    eprintln!("shunt: {message}");
                    return ExitCode::from(2);
                }
            };
            let result = run_agent(*args);
            // The last lines (a SIGTERM's drain) reach stderr before exit.
            drop(log);
            result
        }
        Command::Status(args) => shunt::status::run(&args).map_err(anyhow::Error::from),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            // Our error types already name their causes in their messages.
            eprintln!("shunt: {error}");
            ExitCode::FAILURE
        }
    }
}

fn run_agent(args: shunt::cli::AgentArgs) -> anyhow::Result<()> {
    // A parent may have left SIGINT/SIGTERM blocked (the mask is inherited
    // across exec); the agent must hear them to unenrol cleanly.
    let mut stop_signals = nix::sys::signal::SigSet::empty();
    stop_signals.add(nix::sys::signal::Signal::SIGINT);
    stop_signals.add(nix::sys::signal::Signal::SIGTERM);
    nix::sys::signal::sigprocmask(
        nix::sys::signal::SigmaskHow::SIG_UNBLOCK,
        Some(&stop_signals),
        None,
    )?;
    // The proxy's data path runs on these workers. One per CPU, tokio's multi-thread scheduler: one worker, a
    // current-thread runtime and tokio's defaults measured alike on the
    // HBONE path (docs/BENCHMARKS.md, "Proxy efficiency").
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if args.worker_threads > 0 {
        runtime.worker_threads(args.worker_threads);
    }
    let runtime = runtime.enable_all().build()?;
    runtime.block_on(shunt::app::run(args))?;
    Ok(())
}
