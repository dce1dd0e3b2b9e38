//! The value format of the remote stores (Redis, S3): each block is stored as one value, a
//! fixed header, the block's full key, then its bytes.
//!
//! ```text
//! offset  size  field
//!      0     8  magic "KVTIERB\0"
//!      8     4  format version (1), little-endian
//!     12     4  key length
//!     16     8  block length
//!     24     8  XXH3-64 of the key and the block bytes
//!     32     k  the key
//!   32+k     n  the block
//! ```
//!
//! A value that fails any check (magic, version, key, length, checksum) is a failed read:
//! counted, logged, and never served.

use kvtier_core::Key;

use crate::store::StoreError;

/// The first bytes of every value.
pub(crate) const MAGIC: [u8; 8] = *b"KVTIERB\0";
/// The value format this build reads and writes.
pub(crate) const FORMAT_VERSION: u32 = 1;
/// Bytes before a value's key.
pub(crate) const HEADER_BYTES: usize = 32;

/// The header of `key`'s value holding `block`.
pub(crate) fn header(key: &[u8], block: &[u8]) -> [u8; HEADER_BYTES] {
    let mut header = [0u8; HEADER_BYTES];
    header[..8].copy_from_slice(&MAGIC);
    header[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    header[12..16].copy_from_slice(&(key.len() as u32).to_le_bytes());
    header[16..24].copy_from_slice(&(block.len() as u64).to_le_bytes());
    header[24..32].copy_from_slice(&checksum(key, block).to_le_bytes());
    header
}

/// `key`'s whole value holding `block`, in one buffer.
pub(crate) fn encode(key: &Key, block: &[u8]) -> Vec<u8> {
    let k = key.as_bytes();
    let mut value = Vec::with_capacity(HEADER_BYTES + k.len() + block.len());
    value.extend_from_slice(&header(k, block));
    value.extend_from_slice(k);
    value.extend_from_slice(block);
    value
}

/// XXH3-64 of a key and its block.
fn checksum(key: &[u8], block: &[u8]) -> u64 {
    crate::checksum::xxh3_64(&[key, block])
}

/// Checks `value` as `key`'s block and copies the block into `out`.
pub(crate) fn decode(key: &Key, value: &[u8], out: &mut [u8]) -> Result<(), StoreError> {
    let corrupt = |reason| StoreError::Corrupt {
        key: key.clone(),
        reason,
    };
    if value.len() < HEADER_BYTES || value[..8] != MAGIC {
        return Err(corrupt("not a kvtier block (magic)"));
    }
    let u32_at = |at: usize| u32::from_le_bytes(value[at..at + 4].try_into().expect("4 bytes"));
    let u64_at = |at: usize| u64::from_le_bytes(value[at..at + 8].try_into().expect("8 bytes"));
    if u32_at(8) != FORMAT_VERSION {
        return Err(corrupt("another format version"));
    }
    let k = key.as_bytes();
    let key_len = u32_at(12) as usize;
    let block_len = u64_at(16);
    if key_len != k.len() || block_len != out.len() as u64 {
        return Err(corrupt("length"));
    }
    if value.len() != HEADER_BYTES + key_len + out.len() {
        return Err(corrupt("value length"));
    }
    let (stored_key, block) = value[HEADER_BYTES..].split_at(key_len);
    if stored_key != k {
        return Err(corrupt("another key"));
    }
    if checksum(stored_key, block) != u64_at(24) {
        return Err(corrupt("checksum"));
    }
    out.copy_from_slice(block);
    Ok(())
}
