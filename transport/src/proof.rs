//! Proving that a peer holds the job's secret without sending it: a
//! message carries a fresh random nonce and a MAC (HMAC-SHA-256, cut to
//! 128 bits) keyed by the secret over the message and the nonce, and the
//! answer a MAC over that nonce. Someone who watches the wire learns
//! neither the secret nor anything that opens a connection: a recorded
//! hello replayed is refused ([`Replays`]), and an answer is only good for
//! the nonce it answers. Each use has its own label, so a MAC made for one
//! purpose is never taken for another.

use std::collections::HashSet;

use hmac::{Hmac, Mac};
use sha2::Sha256;

pub const NONCE_LEN: usize = 16;
pub const MAC_LEN: usize = 16;

pub type Nonce = [u8; NONCE_LEN];
pub type Tag = [u8; MAC_LEN];

/// `N` random bytes from the kernel: every secret, nonce and random name
/// of the library comes from here. Without the kernel's randomness a
/// secret could be guessed or a nonce repeat, so there is no fallback.
pub fn random<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    let mut filled = 0;
    while filled < N {
        match rustix::rand::getrandom(&mut b[filled..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => filled += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => panic!("the kernel gives no random bytes (getrandom: {e})"),
        }
    }
    b
}

/// A fresh random nonce.
pub fn nonce() -> Nonce {
    random()
}

/// The MAC under `key` of `label` and `parts`.
pub fn mac(key: u128, label: &str, parts: &[&[u8]]) -> Tag {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&key.to_le_bytes())
        .expect("HMAC takes a key of any length");
    m.update(label.as_bytes());
    for p in parts {
        m.update(&(p.len() as u64).to_le_bytes());
        m.update(p);
    }
    let full = m.finalize().into_bytes();
    full[..MAC_LEN].try_into().expect("SHA-256 is 32 bytes")
}

/// Whether `tag` is the MAC under `key` of `label` and `parts`, compared
/// in time that does not depend on where they differ.
pub fn verify(key: u128, label: &str, parts: &[&[u8]], tag: &[u8]) -> bool {
    let want = mac(key, label, parts);
    tag.len() == MAC_LEN && want.iter().zip(tag).fold(0u8, |d, (a, b)| d | (a ^ b)) == 0
}

/// The nonces of proofs a listener took: one seen again is a replay. It
/// grows by one per honest connection only (a proof must verify first).
#[derive(Debug, Default)]
pub struct Replays(HashSet<Nonce>);

impl Replays {
    /// Records `n`; `false` if it was seen before.
    pub fn first_time(&mut self, n: Nonce) -> bool {
        self.0.insert(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mac_binds_key_label_and_every_part() {
        let t = mac(7, "hello", &[b"ab", b"c"]);
        assert!(verify(7, "hello", &[b"ab", b"c"], &t));
        assert!(!verify(8, "hello", &[b"ab", b"c"], &t));
        assert!(!verify(7, "ack", &[b"ab", b"c"], &t));
        // Lengths are part of it: "ab"+"c" is not "a"+"bc".
        assert!(!verify(7, "hello", &[b"a", b"bc"], &t));
        assert!(!verify(7, "hello", &[b"ab", b"c"], &t[..8]));
        let mut r = Replays::default();
        let n = nonce();
        assert!(r.first_time(n) && !r.first_time(n));
        assert_ne!(nonce(), n);
    }
}
