//! The data path of an enrolled stand-in waypoint, for the kernel test of
//! the from-waypoint exemption (`tests/tests/waypoint_enrolled.rs`): run as
//! the waypoint pod's application (in its netns and in the apps' cgroup,
//! so the node's agent captures what it connects to), it does what a
//! waypoint does with a connection its node proxy hands it — connects
//! onwards to the service — without any L7.
//!
//! `shunt-waypoint-forward LISTEN TO`: listens on `LISTEN`; for each
//! connection it accepts, makes a plain TCP connect to `TO` and relays both
//! ways. Prints `{"listening":"LISTEN"}` once bound and
//! `{"accepted":"PEER"}` for each connection (stdout is line-buffered), so
//! a test counts what reached the waypoint. Runs until killed.

use std::{
    io::{Read, Write},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream},
    thread,
    time::Duration,
};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let parse = |i: usize| args.get(i).and_then(|a| a.parse::<SocketAddr>().ok());
    let (Some(listen), Some(to)) = (parse(0), parse(1)) else {
        eprintln!("usage: shunt-waypoint-forward LISTEN TO");
        std::process::exit(2);
    };
    let listener = match TcpListener::bind(listen) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("listen on {listen}: {e}");
            std::process::exit(1);
        }
    };
    println!("{{\"listening\":\"{listen}\"}}");
    for client in listener.incoming() {
        let Ok(client) = client else { continue };
        let peer = client
            .peer_addr()
            .map(|p| p.to_string())
            .unwrap_or_default();
        println!("{{\"accepted\":\"{peer}\"}}");
        thread::spawn(move || {
            if let Err(e) = forward(client, to) {
                eprintln!("forward from {peer} to {to}: {e}");
            }
        });
    }
}

fn forward(client: TcpStream, to: SocketAddr) -> std::io::Result<()> {
    let upstream = TcpStream::connect_timeout(&to, Duration::from_secs(10))?;
    let (client2, upstream2) = (client.try_clone()?, upstream.try_clone()?);
    let back = thread::spawn(move || copy(upstream2, client2));
    copy(client, upstream)?;
    back.join()
        .map_err(|_| std::io::Error::other("relay thread panicked"))?
}

/// Copies until `from` ends, then ends `to`'s writing side.
fn copy(mut from: TcpStream, mut to: TcpStream) -> std::io::Result<()> {
    let mut buf = [0u8; 16 * 1024];
    loop {
        let n = from.read(&mut buf)?;
        if n == 0 {
            let _ = to.shutdown(Shutdown::Write);
            return Ok(());
        }
        to.write_all(&buf[..n])?;
    }
}
