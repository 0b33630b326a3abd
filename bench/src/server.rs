//! The server side, run as a process in a server pod's netns: an echo port
//! (request/response, new connection per request, fixed rate) and a sink port
//! (bulk stream) that checks every byte against the pattern and answers, at
//! the sender's EOF, with the count and whether it was intact.
//!
//! One thread (tokio current-thread runtime): the server is the same on every
//! path, and on the pinned placement it shares its CPU with everything else.

use std::{net::SocketAddr, time::Duration};

use anyhow::Context as _;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};

use crate::pattern::Pattern;

pub struct ServerArgs {
    pub echo_port: u16,
    pub sink_port: u16,
    /// The server exits by itself after this long, whatever happens to the
    /// harness that started it.
    pub max_seconds: u64,
}

pub fn run(args: ServerArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let echo = TcpListener::bind(SocketAddr::from(([0, 0, 0, 0], args.echo_port)))
            .await
            .context("binding the echo port")?;
        let sink = TcpListener::bind(SocketAddr::from(([0, 0, 0, 0], args.sink_port)))
            .await
            .context("binding the sink port")?;
        println!("ready");
        let serve = async {
            loop {
                tokio::select! {
                    accepted = echo.accept() => {
                        if let Ok((stream, _)) = accepted {
                            tokio::spawn(serve_echo(stream));
                        }
                    }
                    accepted = sink.accept() => {
                        if let Ok((stream, _)) = accepted {
                            tokio::spawn(serve_sink(stream));
                        }
                    }
                }
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(args.max_seconds), serve).await;
        anyhow::Ok(())
    })
}

async fn serve_echo(mut stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if stream.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
        }
    }
    let _ = stream.shutdown().await;
}

async fn serve_sink(mut stream: TcpStream) {
    let pattern = Pattern::new();
    let mut buf = vec![0u8; 256 * 1024];
    let mut received = 0u64;
    let mut intact = true;
    loop {
        match stream.read(&mut buf).await {
            Ok(0) => break,
            Ok(n) => {
                if intact && !pattern.check(received, &buf[..n]) {
                    intact = false;
                }
                received += n as u64;
            }
            Err(_) => return,
        }
    }
    let mut reply = [0u8; 9];
    reply[..8].copy_from_slice(&received.to_le_bytes());
    reply[8] = u8::from(intact);
    let _ = stream.write_all(&reply).await;
    let _ = stream.shutdown().await;
}
