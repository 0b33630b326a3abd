//! An address for an agent's admin, metrics or readiness endpoint when it
//! runs in the test's own netns: a free port on a loopback address of its
//! own (one of 127.100.0.0–127.227.255.255, at random), so that no socket
//! another test binds on 127.0.0.1 in the meantime can take it (a port
//! picked on 127.0.0.1 and released was taken that way: "Address already
//! in use").

use std::{
    collections::hash_map::RandomState,
    hash::{BuildHasher, Hasher},
    net::{Ipv4Addr, SocketAddr, TcpListener},
};

pub fn private_addr() -> SocketAddr {
    let [a, b, c, ..] = RandomState::new().build_hasher().finish().to_le_bytes();
    let ip = Ipv4Addr::new(127, 100 + a % 128, b, 1 + c % 254);
    TcpListener::bind((ip, 0))
        .and_then(|l| l.local_addr())
        .expect("a free port on a loopback address of its own")
}
