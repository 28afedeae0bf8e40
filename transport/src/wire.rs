//! Byte layouts shared by the stream transports: the hello that opens a
//! connection and the header in front of every message. Little-endian.

use crate::proof::{self, Nonce, Replays, MAC_LEN, NONCE_LEN};
use crate::{Hello, Rank, Tag};

/// Protocol version; a peer with another version is refused. 2: TCP
/// connections of two streams, numbered messages. 3: the hello names its
/// channel. 4: the hello proves the job's token (a nonce and a MAC,
/// [`crate::proof`]) instead of carrying it, and the ack proves it back.
pub(crate) const VERSION: u32 = 4;

const HELLO_MAGIC: u32 = u32::from_le_bytes(*b"CLLH");
const ACK_MAGIC: u32 = u32::from_le_bytes(*b"CLLK");
const DATA_MAGIC: u32 = u32::from_le_bytes(*b"CLLD");
const ABORT_MAGIC: u32 = u32::from_le_bytes(*b"CLLA");
const BYE_MAGIC: u32 = u32::from_le_bytes(*b"CLLB");

/// What a hello's MAC covers: magic, version, from, to, channel, nonce.
const SIGNED_LEN: usize = 17 + NONCE_LEN;
pub(crate) const HELLO_LEN: usize = SIGNED_LEN + MAC_LEN;
pub(crate) const ACK_LEN: usize = 8 + MAC_LEN;
pub(crate) const HEADER_LEN: usize = 32;
/// Longest abort reason read from a peer.
pub(crate) const MAX_REASON_LEN: usize = 4096;

/// `h` as it goes on the wire to the listener at `address` (the blob it
/// published), proved by `h.token` with a fresh nonce, and that nonce (the
/// ack must answer it). The proof covers the address, so a hello recorded
/// on its way to one listener is refused by every other.
pub(crate) fn encode_hello(h: &Hello, address: &[u8]) -> ([u8; HELLO_LEN], Nonce) {
    let nonce = proof::nonce();
    let mut b = [0u8; HELLO_LEN];
    b[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
    b[4..8].copy_from_slice(&VERSION.to_le_bytes());
    b[8..12].copy_from_slice(&(h.from as u32).to_le_bytes());
    b[12..16].copy_from_slice(&(h.to as u32).to_le_bytes());
    b[16] = h.channel;
    b[17..SIGNED_LEN].copy_from_slice(&nonce);
    let mac = proof::mac(h.token, "hello", &[&b[..SIGNED_LEN], address]);
    b[SIGNED_LEN..].copy_from_slice(&mac);
    (b, nonce)
}

/// Why a hello is refused.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum BadHello {
    NotOurs,
    Version(u32),
}

/// A hello read off the wire, its proof not checked yet.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Heard {
    pub from: Rank,
    pub to: Rank,
    pub channel: u8,
    pub nonce: Nonce,
    bytes: [u8; HELLO_LEN],
}

pub(crate) fn decode_hello(b: &[u8; HELLO_LEN]) -> Result<Heard, BadHello> {
    if u32_at(b, 0) != HELLO_MAGIC {
        return Err(BadHello::NotOurs);
    }
    let version = u32_at(b, 4);
    if version != VERSION {
        return Err(BadHello::Version(version));
    }
    Ok(Heard {
        from: u32_at(b, 8) as Rank,
        to: u32_at(b, 12) as Rank,
        channel: b[16],
        nonce: b[17..SIGNED_LEN].try_into().unwrap(),
        bytes: *b,
    })
}

/// The hello of a member of the job of `token` that wants rank `me` at
/// this listener (`address`, the blob it published), or why it is refused:
/// no proof of the token for this listener, another rank wanted, or a
/// hello seen before (a recording replayed).
pub(crate) fn accept_hello(
    h: &Heard,
    token: u128,
    me: Rank,
    address: &[u8],
    replays: &mut Replays,
) -> Result<Hello, String> {
    let (signed, mac) = h.bytes.split_at(SIGNED_LEN);
    if !proof::verify(token, "hello", &[signed, address], mac) {
        return Err(format!(
            "a caller as rank {} did not prove this job's token for this listener (another job, a stranger, or a hello meant for another listener)",
            h.from
        ));
    }
    if h.to != me {
        return Err(format!(
            "rank {} wanted rank {}, this is rank {me}",
            h.from, h.to
        ));
    }
    if !replays.first_time(h.nonce) {
        return Err(format!("a hello of rank {} came again (a replay)", h.from));
    }
    Ok(Hello {
        token,
        from: h.from,
        to: h.to,
        channel: h.channel,
    })
}

/// Rank `me`'s ack of the hello that carried `nonce`: proof that we hold
/// `token` too.
pub(crate) fn encode_ack(me: Rank, token: u128, nonce: &Nonce) -> [u8; ACK_LEN] {
    let mut b = [0u8; ACK_LEN];
    b[0..4].copy_from_slice(&ACK_MAGIC.to_le_bytes());
    b[4..8].copy_from_slice(&(me as u32).to_le_bytes());
    let mac = proof::mac(token, "ack", &[nonce, &b[..8]]);
    b[8..].copy_from_slice(&mac);
    b
}

/// The acknowledging peer's rank, or `None` if the bytes are not an ack
/// of our hello (with `nonce`) by a holder of `token`.
pub(crate) fn decode_ack(b: &[u8; ACK_LEN], token: u128, nonce: &Nonce) -> Option<Rank> {
    let proved = proof::verify(token, "ack", &[nonce, &b[..8]], &b[8..]);
    (u32_at(b, 0) == ACK_MAGIC && proved).then(|| u32_at(b, 4) as Rank)
}

/// What a message header announces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Frame {
    /// The `seq`th message (counted from 0, wrapping) its sender sent on
    /// the connection.
    Data {
        tag: Tag,
        len: usize,
        seq: u32,
    },
    Abort {
        reason_len: usize,
    },
    /// A verbs side channel's last word on a connection closed in good
    /// order: the peer received our first `received` messages.
    Bye {
        received: u32,
    },
}

pub(crate) fn encode_header(frame: Frame) -> [u8; HEADER_LEN] {
    let mut b = [0u8; HEADER_LEN];
    let (magic, len, tag, seq) = match frame {
        Frame::Data { tag, len, seq } => (DATA_MAGIC, len, tag, seq),
        Frame::Abort { reason_len } => (ABORT_MAGIC, reason_len, 0, 0),
        Frame::Bye { received } => (BYE_MAGIC, received as usize, 0, 0),
    };
    b[0..4].copy_from_slice(&magic.to_le_bytes());
    b[4..8].copy_from_slice(&seq.to_le_bytes());
    b[8..16].copy_from_slice(&(len as u64).to_le_bytes());
    b[16..32].copy_from_slice(&tag.to_le_bytes());
    b
}

pub(crate) fn decode_header(b: &[u8; HEADER_LEN]) -> Option<Frame> {
    let len = u64::from_le_bytes(b[8..16].try_into().unwrap()) as usize;
    match u32_at(b, 0) {
        DATA_MAGIC => Some(Frame::Data {
            tag: u128::from_le_bytes(b[16..32].try_into().unwrap()),
            len,
            seq: u32_at(b, 4),
        }),
        ABORT_MAGIC => Some(Frame::Abort {
            reason_len: len.min(MAX_REASON_LEN),
        }),
        BYE_MAGIC => Some(Frame::Bye {
            received: len as u32,
        }),
        _ => None,
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_round_trips_and_rejects_strangers() {
        let h = Hello {
            token: 0x0123_4567_89ab_cdef_0011_2233_4455_6677,
            from: 7,
            to: 3,
            channel: 1,
        };
        let (bytes, nonce) = encode_hello(&h, b"127.0.0.1:9");
        let heard = decode_hello(&bytes).unwrap();
        let mut seen = Replays::default();
        // Another token proves nothing; the right one gives the hello back, once.
        let e = accept_hello(&heard, h.token ^ 1, 3, b"127.0.0.1:9", &mut seen).unwrap_err();
        assert!(e.contains("did not prove"), "{e}");
        assert!(accept_hello(&heard, h.token, 4, b"127.0.0.1:9", &mut seen).is_err());
        // Meant for another listener of the same rank (a replay there).
        assert!(accept_hello(&heard, h.token, 3, b"127.0.0.1:10", &mut seen).is_err());
        assert_eq!(
            accept_hello(&heard, h.token, 3, b"127.0.0.1:9", &mut seen),
            Ok(h)
        );
        let e = accept_hello(&heard, h.token, 3, b"127.0.0.1:9", &mut seen).unwrap_err();
        assert!(e.contains("replay"), "{e}");
        // The token is not on the wire.
        assert!(!bytes.windows(16).any(|w| w == h.token.to_le_bytes()));
        // Any byte changed breaks the proof.
        let mut changed = bytes;
        changed[9] ^= 1;
        let other = decode_hello(&changed).unwrap();
        assert!(accept_hello(&other, h.token, 3, b"127.0.0.1:9", &mut Replays::default()).is_err());
        // The ack proves the token back, for this hello's nonce only.
        let ack = encode_ack(3, h.token, &nonce);
        assert_eq!(decode_ack(&ack, h.token, &nonce), Some(3));
        assert_eq!(decode_ack(&ack, h.token ^ 1, &nonce), None);
        assert_eq!(decode_ack(&ack, h.token, &proof::nonce()), None);
        assert_eq!(decode_hello(&[b'G'; HELLO_LEN]), Err(BadHello::NotOurs));
        let mut v2 = bytes;
        v2[4] = 1;
        assert_eq!(decode_hello(&v2), Err(BadHello::Version(1)));
    }

    #[test]
    fn headers_round_trip() {
        for f in [
            Frame::Data {
                tag: u128::MAX - 5,
                len: 1 << 40,
                seq: u32::MAX,
            },
            Frame::Data {
                tag: 0,
                len: 0,
                seq: 0,
            },
            Frame::Abort { reason_len: 17 },
        ] {
            assert_eq!(decode_header(&encode_header(f)), Some(f));
        }
        assert_eq!(decode_header(&[0; HEADER_LEN]), None);
    }
}
