//! How ranks find each other. Three sources of "who am I, how many are we,
//! where is the rendezvous", one interface ([`Bootstrap::from_env`]):
//!
//! * the local launcher (`collbench -n 8`, [`launch`]): it hosts the
//!   rendezvous itself and sets the variables below plus `COLL_LAUNCHER=1`;
//! * torchrun-style variables: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//!   `MASTER_ADDR`, `MASTER_PORT`; rank 0 hosts the rendezvous;
//! * launcher variables: Open MPI's `OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK`,
//!   MPICH/PMI's `PMI_RANK/PMI_SIZE/MPI_LOCALRANKID`, with `MASTER_ADDR`
//!   and `MASTER_PORT` for the rendezvous.
//!
//! At the rendezvous every rank publishes its host identity and transport
//! addresses and receives everyone's, plus a session token that every
//! transport connection must present.

pub mod host;
pub mod launch;
pub mod rendezvous;

use std::net::{SocketAddr, ToSocketAddrs};

use transport::Rank;

/// Environment variable the local launcher sets in each rank.
pub const LAUNCHER_VAR: &str = "COLL_LAUNCHER";
/// Environment variable carrying the job token (hex).
pub const TOKEN_VAR: &str = "COLL_JOB_TOKEN";

/// This process's place in the job, before any connection exists.
#[derive(Clone, Debug)]
pub struct Bootstrap {
    pub rank: Rank,
    pub size: usize,
    /// What the launcher says our rank on this host is (checked against the
    /// rendezvous's view, which is authoritative).
    pub local_rank: Option<usize>,
    /// Where the rendezvous listens; `None` for a single rank.
    pub rendezvous: Option<SocketAddr>,
    /// Whether this process hosts the rendezvous (rank 0, unless a launcher does).
    pub hosts_rendezvous: bool,
    /// Shared by every rank of the job; refuses strangers at the rendezvous.
    pub job_token: u128,
    /// Where rank and size came from, for logs.
    pub source: &'static str,
}

impl Bootstrap {
    /// A job of one rank: no rendezvous, no peers.
    pub fn single() -> Self {
        Bootstrap {
            rank: 0,
            size: 1,
            local_rank: Some(0),
            rendezvous: None,
            hosts_rendezvous: false,
            job_token: 0,
            source: "single process",
        }
    }

    /// Reads the environment (see the module docs). With none of the
    /// variables set, this is a job of one rank.
    pub fn from_env() -> Result<Self, String> {
        let (source, rank_var, size_var, local_var) = if var("RANK").is_some() {
            let src = if var(LAUNCHER_VAR).is_some() {
                "collbench launcher"
            } else {
                "environment (RANK, WORLD_SIZE)"
            };
            (src, "RANK", "WORLD_SIZE", "LOCAL_RANK")
        } else if var("OMPI_COMM_WORLD_RANK").is_some() {
            (
                "Open MPI",
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
            )
        } else if var("PMI_RANK").is_some() {
            ("MPICH (PMI)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID")
        } else {
            return Ok(Self::single());
        };
        let rank: usize = number(rank_var)?;
        let size: usize = number(size_var)?;
        if size == 0 || rank >= size {
            return Err(format!("{rank_var}={rank} is not below {size_var}={size}"));
        }
        let local_rank = var(local_var).map(|_| number(local_var)).transpose()?;
        let mut b = Bootstrap {
            rank,
            size,
            local_rank,
            rendezvous: None,
            hosts_rendezvous: false,
            job_token: 0,
            source,
        };
        if size > 1 {
            let addr = master_addr()?;
            b.rendezvous = Some(addr);
            b.hosts_rendezvous = rank == 0 && var(LAUNCHER_VAR).is_none();
            b.job_token = match var(TOKEN_VAR) {
                Some(t) => u128::from_str_radix(&t, 16)
                    .map_err(|_| format!("{TOKEN_VAR}='{t}' is not a hexadecimal token"))?,
                // Without a token, tell jobs apart by rendezvous and size.
                None => fnv1a(format!("{addr}/{size}").as_bytes()),
            };
        }
        Ok(b)
    }
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

fn number(name: &str) -> Result<usize, String> {
    let v = var(name).ok_or_else(|| format!("{name} is not set"))?;
    v.trim()
        .parse()
        .map_err(|_| format!("{name}='{v}' is not a number"))
}

/// `MASTER_ADDR:MASTER_PORT`, resolved.
fn master_addr() -> Result<SocketAddr, String> {
    let missing = |name: &str| {
        format!(
            "{name} is not set: a job of several ranks needs MASTER_ADDR and MASTER_PORT, \
             an address of rank 0's host and a free port there (as torchrun sets them), \
             or use `collbench -n N`, which sets them itself"
        )
    };
    let host = var("MASTER_ADDR").ok_or_else(|| missing("MASTER_ADDR"))?;
    let port = var("MASTER_PORT").ok_or_else(|| missing("MASTER_PORT"))?;
    let port: u16 = port
        .trim()
        .parse()
        .map_err(|_| format!("MASTER_PORT='{port}' is not a port number"))?;
    let host = host.trim();
    let mut addrs = (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve MASTER_ADDR '{host}': {e}"))?;
    addrs
        .next()
        .ok_or_else(|| format!("MASTER_ADDR '{host}' resolves to no address"))
}

/// 128-bit FNV-1a: a stable token from text.
fn fnv1a(bytes: &[u8]) -> u128 {
    let mut h: u128 = 0x6c62272e07bb014262b821756295c58d;
    for b in bytes {
        h ^= *b as u128;
        h = h.wrapping_mul(0x0000000001000000000000000000013b);
    }
    h
}

/// A fresh random token.
pub(crate) fn random_token() -> u128 {
    let mut b = [0u8; 16];
    if rustix::rand::getrandom(&mut b, rustix::rand::GetRandomFlags::empty()).is_err() {
        // No entropy source: time and pid still make collisions unlikely.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        return fnv1a(format!("{t:?}/{}", std::process::id()).as_bytes());
    }
    u128::from_le_bytes(b)
}
