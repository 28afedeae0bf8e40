//! Where is every rank, asked when a call times out: the rank that timed
//! out asks the others, then reports the root cause ("rank 1 never entered
//! allreduce #57 ...", "rank 2 is stopped or unreachable ...") instead of
//! the symptom (the peer it happened to wait on, maybe itself stuck behind
//! the culprit).
//!
//! Each process answers on a TCP port of its own, from a thread of its own
//! (`listen`), so a rank that is computing or blocked in another call
//! still answers; a stopped or hung process cannot, and that is the answer.
//! The port is published at the rendezvous next to the transports'
//! addresses; a question names the communicator by an id derived from its
//! session token (`status_id`; the token itself never goes on the wire), so
//! only members, or whoever saw one of their questions, can ask.
//!
//! Each communicator keeps its position on a `Board`: the newest
//! collective it started and its phase (a few plain stores per call), and
//! what its oldest running call waits on (written only when the rank sleeps).
//! [`verdict`] turns everyone's position into one sentence; `collbench
//! trace` uses it on flight records too.

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use transport::{Rank, Tag};

use crate::call::descriptor::{CallDesc, Collective};
use crate::observe::waiting::Waiting;

/// How long a rank waits for the others' answers.
pub const ANSWER_WITHIN: Duration = Duration::from_secs(2);
/// Questions asked at once (a thread each).
pub(crate) const AT_ONCE: usize = 64;
/// What a question asks: where the rank is, or its state in an agreement
/// ([`crate::fault::agree`]).
pub(crate) const POSITION: &[u8; 4] = b"CSTQ";
pub(crate) const AGREEMENT: &[u8; 4] = b"CSTA";
/// A question: its kind, a communicator's id, an agreement number.
const QUESTION_LEN: usize = 24;

/// A communicator's position, written by its owner, read by the responder.
/// A sequence lock: the owner makes `version` odd while it writes.
#[derive(Default)]
pub(crate) struct Board {
    version: AtomicU64,
    /// The newest collective started: its tag and phase (0: none yet).
    tag: [AtomicU64; 2],
    phase: AtomicU64,
    /// What the oldest running call waited on when its rank last slept:
    /// that call's tag, peer + 1 (0: nothing), whether it sends, message k of n.
    wait_tag: [AtomicU64; 2],
    wait_peer: AtomicU64,
    wait_message: AtomicU64,
    /// Agreements on failed ranks (off the hot path: a lock).
    agreement: Mutex<crate::observe::ballot::Ballot>,
    /// The communicator is gone (its agreements are still answered).
    left: std::sync::atomic::AtomicBool,
}

const PHASES: [&str; 5] = ["none", "queued", "running", "done", "failed"];

impl Board {
    fn write(&self, f: impl FnOnce(&Self)) {
        let v = self.version.load(Ordering::Relaxed);
        self.version.store(v + 1, Ordering::Relaxed);
        fence(Ordering::Release);
        f(self);
        self.version.store(v + 2, Ordering::Release);
    }

    /// A collective started (phase 1), began running (2), or ended (3 done,
    /// 4 failed). The board shows the running collective (they run in
    /// order), else the newest: a call queued behind one in flight waits.
    pub fn call(&self, desc: &CallDesc, phase: u64) {
        // Point-to-point calls (every message of a pipeline) touch nothing;
        // only a start reads the board (the owner is its only writer).
        if desc.collective == Collective::PointToPoint {
            return;
        }
        if phase == 1 && matches!(self.phase.load(Ordering::Relaxed), 1 | 2) {
            return;
        }
        let tag = desc.tag();
        self.write(|b| {
            b.tag[0].store(tag as u64, Ordering::Relaxed);
            b.tag[1].store((tag >> 64) as u64, Ordering::Relaxed);
            b.phase.store(phase, Ordering::Relaxed);
        });
    }

    /// The oldest running call (`tag`, with `peer` for point-to-point)
    /// waits for `w`.
    pub fn waiting(&self, tag: Tag, w: &Waiting) {
        self.write(|b| {
            b.wait_tag[0].store(tag as u64, Ordering::Relaxed);
            b.wait_tag[1].store((tag >> 64) as u64, Ordering::Relaxed);
            b.wait_peer.store(
                (w.peer as u64 + 1) | (w.send as u64) << 63,
                Ordering::Relaxed,
            );
            b.wait_message
                .store((w.index as u64) << 32 | w.of as u64, Ordering::Relaxed);
        });
    }

    /// Updates the agreement state.
    pub fn agreement(&self, f: impl FnOnce(&mut crate::observe::ballot::Ballot)) {
        f(&mut self.agreement.lock().unwrap_or_else(|e| e.into_inner()));
    }

    /// A consistent copy, as the answer to a question.
    pub fn position(&self) -> Position {
        loop {
            let v = self.version.load(Ordering::Acquire);
            if v % 2 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let load = |a: &[AtomicU64; 2]| {
                a[0].load(Ordering::Relaxed) as u128 | (a[1].load(Ordering::Relaxed) as u128) << 64
            };
            let (tag, phase) = (load(&self.tag), self.phase.load(Ordering::Relaxed));
            let wait_tag = load(&self.wait_tag);
            let peer = self.wait_peer.load(Ordering::Relaxed);
            let message = self.wait_message.load(Ordering::Relaxed);
            fence(Ordering::Acquire);
            if self.version.load(Ordering::Relaxed) == v {
                return Position::from_board(tag, phase, wait_tag, peer, message);
            }
        }
    }
}

/// Where a rank is: its newest collective and what it waits on.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Position {
    /// As errors print it, `allreduce #57 (1024 x f32, sum)`; `None`: no
    /// collective yet.
    pub call: Option<String>,
    pub seq: u32,
    /// queued, running, done, failed; "left" when the rank no longer has
    /// the communicator.
    pub state: String,
    /// The rank its oldest running call waits on, and for what.
    pub waiting_on: Option<Rank>,
    pub waiting_for: Option<String>,
}

impl Position {
    fn from_board(tag: Tag, phase: u64, wait_tag: Tag, peer: u64, message: u64) -> Self {
        let desc = CallDesc::from_tag(tag).filter(|_| phase != 0);
        let waiting = (peer & !(1 << 63) != 0)
            .then(|| CallDesc::from_tag(wait_tag))
            .flatten();
        let (index, of) = (message >> 32, message & 0xffff_ffff);
        let peer_rank = (peer & !(1 << 63)).saturating_sub(1) as Rank;
        let what = if peer >> 63 == 1 { "send" } else { "receive" };
        // A wait recorded for an earlier call is stale once a later one ran.
        let current = waiting.filter(|w| {
            w.collective == Collective::PointToPoint
                || (desc.is_some_and(|d| d.tag() == w.tag()) && phase == 2)
        });
        Position {
            call: desc.map(|d| d.to_string()),
            seq: desc.map_or(0, |d| d.seq),
            state: PHASES[phase.min(4) as usize].to_string(),
            waiting_on: current.map(|_| peer_rank),
            waiting_for: current.map(|w| format!("{what} {index} of {of} in {w}")),
        }
    }

    /// A rank whose process has not made the communicator (yet).
    fn not_yet() -> Self {
        Position {
            state: "not created".into(),
            ..Position::default()
        }
    }

    /// A rank that no longer has the communicator.
    fn left() -> Self {
        Position {
            state: "left".into(),
            ..Position::default()
        }
    }

    fn is_collective_call(&self) -> bool {
        self.call.is_some() && self.state != "left"
    }

    /// The name of its collective (`allreduce`), for comparing calls.
    fn kind(&self) -> &str {
        let call = self.call.as_deref().unwrap_or("");
        call.split(" #").next().unwrap_or(call)
    }
}

/// One rank as the verdict sees it: its position, or none (it did not
/// answer, or left no record).
#[derive(Clone, Debug)]
pub struct RankState {
    pub rank: Rank,
    pub position: Option<Position>,
}

/// Who is at fault, in one sentence; `silent` says what a rank without a
/// position did ("left no record", "did not answer within 2 s").
pub fn verdict(states: &[RankState], silent: &str) -> String {
    let waiters = |rank: Rank| -> Vec<Rank> {
        (states.iter())
            .filter(|s| {
                s.position
                    .as_ref()
                    .is_some_and(|p| p.waiting_on == Some(rank))
            })
            .map(|s| s.rank)
            .collect()
    };
    let missing: Vec<Rank> = (states.iter())
        .filter(|s| s.position.is_none())
        .map(|s| s.rank)
        .collect();
    for &m in &missing {
        let w = waiters(m);
        if !w.is_empty() {
            return format!(
                "rank {m} {silent} while rank(s) {} wait for it: it is stopped, hung or unreachable",
                list(&w)
            );
        }
    }
    let at: Vec<(Rank, &Position)> = (states.iter())
        .filter_map(|s| Some((s.rank, s.position.as_ref()?)))
        .collect();
    if let Some(v) = behind_or_different(&at) {
        return v;
    }
    // Everyone at one call: the rank most waited on.
    let mut counts: HashMap<Rank, usize> = HashMap::new();
    for (_, p) in &at {
        if let Some(peer) = p.waiting_on {
            *counts.entry(peer).or_default() += 1;
        }
    }
    match counts.into_iter().max_by_key(|(r, n)| (*n, usize::MAX - r)) {
        Some((peer, _)) => format!(
            "rank {peer} is the one the others wait for (rank(s) {} wait for it)",
            list(&waiters(peer))
        ),
        None if missing.is_empty() => "no rank is waiting on another".into(),
        None => format!("rank(s) {} {silent}", list(&missing)),
    }
}

/// A rank that called something else at the furthest call, or one that
/// never reached it.
fn behind_or_different(at: &[(Rank, &Position)]) -> Option<String> {
    let furthest = (at.iter())
        .filter(|(_, p)| p.is_collective_call())
        .map(|(_, p)| p.seq)
        .max();
    // Ranks that called something else at the furthest call (a rank still
    // finishing the call before is no evidence against it).
    if let Some(seq) = furthest {
        let mut kinds: Vec<(&str, Vec<Rank>, &str)> = Vec::new();
        for (r, p) in at
            .iter()
            .filter(|(_, p)| p.is_collective_call() && p.seq == seq)
        {
            match kinds.iter_mut().find(|k| k.0 == p.kind()) {
                Some(k) => k.1.push(*r),
                None => kinds.push((p.kind(), vec![*r], p.call.as_deref().unwrap())),
            }
        }
        if kinds.len() > 1 {
            let odd = kinds.iter().min_by_key(|k| k.1.len()).unwrap();
            let usual = kinds.iter().max_by_key(|k| k.1.len()).unwrap();
            return Some(format!(
                "rank(s) {} called {} where rank(s) {} called {}: the ranks disagree on the call",
                list(&odd.1),
                odd.2,
                list(&usual.1),
                usual.2
            ));
        }
    }
    let front = at
        .iter()
        .find(|(_, p)| p.is_collective_call() && Some(p.seq) == furthest);
    let (_, front) = front?;
    let ahead: Vec<Rank> = (at.iter())
        .filter(|(_, p)| p.is_collective_call() && p.seq == front.seq)
        .map(|(r, _)| *r)
        .collect();
    let (r, p) = at
        .iter()
        .find(|(_, p)| !p.is_collective_call() || p.seq < front.seq)?;
    let front_call = front.call.as_deref().unwrap();
    let whereabouts = match (p.state.as_str(), &p.call) {
        ("left", _) => return Some(format!(
            "rank {r} has left the communicator (destroyed it, or is exiting) while rank(s) {} are in {front_call}",
            list(&ahead)
        )),
        (_, None) => "it has made no collective call yet".to_string(),
        ("done", Some(c)) => format!("its last call, {c}, is done: it is in no call"),
        (state, Some(c)) => match &p.waiting_for {
            Some(w) => format!("it is in {c}, {state}, waiting for the {w} on rank {}", p.waiting_on.unwrap()),
            None => format!("it is in {c}, {state}"),
        },
    };
    Some(format!(
        "rank {r} never entered {front_call} ({whereabouts}); rank(s) {} wait for it",
        list(&ahead)
    ))
}

/// "0, 2, 3".
pub fn list(ranks: &[Rank]) -> String {
    let text: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
    text.join(", ")
}

/// The process's responders (one per address it listens on) and the
/// boards they answer for, by communicator id (`status_id`).
struct Responders {
    listening: Mutex<HashMap<IpAddr, SocketAddr>>,
    boards: Mutex<HashMap<u128, Weak<Board>>>,
    retired: Mutex<Vec<Arc<Board>>>,
}

fn responders() -> &'static Responders {
    static R: OnceLock<Responders> = OnceLock::new();
    R.get_or_init(|| Responders {
        listening: Mutex::new(HashMap::new()),
        boards: Mutex::new(HashMap::new()),
        retired: Mutex::new(Vec::new()),
    })
}

/// Adds where this process answers "where are you" ,
/// on the TCP transport's address: a job without one loses only the
/// root-cause line of timeouts.
pub(crate) fn publish(
    mut addresses: crate::bootstrap::mesh::Addresses,
) -> crate::bootstrap::mesh::Addresses {
    let tcp = (addresses.get("tcp"))
        .and_then(|hex| crate::bootstrap::rendezvous::from_hex(hex))
        .and_then(|blob| String::from_utf8(blob).ok()?.parse::<SocketAddr>().ok());
    if let Some(tcp) = tcp {
        match listen(tcp.ip()) {
            Ok(addr) => {
                let hex = crate::bootstrap::rendezvous::to_hex(addr.to_string().as_bytes());
                addresses.insert(crate::bootstrap::mesh::STATUS.into(), hex);
            }
            Err(e) => tracing::warn!("cannot answer status questions on {}: {e}", tcp.ip()),
        }
    }
    addresses
}

/// The address this process answers questions on at `ip`, listening there
/// (with a thread) the first time.
pub(crate) fn listen(ip: IpAddr) -> std::io::Result<SocketAddr> {
    let mut listening = responders().listening.lock().unwrap();
    if let Some(addr) = listening.get(&ip) {
        return Ok(*addr);
    }
    let listener = crate::sys::listener::bind(SocketAddr::new(ip, 0))?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    std::thread::Builder::new()
        .name("coll-status".into())
        .spawn(move || serve(listener))?;
    listening.insert(ip, addr);
    Ok(addr)
}

/// Connections the port holds at once, each until its question has come
/// whole or [`QUESTION_WITHIN`] passed: beyond, one is dropped (see
/// `make_room`).
const HOLD: usize = 1024;
/// How long an asker has to send its whole question (a deadline, not a
/// time per read: a trickling stranger is dropped at it).
const QUESTION_WITHIN: Duration = Duration::from_secs(1);

/// A connection whose question has not all come yet, or whose answer has
/// not all gone (a decision of many ranks may not fit a socket buffer).
struct Asking {
    stream: TcpStream,
    question: [u8; QUESTION_LEN],
    got: usize,
    /// The answer, once the question is whole, and how much of it is sent.
    answer: Option<(Arc<[u8]>, usize)>,
    by: Instant,
}

impl Asking {
    /// Reads or writes what the socket takes; whether to keep it.
    fn step(&mut self, now: Instant) -> bool {
        if self.answer.is_none() {
            match self.stream.read(&mut self.question[self.got..]) {
                Ok(0) => return false,
                Ok(n) => self.got += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return true,
                Err(_) => return false,
            }
            if self.got < QUESTION_LEN {
                return true;
            }
            let Some(text) = answer(&self.question) else {
                return false;
            };
            self.answer = Some((text, 0));
            self.by = now + QUESTION_WITHIN;
        }
        let (text, sent) = self.answer.as_mut().expect("answering");
        loop {
            match self.stream.write(&text[*sent..]) {
                Ok(0) => return false,
                Ok(n) => *sent += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return true,
                Err(_) => return false,
            }
            if *sent == text.len() {
                return false;
            }
        }
    }
}

/// One thread answers every asker, polling them all: a silent, slow or
/// flooding stranger costs a slot for at most [`QUESTION_WITHIN`] (to ask,
/// and as long again to read its answer), no thread, and never delays the
/// answer to a question that came whole.
fn serve(listener: TcpListener) {
    let mut asking: VecDeque<Asking> = VecDeque::new();
    loop {
        let ready = wait_for_any(&listener, &asking);
        let now = Instant::now();
        for (mut a, ready) in std::mem::take(&mut asking).into_iter().zip(ready) {
            if ready && !a.step(now) {
                continue;
            }
            if now < a.by {
                asking.push_back(a);
            }
        }
        // A bounded batch, then back to the askers already held: a flood of
        // new connections cannot keep a question that came from being read.
        for _ in 0..ACCEPT_AT_ONCE {
            let stream = match listener.accept() {
                Ok((stream, _)) => stream,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                // Out of descriptors, say: the listener stays readable,
                // which is no reason to spin.
                Err(_) => {
                    std::thread::sleep(Duration::from_millis(20));
                    break;
                }
            };
            if stream.set_nonblocking(true).is_err() {
                continue;
            }
            let mut a = Asking {
                stream,
                question: [0; QUESTION_LEN],
                got: 0,
                answer: None,
                by: now + QUESTION_WITHIN,
            };
            // A question that came with its connection is answered now.
            if !a.step(now) {
                continue;
            }
            if asking.len() == HOLD {
                make_room(&mut asking);
            }
            asking.push_back(a);
        }
    }
}

/// Connections accepted in one go before the held askers are looked at.
const ACCEPT_AT_ONCE: usize = HOLD / 4;

/// Drops one held connection: the oldest that has sent nothing, else the
/// oldest whose question is not whole, else the oldest (an answer on its
/// way is the last to go: a flood of question prefixes cannot cut it).
fn make_room(asking: &mut VecDeque<Asking>) {
    let silent = asking.iter().position(|a| a.got == 0);
    let asking_still = || asking.iter().position(|a| a.answer.is_none());
    match silent.or_else(asking_still) {
        Some(i) => drop(asking.remove(i)),
        None => drop(asking.pop_front()),
    }
}

/// Waits until the listener or an asker is ready (to be read, or written
/// an answer), or the first asker's deadline; says which askers are.
fn wait_for_any(listener: &TcpListener, asking: &VecDeque<Asking>) -> Vec<bool> {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let mut fds = Vec::with_capacity(asking.len() + 1);
    fds.push(PollFd::new(listener, PollFlags::IN));
    fds.extend(asking.iter().map(|a| {
        let wants = match a.answer {
            None => PollFlags::IN,
            Some(_) => PollFlags::OUT,
        };
        PollFd::new(&a.stream, wants)
    }));
    let first = asking.iter().map(|a| a.by).min();
    let wait = first.map_or(QUESTION_WITHIN, |by| {
        by.saturating_duration_since(Instant::now())
    });
    // At most QUESTION_WITHIN: it fits.
    let timeout = Timespec::try_from(wait).unwrap_or_default();
    let _ = poll(&mut fds, Some(&timeout));
    fds[1..].iter().map(|f| !f.revents().is_empty()).collect()
}

/// Answers for the communicator with token `session` while it lives.
/// Communicators a process keeps answering for, dropped ones included.
const KNOWN: usize = 4096;

/// Boards of communicators that were dropped after an agreement, kept so
/// that survivors still in it get their answer (the newest [`RETIRED`]).
const RETIRED: usize = 64;

/// The communicator of `board` is gone: its position reads "left", its
/// agreements stay answerable.
pub(crate) fn retire(board: &Arc<Board>) {
    board.left.store(true, Ordering::Relaxed);
    let mut boards = responders().boards.lock().unwrap();
    let mut retired = responders().retired.lock().unwrap();
    retired.push(board.clone());
    if retired.len() > RETIRED {
        let old = retired.remove(0);
        boards.retain(|_, b| !std::ptr::eq(b.as_ptr(), Arc::as_ptr(&old)));
    }
}

/// What names a communicator in status questions: derived from its
/// session token, which never goes on the wire (knowing this id lets one
/// ask where ranks are, nothing more).
fn status_id(session: u128) -> u128 {
    u128::from_le_bytes(transport::proof::mac(session, "status", &[]))
}

pub(crate) fn register(session: u128, board: &Arc<Board>) {
    let session = status_id(session);
    let mut boards = responders().boards.lock().unwrap();
    // Dropped communicators stay known (a few bytes each) so that their
    // members read as gone, not as not there yet; forgotten past a bound.
    if boards.len() >= KNOWN {
        boards.retain(|_, b| b.strong_count() > 0);
    }
    boards.insert(session, Arc::downgrade(board));
}

/// The answer to a question, if it is one.
fn answer(q: &[u8; QUESTION_LEN]) -> Option<Arc<[u8]>> {
    let (kind, session, k) = parse_question(q)?;
    // The id is checked by the map: a stranger's reads as unknown.
    let known = responders().boards.lock().unwrap().get(&session).cloned();
    let board = known.as_ref().map(|b| b.upgrade());
    let text = match (kind, board) {
        // Unknown: this process has not made the communicator (yet).
        (POSITION, None) => serde_json::to_vec(&Position::not_yet()),
        (_, None) => serde_json::to_vec(&crate::observe::ballot::Answer::NotYet),
        (POSITION, Some(Some(b))) if !b.left.load(Ordering::Relaxed) => {
            serde_json::to_vec(&b.position())
        }
        (POSITION, Some(_)) => serde_json::to_vec(&Position::left()),
        (_, Some(Some(b))) => {
            return Some(
                b.agreement
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .answer(k),
            )
        }
        (_, Some(None)) => serde_json::to_vec(&crate::observe::ballot::Answer::Left),
    };
    text.ok().map(Into::into)
}

/// A question of `kind` about the communicator `session` (and agreement `k`).
pub(crate) fn question(kind: &[u8; 4], session: u128, k: u32) -> [u8; QUESTION_LEN] {
    let mut q = [0u8; QUESTION_LEN];
    q[..4].copy_from_slice(kind);
    q[4..20].copy_from_slice(&status_id(session).to_le_bytes());
    q[20..].copy_from_slice(&k.to_le_bytes());
    q
}

/// A question's kind, communicator id (see `status_id`) and agreement number, if it is one.
pub fn parse_question(q: &[u8]) -> Option<(&'static [u8; 4], u128, u32)> {
    let q: &[u8; QUESTION_LEN] = q.try_into().ok()?;
    let kind = [POSITION, AGREEMENT]
        .into_iter()
        .find(|k| q[..4] == k[..])?;
    let session = u128::from_le_bytes(q[4..20].try_into().unwrap());
    Some((
        kind,
        session,
        u32::from_le_bytes(q[20..].try_into().unwrap()),
    ))
}

/// An answer's position, if it is one.
pub fn parse_answer(a: &[u8]) -> Option<Position> {
    serde_json::from_slice(a).ok()
}

/// The longest answer read (an agreement's carries every transport address).
const ANSWER_MAX: u64 = 64 << 10;

/// The longest answer read about an agreement among `n` ranks: a decision
/// carries every member's payload (their addresses, under 1 KiB each).
pub(crate) fn agreement_answer_max(n: usize) -> u64 {
    ANSWER_MAX + 1024 * n as u64
}

/// Why a rank gave no answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Silence {
    /// Nothing listens at its address (or it published none): its process
    /// is gone.
    Gone,
    /// Its port took the question and no answer came in time: the process
    /// is stopped or hung. A stranger's flood cannot cause this: a question
    /// that comes with its connection is answered as it is accepted.
    Mute,
    /// No connection got through in time (or each was closed unanswered):
    /// its host is down or cut off, or a flood keeps its port's queue full.
    /// Not proof of death on its own (see `fault::agree::UNREACHABLE_FOR`).
    Unreachable,
}

/// A connection attempt waits this long at first, twice as long at each
/// next, up to `LONGEST_TRY`; each is a fresh SYN. A kernel whose listen
/// queue is full drops SYNs, and left to itself resends one only after 1
/// s, then 3: within 2 s that is two tries at a queue a flood keeps full,
/// where fresh attempts make about six, each a new chance at a freed place.
const FIRST_TRY: Duration = Duration::from_millis(50);
const LONGEST_TRY: Duration = Duration::from_secs(1);

/// Asks the process at `addr` `question`: its answer (at most `limit`
/// bytes), or why there is none. Connections are tried for `within`; an
/// answer has `within` from when one got through.
fn ask(
    addr: SocketAddr,
    question: &[u8],
    within: Duration,
    limit: u64,
) -> Result<Vec<u8>, Silence> {
    let by = Instant::now() + within;
    let mut attempt = FIRST_TRY;
    loop {
        let left = by.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Silence::Unreachable);
        }
        let try_for = left.min(attempt);
        attempt = (attempt * 2).min(LONGEST_TRY);
        let mut s = match TcpStream::connect_timeout(&addr, try_for) {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                return Err(Silence::Gone)
            }
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => continue,
            // Say, no route to the host: the kernel answers at once, so wait.
            Err(_) => {
                std::thread::sleep(try_for);
                continue;
            }
        };
        match answer_on(&mut s, question, within, limit) {
            // Closed with nothing said: the port dropped it. Ask again.
            Ok(a) if a.is_empty() => continue,
            Ok(a) => return Ok(a),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(Silence::Mute)
            }
            // Reset: it died while answering (the next try is refused), or the port dropped it.
            Err(_) => continue,
        }
    }
}

/// Writes `question` on `s` and reads the answer, up to `limit` bytes.
fn answer_on(
    s: &mut TcpStream,
    question: &[u8],
    within: Duration,
    limit: u64,
) -> std::io::Result<Vec<u8>> {
    s.set_read_timeout(Some(within))?;
    s.set_write_timeout(Some(within))?;
    s.write_all(question)?;
    let mut a = Vec::new();
    s.take(limit).read_to_end(&mut a)?;
    Ok(a)
}

/// Asks a rank at `addr` (`None`: it published none) `question`, within
/// [`ANSWER_WITHIN`].
fn ask_rank(addr: Option<SocketAddr>, question: &[u8], limit: u64) -> Result<Vec<u8>, Silence> {
    ask(addr.ok_or(Silence::Gone)?, question, ANSWER_WITHIN, limit)
}

/// Asks each rank (`None`: it published no address) `question`, at most
/// [`AT_ONCE`] at a time, each within [`ANSWER_WITHIN`].
pub(crate) fn ask_each(
    ranks: &[(Rank, Option<SocketAddr>)],
    question: &[u8],
    limit: u64,
) -> Vec<(Rank, Result<Vec<u8>, Silence>)> {
    let mut answers = Vec::with_capacity(ranks.len());
    // One question (what most ranks of an agreement ask) needs no thread.
    if let [(r, a)] = ranks {
        answers.push((*r, ask_rank(*a, question, limit)));
        return answers;
    }
    for batch in ranks.chunks(AT_ONCE) {
        std::thread::scope(|s| {
            let asked: Vec<_> = (batch.iter())
                .map(|&(r, a)| (r, s.spawn(move || ask_rank(a, question, limit))))
                .collect();
            for (r, h) in asked {
                answers.push((r, h.join().unwrap_or(Err(Silence::Mute))));
            }
        });
    }
    answers
}

/// Up to this many ranks, a rank that times out asks every other where it
/// is. Past it, it follows the chain of waits from its own (whom it waits
/// for, whom that one waits for, ...), at most [`CHAIN_MOST`] questions:
/// when a whole large job times out together that is O(n) questions, not
/// O(n^2), and the chain ends at the rank at fault.
const ASK_ALL_UP_TO: usize = 256;
const CHAIN_MOST: usize = 64;

/// Asks the other ranks of `addresses` (`None`: published none, or
/// ourselves) where they are, every one or along the chain of waits (see
/// [`ASK_ALL_UP_TO`]), each within [`ANSWER_WITHIN`]; `me` is this rank's
/// own position. Returns the verdict.
pub(crate) fn diagnose(
    me: Rank,
    mine: Position,
    addresses: &[Option<SocketAddr>],
    session: u128,
) -> String {
    let q = question(POSITION, session, 0);
    // A rank that knows of no wait has no chain to follow.
    let states = match addresses.len() <= ASK_ALL_UP_TO || mine.waiting_on.is_none() {
        true => ask_everyone(me, mine, addresses, &q),
        false => follow_waits(me, mine, addresses, &q),
    };
    let silent = format!("did not answer within {} s", ANSWER_WITHIN.as_secs());
    verdict(&states, &silent)
}

fn ask_everyone(
    me: Rank,
    mine: Position,
    addresses: &[Option<SocketAddr>],
    q: &[u8],
) -> Vec<RankState> {
    let mut states: Vec<RankState> = (0..addresses.len())
        .map(|rank| RankState {
            rank,
            position: None,
        })
        .collect();
    states[me].position = Some(mine);
    let others: Vec<(Rank, Option<SocketAddr>)> = (addresses.iter().enumerate())
        .filter(|(r, _)| *r != me)
        .map(|(r, a)| (r, *a))
        .collect();
    for (r, answer) in ask_each(&others, q, ANSWER_MAX) {
        states[r].position = answer.ok().and_then(|a| parse_answer(&a));
    }
    states
}

/// This rank, the rank it waits for, the rank that one waits for, ...
/// until one is silent or waits for nobody new.
fn follow_waits(
    me: Rank,
    mine: Position,
    addresses: &[Option<SocketAddr>],
    q: &[u8],
) -> Vec<RankState> {
    let mut next = mine.waiting_on;
    let mut states = vec![RankState {
        rank: me,
        position: Some(mine),
    }];
    while let Some(r) = next.filter(|r| *r < addresses.len()) {
        if states.len() > CHAIN_MOST || states.iter().any(|s| s.rank == r) {
            break;
        }
        let position = (ask_rank(addresses[r], q, ANSWER_MAX).ok()).and_then(|a| parse_answer(&a));
        next = position.as_ref().and_then(|p| p.waiting_on);
        states.push(RankState { rank: r, position });
    }
    states
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::{DataType, ReduceOp};

    fn desc(collective: Collective, seq: u32) -> CallDesc {
        CallDesc {
            collective,
            dtype: DataType::F32,
            op: collective.reduces().then_some(ReduceOp::Sum),
            count: 10,
            root: None,
            seq,
            comm: 0,
        }
    }

    fn at(board: &Board) -> Option<Position> {
        Some(board.position())
    }

    /// A board in AllReduce #`seq`, waiting to receive from `peer` if any.
    fn running(seq: u32, peer: Option<Rank>) -> Board {
        let b = Board::default();
        let d = desc(Collective::AllReduce, seq);
        b.call(&d, 2);
        if let Some(peer) = peer {
            let w = Waiting {
                peer,
                send: false,
                index: 1,
                of: 2,
                bytes: 8,
            };
            b.waiting(d.tag(), &w);
        }
        b
    }

    #[test]
    fn a_board_reads_back_what_was_written_and_drops_stale_waits() {
        let b = Board::default();
        assert_eq!(b.position().call, None);
        let d = desc(Collective::AllReduce, 57);
        b.call(&d, 2);
        let w = Waiting {
            peer: 3,
            send: false,
            index: 2,
            of: 7,
            bytes: 40,
        };
        b.waiting(d.tag(), &w);
        let p = b.position();
        assert_eq!(p.call.as_deref(), Some("allreduce #57 (10 x f32, sum)"));
        assert_eq!(
            (p.seq, p.state.as_str(), p.waiting_on),
            (57, "running", Some(3))
        );
        assert_eq!(
            p.waiting_for.as_deref(),
            Some("receive 2 of 7 in allreduce #57 (10 x f32, sum)")
        );
        b.call(&d, 3);
        assert_eq!(b.position().waiting_on, None, "a done call waits on nobody");
    }

    #[test]
    fn verdicts_name_the_rank_at_fault() {
        let running = |seq, peer| at(&running(seq, peer));
        let state = |rank, position| RankState { rank, position };
        // A silent rank that others wait on.
        let v = verdict(
            &[
                state(0, running(5, Some(2))),
                state(1, None),
                state(2, running(5, Some(1))),
            ],
            "did not answer within 2 s",
        );
        assert_eq!(v, "rank 1 did not answer within 2 s while rank(s) 2 wait for it: it is stopped, hung or unreachable");
        // A rank whose last call is done, behind the others.
        let done = Board::default();
        done.call(&desc(Collective::Barrier, 4), 3);
        let v = verdict(
            &[
                state(0, running(5, Some(1))),
                state(1, at(&done)),
                state(2, running(5, Some(0))),
            ],
            "-",
        );
        assert_eq!(v, "rank 1 never entered allreduce #5 (10 x f32, sum) (its last call, barrier #4, is done: it is in no call); rank(s) 0, 2 wait for it");
        // A different call at the same point.
        let other = Board::default();
        other.call(&desc(Collective::AllGather, 5), 2);
        let v = verdict(
            &[
                state(0, running(5, None)),
                state(1, at(&other)),
                state(2, running(5, None)),
            ],
            "-",
        );
        assert!(v.starts_with("rank(s) 1 called allgather #5"), "{v}");
        // Everyone in one call.
        let v = verdict(
            &[
                state(0, running(5, Some(2))),
                state(1, running(5, Some(2))),
                state(2, running(5, None)),
            ],
            "-",
        );
        assert_eq!(
            v,
            "rank 2 is the one the others wait for (rank(s) 0, 1 wait for it)"
        );
    }

    /// Past ASK_ALL_UP_TO ranks, a timed-out rank asks along the chain of
    /// waits only, and the chain's end is the verdict.
    #[test]
    fn a_large_job_follows_the_chain_of_waits() {
        let addr = listen("127.0.0.1".parse().unwrap()).unwrap();
        let board = Arc::new(running(4, Some(7)));
        register(0xc4a1, &board);
        // Rank 5 answers (waiting for 7); 7 and every other rank are silent.
        let mut addresses = vec![None; ASK_ALL_UP_TO + 44];
        addresses[5] = Some(addr);
        let mine = running(4, Some(5));
        let q = question(POSITION, 0xc4a1, 0);
        let asked = follow_waits(0, mine.position(), &addresses, &q);
        assert_eq!(asked.iter().map(|s| s.rank).collect::<Vec<_>>(), [0, 5, 7]);
        let v = diagnose(0, mine.position(), &addresses, 0xc4a1);
        assert!(
            v.starts_with("rank 7 did not answer") && v.contains("rank(s) 5 wait"),
            "{v}"
        );
    }

    #[test]
    fn a_question_is_answered_over_tcp_and_strangers_are_not() {
        let addr = listen("127.0.0.1".parse().unwrap()).unwrap();
        let board = Arc::new(Board::default());
        board.call(&desc(Collective::Broadcast, 9), 1);
        register(0xfeed, &board);
        let where_is = |session| {
            let a = ask(
                addr,
                &question(POSITION, session, 0),
                ANSWER_WITHIN,
                ANSWER_MAX,
            )
            .unwrap();
            parse_answer(&a).unwrap()
        };
        let p = where_is(0xfeed);
        assert_eq!((p.seq, p.state.as_str()), (9, "queued"));
        assert_eq!(where_is(0xbad).state, "not created");
        drop(board);
        assert_eq!(where_is(0xfeed).state, "left");
        assert_eq!(parse_question(b"GET / HTTP/1.1\r\nHost:x\r\n"), None);
    }

    fn threads() -> usize {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("Threads:")).unwrap();
        line[8..].trim().parse().unwrap()
    }

    /// Silent connections that keep coming, more than the port holds, do
    /// not push out a question that came whole: it is answered as it is
    /// accepted.
    #[test]
    fn a_question_is_answered_in_a_flood_past_what_the_port_holds() {
        use std::sync::atomic::AtomicUsize;
        let addr = listen("127.0.0.1".parse().unwrap()).unwrap();
        let made = Arc::new(AtomicUsize::new(0));
        let flooding = {
            let made = made.clone();
            std::thread::spawn(move || {
                let mut held = Vec::new();
                while held.len() < 3 * HOLD {
                    held.extend(TcpStream::connect(addr).ok());
                    made.store(held.len(), Ordering::Relaxed);
                }
            })
        };
        let (mut asked, mut answered) = (0, 0);
        while asked < 5 || made.load(Ordering::Relaxed) < 3 * HOLD {
            let a = ask(addr, &question(POSITION, 1, 0), ANSWER_WITHIN, ANSWER_MAX);
            answered += usize::from(a.is_ok_and(|a| parse_answer(&a).is_some()));
            asked += 1;
        }
        flooding.join().unwrap();
        assert_eq!(
            answered, asked,
            "answered {answered} of {asked} questions in a flood"
        );
    }

    /// A flood of silent and trickling connections takes no thread each,
    /// does not keep a real question from its answer, and is dropped at the
    /// question's deadline.
    #[test]
    fn a_flood_of_strangers_costs_no_threads_and_delays_no_answer() {
        let addr = listen("127.0.0.1".parse().unwrap()).unwrap();
        let before = threads();
        let mut flood: Vec<TcpStream> = (0..300)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        for s in flood.iter_mut().step_by(3) {
            s.write_all(b"CS").unwrap(); // a question's first bytes, then nothing
        }
        let a = ask(
            addr,
            &question(POSITION, 1, 0),
            Duration::from_secs(5),
            ANSWER_MAX,
        )
        .unwrap();
        assert!(
            parse_answer(&a).is_some(),
            "{}",
            String::from_utf8_lossy(&a)
        );
        assert!(
            threads() < before + 20,
            "{} threads, {before} before",
            threads()
        );
        // Past the deadline the strangers are dropped: they read end of file.
        std::thread::sleep(QUESTION_WITHIN + Duration::from_millis(300));
        let mut byte = [0u8; 1];
        flood[0]
            .set_read_timeout(Some(Duration::from_secs(2)))
            .unwrap();
        assert_eq!(flood[0].read(&mut byte).unwrap(), 0);
    }

    /// A listener on loopback whose queue of one is taken: every SYN to it
    /// is dropped, as when a flood keeps a port's queue full. Returns it
    /// and the connection holding the place.
    pub(crate) fn full_queue() -> (TcpListener, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        rustix::net::listen(&l, 0).unwrap();
        let held = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        (l, held)
    }

    #[test]
    fn a_gone_a_mute_and_an_unreachable_rank_are_told_apart() {
        let within = Duration::from_millis(400);
        let ask = |addr| ask(addr, b"q", within, ANSWER_MAX).unwrap_err();
        let closed = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        assert_eq!(ask(closed), Silence::Gone);
        let mute = TcpListener::bind("127.0.0.1:0").unwrap();
        assert_eq!(ask(mute.local_addr().unwrap()), Silence::Mute);
        let (full, _held) = full_queue();
        let t = Instant::now();
        assert_eq!(ask(full.local_addr().unwrap()), Silence::Unreachable);
        assert!(t.elapsed() < 2 * within, "{:?}", t.elapsed());
    }

    /// Frees the queue of `full_queue`'s port after `after`, then answers
    /// every question of `question_len` bytes with `reply` for 5 s.
    pub(crate) fn answer_after(
        (full, held): (TcpListener, TcpStream),
        after: Duration,
        question_len: usize,
        reply: Vec<u8>,
    ) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            std::thread::sleep(after);
            drop(held);
            full.set_nonblocking(true).unwrap();
            let by = Instant::now() + Duration::from_secs(5);
            while Instant::now() < by {
                let Ok((mut s, _)) = full.accept() else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                s.set_nonblocking(false).unwrap();
                let mut q = vec![0u8; question_len];
                if s.read_exact(&mut q).is_ok() {
                    s.write_all(&reply).unwrap();
                }
            }
        })
    }

    /// A queue that frees 1.2 s into a 2 s question: a single connect
    /// would not get through (the kernel resends its SYN at 1 s, then 3),
    /// fresh attempts do.
    #[test]
    fn a_port_whose_queue_frees_before_the_deadline_is_reached() {
        let port = full_queue();
        let addr = port.0.local_addr().unwrap();
        let serving = answer_after(port, Duration::from_millis(1200), 1, b"here".to_vec());
        assert_eq!(
            ask(addr, b"q", ANSWER_WITHIN, ANSWER_MAX).as_deref(),
            Ok(&b"here"[..])
        );
        serving.join().unwrap();
    }
}
