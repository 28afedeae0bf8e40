//! The communicator: a rank's connections to every other rank of the job,
//! and the collective calls on them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use transport::{Connection, MemRegion, Poller, Rank, RegistrationCache, Transport};

use crate::algo::{self, Algorithm, Layout};
use crate::bootstrap::rendezvous::PeerInfo;
use crate::bootstrap::{self, host, Bootstrap};
use crate::descriptor::{Collective, OpDesc};
use crate::mesh;
use crate::schedule::{Exec, Region, Staging, Workspace};
use crate::tuning::{Profile, Setting};
use crate::{Config, DataType, Element, Error, ReduceOp, Result};

/// The caller's buffers for one call, as bytes.
pub enum Buffers<'a> {
    /// The result overwrites the input.
    InPlace(&'a mut [u8]),
    OutOfPlace {
        send: &'a [u8],
        recv: &'a mut [u8],
    },
}

impl<'a> Buffers<'a> {
    /// Out-of-place byte views of typed buffers.
    pub fn typed<T: Element>(send: &'a [T], recv: &'a mut [T]) -> Self {
        Buffers::OutOfPlace {
            send: bytemuck::cast_slice(send),
            recv: bytemuck::cast_slice_mut(recv),
        }
    }
}

/// One rank's view of a job: its peers, its connections, its settings.
/// Collective calls must be made by every rank, in the same order, with
/// matching counts, datatypes and reductions; a mismatch is reported, not
/// mis-reduced. After a failed call the communicator is aborted.
pub struct Communicator {
    rank: Rank,
    size: usize,
    peers: Vec<PeerInfo>,
    local_ranks: Vec<Rank>,
    /// The ranks of each host (see [`hosts`](Self::hosts)).
    hosts: Vec<Vec<Rank>>,
    /// Transports some connection uses; buffers are registered with each.
    transports: Vec<Arc<dyn Transport>>,
    /// How each rank is reached (`None` for ourselves).
    via: Vec<Option<&'static str>>,
    conns: Vec<Option<Box<dyn Connection>>>,
    staging: Staging,
    registrations: RegistrationCache,
    config: Config,
    seq: u32,
    aborted: Option<String>,
    /// (collective, algorithm) pairs whose choice has been logged.
    announced: Vec<(Collective, &'static str)>,
    /// An in-place call's input, copied aside for algorithms that need one.
    scratch: Vec<u64>,
    /// Where an out-of-place reduce-scatter reduces.
    reduce_scatter_buf: Vec<u64>,
    /// The executor's reusable memory.
    workspace: Workspace,
    /// Measured algorithm costs the selector consults: the profile's lines
    /// for this communicator's setting (may be none).
    profile: Profile,
    /// The selector's past choices by (collective, bytes), and why: calls
    /// repeat their sizes, and a choice costs microseconds.
    choices: Vec<(Collective, usize, &'static Algorithm, Arc<str>)>,
    /// How long an idle wait spins before yielding (zero when this host's
    /// ranks outnumber its cores).
    spin: Duration,
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
        let rank = boot.rank;
        let fail = |message: String| Error::Bootstrap { rank, message };
        config.validate().map_err(fail)?;
        let deadline = Instant::now() + config.timeout;
        let bind_ip = boot.local_ip();
        let available = mesh::available(bind_ip, &config);
        let (listeners, addresses) = mesh::listen(&available).map_err(|e| fail(e.to_string()))?;
        let (hostname, host_id) = host::identity();
        let me = PeerInfo {
            rank,
            hostname,
            host_id,
            pid: std::process::id(),
            addresses,
            settings: config.shared_settings(),
        };
        let table = bootstrap::meet(&boot, me, deadline).map_err(fail)?;
        let mesh =
            mesh::connect(&available, listeners, rank, &table, &config, deadline).map_err(fail)?;
        let used: Vec<&dyn Transport> = mesh.used.iter().map(|t| &**t).collect();
        let staging = Staging::new(&used, config.chunk_bytes, config.depth)
            .map_err(|e| fail(e.to_string()))?;
        let me = &table.peers[rank];
        let local_ranks: Vec<Rank> = table
            .peers
            .iter()
            .filter(|p| p.host_id == me.host_id)
            .map(|p| p.rank)
            .collect();
        let local_rank = local_ranks
            .iter()
            .position(|r| *r == rank)
            .expect("we are on our host");
        if boot.local_rank.is_some_and(|l| l != local_rank) {
            tracing::warn!(
                rank,
                "launcher says local rank {:?}, the rendezvous says {local_rank}",
                boot.local_rank
            );
        }
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        let spin = if local_ranks.len() > cores {
            Duration::ZERO
        } else {
            Poller::DEFAULT_SPIN
        };
        mesh::log_peers(rank, &table, &mesh.via);
        tracing::info!(
            rank,
            size = boot.size,
            source = boot.source,
            host = %me.hostname,
            local_ranks = ?local_ranks,
            transport = mesh::summary(&mesh.via),
            chunk = config.chunk_bytes,
            depth = config.depth,
            timeout_s = config.timeout.as_secs_f64(),
            "communicator ready"
        );
        let hosts = group_by_host(&table.peers);
        let mut comm = Communicator {
            profile: Profile::default(),
            choices: Vec::new(),
            rank,
            size: boot.size,
            hosts,
            peers: table.peers,
            local_ranks,
            transports: mesh.used,
            via: mesh.via,
            conns: mesh.conns,
            staging,
            registrations: RegistrationCache::new(),
            config,
            seq: 0,
            aborted: None,
            announced: Vec::new(),
            scratch: Vec::new(),
            reduce_scatter_buf: Vec::new(),
            workspace: Workspace::default(),
            spin,
        };
        // The profile's lines for this communicator's setting only.
        comm.profile = load_profile(rank).only(&comm.setting());
        Ok(comm)
    }

    pub fn rank(&self) -> Rank {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// Ranks on this rank's host, ascending (this rank included).
    pub fn local_ranks(&self) -> &[Rank] {
        &self.local_ranks
    }

    /// This rank's index among [`local_ranks`](Self::local_ranks).
    pub fn local_rank(&self) -> usize {
        self.local_ranks
            .iter()
            .position(|r| *r == self.rank)
            .unwrap()
    }

    /// Hostname of `rank`.
    pub fn hostname(&self, rank: Rank) -> &str {
        &self.peers[rank].hostname
    }

    /// The ranks grouped by host (ranks that share memory), in rank order.
    /// Hosts are told apart by hostname, boot id and network namespace, so
    /// namespaces posing as hosts on one machine count as separate hosts.
    pub fn hosts(&self) -> Vec<Vec<Rank>> {
        self.hosts.clone()
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The transports in use: `shm`, `tcp` or `shm+tcp`.
    pub fn transport_summary(&self) -> String {
        mesh::summary(&self.via)
    }

    /// The transport that reaches `rank` (`None` for this rank itself).
    pub fn transport_to(&self, rank: Rank) -> Option<&'static str> {
        self.via[rank]
    }

    /// The algorithm a call of `collective` on `bytes` per rank would use.
    pub fn algorithm(&self, collective: Collective, bytes: usize) -> Result<&'static Algorithm> {
        self.choose(collective, bytes).map(|(a, _)| a)
    }

    /// Forces `collective`'s algorithm from now on (`None`: the selector
    /// chooses again), as `COLL_ALGO` does. Every rank must do the same.
    pub fn force_algo(&mut self, collective: Collective, name: Option<&str>) {
        let c = collective.name();
        self.choices.clear();
        self.config.algo.retain(|(k, _)| k != c);
        if let Some(name) = name {
            self.config.algo.push((c.to_string(), name.to_lowercase()));
        }
    }

    /// What the selector's cost model is keyed by for this communicator.
    pub fn setting(&self) -> Setting {
        Setting {
            ranks: self.size,
            per_host: self.hosts.iter().map(Vec::len).max().unwrap_or(1),
            transport: self.transport_summary(),
        }
    }

    /// [`choose`](Self::choose), remembered.
    fn choose_cached(
        &mut self,
        collective: Collective,
        bytes: usize,
    ) -> Result<(&'static Algorithm, Arc<str>)> {
        let seen = self
            .choices
            .iter()
            .find(|c| c.0 == collective && c.1 == bytes);
        if let Some((_, _, algo, why)) = seen {
            return Ok((algo, Arc::clone(why)));
        }
        let (algo, why) = self.choose(collective, bytes)?;
        if self.choices.len() == 256 {
            self.choices.clear();
        }
        let why: Arc<str> = why.into();
        self.choices
            .push((collective, bytes, algo, Arc::clone(&why)));
        Ok((algo, why))
    }

    /// The algorithm for a call, and why: forced by configuration, predicted
    /// fastest by the measured profile, or the built-in thresholds' pick.
    fn choose(&self, collective: Collective, bytes: usize) -> Result<(&'static Algorithm, String)> {
        if let Some(name) = self.config.forced_algo(collective) {
            return algo::find(collective, name)
                .map(|a| (a, "forced by COLL_ALGO or --algo".to_string()))
                .ok_or_else(|| Error::InvalidArgument {
                    rank: self.rank,
                    message: format!(
                        "no {collective} algorithm named '{name}' (available: {})",
                        algo::names(collective).join(", ")
                    ),
                });
        }
        let (built_in, why) = algo::select(collective, bytes, self.size, &self.hosts);
        let setting = self.setting();
        let Some((best, us)) = self.profile.best(collective, &setting, bytes) else {
            return Ok((built_in, why.to_string()));
        };
        // The profile overrides the built-in choice only for a predicted gain
        // above measurement noise (one tuning run on a busy host is not exact).
        let built_in_us = self
            .profile
            .predict(collective, built_in.name, &setting, bytes)
            .unwrap_or(f64::INFINITY);
        match algo::find(collective, &best.algo) {
            Some(a) if us * PROFILE_MARGIN < built_in_us => Ok((
                a,
                format!(
                    "fastest in the measured profile: {us:.1} us predicted at {bytes} B, {} {built_in_us:.1} us",
                    built_in.name
                ),
            )),
            _ => Ok((
                built_in,
                format!("{why} (the measured profile agrees within {:.0}%)", (PROFILE_MARGIN - 1.0) * 100.0),
            )),
        }
    }

    /// `recv[i] = op over ranks of send[i]`, on every rank.
    pub fn all_reduce<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let bufs = Buffers::typed(send, recv);
        self.all_reduce_bytes(bufs, T::DTYPE, op)
    }

    /// `buf[i] = op over ranks of buf[i]`, on every rank.
    pub fn all_reduce_in_place<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce_bytes(
            Buffers::InPlace(bytemuck::cast_slice_mut(buf)),
            T::DTYPE,
            op,
        )
    }

    /// AllReduce on byte buffers holding `dtype` elements.
    pub fn all_reduce_bytes(
        &mut self,
        bufs: Buffers<'_>,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        self.run(Collective::AllReduce, bufs, dtype, Some(op), None)
    }

    /// Block `j` of `send` goes to rank `j`; block `j` of `recv` comes from
    /// rank `j`. Lengths must be equal and divisible by the rank count.
    pub fn all_to_all<T: Element>(&mut self, send: &[T], recv: &mut [T]) -> Result<()> {
        let bufs = Buffers::typed(send, recv);
        self.all_to_all_bytes(bufs, T::DTYPE)
    }

    /// AllToAll where the received blocks replace the sent ones.
    pub fn all_to_all_in_place<T: Element>(&mut self, buf: &mut [T]) -> Result<()> {
        self.all_to_all_bytes(Buffers::InPlace(bytemuck::cast_slice_mut(buf)), T::DTYPE)
    }

    /// AllToAll on byte buffers holding `dtype` elements.
    pub fn all_to_all_bytes(&mut self, bufs: Buffers<'_>, dtype: DataType) -> Result<()> {
        self.run(Collective::AllToAll, bufs, dtype, None, None)
    }

    /// `recv = block rank of (op over ranks of send)`, where `send` holds
    /// one block of `recv.len()` elements per rank.
    pub fn reduce_scatter<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let bufs = Buffers::typed(send, recv);
        self.run(Collective::ReduceScatter, bufs, T::DTYPE, Some(op), None)
    }

    /// Reduce-scatter whose result lands in block `rank` of `buf` (NCCL's
    /// in-place convention: `recvbuff == sendbuff + rank * recvcount`); the
    /// other blocks are left with partial results.
    pub fn reduce_scatter_in_place<T: Element>(
        &mut self,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let bufs = Buffers::InPlace(bytemuck::cast_slice_mut(buf));
        self.run(Collective::ReduceScatter, bufs, T::DTYPE, Some(op), None)
    }

    /// Block `j` of `recv` (each `send.len()` elements) is rank `j`'s `send`.
    pub fn all_gather<T: Element>(&mut self, send: &[T], recv: &mut [T]) -> Result<()> {
        let bufs = Buffers::typed(send, recv);
        self.run(Collective::AllGather, bufs, T::DTYPE, None, None)
    }

    /// All-gather where each rank's contribution is already block `rank` of `buf`.
    pub fn all_gather_in_place<T: Element>(&mut self, buf: &mut [T]) -> Result<()> {
        let bufs = Buffers::InPlace(bytemuck::cast_slice_mut(buf));
        self.run(Collective::AllGather, bufs, T::DTYPE, None, None)
    }

    /// Every rank's `buf` becomes rank `root`'s.
    pub fn broadcast<T: Element>(&mut self, buf: &mut [T], root: Rank) -> Result<()> {
        let bufs = Buffers::InPlace(bytemuck::cast_slice_mut(buf));
        self.run(Collective::Broadcast, bufs, T::DTYPE, None, Some(root))
    }

    /// `recv[i] = op over ranks of send[i]` on rank `root`. Every rank passes
    /// a `recv` of the same length: on the others it is used as workspace and
    /// holds partial results afterwards.
    pub fn reduce<T: Element>(
        &mut self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
        root: Rank,
    ) -> Result<()> {
        let bufs = Buffers::typed(send, recv);
        self.run(Collective::Reduce, bufs, T::DTYPE, Some(op), Some(root))
    }

    /// Reduce where `buf` is both input and, on `root`, result.
    pub fn reduce_in_place<T: Element>(
        &mut self,
        buf: &mut [T],
        op: ReduceOp,
        root: Rank,
    ) -> Result<()> {
        let bufs = Buffers::InPlace(bytemuck::cast_slice_mut(buf));
        self.run(Collective::Reduce, bufs, T::DTYPE, Some(op), Some(root))
    }

    /// Returns once every rank has entered the barrier.
    pub fn barrier(&mut self) -> Result<()> {
        self.run(
            Collective::Barrier,
            Buffers::InPlace(&mut []),
            DataType::U8,
            None,
            None,
        )
    }

    /// Keeps `buf` registered with the transport until
    /// [`deregister`](Self::deregister), so calls on it skip registration
    /// (which costs a page pinning per call over verbs).
    pub fn register<T: Element>(&mut self, buf: &[T]) -> Result<()> {
        let bytes: &[u8] = bytemuck::cast_slice(buf);
        let transports: Vec<&dyn Transport> = self.transports.iter().map(|t| &**t).collect();
        self.registrations
            .get_or_register(transports.iter().copied(), bytes.as_ptr(), bytes.len())
            .map(drop)
            .map_err(|e| Error::InvalidArgument {
                rank: self.rank,
                message: e.to_string(),
            })
    }

    /// Forgets a registration made by [`register`](Self::register).
    pub fn deregister<T: Element>(&mut self, buf: &[T]) {
        let bytes: &[u8] = bytemuck::cast_slice(buf);
        self.registrations.evict(bytes.as_ptr(), bytes.len());
    }

    /// Any collective on byte buffers: `op` for those that reduce, `root`
    /// for broadcast and reduce (see the typed calls for each one's buffers).
    pub fn collective_bytes(
        &mut self,
        collective: Collective,
        bufs: Buffers<'_>,
        dtype: DataType,
        op: Option<ReduceOp>,
        root: Option<Rank>,
    ) -> Result<()> {
        self.run(collective, bufs, dtype, op, root)
    }

    /// Validates, builds the algorithm's schedule and runs it. Any failure
    /// aborts the communicator and tells the peers why.
    fn run(
        &mut self,
        collective: Collective,
        bufs: Buffers<'_>,
        dtype: DataType,
        op: Option<ReduceOp>,
        root: Option<Rank>,
    ) -> Result<()> {
        if let Some(reason) = &self.aborted {
            return Err(Error::Aborted {
                rank: self.rank,
                reason: reason.clone(),
            });
        }
        let (input, output) = match bufs {
            Buffers::InPlace(b) => (None, b),
            Buffers::OutOfPlace { send, recv } => (Some(send), recv),
        };
        let larger = input.map_or(0, <[u8]>::len).max(output.len());
        let desc = OpDesc {
            collective,
            dtype,
            op,
            count: (larger / dtype.size()) as u64,
            root: root.map(|r| u16::try_from(r).unwrap_or(u16::MAX)),
            seq: self.seq,
        };
        self.seq = self.seq.wrapping_add(1);
        let result = self.check_args(&desc, input, output).and_then(|()| {
            // Nothing to move (as in NCCL and MPI); barriers always run.
            if desc.count == 0 && collective != Collective::Barrier {
                return Ok(());
            }
            let (algo, why) = self.choose_cached(collective, larger)?;
            self.announce(collective, algo, &why);
            self.execute_into(desc, algo, input, output)
        });
        if let Err(e) = &result {
            self.abort(&root_cause(e));
        }
        result
    }

    /// Runs the call; a reduce-scatter out of place reduces in a whole-size
    /// buffer of ours (the ring passes every block through each rank) and
    /// hands over this rank's block at the end.
    fn execute_into(
        &mut self,
        desc: OpDesc,
        algo: &Algorithm,
        input: Option<&[u8]>,
        output: &mut [u8],
    ) -> Result<()> {
        let Some(send) = input.filter(|_| desc.collective == Collective::ReduceScatter) else {
            return self.execute(desc, algo, input, output);
        };
        let mut whole = std::mem::take(&mut self.reduce_scatter_buf);
        whole.resize(whole.len().max(send.len().div_ceil(8)), 0);
        let bytes = &mut bytemuck::cast_slice_mut(&mut whole)[..send.len()];
        let result = self.execute(desc, algo, Some(send), bytes);
        let mine = self.rank * output.len();
        output.copy_from_slice(&bytes[mine..mine + output.len()]);
        self.reduce_scatter_buf = whole;
        result
    }

    fn check_args(&self, desc: &OpDesc, input: Option<&[u8]>, output: &[u8]) -> Result<()> {
        let bad = |message: String| {
            Err(Error::InvalidArgument {
                rank: self.rank,
                message,
            })
        };
        let (collective, dtype, n) = (desc.collective, desc.dtype, self.size);
        if collective.reduces() != desc.op.is_some() {
            return bad(format!(
                "{collective}: a reduction op is {}",
                match desc.op {
                    Some(_) => "not used here",
                    None => "needed",
                }
            ));
        }
        match desc.root {
            Some(_) if !collective.rooted() => return bad(format!("{collective} has no root")),
            Some(root) if root as usize >= n => {
                return bad(format!(
                    "{collective}: root {root} is not a rank of the {n}"
                ))
            }
            None if collective.rooted() => return bad(format!("{collective} needs a root")),
            _ => {}
        }
        let elem = dtype.size();
        // The one buffer of an in-place call, or the send buffer's length
        // relative to the receive buffer's.
        let (smaller, factor) = match collective {
            Collective::ReduceScatter => (input.map(|_| output.len()), n),
            Collective::AllGather => (input.map(<[u8]>::len), n),
            _ => (input.map(<[u8]>::len), 1),
        };
        let larger = input.map_or(output.len(), |i| i.len().max(output.len()));
        if let (Some(input), Some(smaller)) = (input, smaller) {
            if smaller * factor != larger || input.len().min(output.len()) != smaller {
                let rule = match factor {
                    1 => "equal".to_string(),
                    _ => format!("the larger {n} times the smaller (one block per rank)"),
                };
                return bad(format!(
                    "{collective}: send buffer has {} bytes, receive buffer {}; they must be {rule}",
                    input.len(),
                    output.len()
                ));
            }
        }
        if larger % elem != 0 {
            return bad(format!(
                "{collective}: {larger} bytes is not a whole number of {dtype} elements"
            ));
        }
        if desc.count > OpDesc::MAX_COUNT {
            return bad(format!("{collective}: {} elements is too many", desc.count));
        }
        for b in input.into_iter().chain([output]) {
            if b.as_ptr() as usize % elem != 0 {
                return bad(format!(
                    "{collective}: buffer at {:p} is not aligned for {dtype}",
                    b.as_ptr()
                ));
            }
        }
        let blocks = matches!(
            collective,
            Collective::AllToAll | Collective::ReduceScatter | Collective::AllGather
        );
        if blocks && (larger / elem) % n != 0 {
            return bad(format!(
                "{collective}: count {} is not divisible by the {n} ranks (one block per rank)",
                larger / elem,
            ));
        }
        Ok(())
    }

    fn execute(
        &mut self,
        desc: OpDesc,
        algo: &Algorithm,
        input: Option<&[u8]>,
        output: &mut [u8],
    ) -> Result<()> {
        let elem = desc.dtype.size();
        // An algorithm that cannot run in place gets a copy of the input.
        let mut scratch = std::mem::take(&mut self.scratch);
        let input = match input {
            None if !algo.in_place => {
                scratch.resize(scratch.len().max(output.len().div_ceil(8)), 0);
                let copy = &mut bytemuck::cast_slice_mut(&mut scratch)[..output.len()];
                copy.copy_from_slice(output);
                Some(&*copy)
            }
            other => other,
        };
        let layout = Layout {
            rank: self.rank,
            size: self.size,
            count: desc.count as usize,
            elem,
            chunk: (self.staging.slot_bytes.min(self.config.chunk_bytes) / elem).max(1) * elem,
            in_place: input.is_none(),
            root: desc.root.map_or(0, usize::from),
            hosts: &self.hosts,
        };
        let mut ws = std::mem::take(&mut self.workspace);
        ws.sched.clear();
        (algo.build)(&layout, &mut ws.sched);
        tracing::debug!(rank = self.rank, op = %desc, algo = algo.name, chunk = layout.chunk, ops = ws.sched.len(), "start");
        let rank = self.rank;
        let transports = &self.transports;
        let region = |ptr: *mut u8, len: usize| -> Result<Region> {
            let mr: MemRegion = match self.registrations.lookup(ptr, len) {
                Some(mr) => mr,
                None => transport::register_all(transports.iter().map(|t| &**t), ptr, len)
                    .map_err(|e| Error::collective(rank, desc, e))?,
            };
            Ok(Region { ptr, len, mr })
        };
        let input = match input {
            Some(b) => Some(region(b.as_ptr().cast_mut(), b.len())?),
            None => None,
        };
        let output = region(output.as_mut_ptr(), output.len())?;
        let exec = Exec {
            peers: &mut self.conns,
            input,
            output,
            staging: &mut self.staging,
            dtype: desc.dtype,
            op: desc.op.unwrap_or(ReduceOp::Sum),
            nranks: self.size,
            tag: desc.tag(),
            timeout: self.config.timeout,
            depth: self.config.depth,
            spin: self.spin,
        };
        let result = exec
            .run(&mut ws)
            .map_err(|e| Error::collective(rank, desc, e));
        self.scratch = scratch;
        self.workspace = ws;
        result
    }

    /// Logs, the first time an algorithm runs a collective, why it was chosen.
    fn announce(&mut self, collective: Collective, algo: &'static Algorithm, why: &str) {
        if self.announced.contains(&(collective, algo.name)) {
            return;
        }
        self.announced.push((collective, algo.name));
        tracing::info!(
            rank = self.rank,
            chunk = self.config.chunk_bytes,
            depth = self.config.depth,
            "{collective}: algorithm {}, {why}",
            algo.name
        );
    }

    /// Gives up on every connection, telling each peer `reason`.
    fn abort(&mut self, reason: &str) {
        // The caller gets the error itself; the log only records the abort.
        tracing::info!(rank = self.rank, "aborting the communicator: {reason}");
        for c in self.conns.iter_mut().flatten() {
            c.abort(reason);
        }
        self.aborted = Some(reason.to_string());
    }
}

/// What to tell the peers when `e` aborts us: a peer's own abort reason is
/// passed on as it came, so every rank names the first failure, one level deep.
fn root_cause(e: &Error) -> String {
    match e {
        Error::Collective {
            source: transport::Error::PeerAborted { reason, .. },
            ..
        } => reason.clone(),
        e => e.to_string(),
    }
}

/// How much faster the profile must predict another algorithm to be than the
/// built-in choice to take its place.
const PROFILE_MARGIN: f64 = 1.10;

/// The selector's profile; a broken one is reported and left out (a
/// missing or stale profile only costs speed).
fn load_profile(rank: Rank) -> Profile {
    match Profile::from_env() {
        Ok(p) => {
            if let Some(src) = &p.source {
                tracing::info!(
                    rank,
                    entries = p.entries.len(),
                    "selector profile {}",
                    src.display()
                );
            }
            p
        }
        Err(e) => {
            tracing::warn!(rank, "{e}; the selector uses its built-in thresholds");
            Profile::default()
        }
    }
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
    ["RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse().ok())
        .unwrap_or(0)
}
