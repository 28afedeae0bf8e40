//! RDMA verbs transport over RoCE v2, through sideway (which loads
//! libibverbs at run time). Why sideway: it registers caller buffers
//! (`ibv_reg_mr` on any address), posts RDMA WRITE, WRITE_WITH_IMM and
//! READ, and reads the GID table with GID types; the `ibverbs` crate (0.9)
//! can neither post RDMA writes nor register caller buffers, and fixes the
//! port at 1. Where sideway has no safe API (completion events), its sys
//! crate is called directly.
//!
//! One RC queue pair per peer (or several, `COLL_IB_QPS_PER_PEER`, to
//! spread flows over ECMP paths), set up over a TCP side channel (the TCP
//! transport's greeting: job token, refusal of strangers) that stays open
//! for aborts and as a death detector. Data moves by a receiver-driven
//! rendezvous, as NCCL's IB transport does: `irecv` sends the sender a
//! 40-byte "clear to send" (address, rkey, length, tag, sequence; the rkey
//! is that of a memory window over exactly the posted bytes, unbound when
//! the receive completes: `window.rs`), the sender checks tag and length against its send and RDMA-WRITEs the bytes straight
//! into the posted buffer with an immediate that completes the receive (a
//! message over [`MAX_WRITE`] as several writes, the immediate on the last). No
//! copy on either side; the clear-to-send messages are the credits, so a
//! sender can never write more than its receiver has granted.

mod connection;
mod device;
mod window;

use std::io::{Read, Write};
use std::net::{IpAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sideway::ibverbs::address::Gid;
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::AccessFlags;

pub use connection::VerbsConnection;

use crate::tcp::{self, TcpListener, TcpOptions};
use crate::{Connection, Error, Hello, Listener, MemRegion, Rank, Result, Transport};

/// A registration's key: the memory region, for its lkey and rkey.
#[derive(Clone)]
pub(crate) struct Registration(pub Arc<MemoryRegion>);

/// The verbs transport on one device port.
pub struct VerbsTransport {
    port: Arc<device::Port>,
    pd: Arc<ProtectionDomain>,
    bind_ip: IpAddr,
    settings: Settings,
}

/// What every connection of a transport is set up with.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Settings {
    /// Queue pairs per peer (`COLL_IB_QPS_PER_PEER`, default 1).
    pub qps: usize,
    /// `COLL_IB_TIMEOUT`, `COLL_IB_RETRY_CNT`.
    pub retry: Retry,
    /// The longest RDMA write: longer messages go as several.
    pub max_write: u64,
    /// Receives are granted through memory windows (`window.rs`); a device
    /// without them grants its registrations' own keys.
    pub windows: bool,
}

/// The longest RDMA write: mlx5 ports take at most 1 GiB a message
/// (`max_msg_sz`), the IB spec 2 GiB, and a work request's length is 32
/// bits. A port that says it takes less gets less (soft-RoCE's rxe says
/// 8 MiB).
pub const MAX_WRITE: u64 = 1 << 30;

/// The longest write to post on a port whose `max_msg_sz` is `max_msg`
/// (0: not reported).
fn max_write(max_msg: u32) -> u64 {
    match max_msg {
        0 => MAX_WRITE,
        m => MAX_WRITE.min(m as u64).max(MIN_WRITE),
    }
}

/// The shortest write [`VerbsTransport::with_max_write`] takes.
const MIN_WRITE: u64 = 4096;

impl VerbsTransport {
    /// Opens the device whose RoCE v2 GID matches `bind_ip` (see `device`);
    /// an error that says how to choose another transport where there is none.
    pub fn open(bind_ip: IpAddr) -> Result<Self> {
        let qps = qps_per_peer()?;
        let retry = Retry::from_env()?;
        let port = device::open(bind_ip)?;
        let longest = max_write(port.max_msg);
        let pd = port
            .context
            .alloc_pd()
            .map_err(|e| Error::Invalid(format!("ibv_alloc_pd on {}: {e}", port.device)))?;
        let windows = windows_wanted()? && window::Window::supported(&pd, &port.device);
        tracing::info!(
            device = %port.device, port = port.port, windows, gid_index = port.gid_index, gid = %port.gid,
            mtu = device::mtu_bytes(port.mtu), max_write = longest, qps_per_peer = qps, ib_timeout = retry.timeout, ib_retry_cnt = retry.count,
            "verbs transport ready"
        );
        Ok(VerbsTransport {
            port: Arc::new(port),
            pd,
            bind_ip,
            settings: Settings {
                qps,
                retry,
                max_write: longest,
                windows,
            },
        })
    }

    /// Uses `n` queue pairs per peer (1 to [`MAX_QPS_PER_PEER`]) instead of
    /// `COLL_IB_QPS_PER_PEER`'s number; every rank must use the same.
    pub fn with_qps_per_peer(mut self, n: usize) -> Self {
        self.settings.qps = n.clamp(1, MAX_QPS_PER_PEER);
        self
    }

    /// Sends messages longer than `bytes` (4 KiB to [`MAX_WRITE`]) as
    /// several RDMA writes instead of the port's longest message (at most
    /// `MAX_WRITE`): for tests, which cannot move gigabytes through soft-RoCE.
    pub fn with_max_write(mut self, bytes: u64) -> Self {
        self.settings.max_write = bytes.clamp(MIN_WRITE, MAX_WRITE);
        self
    }

    /// `device:port`, for logs.
    pub fn device(&self) -> String {
        format!("{}:{}", self.port.device, self.port.port)
    }
}

impl Transport for VerbsTransport {
    fn name(&self) -> &'static str {
        "verbs"
    }

    fn listen(&self) -> Result<Box<dyn Listener>> {
        let side = TcpListener::bind(self.bind_ip, TcpOptions::default())?;
        Ok(Box::new(VerbsListener {
            side,
            port: self.port.clone(),
            pd: self.pd.clone(),
            settings: self.settings,
        }))
    }

    fn connect(
        &self,
        address: &[u8],
        hello: Hello,
        deadline: Instant,
    ) -> Result<Box<dyn Connection>> {
        let side = tcp::connect_greeted(address, hello, TcpOptions::default(), deadline)?;
        establish(
            side,
            hello.to,
            &self.port,
            &self.pd,
            self.settings,
            deadline,
        )
    }

    fn register(&self, addr: *const u8, len: usize) -> Result<MemRegion> {
        if len == 0 {
            return Ok(MemRegion::plain(addr, len));
        }
        // No remote access of its own: a peer writes only through the
        // window a receive's grant opens over its bytes (`window.rs`), and
        // never reads (the protocol posts no RDMA READ).
        let access = match self.settings.windows {
            true => AccessFlags::LocalWrite | AccessFlags::MemoryWindowBind,
            false => AccessFlags::LocalWrite | AccessFlags::RemoteWrite,
        };
        // SAFETY: registration pins the pages; the isend/irecv contract keeps
        // them valid while a request uses them.
        let mr = unsafe { self.pd.reg_mr(addr as usize, len, access) }.map_err(|e| {
            let memlock = rustix::process::getrlimit(rustix::process::Resource::Memlock);
            Error::Invalid(format!(
                "ibv_reg_mr of {len} bytes failed: {e} (the locked-memory limit is {:?} bytes; raise it with `ulimit -l unlimited`)",
                memlock.current
            ))
        })?;
        Ok(MemRegion::new(addr, len, Box::new(Registration(mr))))
    }
}

/// Listens for peers on the TCP side channel.
pub struct VerbsListener {
    side: TcpListener,
    port: Arc<device::Port>,
    pd: Arc<ProtectionDomain>,
    settings: Settings,
}

impl Listener for VerbsListener {
    fn address(&self) -> Vec<u8> {
        self.side.address()
    }

    fn accept(
        &mut self,
        token: u128,
        me: Rank,
        deadline: Instant,
    ) -> Result<(Hello, Box<dyn Connection>)> {
        let (hello, side) = self.side.accept_greeted(token, me, deadline)?;
        let peer = hello.from;
        let deadline = crate::handshake_deadline(deadline);
        Ok((
            hello,
            establish(side, peer, &self.port, &self.pd, self.settings, deadline)?,
        ))
    }
}

/// What each side tells the other to connect its queue pairs.
struct QpInfo {
    qpns: Vec<u32>,
    psn: u32,
    gid: [u8; 16],
    mtu: u32,
}

/// Queue pairs per peer at most (`COLL_IB_QPS_PER_PEER`).
pub const MAX_QPS_PER_PEER: usize = 8;
const QP_INFO_LEN: usize = 28 + 4 * MAX_QPS_PER_PEER;

impl QpInfo {
    fn encode(&self) -> [u8; QP_INFO_LEN] {
        let mut b = [0u8; QP_INFO_LEN];
        b[0..4].copy_from_slice(&(self.qpns.len() as u32).to_le_bytes());
        b[4..8].copy_from_slice(&self.psn.to_le_bytes());
        b[8..24].copy_from_slice(&self.gid);
        b[24..28].copy_from_slice(&self.mtu.to_le_bytes());
        for (i, q) in self.qpns.iter().enumerate() {
            b[28 + 4 * i..32 + 4 * i].copy_from_slice(&q.to_le_bytes());
        }
        b
    }

    fn decode(b: &[u8; QP_INFO_LEN]) -> Self {
        let word = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
        let n = (word(0) as usize).min(MAX_QPS_PER_PEER);
        QpInfo {
            qpns: (0..n).map(|i| word(28 + 4 * i)).collect(),
            psn: word(4),
            gid: b[8..24].try_into().unwrap(),
            mtu: word(24),
        }
    }
}

/// `COLL_IB_QPS_PER_PEER`: queue pairs per peer, 1 to [`MAX_QPS_PER_PEER`].
pub fn qps_per_peer() -> Result<usize> {
    match std::env::var("COLL_IB_QPS_PER_PEER") {
        Err(_) => Ok(1),
        Ok(v) => v
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=MAX_QPS_PER_PEER).contains(n))
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "COLL_IB_QPS_PER_PEER='{v}' is not a number from 1 to {MAX_QPS_PER_PEER}"
                ))
            }),
    }
}

/// `COLL_IB_WINDOWS`: `1` (the default) grants each receive through a
/// memory window over its bytes (`window.rs`); `0` grants the registration's
/// own key, sparing a bind and an unbind per receive on a fabric whose every
/// member is trusted. Ranks may differ: a sender writes with whatever key
/// it is granted.
pub fn windows_wanted() -> Result<bool> {
    match std::env::var("COLL_IB_WINDOWS") {
        Err(_) => Ok(true),
        Ok(v) => match v.trim() {
            "1" => Ok(true),
            "0" => {
                tracing::info!("COLL_IB_WINDOWS=0: receives are granted with their registrations' keys; a peer holding one can write into that registered buffer between receives");
                Ok(false)
            }
            _ => Err(Error::Invalid(format!(
                "COLL_IB_WINDOWS='{v}' is neither 1 (memory windows) nor 0 (none)"
            ))),
        },
    }
}

/// How long an RC queue pair retries before its work request fails with
/// RETRY_EXC_ERR, as NCCL_IB_TIMEOUT / NCCL_IB_RETRY_CNT: each try waits
/// 4.096 us x 2^`timeout` for an acknowledgement; `count` retries follow
/// the first try.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Retry {
    pub timeout: u8,
    pub count: u8,
}

impl Retry {
    /// 67 ms per try, 8 tries: a dead peer shows in about half a second,
    /// while a lossy fabric's retransmissions (one try lost in a row of
    /// eight) still get through.
    pub const DEFAULT: Retry = Retry {
        timeout: 14,
        count: 7,
    };

    /// `COLL_IB_TIMEOUT` (1 to 31) and `COLL_IB_RETRY_CNT` (0 to 7).
    pub fn from_env() -> Result<Self> {
        let var = |name: &str, range: std::ops::RangeInclusive<u8>, default: u8| {
            let Ok(v) = std::env::var(name) else {
                return Ok(default);
            };
            (v.trim().parse::<u8>().ok())
                .filter(|n| range.contains(n))
                .ok_or_else(|| {
                    Error::Invalid(format!(
                        "{name}='{v}' is not a number from {} to {}",
                        range.start(),
                        range.end()
                    ))
                })
        };
        Ok(Retry {
            timeout: var("COLL_IB_TIMEOUT", 1..=31, Self::DEFAULT.timeout)?,
            count: var("COLL_IB_RETRY_CNT", 0..=7, Self::DEFAULT.count)?,
        })
    }

    /// How long one try waits for an acknowledgement.
    pub fn per_try(&self) -> Duration {
        Duration::from_nanos(4096 << self.timeout)
    }

    /// What an exhausted retry count means, for the error.
    pub fn explain(&self, peer: Rank) -> String {
        format!(
            "no acknowledgement from peer rank {peer} in {} tries of {:.1} ms (COLL_IB_RETRY_CNT={}, COLL_IB_TIMEOUT={}): the peer, its port or the path to it is down, or the fabric drops that many packets; raise COLL_IB_TIMEOUT or COLL_IB_RETRY_CNT to wait longer",
            self.count as u32 + 1,
            self.per_try().as_secs_f64() * 1e3,
            self.count,
            self.timeout
        )
    }
}

/// Creates the queue pair, swaps `QpInfo` over the side channel, brings
/// both ends to RTS, and waits until the peer's end is ready too.
fn establish(
    mut side: TcpStream,
    peer: Rank,
    port: &Arc<device::Port>,
    pd: &Arc<ProtectionDomain>,
    settings: Settings,
    deadline: Instant,
) -> Result<Box<dyn Connection>> {
    let io = |what: &'static str| move |e: std::io::Error| Error::io(Some(peer), what, &e);
    let left = || {
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    };
    // The listener greets without blocking; the handshake below blocks
    // (with timeouts).
    side.set_nonblocking(false)
        .map_err(io("exchange queue pair numbers"))?;
    let mut conn = VerbsConnection::new(port.clone(), pd, peer, settings)?;
    let mine = QpInfo {
        qpns: conn.qp_numbers(),
        psn: random_psn(),
        gid: port.gid.raw,
        mtu: device::mtu_bytes(port.mtu),
    };
    side.set_write_timeout(Some(left()))
        .map_err(io("exchange queue pair numbers"))?;
    side.write_all(&mine.encode())
        .map_err(io("exchange queue pair numbers"))?;
    let mut theirs = [0u8; QP_INFO_LEN];
    side.set_read_timeout(Some(left()))
        .map_err(io("exchange queue pair numbers"))?;
    side.read_exact(&mut theirs)
        .map_err(io("exchange queue pair numbers"))?;
    let theirs = QpInfo::decode(&theirs);
    if theirs.qpns.len() != mine.qpns.len() {
        return Err(Error::Invalid(format!(
            "COLL_IB_QPS_PER_PEER differs: {} here, {} at peer rank {peer}; set it alike on every rank",
            // Each side's count includes its binder (see `connection`).
            mine.qpns.len() - 1,
            theirs.qpns.len().saturating_sub(1)
        )));
    }
    let mtu = mine.mtu.min(theirs.mtu);
    conn.connect(
        &theirs.qpns,
        mine.psn,
        theirs.psn,
        Gid { raw: theirs.gid },
        mtu,
    )?;
    // Our end can receive; once theirs can too, writes are safe.
    side.write_all(b"R").map_err(io("signal readiness"))?;
    let mut ready = [0u8; 1];
    side.read_exact(&mut ready)
        .map_err(io("wait for the peer's readiness"))?;
    tracing::debug!(
        peer,
        qpns = ?mine.qpns,
        peer_qpns = ?theirs.qpns,
        mtu,
        "queue pair connected"
    );
    conn.attach_side_channel(side)?;
    Ok(Box::new(conn))
}

fn random_psn() -> u32 {
    u32::from_le_bytes(crate::proof::random()) & 0xff_ffff
}
