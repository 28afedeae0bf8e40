//! The transport contract, checked the same way for every transport: two
//! ranks as two threads over real sockets or real shared memory.

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, TcpStream};
use std::time::{Duration, Instant};

use transport::shm::{SharedBuffer, ShmOptions, ShmTransport};
use transport::tcp::{TcpOptions, TcpTransport};
use transport::{Connection, Error, Hello, Poller, Transport};

const TOKEN: u128 = 0xfeed_beef;
const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

fn tcp() -> Box<dyn Transport> {
    Box::new(TcpTransport::new(LOOPBACK, TcpOptions::default()))
}

fn shm() -> Box<dyn Transport> {
    Box::new(ShmTransport::new(ShmOptions::default()))
}

/// Shared memory with every byte copied through the rings.
fn shm_two_copies() -> Box<dyn Transport> {
    Box::new(ShmTransport::new(ShmOptions { single_copy: false }))
}

/// Rank 0 accepts, rank 1 connects, both through `t`; returns (rank 0's
/// end, rank 1's end). Buffers must be registered with the same `t` (for
/// verbs, its protection domain).
fn pair(t: &dyn Transport) -> (Box<dyn Connection>, Box<dyn Connection>) {
    let mut listener = t.listen().unwrap();
    let addr = listener.address();
    let acceptor = std::thread::spawn(move || listener.accept(TOKEN, 0, soon()).unwrap());
    let hello = Hello {
        token: TOKEN,
        from: 1,
        to: 0,
        channel: 0,
    };
    let c1 = t.connect(&addr, hello, soon()).unwrap();
    let (hello, c0) = acceptor.join().unwrap();
    assert_eq!(hello.from, 1);
    (c0, c1)
}

/// Drives both ends until `done` holds or the deadline passes.
fn drive(
    a: &mut Box<dyn Connection>,
    b: &mut Box<dyn Connection>,
    mut done: impl FnMut(&dyn Connection, &dyn Connection) -> bool,
) -> Result<(), Error> {
    let mut poller = Poller::default();
    while !done(a.as_ref(), b.as_ref()) {
        if a.progress()? | b.progress()? {
            poller.busy();
        } else if !poller.idle(
            [&mut *a, &mut *b].into_iter(),
            None,
            Duration::from_secs(10),
            || false,
        )? {
            panic!("no progress for 10 s");
        }
    }
    Ok(())
}

fn messages_arrive_whole_and_in_order(make: fn() -> Box<dyn Transport>) {
    let t = make();
    let (mut c0, mut c1) = pair(&*t);
    // Larger than any socket buffer or ring, small and empty ones between,
    // both ways at once.
    let src: Vec<u8> = (0..8u32 << 20).map(|i| (i * 7 % 251) as u8).collect();
    let (mut dst0, mut dst1) = (vec![0u8; src.len()], vec![0u8; src.len()]);
    let rs = t.register(src.as_ptr(), src.len()).unwrap();
    // One direction's sends say they are all in flight at once: over shared
    // memory the 25536-byte message is then read in place, not through
    // the slots.
    let rs_all = rs.clone().all_in_flight();
    let rd0 = t.register(dst0.as_mut_ptr(), dst0.len()).unwrap();
    let rd1 = t.register(dst1.as_mut_ptr(), dst1.len()).unwrap();
    let cuts = [
        0,
        1,
        100,
        40_000,
        65_536,
        1 << 20,
        1 << 20 | 8,
        5 << 20,
        src.len(),
    ];
    let mut reqs = Vec::new();
    for (i, w) in cuts.windows(2).enumerate() {
        let (at, len) = (w[0], w[1] - w[0]);
        // SAFETY: src and the dsts outlive the requests and are not touched until done.
        unsafe {
            reqs.push((
                c1.isend(&rs, at, len, i as u128).unwrap(),
                c0.irecv(&rd0, at, len, i as u128).unwrap(),
            ));
            reqs.push((
                c0.isend(&rs_all, at, len, i as u128).unwrap(),
                c1.irecv(&rd1, at, len, i as u128).unwrap(),
            ));
        }
    }
    // SAFETY: as above; empty messages.
    unsafe {
        reqs.push((
            c1.isend(&rs, 0, 0, 99).unwrap(),
            c0.irecv(&rd0, 0, 0, 99).unwrap(),
        ));
        reqs.push((
            c0.isend(&rs, 0, 0, 99).unwrap(),
            c1.irecv(&rd1, 0, 0, 99).unwrap(),
        ));
    }
    drive(&mut c0, &mut c1, |a, b| {
        (reqs.chunks(2)).all(|r| {
            b.is_done(r[0].0) && a.is_done(r[0].1) && a.is_done(r[1].0) && b.is_done(r[1].1)
        })
    })
    .unwrap();
    assert!(src == dst0 && src == dst1);
    assert_eq!(c0.pending() + c1.pending(), 0);
}

/// Receives into memory peers may write (over shared memory the sender
/// then copies some messages in itself while the receiver works on others)
/// arrive whole and in order, and nothing lands between them, whether the
/// sender takes up such offers or declines them (`declines`: its sends come
/// from a region that says so). The receiver turns away after each message
/// lands, which gives the sender time to take up offers.
fn receives_peers_may_write_arrive_whole(make: fn() -> Box<dyn Transport>) {
    peers_may_write(make, false);
    peers_may_write(make, true);
}

fn peers_may_write(make: fn() -> Box<dyn Transport>, declines: bool) {
    const N: usize = 64;
    const LEN: usize = 128 << 10;
    // A gap after each receive shows a write at a wrong place.
    const STRIDE: usize = LEN + 4096;
    let t = make();
    let (mut c0, mut c1) = pair(&*t);
    let src: Vec<u8> = (0..N * LEN).map(|i| (i * 13 % 251) as u8).collect();
    let mut dst = vec![0u8; N * STRIDE];
    let rs = t.register(src.as_ptr(), src.len()).unwrap();
    let rs = if declines { rs.declines_help() } else { rs };
    let rd = t
        .register(dst.as_mut_ptr(), dst.len())
        .unwrap()
        .allow_peer_writes();
    let sender = std::thread::spawn(move || {
        // SAFETY: src lives in this thread until every send is done.
        let reqs: Vec<_> = (0..N)
            .map(|i| unsafe { c1.isend(&rs, i * LEN, LEN, i as u128) }.unwrap())
            .collect();
        let deadline = soon();
        while !reqs.iter().all(|r| c1.is_done(*r)) {
            assert!(Instant::now() < deadline, "the sends did not finish");
            c1.progress().unwrap();
        }
        drop(src);
        c1
    });
    // SAFETY: dst outlives the requests and is read only once each is done.
    let reqs: Vec<_> = (0..N)
        .map(|i| unsafe { c0.irecv(&rd, i * STRIDE, LEN, i as u128) }.unwrap())
        .collect();
    let (mut next, deadline) = (0, soon());
    while next < N {
        assert!(Instant::now() < deadline, "the receives did not finish");
        c0.progress().unwrap();
        while next < N && c0.is_done(reqs[next]) {
            // Away for a while, as a reduction of what landed would be
            // (sleeping: on a loaded machine the sender needs the core).
            std::thread::sleep(Duration::from_micros(100));
            next += 1;
        }
    }
    let _c1 = sender.join().unwrap();
    let want: Vec<u8> = (0..N * LEN).map(|i| (i * 13 % 251) as u8).collect();
    for i in 0..N {
        assert!(
            dst[i * STRIDE..][..LEN] == want[i * LEN..][..LEN],
            "message {i} differs (sender declines help: {declines})"
        );
        assert!(
            dst[i * STRIDE + LEN..][..STRIDE - LEN]
                .iter()
                .all(|b| *b == 0),
            "bytes after message {i}"
        );
    }
}

/// What a receive says has landed before it is done has landed: a prefix
/// of the message that only grows. Returns how many times a part (neither
/// nothing nor all) was seen, for receives in memory used as it lands
/// (`used_as_landed`) or not.
fn landed_parts(make: fn() -> Box<dyn Transport>, used_as_landed: bool) -> usize {
    const LEN: usize = (3 << 20) + 8;
    let t = make();
    let (mut c0, mut c1) = pair(&*t);
    let src: Vec<u8> = (0..LEN).map(|i| (i * 31 % 251) as u8 + 1).collect();
    let mut dst = vec![0u8; LEN];
    let rs = t.register(src.as_ptr(), src.len()).unwrap();
    let rd = t.register(dst.as_mut_ptr(), dst.len()).unwrap();
    let rd = if used_as_landed {
        rd.used_as_landed()
    } else {
        rd
    };
    let sender = std::thread::spawn(move || {
        // SAFETY: src lives in this thread until the send is done.
        let req = unsafe { c1.isend(&rs, 0, LEN, 7) }.unwrap();
        let deadline = soon();
        while !c1.is_done(req) {
            assert!(Instant::now() < deadline, "the send did not finish");
            c1.progress().unwrap();
        }
        (c1, src)
    });
    // SAFETY: dst outlives the request; only what landed is read before it is done.
    let req = unsafe { c0.irecv(&rd, 0, LEN, 7) }.unwrap();
    let (mut before, mut parts, deadline) = (0, 0, soon());
    while !c0.is_done(req) {
        assert!(Instant::now() < deadline, "the receive did not finish");
        c0.progress().unwrap();
        if c0.is_done(req) {
            break;
        }
        let landed = c0.landed(req);
        assert!(
            before <= landed && landed <= LEN,
            "landed {before}, then {landed}"
        );
        let src: Vec<u8> = (0..landed).map(|i| (i * 31 % 251) as u8 + 1).collect();
        assert!(dst[..landed] == src[..], "a byte said landed differs");
        parts += (landed > before) as usize;
        before = landed;
    }
    let (_c1, src) = sender.join().unwrap();
    assert!(dst == src);
    parts
}

fn what_landed_is_a_growing_prefix(make: fn() -> Box<dyn Transport>) {
    landed_parts(make, true);
    landed_parts(make, false);
}

fn a_different_length_or_tag_is_a_mismatch(make: fn() -> Box<dyn Transport>) {
    // Close lengths, and lengths far apart both ways (over TCP, a small and
    // a large message travel on different streams).
    for (sent, posted) in [(60, 64), (16, 1 << 20), (1 << 20, 16)] {
        mismatch(make, sent, posted);
    }
}

/// Rank 0 sends `sent` bytes where rank 1 posted a receive of `posted`.
fn mismatch(make: fn() -> Box<dyn Transport>, sent: usize, posted: usize) {
    let t = make();
    let (mut c0, mut c1) = pair(&*t);
    let buf = vec![0u8; 1 << 20];
    let r = t.register(buf.as_ptr(), buf.len()).unwrap();
    // SAFETY: buf outlives the requests.
    unsafe {
        c0.isend(&r, 0, sent, 42).unwrap();
        c1.irecv(&r, 0, posted, 42).unwrap();
    }
    // The receiver finds out (sockets, shared memory), or the sender, when
    // it holds the receiver's grant (verbs): either names the other side.
    let err = drive(&mut c0, &mut c1, |_, _| false).unwrap_err();
    let at_receiver = matches!(
        err,
        Error::Mismatch { peer: 0, expected_len, got_len, got_tag: 42, .. }
            if expected_len == posted && got_len == sent
    );
    let at_sender = matches!(
        err,
        Error::Mismatch { peer: 1, expected_len, got_len, got_tag: 42, .. }
            if expected_len == sent && got_len == posted
    );
    assert!(
        at_receiver || at_sender,
        "{sent} sent, {posted} posted: {err}"
    );
}

fn an_abort_reaches_the_peer_with_its_reason(make: fn() -> Box<dyn Transport>) {
    let t = make();
    let (mut c0, mut c1) = pair(&*t);
    let buf = [0u8; 16];
    let r = t.register(buf.as_ptr(), 16).unwrap();
    c1.abort("rank 1 gave up: testing");
    // SAFETY: buf outlives the request.
    unsafe { c0.irecv(&r, 0, 16, 7).unwrap() };
    let other_t = make();
    let mut other = pair(&*other_t).1;
    let err = drive(&mut c0, &mut other, |_, _| false).unwrap_err();
    assert!(
        matches!(&err, Error::PeerAborted { peer: 1, reason } if reason == "rank 1 gave up: testing"),
        "{err}"
    );
}

fn a_dead_peer_is_closed_not_a_hang(make: fn() -> Box<dyn Transport>) {
    let t = make();
    let (mut c0, c1) = pair(&*t);
    let buf = [0u8; 16];
    let r = t.register(buf.as_ptr(), 16).unwrap();
    drop(c1);
    // SAFETY: buf outlives the request.
    unsafe { c0.irecv(&r, 0, 16, 7).unwrap() };
    let other_t = make();
    let mut other = pair(&*other_t).1;
    let err = drive(&mut c0, &mut other, |_, _| false).unwrap_err();
    assert!(matches!(err, Error::Closed { peer: 1 }), "{err}");
}

/// A peer whose sends completed and that then exited must not fail the
/// receiver of its last message: only waiting for more is an error.
fn a_peer_that_leaves_after_sending_is_not_an_error(make: fn() -> Box<dyn Transport>) {
    let t = make();
    let (mut c0, mut c1) = pair(&*t);
    let src = [7u8; 100];
    let mut dst = [0u8; 100];
    let (rs, rd) = (
        t.register(src.as_ptr(), 100).unwrap(),
        t.register(dst.as_mut_ptr(), 100).unwrap(),
    );
    // The receiver waits first and prepares to sleep, as a rank that got
    // there early does; then the message comes and its sender leaves.
    // SAFETY: src and dst outlive the requests.
    let r = unsafe { c0.irecv(&rd, 0, 100, 5).unwrap() };
    while c0.progress().unwrap() {}
    let _ = c0.wake_source();
    // SAFETY: as above.
    let s = unsafe { c1.isend(&rs, 0, 100, 5).unwrap() };
    let mut poller = Poller::default();
    while !c1.is_done(s) {
        if c1.progress().unwrap() {
            poller.busy();
        } else {
            assert!(
                poller
                    .idle([&mut c1].into_iter(), None, Duration::from_secs(10), || {
                        true
                    })
                    .unwrap(),
                "the send never completed"
            );
        }
    }
    drop(c1);
    let other_t = make();
    let mut other = pair(&*other_t).1;
    drive(&mut c0, &mut other, |a, _| a.is_done(r)).unwrap();
    assert_eq!(dst, src);
    // Waiting for more from it fails.
    // SAFETY: as above.
    unsafe { c0.irecv(&rd, 0, 100, 6).unwrap() };
    let err = drive(&mut c0, &mut other, |_, _| false).unwrap_err();
    assert!(matches!(err, Error::Closed { peer: 1 }), "{err}");
}

fn a_wrong_token_is_refused_and_the_peer_still_gets_in(make: fn() -> Box<dyn Transport>) {
    let t = make();
    let mut listener = t.listen().unwrap();
    let addr = listener.address();
    let acceptor = std::thread::spawn(move || listener.accept(TOKEN, 0, soon()));
    let wrong = Hello {
        token: 1,
        from: 1,
        to: 0,
        channel: 0,
    };
    let err = t
        .connect(&addr, wrong, soon())
        .err()
        .expect("the wrong token must be refused");
    assert!(err.to_string().contains("refused"), "{err}");
    let good = Hello {
        token: TOKEN,
        from: 1,
        to: 0,
        channel: 0,
    };
    let _c1 = t.connect(&addr, good, soon()).unwrap();
    let (hello, _c0) = acceptor.join().unwrap().unwrap();
    assert_eq!(hello.from, 1);
}

/// The contract suite as a module `$name` of tests over the transports
/// `$factory` makes, each run only if `$ready()` (a device is there).
macro_rules! contract {
    ($($transport:ident),*) => {$(
        contract!($transport: super::$transport, || true);
    )*};
    ($name:ident: $factory:path, $ready:expr) => {
        mod $name {
            #[test]
            fn messages_arrive_whole_and_in_order() {
                if $ready() {
                    super::messages_arrive_whole_and_in_order($factory)
                }
            }
            #[test]
            fn receives_peers_may_write_arrive_whole() {
                if $ready() {
                    super::receives_peers_may_write_arrive_whole($factory)
                }
            }
            #[test]
            fn what_landed_is_a_growing_prefix() {
                if $ready() {
                    super::what_landed_is_a_growing_prefix($factory)
                }
            }
            #[test]
            fn a_different_length_or_tag_is_a_mismatch() {
                if $ready() {
                    super::a_different_length_or_tag_is_a_mismatch($factory)
                }
            }
            #[test]
            fn an_abort_reaches_the_peer_with_its_reason() {
                if $ready() {
                    super::an_abort_reaches_the_peer_with_its_reason($factory)
                }
            }
            #[test]
            fn a_dead_peer_is_closed_not_a_hang() {
                if $ready() {
                    super::a_dead_peer_is_closed_not_a_hang($factory)
                }
            }
            #[test]
            fn a_peer_that_leaves_after_sending_is_not_an_error() {
                if $ready() {
                    super::a_peer_that_leaves_after_sending_is_not_an_error($factory)
                }
            }
            #[test]
            fn a_wrong_token_is_refused_and_the_peer_still_gets_in() {
                if $ready() {
                    super::a_wrong_token_is_refused_and_the_peer_still_gets_in($factory)
                }
            }
        }
    };
}

contract!(tcp, shm, shm_two_copies);

/// Read from the sender's memory, a receive used as it lands arrives in
/// pieces (3 MiB: twelve), one per progress; any other arrives whole.
#[test]
fn shm_reads_receives_used_as_they_land_in_pieces() {
    assert!(landed_parts(shm, true) >= 11);
    assert_eq!(landed_parts(shm, false), 0);
}

/// Sends `len` bytes at `at` in `src` from c1 to c0 (in pieces when
/// `in_pieces`), and returns what arrived.
fn send_from(
    t: &dyn Transport,
    (c0, c1): (&mut Box<dyn Connection>, &mut Box<dyn Connection>),
    src: &SharedBuffer,
    (at, len): (usize, usize),
    in_pieces: bool,
) -> Vec<u8> {
    let mut dst = vec![0u8; len];
    let rs = t.register(src.as_ptr(), src.len()).unwrap();
    let rd = t.register(dst.as_mut_ptr(), dst.len()).unwrap();
    let rd = if in_pieces { rd.used_as_landed() } else { rd };
    // SAFETY: src and dst outlive the requests and are not touched until done.
    let (s, r) = unsafe {
        (
            c1.isend(&rs, at, len, 5).unwrap(),
            c0.irecv(&rd, 0, len, 5).unwrap(),
        )
    };
    drive(c0, c1, |a, b| b.is_done(s) && a.is_done(r)).unwrap();
    dst
}

/// Our read-only mappings of `SharedBuffer`s: how many buffers we read
/// through a mapping and still hold (the buffers themselves are mapped
/// read-write).
fn read_mappings() -> usize {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    (maps.lines())
        .filter(|l| l.contains("coll-buffer") && l.contains(" r--s "))
        .count()
}

/// A large message from a `SharedBuffer` is read through a mapping of it
/// (not with process_vm_readv) and arrives whole, from any offset, whole or
/// in pieces; a buffer freed and another allocated (under the same
/// descriptor number) is read anew, and the freed one's mapping goes.
#[test]
fn shm_reads_shared_buffers_through_a_mapping() {
    let t = shm();
    let (mut c0, mut c1) = pair(&*t);
    let fill = |b: &mut SharedBuffer, seed: usize| {
        (b.bytes_mut().iter_mut().enumerate()).for_each(|(i, x)| *x = ((i * seed) % 251) as u8)
    };
    let mut a = SharedBuffer::new(5 << 20).unwrap();
    fill(&mut a, 7);
    let before = read_mappings();
    for (at, len, pieces) in [
        (0, 5 << 20, false),
        (4097, (3 << 20) + 5, true),
        (1 << 20, 65_537, false),
    ] {
        let got = send_from(&*t, (&mut c0, &mut c1), &a, (at, len), pieces);
        assert!(got[..] == a.bytes()[at..at + len], "{len} bytes at {at}");
    }
    assert_eq!(read_mappings(), before + 1, "read through one mapping");
    drop(a);
    let mut b = SharedBuffer::new(2 << 20).unwrap();
    fill(&mut b, 13);
    let got = send_from(&*t, (&mut c0, &mut c1), &b, (3, (2 << 20) - 3), true);
    assert!(got[..] == b.bytes()[3..], "the new buffer's bytes");
    assert_eq!(read_mappings(), before + 1, "the freed buffer unmapped");
}

#[test]
fn tcp_refuses_garbage_and_silence() {
    let t = tcp();
    let mut listener = t.listen().unwrap();
    let addr = String::from_utf8(listener.address()).unwrap();
    let mut junk = TcpStream::connect(&addr).unwrap();
    junk.write_all(b"GET / HTTP/1.0\r\n\r\n0123456789abcdef")
        .unwrap();
    let _silent = TcpStream::connect(&addr).unwrap();
    let acceptor = std::thread::spawn(move || listener.accept(TOKEN, 0, soon()));
    let good = Hello {
        token: TOKEN,
        from: 1,
        to: 0,
        channel: 0,
    };
    let _c1 = t.connect(addr.as_bytes(), good, soon()).unwrap();
    let (hello, _c0) = acceptor.join().unwrap().unwrap();
    assert_eq!(hello.from, 1);
}

/// The same contract over RDMA verbs, where a device exists (the soft-RoCE
/// VM of ci/rxe.sh): skipped with a message elsewhere, unless
/// COLL_REQUIRE_VERBS=1.
#[cfg(feature = "verbs")]
mod verbs {
    use super::*;
    use transport::verbs::VerbsTransport;

    fn verbs() -> Box<dyn Transport> {
        Box::new(VerbsTransport::open(LOOPBACK).expect("an RDMA device"))
    }

    /// Messages spread over 3 queue pairs, whose completions interleave.
    fn verbs_three_qps() -> Box<dyn Transport> {
        Box::new(
            VerbsTransport::open(LOOPBACK)
                .expect("an RDMA device")
                .with_qps_per_peer(3),
        )
    }

    /// Messages cut into writes of 4 KiB: the megabyte ones take more
    /// writes than the send queue holds, as messages over `MAX_WRITE` would.
    fn verbs_small_writes() -> Box<dyn Transport> {
        Box::new(
            VerbsTransport::open(LOOPBACK)
                .expect("an RDMA device")
                .with_max_write(4096),
        )
    }

    fn available() -> bool {
        match VerbsTransport::open(LOOPBACK) {
            Ok(_) => true,
            Err(e) => {
                let required = std::env::var("COLL_REQUIRE_VERBS").is_ok_and(|v| v == "1");
                assert!(!required, "no RDMA device ({e}), and COLL_REQUIRE_VERBS=1");
                eprintln!("skipping: {e}");
                false
            }
        }
    }

    contract!(one_qp: super::verbs, super::available);
    contract!(three_qps: super::verbs_three_qps, super::available);
    contract!(small_writes: super::verbs_small_writes, super::available);
}
