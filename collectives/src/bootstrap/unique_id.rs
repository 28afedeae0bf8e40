//! A job's rendezvous as 128 opaque bytes, as NCCL's `ncclUniqueId`: one
//! process makes it, which starts serving the rendezvous it names; the
//! application hands the bytes to every rank out of band (`MPI_Bcast`, a
//! torch store, a file); each rank then joins with its rank and the job
//! size. An id serves one job, within `COLL_TIMEOUT` of its making.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::time::Instant;

use transport::Rank;

use super::rendezvous::Server;
use super::{default_ip, random_token, Bootstrap, Meeting};
use crate::Config;

pub const UNIQUE_ID_BYTES: usize = 128;

const MAGIC: &[u8; 8] = b"COLLUID1";

/// See the module docs. Layout: magic (8) | port (2, big-endian) | IPv6 or
/// IPv4-mapped address (16) | token (16) | zeros.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId {
    bytes: [u8; UNIQUE_ID_BYTES],
}

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "UniqueId({})", self.addr())
    }
}

impl UniqueId {
    /// Makes an id and serves its rendezvous from this process, on
    /// `COLL_SOCKET_IFNAME`'s address, else the first interface's that is
    /// not loopback (so ranks on other hosts can reach it), else loopback.
    pub fn new() -> Result<Self, String> {
        let timeout = Config::from_env()?.timeout;
        let server = Server::bind(SocketAddr::new(default_ip()?, 0))?;
        let (addr, token) = (server.local_addr(), random_token());
        // The thread ends when the job has met, or at the deadline.
        drop(server.spawn(None, token, Instant::now() + timeout));
        Ok(Self::encode(addr, token))
    }

    fn encode(addr: SocketAddr, token: u128) -> Self {
        let mut bytes = [0u8; UNIQUE_ID_BYTES];
        bytes[..8].copy_from_slice(MAGIC);
        bytes[8..10].copy_from_slice(&addr.port().to_be_bytes());
        let ip = match addr.ip() {
            IpAddr::V4(v4) => v4.to_ipv6_mapped(),
            IpAddr::V6(v6) => v6,
        };
        bytes[10..26].copy_from_slice(&ip.octets());
        bytes[26..42].copy_from_slice(&token.to_le_bytes());
        UniqueId { bytes }
    }

    /// Reads an id made by [`new`](Self::new) (anywhere).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, String> {
        let bytes: [u8; UNIQUE_ID_BYTES] = bytes.try_into().map_err(|_| {
            format!(
                "a unique id has {UNIQUE_ID_BYTES} bytes, not {}",
                bytes.len()
            )
        })?;
        if &bytes[..8] != MAGIC {
            return Err(
                "these bytes are not a unique id (made by collGetUniqueId / UniqueId::new)".into(),
            );
        }
        Ok(UniqueId { bytes })
    }

    pub fn as_bytes(&self) -> &[u8; UNIQUE_ID_BYTES] {
        &self.bytes
    }

    /// The rendezvous address the id names.
    pub fn addr(&self) -> SocketAddr {
        let port = u16::from_be_bytes([self.bytes[8], self.bytes[9]]);
        let v6 = Ipv6Addr::from(<[u8; 16]>::try_from(&self.bytes[10..26]).unwrap());
        let ip = v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4);
        SocketAddr::new(ip, port)
    }

    fn token(&self) -> u128 {
        u128::from_le_bytes(self.bytes[26..42].try_into().unwrap())
    }

    /// Rank `rank` of `size`'s place in the job this id names.
    pub fn bootstrap(&self, rank: Rank, size: usize) -> Result<Bootstrap, String> {
        if size == 0 || rank >= size {
            return Err(format!("rank {rank} is not below the size {size}"));
        }
        Ok(Bootstrap {
            rank,
            size,
            local_rank: None,
            meeting: Some(Meeting::Address {
                addr: self.addr(),
                hosted_elsewhere: true,
                token: self.token(),
                secret: true,
            }),
            source: "unique id",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip() {
        let addr: SocketAddr = "10.1.2.3:4567".parse().unwrap();
        let id = UniqueId::encode(addr, 0xfeed);
        let back = UniqueId::from_bytes(id.as_bytes()).unwrap();
        assert_eq!((back.addr(), back.token()), (addr, 0xfeed));
        assert!(UniqueId::from_bytes(&[0; 128]).is_err());
        assert!(UniqueId::from_bytes(&[0; 12]).is_err());
        assert!(id.bootstrap(2, 2).is_err());
    }
}
