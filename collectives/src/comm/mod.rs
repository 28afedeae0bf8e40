//! The communicator: a rank's connections to the other ranks of the job,
//! its settings, and the one path every call takes (check, choose, build,
//! execute). Everything that needs the whole communicator lives here:
//!
//! * `mod.rs`: [`Communicator`], its set-up from a bootstrap, its state;
//! * `calls.rs`: the typed calls (`all_reduce`, `send`, ...);
//! * `inflight.rs`: calls in flight, started, stepped and finished;
//! * `nonblocking.rs`, `group.rs`: non-blocking calls and group calls;
//! * `split.rs`, `shrink.rs`: child communicators, and going on without
//!   failed ranks;
//! * `flags.rs`: turning on the flag path for small calls ([`crate::tiny`]).
//!
//! Owns: the communicator's state. It is the top of the crate: every other
//! folder is below it and none imports it.

mod calls;
mod flags;
pub(crate) mod group;
pub(crate) mod inflight;
pub(crate) mod nonblocking;
mod parts;
mod progress;
mod shrink;
mod split;

use std::sync::Arc;
use std::time::Instant;

use transport::{Listener, Rank, RegistrationCache, Transport};

use crate::algo::{Algorithm, Topology};
use crate::bootstrap::connector::{self, Connector};
use crate::bootstrap::mesh::{self, LANES};
use crate::bootstrap::rendezvous::{PeerInfo, Table};
use crate::bootstrap::{self, Bootstrap};
use crate::call::args::{CallArgs, Peer};
use crate::call::buffers::Buffers;
use crate::call::descriptor::Collective;
use crate::comm::inflight::{InFlight, RawBuf};
use crate::exec::transfers::Staging;
use crate::fault::abort::{AbortFlag, AbortHandle};
use crate::observe::recorder::{self, Dump, Recorder, Stats};
use crate::select::selector::Selector;
use crate::select::tuning::Setting;
use crate::{Config, Error, Result};
use parts::{Ids, Job, Links, Workspace};

/// One rank's view of a job: its peers, its connections, its settings.
/// Collective calls must be made by every rank, in the same order, with
/// matching counts, datatypes and reductions; a mismatch is reported, not
/// mis-reduced. A call whose arguments are wrong fails before any byte
/// moves and leaves the communicator usable; any other failure aborts it.
pub struct Communicator {
    pub(crate) rank: Rank,
    pub(crate) size: usize,
    pub(crate) config: Config,
    /// Who is in the job and how each rank is reached.
    pub(crate) job: Job,
    /// The connections and the memory registered for them.
    pub(crate) links: Links,
    /// The numbers that keep calls, messages and children apart.
    pub(crate) ids: Ids,
    pub(crate) abort: Arc<AbortFlag>,
    /// Why the communicator is unusable, once it is.
    aborted: Option<String>,
    /// Memory algorithms borrow during a call.
    pub(crate) workspace: Workspace,
    /// Calls started and not finished, and the executor's reusable memory.
    pub(crate) inflight: InFlight,
    /// The last calls and the counters.
    pub(crate) recorder: Recorder,
    pub(crate) selector: Selector,
    /// The small-call path, once set up (see [`crate::tiny`]).
    pub(crate) tiny: crate::tiny::State,
}

/// What the second half of initialisation needs: everyone's info and this
/// rank's listeners (from the bootstrap, or from a parent's split).
pub(crate) struct Setup {
    pub rank: Rank,
    pub table: Table,
    pub available: Vec<Arc<dyn Transport>>,
    pub listeners: Vec<Box<dyn Listener>>,
    pub config: Config,
    pub deadline: Instant,
    /// When making this communicator began, for its `init_seconds`.
    pub started: Instant,
    /// What the launcher says this rank's local rank is, to cross-check.
    pub local_rank_hint: Option<usize>,
    /// Where rank and size came from, for logs.
    pub source: &'static str,
}

impl Communicator {
    /// Joins the job described by the environment (see [`Bootstrap::from_env`]
    /// and [`Config::from_env`]).
    pub fn from_env() -> Result<Self> {
        let boot = Bootstrap::from_env().map_err(|message| Error::Bootstrap {
            rank: env_rank(),
            message,
        })?;
        let config = Config::from_env().map_err(|message| Error::Bootstrap {
            rank: boot.rank,
            message,
        })?;
        Self::init(boot, config)
    }

    /// Joins the job: rendezvous, then a connection to every other rank.
    pub fn init(boot: Bootstrap, config: Config) -> Result<Self> {
        crate::log::init();
        recorder::install_signal();
        let rank = boot.rank;
        let fail = |message: String| Error::Bootstrap { rank, message };
        config.validate().map_err(fail)?;
        let started = Instant::now();
        let deadline = started + config.timeout;
        let available = mesh::available(boot.local_ip().map_err(fail)?, &config);
        let (listeners, addresses) = listen(&available).map_err(fail)?;
        let me = PeerInfo::new(rank, addresses, config.shared_settings());
        let table = bootstrap::meet(&boot, me, deadline).map_err(fail)?;
        Self::connect(Setup {
            rank,
            table,
            available,
            listeners,
            config,
            deadline,
            started,
            local_rank_hint: boot.local_rank,
            source: boot.source,
        })
    }

    /// The second half of initialisation: connections to every rank of
    /// `setup.table`, staging, the selector.
    pub(crate) fn connect(setup: Setup) -> Result<Self> {
        let Setup {
            rank,
            table,
            available,
            listeners,
            config,
            deadline,
            started,
            local_rank_hint,
            source,
        } = setup;
        let fail = |message: String| Error::Bootstrap { rank, message };
        let plan = mesh::plan(&available, rank, &table, &config).map_err(fail)?;
        for t in &available {
            t.expect_peers(plan.via.iter().filter(|v| **v == Some(t.name())).count());
        }
        let routes = connector::routes(&available, &plan.transport, &table).map_err(fail)?;
        let tcp = (available.iter().find(|t| t.name() == "tcp"))
            .expect("TCP is always available")
            .clone();
        let connector = Connector::new(rank, &table, routes, tcp, listeners, config.timeout);
        let size = table.peers.len();
        let used: Vec<&dyn Transport> = plan.used.iter().map(|t| &**t).collect();
        let staging = Staging::new(&used, config.chunk_bytes, config.depth)
            .map_err(|e| fail(e.to_string()))?;
        let mut links = Links {
            available,
            transports: plan.used,
            lanes: std::array::from_fn(|_| (0..size).map(|_| None).collect()),
            connector,
            staging,
            registrations: RegistrationCache::new(),
        };
        if config.eager_connect {
            let peers: Vec<Rank> = (0..size).filter(|&p| p != rank).collect();
            for lane in 0..LANES {
                (links.connect(lane, &peers, &plan.via, deadline))
                    .map_err(|e| fail(e.to_string()))?;
            }
        }
        let via = plan.via;
        let abort = AbortFlag::new().map_err(|e| fail(format!("eventfd: {e}")))?;
        let me = &table.peers[rank];
        let local_ranks: Vec<Rank> = (table.peers.iter())
            .filter(|p| p.host_id == me.host_id)
            .map(|p| p.rank)
            .collect();
        let local_rank = local_ranks.iter().position(|r| *r == rank).unwrap();
        if local_rank_hint.is_some_and(|l| l != local_rank) {
            tracing::warn!(
                rank,
                "launcher says local rank {local_rank_hint:?}, the rendezvous says {local_rank}"
            );
        }
        let spin = crate::bootstrap::cpus::spin(local_ranks.len());
        mesh::log_peers(rank, &table, &via);
        tracing::info!(
            rank,
            size,
            source,
            host = %me.hostname,
            local_ranks = ?local_ranks,
            transport = mesh::summary(&via),
            chunk = config.chunk_bytes,
            depth = config.depth,
            timeout_s = config.timeout.as_secs_f64(),
            "communicator ready"
        );
        let hosts = group_by_host(&table.peers);
        let setting = Setting {
            ranks: size,
            per_host: hosts.iter().map(Vec::len).max().unwrap_or(1),
            transport: mesh::summary(&via),
        };
        let topology = Topology {
            hosts: hosts.clone(),
            crowded_sockets: crate::bootstrap::cpus::crowded_sockets(
                &config.transport,
                &table.peers,
                &hosts,
            ),
            crowded: crate::bootstrap::cpus::crowded(&table.peers, &hosts),
            shared_memory: mesh::all_shared_memory(&via),
        };
        let tiny = crate::tiny::State::initial(config.tiny_bytes, &via);
        let comm = Communicator {
            tiny,
            selector: Selector::new(rank, topology, setting),
            rank,
            size,
            config,
            job: Job {
                hosts,
                peers: table.peers,
                local_ranks,
                via,
            },
            links,
            ids: Ids {
                session: table.session,
                seq: 0,
                p2p_sent: vec![0; size],
                p2p_received: vec![0; size],
                splits: 0,
                agreements: 0,
            },
            abort,
            aborted: None,
            workspace: Workspace::default(),
            inflight: InFlight::new(spin, rank),
            recorder: Recorder::new(rank, size),
        };
        crate::observe::status::register(comm.ids.session, &comm.recorder.board);
        let mut comm = comm;
        comm.set_up_tiny()?;
        comm.recorder.stats.init_seconds = started.elapsed().as_secs_f64();
        Ok(comm)
    }

    /// Where each rank answers status questions (`None`: it published
    /// none), for the diagnosis of a timeout.
    pub(crate) fn status_addresses(&self) -> Vec<Option<std::net::SocketAddr>> {
        self.job.peers.iter().map(mesh::status_address).collect()
    }

    pub fn rank(&self) -> Rank {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// Ranks on this rank's host, ascending (this rank included).
    pub fn local_ranks(&self) -> &[Rank] {
        &self.job.local_ranks
    }

    /// This rank's index among [`local_ranks`](Self::local_ranks).
    pub fn local_rank(&self) -> usize {
        (self.job.local_ranks.iter())
            .position(|r| *r == self.rank)
            .unwrap()
    }

    /// Hostname of `rank`.
    pub fn hostname(&self, rank: Rank) -> &str {
        &self.job.peers[rank].hostname
    }

    /// The ranks grouped by host (ranks that share memory), in rank order.
    /// Hosts are told apart by hostname, boot id and network namespace, so
    /// namespaces posing as hosts on one machine count as separate hosts.
    pub fn hosts(&self) -> Vec<Vec<Rank>> {
        self.job.hosts.clone()
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The pipeline a collective call on `bytes` per rank runs with: its
    /// chunk bytes and how many staged receives it keeps in flight. Large
    /// reductions over shared memory stage fewer, smaller chunks than the
    /// configured ones (see `COLL_CHUNK` in the README).
    pub fn pipeline(&self, collective: Collective, bytes: usize) -> (usize, usize) {
        let chunk = self.links.staging.slot_bytes.min(self.config.chunk_bytes);
        let shared_memory = self.selector.shared_memory();
        match crate::exec::transfers::stages_in_cache(collective, bytes, shared_memory) {
            true => (chunk.min(crate::exec::transfers::CACHED_CHUNK), 1),
            false => (chunk, self.links.staging.slots),
        }
    }

    /// The transports in use: `shm`, `tcp` or `shm+tcp`.
    pub fn transport_summary(&self) -> String {
        mesh::summary(&self.job.via)
    }

    /// The transport that reaches `rank` (`None` for this rank itself).
    pub fn transport_to(&self, rank: Rank) -> Option<&'static str> {
        self.job.via[rank]
    }

    /// The algorithm a call of `collective` on `bytes` per rank would use.
    pub fn algorithm(&self, collective: Collective, bytes: usize) -> Result<&'static Algorithm> {
        (self.selector)
            .choose(&self.config, collective, bytes)
            .map(|(a, _)| a)
    }

    /// Forces `collective`'s algorithm from now on (`None`: the selector
    /// chooses again), as `COLL_ALGO` does. Every rank must do the same.
    pub fn force_algo(&mut self, collective: Collective, name: Option<&str>) {
        let c = collective.name();
        self.selector.forget();
        self.config.algo.retain(|(k, _)| k != c);
        if let Some(name) = name {
            self.config.algo.push((c.to_string(), name.to_lowercase()));
        }
    }

    /// What the selector's cost model is keyed by for this communicator.
    pub fn setting(&self) -> Setting {
        self.selector.setting().clone()
    }

    /// A handle that aborts this communicator from any thread (see
    /// [`AbortHandle`]).
    pub fn abort_handle(&self) -> AbortHandle {
        self.abort.handle()
    }

    /// Aborts the communicator: every later call fails, and every peer's
    /// pending or next call fails naming this rank and `reason`.
    pub fn abort(&mut self, reason: &str) {
        self.abort.fire(reason);
        self.close(reason);
    }

    /// Whether [`aborted`](Self::aborted) has a reason: two loads, inlined
    /// (every call asks).
    #[inline]
    pub(crate) fn is_aborted(&self) -> bool {
        self.aborted.is_some() || self.abort.fired()
    }

    /// Whether the communicator was aborted (by a failure or on request), and why.
    pub fn aborted(&self) -> Option<String> {
        self.aborted.clone().or_else(|| self.abort.reason())
    }

    /// The counters: bytes and messages per peer, calls per collective,
    /// time spent waiting, failures.
    pub fn stats(&self) -> Stats {
        let mut s = self.recorder.stats.snapshot();
        s.connections = self.links.connector.made as u64;
        s.connect_seconds = self.links.connector.seconds;
        s
    }

    /// This rank's flight record: its last calls (what each waits on, if
    /// running) and counters.
    pub fn trace(&self, reason: &str) -> Dump {
        let calls = self.recorder.calls(|n| self.waiting_on(n));
        Dump {
            rank: self.rank,
            size: self.size,
            host: self.job.peers[self.rank].hostname.clone(),
            pid: std::process::id(),
            reason: reason.to_string(),
            time: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64()),
            calls,
            stats: self.stats(),
        }
    }

    /// Writes [`trace`](Self::trace) as JSON into `COLL_TRACE_DUMP_DIR`
    /// (default: the temp dir), `coll-trace-rank<R>-pid<P>.json`; returns
    /// the path. Also done when a call fails and on SIGUSR1.
    pub fn dump_trace(&self, reason: &str) -> std::io::Result<std::path::PathBuf> {
        recorder::write(&self.trace(reason), &recorder::dump_dir())
    }

    /// Keeps `bytes` registered with the transports until
    /// [`deregister_bytes`](Self::deregister_bytes), so calls on it skip
    /// registration (which costs a page pinning per call over verbs).
    pub fn register_bytes(&mut self, bytes: &[u8]) -> Result<()> {
        let transports: Vec<&dyn Transport> = self.links.transports.iter().map(|t| &**t).collect();
        self.links
            .registrations
            .get_or_register(transports.iter().copied(), bytes.as_ptr(), bytes.len())
            .map(drop)
            .map_err(|e| Error::InvalidArgument {
                rank: self.rank,
                message: e.to_string(),
            })
    }

    /// Forgets a registration made by [`register_bytes`](Self::register_bytes).
    pub fn deregister_bytes(&mut self, bytes: &[u8]) {
        self.links.registrations.evict(bytes.as_ptr(), bytes.len());
    }

    /// Any call on byte buffers, described by `args` (see the typed calls
    /// in `calls.rs` for each one's buffers; point-to-point sends pass
    /// their buffer as the send half of `OutOfPlace` with an empty
    /// receive half, receives theirs `InPlace`).
    #[inline]
    pub fn call(&mut self, args: &CallArgs, bufs: Buffers<'_>) -> Result<()> {
        let (input, output) = bufs.split();
        self.run(args, input, output)
    }

    /// A call with NCCL's buffer conventions: `count` as NCCL means it for
    /// the collective (see [`CallArgs::nccl_lengths`]), in place when the
    /// addresses say so (see [`CallArgs::nccl_in_place`]); a Reduce's
    /// receive buffer may be null off the root (workspace is lent then).
    ///
    /// # Safety
    /// `send` and `recv` must be valid for the lengths `count` stands for
    /// (reads and writes respectively; either may be null when its length
    /// is zero) and must not be used by anyone else during the call.
    pub unsafe fn call_raw(
        &mut self,
        args: &CallArgs,
        send: *const u8,
        recv: *mut u8,
        count: usize,
    ) -> Result<()> {
        let mut workspace = Vec::new();
        // SAFETY: the caller's promise.
        let (input, output) = unsafe { self.nccl_bufs(args, send, recv, count, &mut workspace)? };
        // SAFETY: as above; `workspace` outlives the call.
        unsafe { self.run_raw(args, input, output) }
    }

    /// NCCL's buffer conventions (see [`call_raw`](Self::call_raw)) as the
    /// executor's buffers: `(None, buf)` in place. `workspace` lends a
    /// Reduce's receive buffer off the root when it is null.
    ///
    /// # Safety
    /// As [`call_raw`](Self::call_raw).
    pub(crate) unsafe fn nccl_bufs(
        &self,
        args: &CallArgs,
        send: *const u8,
        recv: *mut u8,
        count: usize,
        workspace: &mut Vec<u64>,
    ) -> Result<(Option<RawBuf>, RawBuf)> {
        // SAFETY: the caller's promise.
        let bufs = unsafe { args.nccl_buffers(self.rank, self.size, send, recv, count, workspace) };
        let bufs = bufs.map_err(|message| Error::InvalidArgument {
            rank: self.rank,
            message,
        })?;
        Ok(RawBuf::from_buffers(bufs))
    }

    /// Runs one call to its end. Argument errors leave the communicator
    /// usable; any other failure aborts it and tells the peers why.
    #[inline]
    pub(crate) fn run(
        &mut self,
        args: &CallArgs,
        input: Option<&[u8]>,
        output: &mut [u8],
    ) -> Result<()> {
        // SAFETY: the borrows keep both buffers alive and to ourselves until
        // `run_raw` returns, which is when the call has finished (or failed
        // and the connections were aborted).
        unsafe { self.run_raw(args, input.map(RawBuf::of), RawBuf::of_mut(output)) }
    }

    /// This call's sequence number: the communicator's for collectives, the
    /// pair's and direction's for point-to-point.
    pub(crate) fn next_seq(&mut self, peer: Option<Peer>) -> u32 {
        let counter = match peer {
            Some(Peer::To(p)) if p < self.size => &mut self.ids.p2p_sent[p],
            Some(Peer::From(p)) if p < self.size => &mut self.ids.p2p_received[p],
            Some(_) => return 0,
            None => &mut self.ids.seq,
        };
        let seq = *counter;
        *counter = counter.wrapping_add(1);
        seq
    }

    /// Gives up on every connection, telling each peer `reason`; every
    /// call in flight fails.
    pub(crate) fn close(&mut self, reason: &str) {
        if self.aborted.is_some() {
            return;
        }
        self.inflight.fail_all(self.rank, reason);
        // The caller gets the error itself; the log only records the abort.
        tracing::info!(rank = self.rank, "aborting the communicator: {reason}");
        self.links.connector.close(reason);
        for c in self.links.lanes.iter_mut().flatten().flatten() {
            c.abort(reason);
        }
        // After the connections: a peer that sees we left finds the reason there.
        if let Some(t) = self.tiny.on() {
            t.leave();
        }
        self.aborted = Some(reason.to_string());
    }
}

impl Drop for Communicator {
    /// Writes the counters where `COLL_STATS` says (`{rank}` in the path is
    /// replaced by the rank; without it, `.rank<R>.json` is appended), and
    /// the trace where `COLL_TRACE` says (the same way).
    fn drop(&mut self) {
        if self.ids.agreements > 0 {
            crate::observe::status::retire(&self.recorder.board);
        }
        if let (Some(t), Some(path)) = (
            &self.recorder.timeline,
            crate::observe::timeline::path_for(self.rank),
        ) {
            let events = t.events(self.rank, self.size, |at| self.recorder.unix_us(at));
            if let Err(e) = crate::observe::timeline::write(&path, events) {
                tracing::warn!(rank = self.rank, "COLL_TRACE: could not write {path}: {e}");
            }
        }
        let Some(path) = std::env::var_os("COLL_STATS") else {
            return;
        };
        let path = path.to_string_lossy();
        let path = match path.contains("{rank}") {
            true => path.replace("{rank}", &self.rank.to_string()),
            false => format!("{path}.rank{}.json", self.rank),
        };
        let written = serde_json::to_string_pretty(&self.stats())
            .map_err(std::io::Error::other)
            .and_then(|text| std::fs::write(&path, text + "\n"));
        if let Err(e) = written {
            tracing::warn!(rank = self.rank, "COLL_STATS: could not write {path}: {e}");
        }
    }
}

/// A listener per transport, and the addresses to publish: theirs and the
/// status port's.
fn listen(
    available: &[Arc<dyn Transport>],
) -> std::result::Result<(Vec<Box<dyn Listener>>, mesh::Addresses), String> {
    let (listeners, addresses) = mesh::listen(available).map_err(|e| e.to_string())?;
    Ok((listeners, crate::observe::status::publish(addresses)))
}

/// The most shared memory one of `ranks_on_host` ranks with `config`
/// holds: a connection to every peer on the host if they connect through
/// shared memory (as an AllToAll makes them; each smaller when many ranks
/// share the host), and its flag path's segment.
pub fn shared_memory_per_rank(config: &Config, ranks_on_host: usize) -> u64 {
    let peers = ranks_on_host.saturating_sub(1);
    let connections = match config.transport_for(true, false) {
        Ok("shm") => transport::shm::connection_bytes(peers) * peers,
        _ => 0,
    };
    let flags = match config.tiny_bytes {
        0 => 0,
        max => crate::tiny::Tiny::segment_bytes(max),
    };
    (connections + flags) as u64
}

/// The ranks of `peers` grouped by host, in rank order.
fn group_by_host(peers: &[PeerInfo]) -> Vec<Vec<Rank>> {
    let mut hosts: Vec<(&str, Vec<Rank>)> = Vec::new();
    for p in peers {
        match hosts.iter_mut().find(|(id, _)| *id == p.host_id) {
            Some((_, ranks)) => ranks.push(p.rank),
            None => hosts.push((&p.host_id, vec![p.rank])),
        }
    }
    hosts.into_iter().map(|(_, ranks)| ranks).collect()
}

/// The rank number the environment claims, for errors before bootstrap.
fn env_rank() -> Rank {
    (bootstrap::RANK_VARS.iter())
        .find_map(|v| std::env::var(v).ok()?.parse().ok())
        .unwrap_or(0)
}
