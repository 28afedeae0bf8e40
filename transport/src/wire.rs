//! Byte layouts shared by the stream transports: the hello that opens a
//! connection and the header in front of every message. Little-endian.

use crate::{Hello, Rank, Tag};

/// Protocol version; a peer with another version is refused. 2: TCP
/// connections of two streams, numbered messages. 3: the hello names its
/// channel.
pub(crate) const VERSION: u32 = 3;

const HELLO_MAGIC: u32 = u32::from_le_bytes(*b"CLLH");
const ACK_MAGIC: u32 = u32::from_le_bytes(*b"CLLK");
const DATA_MAGIC: u32 = u32::from_le_bytes(*b"CLLD");
const ABORT_MAGIC: u32 = u32::from_le_bytes(*b"CLLA");
const BYE_MAGIC: u32 = u32::from_le_bytes(*b"CLLB");

pub(crate) const HELLO_LEN: usize = 33;
pub(crate) const ACK_LEN: usize = 8;
pub(crate) const HEADER_LEN: usize = 32;
/// Longest abort reason read from a peer.
pub(crate) const MAX_REASON_LEN: usize = 4096;

pub(crate) fn encode_hello(h: &Hello) -> [u8; HELLO_LEN] {
    let mut b = [0u8; HELLO_LEN];
    b[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
    b[4..8].copy_from_slice(&VERSION.to_le_bytes());
    b[8..24].copy_from_slice(&h.token.to_le_bytes());
    b[24..28].copy_from_slice(&(h.from as u32).to_le_bytes());
    b[28..32].copy_from_slice(&(h.to as u32).to_le_bytes());
    b[32] = h.channel;
    b
}

/// Why a hello is refused.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum BadHello {
    NotOurs,
    Version(u32),
}

pub(crate) fn decode_hello(b: &[u8; HELLO_LEN]) -> Result<Hello, BadHello> {
    if u32_at(b, 0) != HELLO_MAGIC {
        return Err(BadHello::NotOurs);
    }
    let version = u32_at(b, 4);
    if version != VERSION {
        return Err(BadHello::Version(version));
    }
    Ok(Hello {
        token: u128::from_le_bytes(b[8..24].try_into().unwrap()),
        from: u32_at(b, 24) as Rank,
        to: u32_at(b, 28) as Rank,
        channel: b[32],
    })
}

/// Why a decoded hello is refused by rank `me` of the job of `token`, if it is.
pub(crate) fn refuse_hello(h: &Hello, token: u128, me: Rank) -> Option<String> {
    if h.token != token {
        return Some(format!("rank {} presented another job's token", h.from));
    }
    (h.to != me).then(|| format!("rank {} wanted rank {}, this is rank {me}", h.from, h.to))
}

pub(crate) fn encode_ack(me: Rank) -> [u8; ACK_LEN] {
    let mut b = [0u8; ACK_LEN];
    b[0..4].copy_from_slice(&ACK_MAGIC.to_le_bytes());
    b[4..8].copy_from_slice(&(me as u32).to_le_bytes());
    b
}

/// The acknowledging peer's rank, or `None` if the bytes are not an ack.
pub(crate) fn decode_ack(b: &[u8; ACK_LEN]) -> Option<Rank> {
    (u32_at(b, 0) == ACK_MAGIC).then(|| u32_at(b, 4) as Rank)
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
        assert_eq!(decode_hello(&encode_hello(&h)), Ok(h));
        assert_eq!(decode_hello(&[b'G'; HELLO_LEN]), Err(BadHello::NotOurs));
        let mut v2 = encode_hello(&h);
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
        assert_eq!(decode_ack(&encode_ack(9)), Some(9));
    }
}
