//! XXH3-64 of block values: the Redis tier's value header and the file tier's records. The
//! implementation picks AVX2 at run time when the CPU has it (a block's checksum is on the
//! path of every read and write); the values are XXH3-64's, the same on every machine.

use std::hash::Hasher;

/// XXH3-64 (seed 0) of `parts`, one after another, as of their concatenation.
pub(crate) fn xxh3_64(parts: &[&[u8]]) -> u64 {
    let mut h = twox_hash::XxHash3_64::new();
    for part in parts {
        h.write(part);
    }
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The values are XXH3-64's: a published one (the empty input), and the same as the
    /// implementation the tiers used before (xxhash-rust, still the core's key hash) for
    /// every length class of the algorithm (0, 1–3, 4–8, 9–16, 17–128, 129–240, longer,
    /// longer than one block of stripes), whole and split into parts.
    #[test]
    fn checksums_are_xxh3_64() {
        assert_eq!(xxh3_64(&[]), 0x2D06_8005_38D3_94C2);
        let data: Vec<u8> = (0..300_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for len in [
            0,
            1,
            3,
            4,
            8,
            9,
            16,
            17,
            128,
            129,
            240,
            241,
            1024,
            1025,
            16 << 10,
            256 << 10,
            300_000,
        ] {
            let d = &data[..len];
            let want = xxhash_rust::xxh3::xxh3_64(d);
            assert_eq!(xxh3_64(&[d]), want, "{len} bytes");
            let (a, b) = d.split_at(len / 3);
            assert_eq!(xxh3_64(&[a, b]), want, "{len} bytes in two parts");
        }
        // Many short parts, then long ones (a file tier record: small header fields, the
        // key, the block), at every split of the first 300 bytes.
        for len in [64, 300, 20_000, 300_000] {
            let d = &data[..len];
            let want = xxhash_rust::xxh3::xxh3_64(d);
            for cut in (0..len.min(300)).step_by(7) {
                let (head, tail) = d.split_at(cut);
                let mut parts: Vec<&[u8]> = head.chunks(5).collect();
                parts.extend(tail.chunks(4096));
                assert_eq!(xxh3_64(&parts), want, "{len} bytes cut at {cut}");
            }
        }
    }
}
