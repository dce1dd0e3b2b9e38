//! Identifiers: keys, slots, tiers, jobs and requests.

use alloc::sync::Arc;
use alloc::vec::Vec;
use core::fmt;

/// An opaque byte string naming one offloaded block.
///
/// Equal bytes name the same block. kvtier never hashes a key with a per-process seed: the same
/// tokens give the same key in every process and after a restart. A key carries a fixed 64-bit
/// hash of its bytes, computed once when it is made, so the core's indexes never hash again;
/// equality still compares the bytes.
///
/// A key of up to [`Key::INLINE`] bytes (vLLM's 36-byte keys among them) keeps its bytes inline:
/// cloning one copies 56 bytes and touches no shared memory, so the core's hot paths pay no
/// atomic reference count and no cache miss on a separate allocation. A longer key shares its
/// bytes behind a reference count, so a clone stays cheap.
#[derive(Clone)]
pub struct Key {
    hash: u64,
    repr: Repr,
}

#[derive(Clone)]
enum Repr {
    /// The bytes, zero after `len`.
    Inline {
        len: u8,
        bytes: Inline,
    },
    Shared(Arc<[u8]>),
}

/// Inline bytes.
#[derive(Clone, Copy)]
struct Inline([u8; Key::INLINE]);

impl Inline {
    /// The inline bytes of a key of at most [`Key::INLINE`] bytes, zero after them.
    ///
    /// A key of 16 bytes or more is copied as fixed 16-byte windows, the last one ending at
    /// the key's end: fixed-size copies stay in registers, where a copy of variable length is
    /// a call to `memcpy`.
    #[inline]
    fn new(bytes: &[u8]) -> Inline {
        let n = bytes.len();
        let mut out = [0u8; Key::INLINE];
        let window = |at: usize| -> [u8; 16] { bytes[at..at + 16].try_into().expect("16 bytes") };
        if n < 16 {
            out[..n].copy_from_slice(bytes);
        } else {
            let (first, last) = (window(0), window(n - 16));
            out[..16].copy_from_slice(&first);
            if n > 32 {
                let middle = window(16);
                out[16..32].copy_from_slice(&middle);
            }
            out[n - 16..n].copy_from_slice(&last);
        }
        Inline(out)
    }

    /// Equality as three 16-byte words (the last two overlap), compared without a call.
    #[inline]
    fn words_eq(&self, other: &Inline) -> bool {
        let word = |b: &Inline, at: usize| {
            u128::from_ne_bytes(b.0[at..at + 16].try_into().expect("16 bytes"))
        };
        (word(self, 0) ^ word(other, 0))
            | (word(self, 16) ^ word(other, 16))
            | (word(self, Key::INLINE - 16) ^ word(other, Key::INLINE - 16))
            == 0
    }
}

// 56 bytes: the hash, the inline bytes, their length and the variant's tag.
const _: () = assert!(core::mem::size_of::<Key>() == 56);

impl Key {
    /// The longest key kept inline (longer keys share their bytes).
    pub const INLINE: usize = 46;

    /// Makes a key from its bytes.
    pub fn new(bytes: &[u8]) -> Self {
        let repr = if bytes.len() <= Key::INLINE {
            Repr::Inline {
                len: bytes.len() as u8,
                bytes: Inline::new(bytes),
            }
        } else {
            Repr::Shared(Arc::from(bytes))
        };
        Key {
            hash: hash_bytes(bytes),
            repr,
        }
    }

    /// The key's bytes.
    #[inline]
    pub fn as_bytes(&self) -> &[u8] {
        match &self.repr {
            Repr::Inline { len, bytes } => &bytes.0[..usize::from(*len)],
            Repr::Shared(bytes) => bytes,
        }
    }

    /// Number of bytes in the key.
    pub fn len(&self) -> usize {
        self.as_bytes().len()
    }

    /// Whether the key has no bytes.
    pub fn is_empty(&self) -> bool {
        self.as_bytes().is_empty()
    }

    /// The fixed 64-bit hash of the key's bytes (the same in every process).
    pub fn hash64(&self) -> u64 {
        self.hash
    }
}

/// Appends a clone of `key` to `keys`, made in place. A `push` of `key.clone()` builds the
/// clone on the stack with narrow stores and copies it with wide loads, which the CPU cannot
/// forward from those stores: on the store path that stall cost more than the copy itself.
#[inline]
pub(crate) fn push_clone(keys: &mut Vec<Key>, key: &Key) {
    keys.resize_with(keys.len() + 1, || key.clone());
}

/// A fixed 64-bit hash of `bytes`: XXH3 with its default secret, no seed.
#[inline]
fn hash_bytes(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

impl PartialEq for Key {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash
            && match (&self.repr, &other.repr) {
                // Fixed-size compares: the unused inline bytes are zero.
                (Repr::Inline { len: a, bytes: x }, Repr::Inline { len: b, bytes: y }) => {
                    a == b && x.words_eq(y)
                }
                (Repr::Shared(a), Repr::Shared(b)) => Arc::ptr_eq(a, b) || a == b,
                // The length decides the variant: an inline key never equals a shared one.
                _ => false,
            }
    }
}

impl Eq for Key {}

impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Self) -> Option<core::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Key {
    /// By bytes, as the bytes are the key.
    fn cmp(&self, other: &Self) -> core::cmp::Ordering {
        self.as_bytes().cmp(other.as_bytes())
    }
}

impl core::hash::Hash for Key {
    fn hash<H: core::hash::Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

impl From<&[u8]> for Key {
    fn from(bytes: &[u8]) -> Self {
        Key::new(bytes)
    }
}

impl From<Vec<u8>> for Key {
    fn from(bytes: Vec<u8>) -> Self {
        if bytes.len() <= Key::INLINE {
            return Key::new(&bytes);
        }
        Key {
            hash: hash_bytes(&bytes),
            repr: Repr::Shared(Arc::from(bytes)),
        }
    }
}

impl<const N: usize> From<[u8; N]> for Key {
    fn from(bytes: [u8; N]) -> Self {
        Key::new(&bytes)
    }
}

impl AsRef<[u8]> for Key {
    fn as_ref(&self) -> &[u8] {
        self.as_bytes()
    }
}

impl fmt::Display for Key {
    /// Hex of the first 8 bytes, then `…` if the key is longer.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let bytes = self.as_bytes();
        let mut hex = [0u8; 16];
        let shown = bytes.len().min(8);
        for (i, b) in bytes[..shown].iter().enumerate() {
            hex[2 * i] = HEX[usize::from(b >> 4)];
            hex[2 * i + 1] = HEX[usize::from(b & 0xf)];
        }
        // Only ASCII hex digits were written.
        f.write_str(core::str::from_utf8(&hex[..2 * shown]).map_err(|_| fmt::Error)?)?;
        if bytes.len() > 8 {
            f.write_str("…")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({self})")
    }
}

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident($inner:ty), $prefix:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
        pub struct $name(pub $inner);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }
    };
}

id_type!(
    /// A slot of the primary tier, `0..num_blocks`.
    SlotId(u32),
    "slot "
);
id_type!(
    /// A secondary tier: its index in [`Config::tiers`](crate::Config::tiers); tier 0 is asked first.
    TierId(u16),
    "tier "
);
id_type!(
    /// A job, given at submission; ids strictly increase from 1.
    JobId(u64),
    "job "
);
id_type!(
    /// The inference engine's request. Promotions are batched and protected per request.
    RequestId(u64),
    "request "
);

impl RequestId {
    /// The request named by a victim tier's write-ahead store jobs (V2), which no request
    /// of the engine started.
    pub const WRITE_AHEAD: RequestId = RequestId(u64::MAX);
}

impl SlotId {
    /// The slot's position in the primary tier (and its row in the region).
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl TierId {
    /// The tier's position in [`Config::tiers`](crate::Config::tiers).
    pub fn index(self) -> usize {
        usize::from(self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys at, below and above the inline limit keep their bytes, and equal bytes (however
    /// the key was made) are the same key; different bytes of one length are not.
    #[test]
    fn inline_and_shared_keys_compare_by_bytes() {
        for len in [0, 1, 36, Key::INLINE, Key::INLINE + 1, 100] {
            let bytes: Vec<u8> = (0..len).map(|i| i as u8 ^ 0x5a).collect();
            let a = Key::new(&bytes);
            let b = Key::from(bytes.clone());
            assert_eq!(a.as_bytes(), &bytes[..]);
            assert_eq!(a.len(), len);
            assert_eq!(a, b);
            assert_eq!(a.clone(), b);
            assert_eq!(a.cmp(&b), core::cmp::Ordering::Equal);
            if len > 0 {
                let mut other = bytes.clone();
                other[len - 1] ^= 1;
                assert_ne!(a, Key::new(&other));
            }
        }
        // A trailing zero byte is part of the key: not equal to the shorter key.
        assert_ne!(Key::from([1u8, 0]), Key::from([1u8]));
        assert!(Key::from([1u8]) < Key::from([1u8, 0]));
    }
}
