//! The session affinity table's memory does not grow with the length of session ids: an
//! id is kept as a fixed-size hash. Measured with a counting global allocator (this test
//! binary's own), so the bytes the table holds are counted exactly.

use rolter::routing::SessionTable;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The system allocator, counting the bytes currently allocated.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Sessions pinned in the test, and each id's length (the 60 KB ids).
const SESSIONS: usize = 2_000;
const ID_BYTES: usize = 60_000;

#[test]
fn long_session_ids_cost_the_table_no_more_than_short_ones() {
    let table = SessionTable::new(300, 10 * SESSIONS);
    let mut id = vec![b'x'; ID_BYTES];
    let before = LIVE.load(Ordering::Relaxed);
    for i in 0..SESSIONS {
        id[..8].copy_from_slice(format!("{i:08}").as_bytes());
        table.put(std::str::from_utf8(&id).unwrap(), "p0/model", 1_000);
    }
    let held = LIVE.load(Ordering::Relaxed) - before;
    assert_eq!(table.len(), SESSIONS, "distinct ids collided");
    // A hash, an expiry, a label and the map's own slots: well under 1 KiB per session
    // (the ids alone would be 120 MB).
    let per_session = held / SESSIONS;
    assert!(
        per_session < 1024,
        "{per_session} bytes per session ({held} in all)"
    );
    // Every id is still found.
    for i in [0usize, 1, SESSIONS - 1] {
        id[..8].copy_from_slice(format!("{i:08}").as_bytes());
        assert_eq!(
            table
                .get(std::str::from_utf8(&id).unwrap(), 2_000)
                .as_deref(),
            Some("p0/model")
        );
    }
}
