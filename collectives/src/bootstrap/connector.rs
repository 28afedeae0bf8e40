//! Connections made when a call first needs them (NCCL's runtime connect):
//! a ring job holds two peers' connections, not every rank's.
//!
//! Of each pair of ranks the higher one dials, once per lane. The lower one
//! never dials a data connection: when it needs one that has not come, it
//! asks the higher one to dial ("dial me", a short TCP hello with
//! [`REQUEST`] in its channel) and waits. With one dialler per pair no pair
//! ever ends up with two connections for one lane, whatever the timing.
//!
//! Every rank accepts in the background (a thread per listener), whatever
//! its caller is doing: a rank blocked in one call never keeps a peer from
//! connecting for another. That thread also dials when asked to.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use transport::{Connection, Hello, Listener, Rank, Transport};

use crate::bootstrap::rendezvous::{self, Table};

/// The bit of a hello's channel that makes it a request to dial back on
/// the lane in the other bits.
pub(crate) const REQUEST: u8 = 0x80;

/// How long a lower rank waits for the higher one to dial by itself (it
/// does, when it reaches the same call) before asking it to.
const GRACE: Duration = Duration::from_millis(50);

/// How often the accepting threads look whether they are still wanted.
const POLL: Duration = Duration::from_millis(500);

/// How often a rank that asked a peer to dial looks whether it refused.
const ASKED_POLL: Duration = Duration::from_millis(10);

/// How long after a peer closed our request its connection may take to
/// show (it dials, then closes); then it is a peer that left.
const LEFT_AFTER: Duration = Duration::from_secs(1);

/// A request made to a peer to dial back, and since when it is closed.
type Request = (Box<dyn Connection>, Option<Instant>);

/// A connection's place: the peer and the lane.
type Key = (Rank, u8);

/// How this rank reaches one peer.
pub(crate) struct Route {
    pub transport: Arc<dyn Transport>,
    /// The peer's address for that transport.
    pub address: Vec<u8>,
    /// The peer's TCP address, where requests go.
    pub request_to: Vec<u8>,
}

/// Connections to peers, made on demand. Its accepting threads hold it
/// weakly: dropped, they end within [`POLL`] (and close their listeners).
pub(crate) struct Connector {
    shared: Arc<Shared>,
    /// Connections handed out so far, and the seconds spent on them.
    pub made: usize,
    pub seconds: f64,
}

struct Shared {
    rank: Rank,
    token: u128,
    /// By peer (`None` for ourselves).
    routes: Vec<Option<Route>>,
    /// TCP, for requests.
    tcp: Arc<dyn Transport>,
    /// How long a dial may take.
    patience: Duration,
    state: Mutex<Slots>,
    arrived: Condvar,
}

#[derive(Default)]
struct Slots {
    /// Made, not yet handed out.
    ready: BTreeMap<Key, Box<dyn Connection>>,
    /// Being dialled (by the caller or by an accepting thread).
    dialing: BTreeSet<Key>,
    /// Handed out: a second connection for these is refused.
    taken: BTreeSet<Key>,
    /// A dial that failed, and why.
    failed: BTreeMap<Key, transport::Error>,
    /// Set when the communicator aborts: what arrives later is aborted with it.
    closed: Option<String>,
}

impl Connector {
    /// Starts accepting on `listeners`; `routes` says how to reach each peer.
    pub(crate) fn new(
        rank: Rank,
        table: &Table,
        routes: Vec<Option<Route>>,
        tcp: Arc<dyn Transport>,
        listeners: Vec<Box<dyn Listener>>,
        patience: Duration,
    ) -> Self {
        let shared = Arc::new(Shared {
            rank,
            token: table.session,
            routes,
            tcp,
            patience,
            state: Mutex::new(Slots::default()),
            arrived: Condvar::new(),
        });
        for l in listeners {
            let weak = Arc::downgrade(&shared);
            std::thread::Builder::new()
                .name(format!("coll-accept-{rank}"))
                .spawn(move || accept_loop(weak, l))
                .expect("spawn an accepting thread");
        }
        Connector {
            shared,
            made: 0,
            seconds: 0.0,
        }
    }

    /// Connections on `lane` to each of `peers`, made or awaited until
    /// `deadline`. Errors name the peer.
    pub(crate) fn connect(
        &mut self,
        peers: &[Rank],
        lane: u8,
        deadline: Instant,
    ) -> transport::Result<Vec<(Rank, Box<dyn Connection>)>> {
        let s = &self.shared;
        let started = Instant::now();
        for &p in peers.iter().filter(|&&p| p < s.rank) {
            // A failure lands in the slots, where the wait below finds it.
            let _ = s.dial((p, lane));
        }
        let grace = Instant::now() + GRACE;
        let mut asked: Option<Vec<Request>> = None;
        let mut slots = s.lock();
        let got = loop {
            let missing: Vec<Rank> = (peers.iter().copied())
                .filter(|&p| !slots.ready.contains_key(&(p, lane)))
                .collect();
            if let Some(e) = missing
                .iter()
                .find_map(|&p| slots.failed.remove(&(p, lane)))
            {
                return Err(e);
            }
            if missing.is_empty() {
                break peers
                    .iter()
                    .map(|&p| (p, slots.ready.remove(&(p, lane)).unwrap()))
                    .collect();
            }
            let now = Instant::now();
            if now >= deadline {
                let others = match missing.len() {
                    1 => String::new(),
                    n => format!("; {} other rank(s) did not either", n - 1),
                };
                return Err(transport::Error::Timeout {
                    peer: missing[0],
                    waited: now - started,
                    waiting_for: format!("it to connect on lane {lane}{others}"),
                });
            }
            match &mut asked {
                None if now >= grace => {
                    drop(slots);
                    let to = missing.iter().filter(|&&p| p > s.rank);
                    let ask = |&p| Ok((s.ask(p, lane, deadline)?, None));
                    asked = Some(to.map(ask).collect::<transport::Result<_>>()?);
                    slots = s.lock();
                    continue;
                }
                None => slots = s.arrived.wait_timeout(slots, grace - now).unwrap().0,
                // A peer closes our request once it dialled back, at once
                // if it left, or aborts it saying why it cannot.
                Some(requests) => {
                    for (r, closed) in requests.iter_mut() {
                        match r.progress() {
                            Err(transport::Error::Closed { peer }) => {
                                let since = *closed.get_or_insert(now);
                                if now - since > LEFT_AFTER && missing.contains(&peer) {
                                    return Err(transport::Error::Closed { peer });
                                }
                            }
                            Err(e) => return Err(e),
                            Ok(_) => {}
                        }
                    }
                    let until = deadline.min(now + ASKED_POLL);
                    slots = s.arrived.wait_timeout(slots, until - now).unwrap().0;
                }
            }
        };
        for &p in peers {
            slots.taken.insert((p, lane));
        }
        self.made += peers.len();
        self.seconds += started.elapsed().as_secs_f64();
        Ok(got)
    }

    /// The communicator aborted: connections made or arriving from now on
    /// are aborted with `reason`, so a peer that dials finds it.
    pub(crate) fn close(&self, reason: &str) {
        let mut slots = self.shared.lock();
        slots.closed = Some(reason.to_string());
        for c in slots.ready.values_mut() {
            c.abort(reason);
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Slots> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Dials `key` unless it is made, being made or handed out; the result
    /// lands in the slots either way, and a failure is returned too.
    fn dial(&self, key: Key) -> Result<(), String> {
        let (peer, lane) = key;
        {
            let mut slots = self.lock();
            if slots.ready.contains_key(&key)
                || slots.dialing.contains(&key)
                || slots.taken.contains(&key)
            {
                return Ok(());
            }
            slots.dialing.insert(key);
        }
        let result = match &self.routes[peer] {
            Some(route) => {
                let hello = Hello {
                    token: self.token,
                    from: self.rank,
                    to: peer,
                    channel: lane,
                };
                let deadline = Instant::now() + self.patience;
                route.transport.connect(&route.address, hello, deadline)
            }
            None => Err(no_route(peer)),
        };
        let mut slots = self.lock();
        slots.dialing.remove(&key);
        match result {
            Ok(c) => {
                self.land(slots, key, c);
                Ok(())
            }
            Err(e) => {
                let why = e.to_string();
                slots.failed.insert(key, e);
                self.arrived.notify_all();
                Err(why)
            }
        }
    }

    /// A connection made, by us or by the peer: ready for the caller (or
    /// aborted at once if the communicator was).
    fn land(&self, mut slots: MutexGuard<'_, Slots>, key: Key, mut c: Box<dyn Connection>) {
        if let Some(reason) = &slots.closed {
            c.abort(reason);
        }
        slots.ready.insert(key, c);
        self.arrived.notify_all();
    }

    /// Asks the higher rank `peer` to dial us on `lane`. The request's
    /// connection is kept: a peer that cannot dial back aborts it, saying why.
    fn ask(
        &self,
        peer: Rank,
        lane: u8,
        deadline: Instant,
    ) -> transport::Result<Box<dyn Connection>> {
        let route = self.routes[peer].as_ref().ok_or_else(|| no_route(peer))?;
        let hello = Hello {
            token: self.token,
            from: self.rank,
            to: peer,
            channel: REQUEST | lane,
        };
        tracing::debug!(rank = self.rank, peer, lane, "asking a peer to connect");
        let mut c = self.tcp.connect(&route.request_to, hello, deadline)?;
        // A receive of nothing, so that progress reads a refusal's reason.
        let nothing = transport::MemRegion::plain(std::ptr::NonNull::dangling().as_ptr(), 0);
        // SAFETY: zero bytes: nothing is ever written through it.
        unsafe { c.irecv(&nothing, 0, 0, 0) }?;
        Ok(c)
    }

    /// What an accepting thread does with a connection from `hello.from`.
    fn arrive(&self, hello: Hello, c: Box<dyn Connection>) {
        let (peer, channel) = (hello.from, hello.channel);
        if channel & REQUEST != 0 && peer < self.rank {
            // Dropped once the dial is made (the asker polls it meanwhile);
            // a dial that failed is refused with its reason.
            let mut request = c;
            if let Err(why) = self.dial((peer, channel & !REQUEST)) {
                request.abort(&format!("rank {} could not connect back: {why}", self.rank));
            }
            return;
        }
        if channel & REQUEST != 0 || peer < self.rank {
            return tracing::warn!(
                rank = self.rank,
                "refused a connection from rank {peer}: the higher rank of a pair dials"
            );
        }
        let key = (peer, channel);
        let slots = self.lock();
        if slots.ready.contains_key(&key) || slots.taken.contains(&key) {
            return tracing::warn!(
                rank = self.rank,
                "refused a second connection from rank {peer} on lane {channel}"
            );
        }
        self.land(slots, key, c);
    }
}

fn no_route(peer: Rank) -> transport::Error {
    transport::Error::Invalid(format!("no way to reach rank {peer} (it is this rank?)"))
}

/// Accepts until the connector is dropped.
fn accept_loop(shared: Weak<Shared>, mut listener: Box<dyn Listener>) {
    loop {
        let Some((rank, token)) = shared.upgrade().map(|s| (s.rank, s.token)) else {
            return;
        };
        let deadline = Instant::now() + POLL;
        match listener.accept(token, rank, deadline) {
            Ok((hello, c)) => match shared.upgrade() {
                Some(s) => s.arrive(hello, c),
                // Closed without a word: the peer sees one that left.
                None => return drop(c),
            },
            // A failure before the deadline (out of descriptors, say):
            // not a reason to spin.
            Err(e) if Instant::now() < deadline => {
                tracing::debug!(rank, "accepting: {e}");
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(_) => {}
        }
    }
}

/// How this rank reaches each peer: the transport `plan` names and the
/// peer's published addresses.
pub(crate) fn routes(
    available: &[Arc<dyn Transport>],
    plan: &[Option<usize>],
    table: &Table,
) -> Result<Vec<Option<Route>>, String> {
    let address = |peer: Rank, name: &str| {
        (table.peers[peer].addresses.get(name))
            .and_then(|h| rendezvous::from_hex(h))
            .ok_or_else(|| format!("rank {peer} published no {name} address"))
    };
    plan.iter()
        .enumerate()
        .map(|(peer, t)| {
            let Some(t) = *t else { return Ok(None) };
            Ok(Some(Route {
                transport: available[t].clone(),
                address: address(peer, available[t].name())?,
                request_to: address(peer, "tcp")?,
            }))
        })
        .collect()
}
