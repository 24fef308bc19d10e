#![no_main]
//! The `kvbridge wire decode|encode` JSON front end: arbitrary text must
//! give an answer or an input error, never a panic.

use kvbridge_wire::Limits;
use kvbridge_wire::json::{decode_command, encode_command};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = decode_command(text, &Limits::DEFAULT);
        if let Ok(out) = encode_command(text) {
            let _ = out.len();
        }
    }
});
