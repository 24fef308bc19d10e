#![no_main]
//! A decode rank's mapping onto the ranks of a prefill server whose
//! `PrefillServerInfo` (bootstrap JSON) a peer sent: never a panic, never
//! an absurd allocation, and every rank it names exists on the prefill side.
//!
//! Input: 42 bytes of local topology (five u64 LE: attn TP size, engine
//! rank, PP size, PP rank, page size; a flags byte; a dtype byte), a mode
//! byte, then the prefill server's info. Flags: bit 0 MLA, 1 hybrid MLA,
//! 2 all CP ranks, 3 take the prefill's page size, 4 take its PP size,
//! 5 small local sizes (mod 17). Mode bit 1: the decode's `kv_layout`
//! tag is the prefill's own (else none). Mode bit 0 clear: the info is raw JSON;
//! set: it is built from 41 more bytes (four sizes, a page size, flags:
//! bit 0 small sizes, 1 page size present, 2 dtype present, 3 follow the
//! room, 4 DSA layer split, 5 KV cache sharding), printed as JSON and
//! parsed back, which reaches the mapping far more often than raw text.

use kvbridge_roles::decode::topology::{LocalTopology, resolve};
use kvbridge_wire::bootstrap::PrefillServerInfo;
use libfuzzer_sys::fuzz_target;

/// More entries than any real deployment has ranks: a mapping this long
/// is an absurd allocation.
const ABSURD: usize = 1 << 16;

const DTYPES: [&str; 4] = ["auto", "fp8_e4m3", "bfloat16", ""];

/// Little-endian u64 number `i` of `b`, reduced mod 17 when `small`.
fn word(b: &[u8], i: usize, small: bool) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[i * 8..i * 8 + 8]);
    let v = u64::from_le_bytes(a);
    if small { v % 17 } else { v }
}

/// The prefill server's info as JSON text built from 41 bytes.
fn built_info(b: &[u8]) -> Option<Vec<u8>> {
    let b = b.get(..41)?;
    let f = b[40];
    let small = f & 1 != 0;
    let v = serde_json::json!({
        "attn_tp_size": word(b, 0, small),
        "attn_cp_size": word(b, 1, small),
        "dp_size": word(b, 2, small),
        "pp_size": word(b, 3, small),
        "page_size": (f & 2 != 0).then(|| word(b, 4, small)),
        "kv_cache_dtype": (f & 4 != 0).then(|| DTYPES[usize::from(f >> 6)]),
        "follow_bootstrap_room": f & 8 != 0,
        "enable_dsa_cache_layer_split": f & 16 != 0,
        "enable_kv_cache_sharding": f & 32 != 0,
    });
    serde_json::to_vec(&v).ok()
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 43 {
        return;
    }
    let (head, rest) = data.split_at(42);
    let (mode, rest) = (rest[0], &rest[1..]);
    let built;
    let json = if mode & 1 == 0 {
        rest
    } else {
        let Some(b) = built_info(rest) else {
            return;
        };
        built = b;
        &built
    };
    let Ok(info) = serde_json::from_slice::<PrefillServerInfo>(json) else {
        return;
    };
    let flags = head[40];
    let small = flags & 32 != 0;
    let local = LocalTopology {
        attn_tp_size: word(head, 0, small),
        engine_rank: word(head, 1, small),
        pp_size: if flags & 16 != 0 {
            info.pp_size
        } else {
            word(head, 2, small)
        },
        pp_rank: word(head, 3, small),
        page_size: match info.page_size {
            Some(p) if flags & 8 != 0 => p,
            _ => word(head, 4, small),
        },
        is_mla: flags & 1 != 0,
        is_hybrid_mla: flags & 2 != 0,
        all_cp_ranks: flags & 4 != 0,
        dcp_size: if flags & 32 != 0 { 2 } else { 1 },
    };
    let dtype = match usize::from(head[41]) % (DTYPES.len() + 1) {
        0 => info.kv_cache_dtype.as_deref().unwrap_or("auto"),
        i => DTYPES[i - 1],
    };
    let layout = if mode & 2 != 0 {
        info.kv_layout.clone()
    } else {
        None
    };
    let Ok(m) = resolve(&info, &local, dtype, layout.as_deref()) else {
        return;
    };
    assert!(m.target_tp_ranks.len() <= ABSURD);
    assert!(m.target_cp_ranks.len() <= ABSURD);
    assert!(m.target_pp_ranks.len() <= ABSURD);
    assert!(!m.target_tp_ranks.is_empty());
    assert!(m.target_tp_ranks.iter().all(|r| *r < info.attn_tp_size));
    assert!(m.target_cp_ranks.iter().all(|r| *r < info.attn_cp_size));
    if local.pp_rank < local.pp_size {
        assert!(m.target_pp_ranks.iter().all(|r| *r < info.pp_size));
    }
    if let Some(t) = m.target_tp_rank {
        assert!(m.target_tp_ranks.contains(&t));
    }
    assert!(m.required_dst_info_num >= 1);
    assert!(m.required_prefill_response_num >= 1);
});
