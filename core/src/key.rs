//! Identifiers: keys, slots, tiers, jobs and requests.

use alloc::sync::Arc;
use alloc::vec::Vec;
use core::fmt;

/// An opaque byte string naming one offloaded block.
///
/// Equal bytes name the same block. kvtier never hashes a key with a per-process seed: the same
/// tokens give the same key in every process and after a restart. Cloning a `Key` is cheap (the
/// bytes are shared), so the core keeps one copy of the bytes however many tiers hold the block.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Key(Arc<[u8]>);

impl Key {
    /// Makes a key from its bytes.
    pub fn new(bytes: &[u8]) -> Self {
        Key(Arc::from(bytes))
    }

    /// The key's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// Number of bytes in the key.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the key has no bytes.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl From<&[u8]> for Key {
    fn from(bytes: &[u8]) -> Self {
        Key::new(bytes)
    }
}

impl From<Vec<u8>> for Key {
    fn from(bytes: Vec<u8>) -> Self {
        Key(Arc::from(bytes))
    }
}

impl<const N: usize> From<[u8; N]> for Key {
    fn from(bytes: [u8; N]) -> Self {
        Key::new(&bytes)
    }
}

impl AsRef<[u8]> for Key {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Display for Key {
    /// Hex of the first 8 bytes, then `…` if the key is longer.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0.iter().take(8) {
            write!(f, "{b:02x}")?;
        }
        if self.0.len() > 8 {
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
    pub(crate) fn index(self) -> usize {
        self.0 as usize
    }
}

impl TierId {
    pub(crate) fn index(self) -> usize {
        usize::from(self.0)
    }
}
