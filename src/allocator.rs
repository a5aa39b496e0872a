//! The binary's global allocator: mimalloc, entered through its plain `malloc` path
//! whenever that path already gives the alignment Rust asks for.
//!
//! Owns: the `GlobalAlloc` adapter only. Must not: hold state or policy.
//!
//! Why not `mimalloc::MiMalloc` as it is: it passes every Rust allocation through
//! `mi_malloc_aligned(size, align)`, whose fast path only covers blocks up to 1 KiB; every
//! larger allocation (the prompt and request buffers, pingora's header and body buffers,
//! boxed futures: about 13 per proxied request) goes through mimalloc's generic aligned
//! path, which ends in the same plain `malloc` after ~180 more instructions (callgrind,
//! `loadtest/profile.sh`). mimalloc guarantees that a block is aligned to
//! `min(size, 16)` (`mi_malloc_is_naturally_aligned` in its `alloc-aligned.c`), so an
//! alignment up to 16 and not above the size goes straight to `mi_malloc`; anything else
//! keeps the aligned entry points.

use libmimalloc_sys as mi;
use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

/// mimalloc's `MI_MAX_ALIGN_SIZE`: the alignment every block of at least that size has.
const NATURAL_ALIGN: usize = 16;

/// mimalloc as the global allocator (see the module docs).
pub struct MiMalloc;

fn natural(size: usize, align: usize) -> bool {
    align <= NATURAL_ALIGN && align <= size
}

// SAFETY: every block comes from mimalloc and goes back to it (`mi_free` accepts blocks
// from both the plain and the aligned entry points); the alignment guarantee relied on is
// mimalloc's own (module docs).
unsafe impl GlobalAlloc for MiMalloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if natural(layout.size(), layout.align()) {
            mi::mi_malloc(layout.size()) as *mut u8
        } else {
            mi::mi_malloc_aligned(layout.size(), layout.align()) as *mut u8
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if natural(layout.size(), layout.align()) {
            mi::mi_zalloc(layout.size()) as *mut u8
        } else {
            mi::mi_zalloc_aligned(layout.size(), layout.align()) as *mut u8
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        mi::mi_free(ptr as *mut c_void)
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if natural(new_size, layout.align()) {
            mi::mi_realloc(ptr as *mut c_void, new_size) as *mut u8
        } else {
            mi::mi_realloc_aligned(ptr as *mut c_void, new_size, layout.align()) as *mut u8
        }
    }
}

/// Give the memory this thread freed back to the OS now (`mi_collect(true)`): mimalloc
/// returns freed pages after a delay (`purge_delay`, 10 ms), but only when the thread that
/// owns them allocates in the same place again, so a thread that freed a lot (thousands of
/// connections closing) and then idles keeps it all resident. Costs a walk of this thread's
/// pages: for rare calls. (Purging at once instead, `purge_delay = 0`, cost 30% more CPU
/// per request under load: 64 connections, 4 KiB requests, 5 interleaved wrk rounds.)
/// A no-op for memory from another allocator (tests run on the system one).
pub fn release_freed() {
    // SAFETY: `mi_collect` takes no pointers and may be called from any thread at any time.
    unsafe { mi::mi_collect(true) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every size/alignment pair, through alloc, realloc (growing and shrinking) and
    /// alloc_zeroed, comes back aligned, zeroed where asked and with its contents kept.
    #[test]
    fn blocks_are_aligned_and_keep_their_contents() {
        let a = MiMalloc;
        for align in [1usize, 2, 4, 8, 16, 32, 64, 4096] {
            for size in [
                1usize, 3, 8, 15, 16, 17, 24, 100, 1024, 1025, 4000, 9000, 70_000,
            ] {
                let layout = Layout::from_size_align(size, align).unwrap();
                // Growing and shrinking.
                for new_size in [size * 3, size.div_ceil(2)] {
                    unsafe {
                        let p = a.alloc(layout);
                        assert!(!p.is_null());
                        assert_eq!(p as usize % align, 0, "alloc {size} align {align}");
                        std::ptr::write_bytes(p, 0xAB, size);
                        let q = a.realloc(p, layout, new_size);
                        assert_eq!(
                            q as usize % align,
                            0,
                            "realloc {size}->{new_size} align {align}"
                        );
                        let kept = std::slice::from_raw_parts(q, size.min(new_size));
                        assert!(kept.iter().all(|&b| b == 0xAB), "realloc lost bytes");
                        a.dealloc(q, Layout::from_size_align(new_size, align).unwrap());
                    }
                }
                unsafe {
                    let z = a.alloc_zeroed(layout);
                    assert_eq!(z as usize % align, 0, "alloc_zeroed {size} align {align}");
                    assert!(std::slice::from_raw_parts(z, size).iter().all(|&b| b == 0));
                    a.dealloc(z, layout);
                }
            }
        }
    }
}
