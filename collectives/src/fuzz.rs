//! Property tests of what peers, launchers and strangers can send this
//! crate: rendezvous messages, PMI replies, announcements, unique ids,
//! address blobs, message tags, status questions and answers. Any input is
//! a value or an error: never a panic, a hang or an allocation the input did
//! not pay for. A bounded run in every `cargo test` (`PROPTEST_CASES` raises it).

use std::io::{Cursor, Read, Write};
use std::net::TcpStream;

use proptest::prelude::*;

use crate::bootstrap::rendezvous::{self, Join, Reply};
use crate::bootstrap::{meet, pmi, UniqueId};
use crate::call::descriptor::CallDesc;
use crate::observe::status;

/// A length-prefixed message: any prefix (`None`: the body's own length)
/// followed by any body, or JSON-looking bytes.
fn framed() -> impl Strategy<Value = Vec<u8>> {
    let body = prop_oneof![
        prop::collection::vec(any::<u8>(), 0..256),
        "\\{\"(job|size|info|Welcome|Refused)\": ?[\\[\\{\"0-9a-z,:]{0,64}\\}?"
            .prop_map(String::into_bytes),
    ];
    (prop::option::of(any::<u32>()), body).prop_map(|(len, body)| {
        let len = len.unwrap_or(body.len() as u32);
        let mut m = len.to_le_bytes().to_vec();
        m.extend_from_slice(&body);
        m
    })
}

/// A reader that remembers the largest buffer it was asked to fill.
struct Watched<R> {
    inner: R,
    largest: usize,
}

impl<R: Read> Read for Watched<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.largest = self.largest.max(buf.len());
        self.inner.read(buf)
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn any_rendezvous_message_is_read_or_refused(m in framed()) {
        let _ = rendezvous::receive_at_most::<Join>(&mut Cursor::new(&m), 64 << 20);
        let _ = rendezvous::receive_at_most::<Reply>(&mut Cursor::new(&m), 64 << 20);
    }

    #[test]
    fn a_huge_length_prefix_allocates_only_what_arrives(len in 1u32 << 20..64 << 20, sent in 0usize..64) {
        let mut m = len.to_le_bytes().to_vec();
        m.extend(std::iter::repeat_n(b'x', sent));
        let mut r = Watched { inner: Cursor::new(&m), largest: 0 };
        prop_assert!(rendezvous::receive_at_most::<Join>(&mut r, 64 << 20).is_err());
        // The parser never offered a buffer sized by the claim.
        prop_assert!(r.largest <= 64 << 10, "a {} byte buffer for {sent} bytes", r.largest);
    }

    #[test]
    fn any_pmi_reply_parses_or_is_refused(line in "(cmd=[a-z_]{0,12} ?)?([a-z_]{0,8}=?[ -~]{0,16} ?){0,6}\n?") {
        if let Ok(fields) = pmi::parse_reply(&line, "get_result") {
            prop_assert_eq!(fields.get("cmd").map(String::as_str), Some("get_result"));
        }
    }

    #[test]
    fn any_announcement_or_hex_or_id_parses_or_is_refused(text in "[ -~]{0,80}", bytes in prop::collection::vec(any::<u8>(), 0..64)) {
        let _ = meet::parse_announcement(&text);
        let _ = rendezvous::from_hex(&text);
        if let Ok(id) = UniqueId::from_bytes(&bytes) {
            let _ = id.addr();
        }
    }

    #[test]
    fn any_tag_names_a_call_or_nothing(tag in any::<u128>()) {
        if let Some(d) = CallDesc::from_tag(tag) {
            prop_assert_eq!(CallDesc::from_tag(d.tag()), Some(d));
            let _ = d.to_string();
        }
    }

    #[test]
    fn any_status_question_or_answer_parses_or_is_refused(bytes in prop::collection::vec(any::<u8>(), 0..64), text in "[ -~]{0,200}") {
        let _ = status::parse_question(&bytes);
        let _ = status::parse_answer(&bytes);
        let _ = status::parse_answer(text.as_bytes());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Strangers write anything to the status port and hang up (or not):
    /// the responder answers members afterwards as before.
    #[test]
    fn the_status_port_shrugs_off_strangers(junk in prop::collection::vec(any::<u8>(), 0..64)) {
        let addr = status::listen("127.0.0.1".parse().unwrap()).unwrap();
        let mut s = TcpStream::connect(addr).unwrap();
        let _ = s.write_all(&junk);
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut reply = Vec::new();
        let _ = s.read_to_end(&mut reply);
        prop_assert!(reply.len() <= 4096);
    }
}
