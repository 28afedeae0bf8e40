//! Point-to-point: one message, straight from the send buffer into the
//! receive buffer (no staging, no chunks: posting it whole keeps messages
//! of one pair in call order however many calls are in flight). Its tag
//! carries the pair's own sequence number and the count, so a receive that
//! expects another count or datatype than the send gets a named error.

use super::Layout;
use crate::algo::schedule::{Buf, Schedule, Span};
use crate::call::args::Peer;

pub(super) fn build(l: &Layout, s: &mut Schedule) {
    let len = l.count * l.elem;
    match l.peer.expect("point-to-point has a peer") {
        Peer::To(p) => {
            let span = Span {
                buf: l.input(),
                offset: 0,
                len,
            };
            s.send(p, span, None);
        }
        Peer::From(p) => {
            let span = Span {
                buf: Buf::Output,
                offset: 0,
                len,
            };
            s.recv(p, span, None);
        }
    }
}
