#![no_main]
//! The CUDA IPC engine's control reply to `Exports` (ack, table length,
//! export table) and the export table decoder alone: a table that decodes
//! is sorted, disjoint and re-encodes to a table that decodes the same.

use kvbridge_engine::fuzzing;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    if pick % 2 == 0 {
        fuzzing::tcp_exports_reply(rest);
    } else {
        fuzzing::export_table(rest);
    }
});
