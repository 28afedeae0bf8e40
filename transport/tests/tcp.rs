//! The TCP transport over real loopback sockets: two ranks as two threads.

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, TcpStream};
use std::time::{Duration, Instant};

use transport::tcp::{TcpOptions, TcpTransport};
use transport::{Connection, Error, Hello, Poller, Transport};

const TOKEN: u128 = 0xfeed_beef;
const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

/// Rank 0 accepts, rank 1 connects; returns (rank 0's end, rank 1's end).
fn pair() -> (Box<dyn Connection>, Box<dyn Connection>) {
    let t = TcpTransport::new(LOOPBACK, TcpOptions::default());
    let mut listener = t.listen().unwrap();
    let addr = listener.address();
    let acceptor = std::thread::spawn(move || listener.accept(TOKEN, 0, soon()).unwrap());
    let hello = Hello {
        token: TOKEN,
        from: 1,
        to: 0,
    };
    let c1 = t.connect(&addr, hello, soon()).unwrap();
    let (peer, c0) = acceptor.join().unwrap();
    assert_eq!(peer, 1);
    (c0, c1)
}

/// Drives both ends until `done` holds or the deadline passes.
fn drive(
    a: &mut Box<dyn Connection>,
    b: &mut Box<dyn Connection>,
    mut done: impl FnMut(&dyn Connection, &dyn Connection) -> bool,
) -> Result<(), Error> {
    let deadline = soon();
    let mut poller = Poller::default();
    while !done(a.as_ref(), b.as_ref()) {
        if a.progress()? | b.progress()? {
            poller.busy();
        } else if !poller.idle([&mut *a, &mut *b].into_iter(), deadline)? {
            panic!("no progress before the deadline");
        }
    }
    Ok(())
}

#[test]
fn messages_arrive_whole_and_in_order() {
    let (mut c0, mut c1) = pair();
    let t = TcpTransport::new(LOOPBACK, TcpOptions::default());
    // Larger than any socket buffer, so progress must interleave both ends.
    let src: Vec<u8> = (0..8 << 20).map(|i: u32| (i * 7 % 251) as u8).collect();
    let mut dst = vec![0u8; src.len()];
    let (rs, rd) = (
        t.register(src.as_ptr(), src.len()).unwrap(),
        t.register(dst.as_mut_ptr(), dst.len()).unwrap(),
    );
    let half = src.len() / 2;
    // SAFETY: src and dst outlive the requests and are not touched until done.
    let (s1, s2, s0, r1, r2, r0) = unsafe {
        (
            c1.isend(&rs, 0, half, 1).unwrap(),
            c1.isend(&rs, half, src.len() - half, 2).unwrap(),
            c1.isend(&rs, 0, 0, 3).unwrap(),
            c0.irecv(&rd, 0, half, 1).unwrap(),
            c0.irecv(&rd, half, src.len() - half, 2).unwrap(),
            c0.irecv(&rd, 0, 0, 3).unwrap(),
        )
    };
    drive(&mut c0, &mut c1, |a, b| {
        [r1, r2, r0].iter().all(|r| a.is_done(*r)) && [s1, s2, s0].iter().all(|r| b.is_done(*r))
    })
    .unwrap();
    assert!(src == dst);
    assert_eq!(c0.pending() + c1.pending(), 0);
}

#[test]
fn a_different_length_or_tag_is_a_mismatch() {
    let (mut c0, mut c1) = pair();
    let t = TcpTransport::new(LOOPBACK, TcpOptions::default());
    let buf = [0u8; 64];
    let r = t.register(buf.as_ptr(), 64).unwrap();
    // SAFETY: buf outlives the requests.
    unsafe {
        c1.isend(&r, 0, 60, 42).unwrap();
        c0.irecv(&r, 0, 64, 42).unwrap();
    }
    let err = drive(&mut c0, &mut c1, |_, _| false).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Mismatch {
                peer: 1,
                expected_len: 64,
                got_len: 60,
                got_tag: 42,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn an_abort_reaches_the_peer_with_its_reason() {
    let (mut c0, mut c1) = pair();
    let t = TcpTransport::new(LOOPBACK, TcpOptions::default());
    let buf = [0u8; 16];
    let r = t.register(buf.as_ptr(), 16).unwrap();
    c1.abort("rank 1 gave up: testing");
    // SAFETY: buf outlives the request.
    unsafe { c0.irecv(&r, 0, 16, 7).unwrap() };
    let err = drive(&mut c0, &mut c1, |_, _| false).unwrap_err();
    assert!(
        matches!(&err, Error::PeerAborted { peer: 1, reason } if reason == "rank 1 gave up: testing"),
        "{err}"
    );
}

#[test]
fn a_dead_peer_is_closed_not_a_hang() {
    let (mut c0, c1) = pair();
    let t = TcpTransport::new(LOOPBACK, TcpOptions::default());
    let buf = [0u8; 16];
    let r = t.register(buf.as_ptr(), 16).unwrap();
    drop(c1);
    // SAFETY: buf outlives the request.
    unsafe { c0.irecv(&r, 0, 16, 7).unwrap() };
    let mut other = pair().1;
    let err = drive(&mut c0, &mut other, |_, _| false).unwrap_err();
    assert!(matches!(err, Error::Closed { peer: 1 }), "{err}");
}

#[test]
fn strangers_are_refused_and_the_peer_still_gets_in() {
    let t = TcpTransport::new(LOOPBACK, TcpOptions::default());
    let mut listener = t.listen().unwrap();
    let addr = String::from_utf8(listener.address()).unwrap();
    // Garbage, a wrong token, and a silent socket, before the real peer.
    let mut junk = TcpStream::connect(&addr).unwrap();
    junk.write_all(b"GET / HTTP/1.0\r\n\r\n0123456789abcdef")
        .unwrap();
    let wrong = Hello {
        token: 1,
        from: 1,
        to: 0,
    };
    let t2 = TcpTransport::new(LOOPBACK, TcpOptions::default());
    let addr2 = addr.clone();
    let stranger = std::thread::spawn(move || t2.connect(addr2.as_bytes(), wrong, soon()).err());
    let _silent = TcpStream::connect(&addr).unwrap();
    let acceptor = std::thread::spawn(move || listener.accept(TOKEN, 0, soon()));
    let err = stranger
        .join()
        .unwrap()
        .expect("the wrong token must be refused");
    assert!(err.to_string().contains("refused"), "{err}");
    let good = Hello {
        token: TOKEN,
        from: 1,
        to: 0,
    };
    let _c1 = t.connect(addr.as_bytes(), good, soon()).unwrap();
    let (peer, _c0) = acceptor.join().unwrap().unwrap();
    assert_eq!(peer, 1);
}
