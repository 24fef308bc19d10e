//! The export table a receiver publishes to IPC peers: for each registered
//! device region its range, the allocation holding it (base and size in the
//! receiver's address space) and that allocation's CUDA IPC handle.
//! Little-endian; strictly decoded (it is peer input).
//!
//! ```text
//! count u32 | 0 u32 | count x (start u64 | len u64 | base u64 | size u64 | handle [64])
//! ```

/// One exported region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Export {
    /// First byte of the registered region (receiver's address).
    pub start: u64,
    /// Length of the region.
    pub len: u64,
    /// Base of the allocation holding it (what the handle opens).
    pub base: u64,
    /// Size of that allocation.
    pub size: u64,
    /// The allocation's `CUipcMemHandle`.
    pub handle: [u8; 64],
}

const ENTRY: usize = 32 + 64;
/// Most entries a table may hold.
pub const MAX_ENTRIES: usize = 1 << 16;

/// Encode a table.
pub fn encode(entries: &[Export]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + entries.len() * ENTRY);
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    for e in entries {
        for v in [e.start, e.len, e.base, e.size] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&e.handle);
    }
    out
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Decode a table; `None` when malformed: wrong length, non-zero reserved
/// word, a region outside its allocation, or overlapping regions.
pub fn decode(b: &[u8]) -> Option<Vec<Export>> {
    if b.len() < 8 || b[4..8] != [0; 4] {
        return None;
    }
    let mut c = [0u8; 4];
    c.copy_from_slice(&b[..4]);
    let count = u32::from_le_bytes(c) as usize;
    if count > MAX_ENTRIES || b.len() != 8 + count * ENTRY {
        return None;
    }
    let mut out: Vec<Export> = (0..count)
        .map(|i| {
            let at = 8 + i * ENTRY;
            let mut handle = [0u8; 64];
            handle.copy_from_slice(&b[at + 32..at + ENTRY]);
            Export {
                start: u64_at(b, at),
                len: u64_at(b, at + 8),
                base: u64_at(b, at + 16),
                size: u64_at(b, at + 24),
                handle,
            }
        })
        .collect();
    let sane = |e: &Export| {
        let end = e.start.checked_add(e.len);
        let alloc_end = e.base.checked_add(e.size);
        matches!((end, alloc_end), (Some(end), Some(ae)) if e.len > 0 && e.start >= e.base && end <= ae)
    };
    if !out.iter().all(sane) {
        return None;
    }
    out.sort_unstable_by_key(|e| e.start);
    if out.windows(2).any(|w| w[0].start + w[0].len > w[1].start) {
        return None;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(start: u64, len: u64) -> Export {
        Export {
            start,
            len,
            base: start & !0xfff,
            size: 0x10_000,
            handle: [7; 64],
        }
    }

    #[test]
    fn round_trip_and_strictness() {
        let t = vec![e(0x1000, 0x100), e(0x2000, 0x200)];
        let b = encode(&t);
        assert_eq!(decode(&b), Some(t.clone()));
        assert_eq!(decode(&b[..b.len() - 1]), None);
        let mut bad = b.clone();
        bad[5] = 1;
        assert_eq!(decode(&bad), None);
        // region outside its allocation
        assert_eq!(
            decode(&encode(&[Export {
                size: 0x10,
                ..e(0x1000, 0x100)
            }])),
            None
        );
        // overlapping regions
        assert_eq!(decode(&encode(&[e(0x1000, 0x200), e(0x1100, 0x10)])), None);
        assert_eq!(decode(&encode(&[])), Some(vec![]));
    }
}
