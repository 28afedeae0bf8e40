//! Tests that attack: a hostile peer in another process, speaking the real
//! handshake over the real transport, then publishing a descriptor that
//! points past what we posted and trying to shrink its segment under us.
//! We must refuse it with an error naming the peer, and no byte outside our
//! receive may change.
//!
//! The test binary runs itself again as the peer: the test named
//! `hostile_peer` does nothing unless `COLL_TEST_HOSTILE` holds the
//! listener's address.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::segment::{Desc, Kind};
use super::{ShmOptions, ShmTransport};
use crate::{Hello, Transport};

const ADDRESS_VAR: &str = "COLL_TEST_HOSTILE";
const TOKEN: u128 = 0x5eed;
const TAG: u128 = 7;

/// The peer, when run as one: connects as rank 1, says what it managed.
#[test]
fn hostile_peer() {
    let Ok(address) = std::env::var(ADDRESS_VAR) else {
        return;
    };
    let hello = Hello {
        token: TOKEN,
        from: 1,
        to: 0,
        channel: 0,
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let shm = ShmTransport::new(ShmOptions::default());
    let mut conn = shm.dial(address.as_bytes(), hello, deadline).unwrap();
    match conn.truncate_segment() {
        Ok(()) => println!("truncated"),
        Err(e) => println!("truncate refused: {e}"),
    }
    // 1 byte at offset 0 of an 8-byte message, then 2^64 - 1 bytes at 1:
    // the end wraps to 0 in unchecked arithmetic.
    for (offset, len) in [(0, 1), (1, u64::MAX)] {
        conn.publish_raw(Desc {
            tag: TAG,
            msg_len: 8,
            offset,
            len,
            remote: 0,
            kind: Kind::Eager as u32,
            region_fd: -1,
            region_ino: 0,
            region_offset: 0,
        })
        .unwrap();
    }
    println!("published");
    std::thread::sleep(Duration::from_secs(3));
}

#[test]
fn a_hostile_peer_is_refused_by_name_and_writes_nothing_outside_the_receive() {
    let shm = ShmTransport::new(ShmOptions::default());
    let mut listener = shm.listen().unwrap();
    let address = String::from_utf8(listener.address()).unwrap();
    let mut peer = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "shm::hostile::hostile_peer", "--nocapture"])
        .env(ADDRESS_VAR, &address)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let (hello, mut conn) = listener.accept(TOKEN, 0, deadline).unwrap();
    assert_eq!(hello.from, 1);
    // An 8-byte receive in the middle of a guarded buffer.
    let mut buffer = [0xaau8; 24];
    let region = shm.register(buffer[8..].as_mut_ptr(), 8).unwrap();
    // SAFETY: `buffer` outlives the request: we wait for it below and drop
    // the connection before the buffer.
    let request = unsafe { conn.irecv(&region, 0, 8, TAG) }.unwrap();
    let failed = loop {
        match conn.progress() {
            Err(e) => break e,
            Ok(_) if conn.is_done(request) => panic!("a hostile fragment was taken"),
            Ok(_) if Instant::now() > deadline => panic!("no error in 10 s"),
            Ok(_) => std::thread::sleep(Duration::from_millis(1)),
        }
    };
    drop(conn);
    let said: Vec<String> = BufReader::new(peer.stdout.take().unwrap())
        .lines()
        .map_while(|l| l.ok())
        .filter(|l| !l.starts_with("running") && !l.starts_with("test "))
        .collect();
    let _ = peer.wait();
    assert!(failed.to_string().contains("peer rank 1"), "{failed}");
    assert!(
        buffer[..8].iter().chain(&buffer[16..]).all(|b| *b == 0xaa),
        "{buffer:?}"
    );
    assert!(
        said.iter().any(|l| l.starts_with("truncate refused")),
        "{said:?}"
    );
    assert!(said.iter().any(|l| l == "published"), "{said:?}");
}
