#![no_main]
//! The TCP engine's data-plane framing, as each side decodes its peer's
//! bytes: hello, challenge, verdict, request header with its descriptors,
//! and ack. The first byte picks the decoder; whatever decodes must
//! re-encode to the bytes it came from.

use kvbridge_engine::fuzzing;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    match pick % 5 {
        0 => fuzzing::tcp_hello(rest),
        1 => fuzzing::tcp_challenge(rest),
        2 => fuzzing::tcp_verdict(rest),
        3 => fuzzing::tcp_request(rest),
        _ => fuzzing::tcp_ack(rest),
    }
});
