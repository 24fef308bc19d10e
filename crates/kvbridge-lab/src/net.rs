//! Addresses given on the command line.

use std::net::{SocketAddr, ToSocketAddrs};

/// The first address `addr` (an IP or a host name, with a port) resolves
/// to, IPv4 first.
pub fn first_addr(addr: impl ToSocketAddrs) -> std::io::Result<SocketAddr> {
    let all: Vec<SocketAddr> = addr.to_socket_addrs()?.collect();
    all.iter()
        .find(|a| a.is_ipv4())
        .or_else(|| all.first())
        .copied()
        .ok_or_else(|| std::io::Error::other("resolves to no address"))
}
