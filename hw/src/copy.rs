//! Bulk copies of KV bytes between a region and an engine's memory, around the CPU's caches.
//!
//! A store's bytes are not read from the region again for a long while, and a load of many
//! blocks is larger than the caches: either way most of the destination's cache lines are
//! evicted before they are read. An ordinary copy still reads every destination line into
//! the cache before it writes it (the write-allocate): three units of memory traffic where
//! the copy needs two; on a CPU engine the copy shares the memory bus with the model's forward.
//! [`copy_bulk`] writes with non-temporal stores instead, which go to memory without that
//! read, and prefetches its source ahead of the loads. `memcpy` does the same, but only for
//! a single copy above glibc's threshold (`glibc.cpu.x86_non_temporal_threshold`, 192 MiB
//! on the machine measured), while a job is many pieces of 16 KiB to a few MiB, one per layer and block.
//!
//! Measured on a 2-core EPYC VM (`docs/performance.md`, "Copies in pieces"): 256 MiB in
//! pieces of 16 KiB to 4 MiB moved at 0.92–1.03× the rate of one `memcpy` of the whole with
//! [`copy_bulk`], and at 0.62–0.66× with `copy_from_slice` per piece.
//!
//! Non-temporal stores are weakly ordered: [`copy_bulk`] ends with a store fence, so the
//! bytes are visible before any later store (a seal, a job's completion) that publishes them.

/// Pieces shorter than this are copied with `copy_from_slice`: 16 KiB, the smallest piece
/// measured (it gained as much as the larger ones), is about the smallest KV page of one
/// layer and block; below it the head, tail and fence are a larger share of the copy.
pub const STREAM_MIN: usize = 16 << 10;

/// Copies `src` into `dst`, around the CPU's caches when it is at least [`STREAM_MIN`] bytes
/// on x86-64 (a plain copy elsewhere). The bytes are visible to other threads and processes
/// in the order of any store that follows.
///
/// # Panics
///
/// If the two lengths differ, as `copy_from_slice` does.
pub fn copy_bulk(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_bulk: lengths differ");
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    if dst.len() >= STREAM_MIN {
        // SAFETY: both ranges are valid for `len` bytes (they are slices), and they do not
        // overlap (one is borrowed mutably, the other shared).
        unsafe { x86::stream(dst.as_mut_ptr(), src.as_ptr(), dst.len()) };
        return;
    }
    dst.copy_from_slice(src);
}

#[cfg(all(target_arch = "x86_64", not(miri)))]
mod x86 {
    use core::arch::x86_64::{
        __m128i, _MM_HINT_NTA, _mm_loadu_si128, _mm_prefetch, _mm_sfence, _mm_stream_si128,
    };

    /// How far ahead of the loads the source is prefetched, in bytes.
    const PREFETCH: usize = 512;

    /// Copies one 64-byte line, `dst` aligned to 64 bytes, with non-temporal stores.
    ///
    /// # Safety
    ///
    /// `src..src + 64` readable, `dst..dst + 64` writable and aligned to 16 bytes at least.
    #[inline(always)]
    unsafe fn line(dst: *mut u8, src: *const u8) {
        let (s, d) = (src.cast::<__m128i>(), dst.cast::<__m128i>());
        // SAFETY: the caller's contract; SSE2 is part of x86-64's baseline.
        unsafe {
            let a = _mm_loadu_si128(s);
            let b = _mm_loadu_si128(s.add(1));
            let c = _mm_loadu_si128(s.add(2));
            let e = _mm_loadu_si128(s.add(3));
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
        }
    }

    /// Copies `len` bytes: the head up to `dst`'s first 64-byte boundary and the tail with an
    /// ordinary copy, the lines between with non-temporal stores, then a store fence.
    ///
    /// # Safety
    ///
    /// `src..src + len` readable, `dst..dst + len` writable, the two disjoint.
    pub(super) unsafe fn stream(dst: *mut u8, src: *const u8, len: usize) {
        let head = dst.align_offset(64).min(len);
        // SAFETY: every range below lies within the caller's `len` bytes, and the lines'
        // destinations are 64-byte aligned (from `head` on). A prefetch never faults, and its
        // address is computed with `wrapping_add`, so it may point past the source.
        unsafe {
            core::ptr::copy_nonoverlapping(src, dst, head);
            let mut i = head;
            while i + 128 <= len {
                _mm_prefetch::<_MM_HINT_NTA>(src.wrapping_add(i + PREFETCH).cast());
                _mm_prefetch::<_MM_HINT_NTA>(src.wrapping_add(i + PREFETCH + 64).cast());
                line(dst.add(i), src.add(i));
                line(dst.add(i + 64), src.add(i + 64));
                i += 128;
            }
            if i + 64 <= len {
                line(dst.add(i), src.add(i));
                i += 64;
            }
            core::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i);
            _mm_sfence();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every length around the thresholds and line boundaries, at several misalignments of
    /// source and destination: the destination holds the source's bytes, and nothing around
    /// it moved.
    #[test]
    fn copies_every_length_and_alignment_exactly() {
        let lens = [
            0,
            1,
            63,
            64,
            65,
            STREAM_MIN - 1,
            STREAM_MIN,
            STREAM_MIN + 1,
            STREAM_MIN + 63,
            STREAM_MIN + 127,
            (1 << 20) + 7,
        ];
        let max = lens.iter().max().unwrap() + 256;
        let src: Vec<u8> = (0..max).map(|i| (i * 7 + i / 251) as u8).collect();
        let mut dst = vec![0u8; max];
        for &len in &lens {
            for (s_off, d_off) in [(0, 0), (1, 0), (0, 1), (17, 45), (63, 63), (64, 3)] {
                dst.fill(0xAA);
                copy_bulk(&mut dst[d_off..d_off + len], &src[s_off..s_off + len]);
                assert_eq!(
                    &dst[d_off..d_off + len],
                    &src[s_off..s_off + len],
                    "len {len}"
                );
                assert!(dst[..d_off].iter().all(|&b| b == 0xAA), "before, len {len}");
                assert!(
                    dst[d_off + len..].iter().all(|&b| b == 0xAA),
                    "after, len {len}"
                );
            }
        }
    }

    /// Every pair of source and destination offsets from a 64-byte boundary (the source's
    /// in steps of 5), so that the streamed lines follow each possible head (0 to 63 bytes
    /// copied before them).
    #[test]
    fn copies_at_every_offset_from_a_line_boundary() {
        let len = STREAM_MIN + 200;
        let src: Vec<u8> = (0..len + 192).map(|i| (i * 13 + i / 509) as u8).collect();
        let mut dst = vec![0u8; len + 192];
        let s0 = src.as_ptr().align_offset(64);
        let d0 = dst.as_ptr().align_offset(64);
        for s_off in (s0..s0 + 64).step_by(5) {
            for d_off in d0..d0 + 64 {
                dst.fill(0x55);
                copy_bulk(&mut dst[d_off..d_off + len], &src[s_off..s_off + len]);
                assert!(
                    dst[d_off..d_off + len] == src[s_off..s_off + len],
                    "{s_off} {d_off}"
                );
                assert!(dst[..d_off].iter().all(|&b| b == 0x55), "before");
                assert!(dst[d_off + len..].iter().all(|&b| b == 0x55), "after");
            }
        }
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn refuses_slices_of_different_lengths() {
        copy_bulk(&mut [0u8; 4], &[1u8; 3]);
    }
}
