//! The response-id scanner (`prompt::responses::ResponseIdSniffer`) over upstream answers.
//!
//! Input: the first byte picks JSON or SSE (low bit) and where the rest is cut into two
//! chunks. Never panics, and the cut never changes what is found (the scan is incremental).
#![no_main]

use libfuzzer_sys::fuzz_target;
use rolter::prompt::responses::ResponseIdSniffer;

fn sniff(stream: bool, chunks: &[&[u8]]) -> Option<String> {
    let mut s = ResponseIdSniffer::new(stream);
    let mut found = None;
    for c in chunks {
        if let Some(id) = s.feed(c) {
            assert!(found.is_none(), "an id reported twice");
            found = Some(id);
        }
    }
    found
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let stream = selector & 1 == 1;
    let cut = (usize::from(selector >> 1) * body.len() / 128).min(body.len());
    let (a, b) = body.split_at(cut);
    assert_eq!(sniff(stream, &[a, b]), sniff(stream, &[body]));
});
