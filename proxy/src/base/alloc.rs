//! The process's allocator: mimalloc, asked for a plain block whenever every plain block is
//! aligned enough. The `mimalloc` crate asks `mi_malloc_aligned` for every allocation, and
//! mimalloc 3's aligned path serves a block from the fast path only when it is at most 1 KiB and
//! the next free one happens to sit at the alignment: the rest (connection futures, buffers, a
//! `HeaderMap`'s table) took the generic path, about 6,000 instructions a request of plain
//! pingora (bench/RESULTS.md, issue 23).

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

use libmimalloc_sys as mi;

// On 32-bit targets mimalloc's plain blocks of 4 bytes are only 4-aligned.
const _: () = assert!(
    usize::BITS == 64,
    "plain_is_aligned assumes a 64-bit target"
);

/// mimalloc's plain blocks are aligned to 8 bytes, and to 16 (`MI_MAX_ALIGN_SIZE`) when their
/// size is a multiple of 16 (every size class past 64 bytes is); the test below holds this
/// version to it.
fn plain_is_aligned(layout: Layout) -> bool {
    layout.align() <= 8 || (layout.align() == 16 && layout.size().is_multiple_of(16))
}

pub struct MiMalloc;

// SAFETY: every block comes from mimalloc, aligned as the layout asks (a plain one only where
// `plain_is_aligned` holds), and goes back to it through `mi_free` or a `mi_realloc*`.
unsafe impl GlobalAlloc for MiMalloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if plain_is_aligned(layout) {
            mi::mi_malloc(layout.size()).cast()
        } else {
            mi::mi_malloc_aligned(layout.size(), layout.align()).cast()
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if plain_is_aligned(layout) {
            mi::mi_zalloc(layout.size()).cast()
        } else {
            mi::mi_zalloc_aligned(layout.size(), layout.align()).cast()
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        mi::mi_free(ptr.cast::<c_void>());
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // The new block keeps the old alignment: the test is on the new size.
        match Layout::from_size_align(new_size, layout.align()) {
            Ok(new) if plain_is_aligned(new) => mi::mi_realloc(ptr.cast(), new_size).cast(),
            _ => mi::mi_realloc_aligned(ptr.cast(), new_size, layout.align()).cast(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Allocates `layout`, checks its alignment, resizes it to `new_size`, checks the
    /// alignment and the kept bytes again; the block is returned with its final layout.
    fn checked(a: &MiMalloc, layout: Layout, new_size: usize) -> (*mut u8, Layout) {
        // SAFETY: a non-zero size; the block is written within its size only.
        unsafe {
            let p = a.alloc(layout);
            assert!(!p.is_null());
            assert_eq!(p as usize % layout.align(), 0, "{layout:?}");
            p.write_bytes(0xa5, layout.size());
            let q = a.realloc(p, layout, new_size);
            assert!(!q.is_null());
            assert_eq!(q as usize % layout.align(), 0, "{layout:?} to {new_size}");
            let kept = layout.size().min(new_size);
            assert!(std::slice::from_raw_parts(q, kept)
                .iter()
                .all(|b| *b == 0xa5));
            (
                q,
                Layout::from_size_align(new_size, layout.align()).unwrap(),
            )
        }
    }

    #[test]
    fn plain_blocks_are_aligned_as_claimed_at_every_size() {
        let a = MiMalloc;
        let mut held = Vec::new();
        let sizes = (1..=4096).chain((4096..=(1 << 20)).step_by(4096 + 16));
        for size in sizes {
            for align in [1, 2, 4, 8, 16] {
                let Ok(layout) = Layout::from_size_align(size, align) else {
                    continue;
                };
                if !plain_is_aligned(layout) {
                    continue;
                }
                let (q, last) = checked(&a, layout, size * 2);
                if size <= 64 * 1024 {
                    // Kept, so that later blocks land at other places of their pages.
                    held.push((q, last));
                } else {
                    // SAFETY: from `a`, with its layout.
                    unsafe { a.dealloc(q, last) };
                }
            }
        }
        for (p, layout) in held {
            // SAFETY: each came from `a`, with its layout.
            unsafe { a.dealloc(p, layout) };
        }
    }

    #[test]
    fn wider_alignments_take_the_aligned_path_and_resize_across_paths() {
        let a = MiMalloc;
        for (size, align, new_size) in [
            (24, 16, 48),
            (24, 16, 4096),
            (64, 32, 16),
            (4096, 4096, 100),
            (100, 64, 1 << 20),
        ] {
            let layout = Layout::from_size_align(size, align).unwrap();
            assert!(!plain_is_aligned(layout), "{layout:?}");
            // SAFETY: a non-zero size; read within it.
            let zeroed = unsafe { a.alloc_zeroed(layout) };
            assert!(!zeroed.is_null());
            assert_eq!(zeroed as usize % align, 0);
            assert!(unsafe { std::slice::from_raw_parts(zeroed, size) }
                .iter()
                .all(|b| *b == 0));
            unsafe { a.dealloc(zeroed, layout) };
            let (q, last) = checked(&a, layout, new_size);
            unsafe { a.dealloc(q, last) };
        }
    }
}
