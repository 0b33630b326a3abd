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

/// Worker threads of the control runtime: its work is bursts (a push from
/// istiod, a pod event), never the data path's.
const CONTROL_WORKERS: usize = 2;

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
    // The data path and the control plane apart (docs/ARCHITECTURE.md,
    // "Threads"): the data path's shards — one single-threaded runtime per
    // worker, one worker per CPU, each pod's listeners, connections and
    // HBONE pool on one of them (`shards.rs`) — and the control runtime for
    // everything else (sources, reconciler, certificates, admin, metrics),
    // so that no control timer or burst of work runs among the data path's
    // connections. The data path's own timers are kept on a thread of their
    // own (`timers.rs`, started with the shards), so the shards have no time
    // driver: their threads do not read the clock and lock an empty timer
    // wheel around every sleep. A `tokio::time` timer made on a shard would
    // panic; clippy points them out (`userspace/clippy.toml`) and every
    // end-to-end test runs shards.
    let workers = match args.worker_threads {
        0 => std::thread::available_parallelism().map_or(1, usize::from),
        n => n,
    };
    let data_path = shunt::shards::DataPath::start(workers)?;
    let control = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(CONTROL_WORKERS)
        .thread_name("shunt-control")
        .enable_all()
        .build()?;
    let outcome = control.block_on(shunt::app::run(args, data_path.shards()));
    // The proxy has drained (inside `run`); what is left of its tasks is
    // cancelled before the control runtime they may still wake goes.
    data_path.stop();
    drop(control);
    outcome?;
    Ok(())
}
