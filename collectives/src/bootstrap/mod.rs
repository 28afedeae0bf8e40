//! How ranks find each other: "who am I, how many are we" from the
//! environment, and "where do we meet" (the rendezvous, where every rank
//! publishes its host identity and transport addresses and receives
//! everyone's, plus a session token every transport connection presents).
//!
//! Sources of rank and size ([`Bootstrap::from_env`]):
//!
//! * the local launcher (`collbench -n 8`, [`launch`]), which also hosts the
//!   rendezvous and sets the torchrun variables plus `COLL_LAUNCHER=1`;
//! * torchrun-style variables: `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//!   `LOCAL_WORLD_SIZE`;
//! * Open MPI: `OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE`;
//! * MPICH (hydra): `PMI_RANK/PMI_SIZE`, `MPI_LOCALRANKID/MPI_LOCALNRANKS`;
//! * Slurm: `SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID`.
//!
//! Where the ranks meet ([`Meeting`]), first that applies:
//!
//! 1. `MASTER_ADDR:MASTER_PORT`: rank 0 listens there (torchrun's way;
//!    under torchrun's agent, whose own store holds `MASTER_PORT`, ranks of
//!    one host meet as in 4, ranks of several on `MASTER_PORT + 1` or
//!    `COLL_MASTER_PORT`);
//! 2. built with the `mpi` feature, under mpirun: rank 0 broadcasts its
//!    rendezvous address with MPI (and a binary started by another MPI's
//!    launcher is refused instead of running as N jobs of one rank);
//! 3. `PMI_FD` (MPICH's launcher): rank 0 listens on a port of its own and
//!    publishes it in the launcher's key-value space: works across hosts;
//! 4. every rank on this host (the launcher's local size equals the world
//!    size): rank 0 announces its rendezvous on an abstract Unix socket
//!    named after the job (Open MPI's namespace, Slurm's job and step, or
//!    the launcher's pid that all local ranks share as parent);
//! 5. otherwise it is an error that says to set `MASTER_ADDR`/`MASTER_PORT`.
//!
//! Also here: which host a rank is on and its cores (`host`, `cpus`), the
//! `mesh` plan of how each peer is reached, and the `connector` that makes
//! a connection when a call first needs it.
//!
//! Owns: finding the ranks and connecting them. May not touch: calls,
//! schedules, the communicator (which calls in to set itself up).

pub(crate) mod connector;
pub(crate) mod cpus;
pub mod host;
pub mod launch;
pub(crate) mod meet;
pub(crate) mod mesh;
#[cfg(feature = "mpi")]
mod mpi;
pub(crate) mod pmi;
pub mod relay;
pub mod rendezvous;
mod unique_id;

pub use unique_id::{UniqueId, UNIQUE_ID_BYTES};

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::os::fd::RawFd;

use transport::Rank;

pub(crate) use meet::meet;

/// Environment variable the local launcher sets in each rank.
pub const LAUNCHER_VAR: &str = "COLL_LAUNCHER";
/// Environment variable carrying the job token (hex).
pub const TOKEN_VAR: &str = "COLL_JOB_TOKEN";

/// Where the ranks of a job meet.
#[derive(Clone, Debug)]
pub enum Meeting {
    /// A known address. Rank 0 hosts the rendezvous there unless it is
    /// hosted elsewhere (by the local launcher, or by whoever made the
    /// [`UniqueId`]); every connection must present `token`.
    Address {
        addr: SocketAddr,
        hosted_elsewhere: bool,
        token: u128,
        /// Whether the token is a secret (a unique id's, `COLL_JOB_TOKEN`),
        /// not one anyone who knows the address and size can compute.
        secret: bool,
    },
    /// MPICH's launcher: rank 0's address travels through PMI-1 on this fd.
    Pmi { fd: RawFd },
    /// Every rank is on this host: rank 0 announces its rendezvous on the
    /// abstract Unix socket `coll-rendezvous-<key>`.
    Local { key: String },
    /// Under mpirun, built with the `mpi` feature: rank 0's address is
    /// broadcast with MPI.
    #[cfg(feature = "mpi")]
    Mpi,
}

/// This process's place in the job, before any connection exists.
#[derive(Clone, Debug)]
pub struct Bootstrap {
    pub rank: Rank,
    pub size: usize,
    /// What the launcher says our rank on this host is (checked against the
    /// rendezvous's view, which is authoritative).
    pub local_rank: Option<usize>,
    /// How to meet the other ranks; `None` for a job of one.
    pub meeting: Option<Meeting>,
    /// Where rank and size came from, for logs.
    pub source: &'static str,
}

/// The variables a launcher sets: rank, size, local rank, local size.
struct Source {
    name: &'static str,
    vars: [&'static str; 4],
}

const SOURCES: [Source; 4] = [
    Source {
        name: "environment (RANK, WORLD_SIZE)",
        vars: ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"],
    },
    Source {
        name: "Open MPI",
        vars: [
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ],
    },
    Source {
        name: "MPICH (PMI)",
        vars: ["PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"],
    },
    Source {
        name: "Slurm",
        vars: [
            "SLURM_PROCID",
            "SLURM_NTASKS",
            "SLURM_LOCALID",
            "SLURM_NTASKS_PER_NODE",
        ],
    },
];

/// The rank variable of every launcher this crate knows (torchrun's, Open
/// MPI's, MPICH's, Slurm's): one set means a launcher made this process a
/// rank (see [`under_launcher`]).
pub const RANK_VARS: [&str; 4] = [
    SOURCES[0].vars[0],
    SOURCES[1].vars[0],
    SOURCES[2].vars[0],
    SOURCES[3].vars[0],
];
const _: () = assert!(
    RANK_VARS.len() == SOURCES.len(),
    "a launcher's rank variable is missing"
);

/// Whether a launcher (the local one, torchrun, mpirun, srun, ...) already
/// made this process one rank of a job: a program that starts its own ranks
/// when run alone must not start more then.
pub fn under_launcher() -> bool {
    std::iter::once(&LAUNCHER_VAR)
        .chain(&RANK_VARS)
        .any(|v| std::env::var_os(v).is_some())
}

impl Bootstrap {
    /// A job of one rank: no rendezvous, no peers.
    pub fn single() -> Self {
        Bootstrap {
            rank: 0,
            size: 1,
            local_rank: Some(0),
            meeting: None,
            source: "single process",
        }
    }

    /// Reads the environment (see the module docs). With none of the
    /// variables set, this is a job of one rank.
    pub fn from_env() -> Result<Self, String> {
        // Refused before anything starts (`local_ip` reads it when used).
        interface_ip_from_env()?;
        let Some(src) = SOURCES.iter().find(|s| var(s.vars[0]).is_some()) else {
            return Ok(Self::single());
        };
        let [rank_var, size_var, local_var, local_size_var] = src.vars;
        let rank: usize = number(rank_var)?;
        let size: usize = number(size_var)?;
        if size == 0 || rank >= size {
            return Err(format!("{rank_var}={rank} is not below {size_var}={size}"));
        }
        if size > rendezvous::MAX_RANKS {
            return Err(format!(
                "{size_var}={size} is above the most ranks a job may have, {}",
                rendezvous::MAX_RANKS
            ));
        }
        let local_rank = var(local_var).map(|_| number(local_var)).transpose()?;
        let local_size: Option<usize> = var(local_size_var).and_then(|v| v.trim().parse().ok());
        let source = if var(LAUNCHER_VAR).is_some() {
            "collbench launcher"
        } else {
            src.name
        };
        let meeting = if size == 1 {
            None
        } else {
            Some(meeting(size, local_size)?)
        };
        Ok(Bootstrap {
            rank,
            size,
            local_rank,
            meeting,
            source,
        })
    }

    /// The address this rank's listeners bind: the one peers can reach
    /// (`COLL_SOCKET_IFNAME`'s, an unknown one an error however the job
    /// was made, by `from_env` or from a unique id).
    pub fn local_ip(&self) -> Result<IpAddr, String> {
        if let Some(ip) = interface_ip_from_env()? {
            return Ok(ip);
        }
        let loopback = IpAddr::from([127, 0, 0, 1]);
        Ok(match &self.meeting {
            Some(Meeting::Address { addr, .. }) => local_ip_towards(*addr),
            Some(Meeting::Local { .. }) | None => loopback,
            // PMI or MPI reach other hosts: listen where they can reach us.
            Some(_) => first_interface_ip().unwrap_or(loopback),
        })
    }
}

/// How this job meets (see the module docs).
fn meeting(size: usize, local_size: Option<usize>) -> Result<Meeting, String> {
    // torchrun's agent serves its own store on MASTER_PORT: its ranks meet
    // on their host when they can, else one port above (or COLL_MASTER_PORT).
    let agent_store =
        var("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v.eq_ignore_ascii_case("true"));
    let all_local = local_size == Some(size);
    if var("MASTER_ADDR").is_some() || var("MASTER_PORT").is_some() {
        if agent_store && all_local && var("COLL_MASTER_PORT").is_none() {
            return Ok(local_meeting(size));
        }
        let mut addr = master_addr()?;
        if let Some(p) = var("COLL_MASTER_PORT") {
            addr.set_port(
                p.trim()
                    .parse()
                    .map_err(|_| format!("COLL_MASTER_PORT='{p}' is not a port number"))?,
            );
        } else if agent_store {
            addr.set_port(addr.port().wrapping_add(1));
        }
        let (token, secret) = match var(TOKEN_VAR) {
            Some(t) => (
                u128::from_str_radix(&t, 16)
                    .map_err(|_| format!("{TOKEN_VAR}='{t}' is not a hexadecimal token"))?,
                true,
            ),
            // Without a token, tell jobs apart by rendezvous and size.
            None => (fnv1a(format!("{addr}/{size}").as_bytes()), false),
        };
        return Ok(Meeting::Address {
            addr,
            hosted_elsewhere: var(LAUNCHER_VAR).is_some(),
            token,
            secret,
        });
    }
    #[cfg(feature = "mpi")]
    if var("OMPI_COMM_WORLD_SIZE").is_some() || var("PMI_SIZE").is_some() {
        return Ok(Meeting::Mpi);
    }
    if let Some(fd) = var("PMI_FD") {
        let fd = fd
            .trim()
            .parse()
            .map_err(|_| format!("PMI_FD='{fd}' is not a file descriptor"))?;
        return Ok(Meeting::Pmi { fd });
    }
    if local_size == Some(size) {
        return Ok(local_meeting(size));
    }
    Err(
        "MASTER_ADDR and MASTER_PORT are not set, and the ranks span several hosts with no \
         launcher channel this library speaks (MPICH's PMI): set MASTER_ADDR to an address of \
         rank 0's host and MASTER_PORT to a free port there, as torchrun does"
            .into(),
    )
}

/// Every rank on this host: meet on a socket named after the job.
fn local_meeting(size: usize) -> Meeting {
    let job = var("PMIX_NAMESPACE")
        .or_else(|| {
            Some(format!(
                "{}.{}",
                var("SLURM_JOB_ID")?,
                var("SLURM_STEP_ID")?
            ))
        })
        .unwrap_or_else(|| {
            format!(
                "ppid{}",
                rustix::process::getppid().map_or(0, |p| p.as_raw_nonzero().get())
            )
        });
    Meeting::Local {
        key: format!("{job}-{size}"),
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
        format!("{name} is not set: set both MASTER_ADDR and MASTER_PORT (rank 0's host and a free port there)")
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

/// The local address the kernel would use to reach `dest`: the address peers
/// on that network can reach us at (no packet is sent).
fn local_ip_towards(dest: SocketAddr) -> IpAddr {
    let probe = || -> std::io::Result<IpAddr> {
        let unspecified: SocketAddr = if dest.is_ipv4() {
            "0.0.0.0:0"
        } else {
            "[::]:0"
        }
        .parse()
        .unwrap();
        let s = std::net::UdpSocket::bind(unspecified)?;
        s.connect(dest)?;
        Ok(s.local_addr()?.ip())
    };
    probe().unwrap_or(dest.ip())
}

/// `COLL_SOCKET_IFNAME`: the interface whose address to listen on (as
/// NCCL_SOCKET_IFNAME); one that is not up is an error, not ignored.
fn interface_ip_from_env() -> Result<Option<IpAddr>, String> {
    let Some(name) = var("COLL_SOCKET_IFNAME") else {
        return Ok(None);
    };
    let up = interfaces();
    match up.iter().find(|(n, _)| *n == name) {
        Some((_, ip)) => Ok(Some(*ip)),
        None => Err(format!(
            "COLL_SOCKET_IFNAME={name}: no interface of that name is up with an IPv4 \
             address (up: {})",
            up.iter()
                .map(|(n, _)| n.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}

/// The address to serve a rendezvous on when nothing says where ranks
/// meet: `COLL_SOCKET_IFNAME`'s, else the first interface's that is not
/// loopback, else loopback.
fn default_ip() -> Result<IpAddr, String> {
    Ok(interface_ip_from_env()?
        .or_else(first_interface_ip)
        .unwrap_or(IpAddr::from([127, 0, 0, 1])))
}

/// The first IPv4 address of an interface that is up and not loopback.
fn first_interface_ip() -> Option<IpAddr> {
    interfaces()
        .into_iter()
        .map(|(_, ip)| ip)
        .find(|ip| !ip.is_loopback())
}

/// `(name, IPv4 address)` of every interface that is up.
fn interfaces() -> Vec<(String, IpAddr)> {
    let mut out = Vec::new();
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `list` with a linked list we free below; we
    // only read entries while it is alive.
    unsafe {
        if libc::getifaddrs(&mut list) != 0 {
            return out;
        }
        let mut at = list;
        while let Some(ifa) = at.as_ref() {
            let up = ifa.ifa_flags & libc::IFF_UP as u32 != 0;
            if up && !ifa.ifa_addr.is_null() && (*ifa.ifa_addr).sa_family == libc::AF_INET as u16 {
                let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                let ip = IpAddr::from(u32::from_be(sin.sin_addr.s_addr).to_be_bytes());
                let name = std::ffi::CStr::from_ptr(ifa.ifa_name)
                    .to_string_lossy()
                    .into_owned();
                out.push((name, ip));
            }
            at = ifa.ifa_next;
        }
        libc::freeifaddrs(list);
    }
    out
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

/// A token derived from `parent` and `salt` (a MAC under `parent`): what
/// the members of a job, a split or a shrink all compute alike, and nobody
/// without `parent` can.
pub(crate) fn derive_token(parent: u128, salt: &str) -> u128 {
    u128::from_le_bytes(transport::proof::mac(
        parent,
        "derived token",
        &[salt.as_bytes()],
    ))
}

/// A fresh random token (a secret: from the kernel, with no weaker fallback).
pub(crate) fn random_token() -> u128 {
    u128::from_le_bytes(transport::proof::random())
}
