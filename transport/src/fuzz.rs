//! Property tests of what a peer, or a stranger, can send: every parser of
//! bytes from the network turns any input into a value or an error, never a
//! panic, a hang or an allocation the input did not pay for; encodings
//! round-trip. A bounded run in every `cargo test` (`PROPTEST_CASES` raises it).

use std::io::Write;
use std::net::{TcpListener, TcpStream};

use proptest::prelude::*;

use crate::tcp::TcpConnection;
use crate::wire::{self, Frame, HEADER_LEN};
use crate::{Connection, Hello, MemRegion};

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn any_hello_ack_or_header_decodes_or_is_refused(bytes in prop::collection::vec(any::<u8>(), wire::HELLO_LEN), token in any::<u128>()) {
        let hello: [u8; wire::HELLO_LEN] = bytes[..].try_into().unwrap();
        if let Ok(heard) = wire::decode_hello(&hello) {
            // Bytes nobody made with the token prove nothing.
            prop_assert!(wire::accept_hello(&heard, token, heard.to, b"x", &mut Default::default()).is_err());
        }
        let nonce = crate::proof::nonce();
        prop_assert_eq!(wire::decode_ack(bytes[..wire::ACK_LEN].try_into().unwrap(), token, &nonce), None);
        if let Some(Frame::Abort { reason_len }) = wire::decode_header(bytes[..HEADER_LEN].try_into().unwrap()) {
            prop_assert!(reason_len <= wire::MAX_REASON_LEN);
        }
    }

    #[test]
    fn hellos_and_headers_round_trip(token in any::<u128>(), from in 0usize..1 << 20, to in 0usize..1 << 20,
                                     channel in any::<u8>(), tag in any::<u128>(), len in 0usize..1 << 48) {
        let h = Hello { token, from, to, channel };
        let (bytes, nonce) = wire::encode_hello(&h, b"x");
        let heard = wire::decode_hello(&bytes).unwrap();
        prop_assert_eq!(wire::accept_hello(&heard, token, to, b"x", &mut Default::default()), Ok(h));
        prop_assert_eq!(wire::decode_ack(&wire::encode_ack(to, token, &nonce), token, &nonce), Some(to));
        let f = Frame::Data { tag, len, seq: len as u32 ^ from as u32 };
        prop_assert_eq!(wire::decode_header(&wire::encode_header(f)), Some(f));
        let bye = Frame::Bye { received: len as u32 };
        prop_assert_eq!(wire::decode_header(&wire::encode_header(bye)), Some(bye));
    }

    #[test]
    fn any_address_blob_parses_or_is_refused(blob in prop::collection::vec(any::<u8>(), 0..64)) {
        let _ = crate::tcp::parse_address(&blob);
    }

    #[test]
    fn any_shm_identity_parses(bytes in prop::collection::vec(any::<u8>(), 0..32)) {
        let _ = crate::shm::parse_identity(&bytes);
    }
}

proptest! {
    // Each case is a real socket pair: fewer, slower cases.
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// A connected peer sends anything on the small messages' lane (a valid
    /// header may lead it, with any length, tag and number), then hangs up
    /// (both lanes): the receiving connection fails or completes, within a
    /// bounded number of steps.
    #[test]
    fn a_tcp_connection_survives_any_byte_stream(
        lead in prop::option::of((any::<u128>(), any::<u64>(), any::<bool>(), any::<u32>())),
        junk in prop::collection::vec(any::<u8>(), 0..512),
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut peer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (small, _) = listener.accept().unwrap();
        let other_peer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (large, _) = listener.accept().unwrap();
        let mut conn = TcpConnection::new([small, large], false, 1).unwrap();
        let mut buf = vec![0u8; 64];
        let region = MemRegion::plain(buf.as_mut_ptr(), buf.len());
        // SAFETY: `buf` outlives the connection (dropped at the end of the case).
        let request = unsafe { conn.irecv(&region, 0, 64, 7) }.unwrap();
        if let Some((tag, len, abort, seq)) = lead {
            let frame = match abort {
                true => Frame::Abort { reason_len: len as usize },
                false => Frame::Data { tag, len: len as usize, seq: seq % 3 },
            };
            let header: [u8; HEADER_LEN] = wire::encode_header(frame);
            peer.write_all(&header).unwrap();
        }
        let _ = peer.write_all(&junk);
        drop(peer);
        drop(other_peer);
        let mut outcome = None;
        for _ in 0..10_000 {
            match conn.progress() {
                Err(e) => { outcome = Some(Err(e)); break; }
                Ok(_) if conn.is_done(request) => { outcome = Some(Ok(())); break; }
                Ok(_) => std::thread::yield_now(),
            }
        }
        prop_assert!(outcome.is_some(), "neither failed nor completed");
        drop(conn);
        drop(buf);
    }
}
