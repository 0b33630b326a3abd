//! The test container image's one binary (compiled by `containerd.rs` with
//! the host's rustc, statically linked; std only). As the sandbox's pause
//! process (no arguments) it waits for SIGTERM. As a container,
//! `connect ADDR MESSAGE` connects to ADDR as its very first action,
//! sends MESSAGE, half-closes and prints what comes back; exit 3 when the
//! connect fails, 4 when the exchange does.

use std::io::{Read as _, Write as _};

unsafe extern "C" {
    fn signal(signum: i32, handler: usize) -> usize;
    fn pause() -> i32;
    fn _exit(code: i32) -> !;
}

extern "C" fn on_term(_: i32) {
    // SAFETY: _exit is async-signal-safe.
    unsafe { _exit(0) }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("connect") && args.len() == 4 {
        let mut stream = match std::net::TcpStream::connect(&args[2]) {
            Ok(stream) => stream,
            Err(error) => {
                eprintln!("connect {}: {error}", args[2]);
                std::process::exit(3);
            }
        };
        let mut answer = String::new();
        let exchanged = stream
            .write_all(args[3].as_bytes())
            .and_then(|()| stream.shutdown(std::net::Shutdown::Write))
            .and_then(|()| stream.read_to_string(&mut answer));
        match exchanged {
            Ok(_) => println!("{answer}"),
            Err(error) => {
                eprintln!("exchange with {}: {error}", args[2]);
                std::process::exit(4);
            }
        }
        return;
    }
    // PID 1 of its namespace: without handlers SIGTERM would be ignored.
    // SAFETY: installs a handler that only calls _exit.
    unsafe {
        signal(15, on_term as usize);
        signal(2, on_term as usize);
        loop {
            pause();
        }
    }
}
