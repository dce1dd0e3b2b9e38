//! Identifiers: keys, slots, tiers, jobs and requests.

use alloc::sync::Arc;
use alloc::vec::Vec;
use core::fmt;

/// An opaque byte string naming one offloaded block.
///
/// Equal bytes name the same block. kvtier never hashes a key with a per-process seed: the same
/// tokens give the same key in every process and after a restart. A key carries a fixed 64-bit
/// hash of its bytes, computed once when it is made, so the core's indexes never hash again;
/// equality still compares the bytes. Cloning a `Key` is cheap (the bytes are shared), so the
/// core keeps one copy of the bytes however many tiers hold the block.
#[derive(Clone)]
pub struct Key {
    hash: u64,
    bytes: Arc<[u8]>,
}

impl Key {
    /// Makes a key from its bytes.
    pub fn new(bytes: &[u8]) -> Self {
        Key {
            hash: hash_bytes(bytes),
            bytes: Arc::from(bytes),
        }
    }

    /// The key's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Number of bytes in the key.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Whether the key has no bytes.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The fixed 64-bit hash of the key's bytes (the same in every process).
    pub fn hash64(&self) -> u64 {
        self.hash
    }
}

/// A fixed 64-bit hash of `bytes`: constant multipliers, no seed.
fn hash_bytes(bytes: &[u8]) -> u64 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut h = 0x243F_6A88_85A3_08D3 ^ (bytes.len() as u64).wrapping_mul(K);
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        let w = u64::from_le_bytes(c.try_into().expect("8-byte chunk"));
        h = (h ^ w).wrapping_mul(K);
        h ^= h >> 29;
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut w = [0u8; 8];
        w[..rest.len()].copy_from_slice(rest);
        h = (h ^ u64::from_le_bytes(w)).wrapping_mul(K);
    }
    h ^= h >> 32;
    h = h.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    h ^ (h >> 31)
}

impl PartialEq for Key {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash
            && (Arc::ptr_eq(&self.bytes, &other.bytes) || self.bytes == other.bytes)
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
        self.bytes.cmp(&other.bytes)
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
        Key {
            hash: hash_bytes(&bytes),
            bytes: Arc::from(bytes),
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
        &self.bytes
    }
}

impl fmt::Display for Key {
    /// Hex of the first 8 bytes, then `…` if the key is longer.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.bytes.iter().take(8) {
            write!(f, "{b:02x}")?;
        }
        if self.bytes.len() > 8 {
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
