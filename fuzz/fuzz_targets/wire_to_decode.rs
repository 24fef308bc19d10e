#![no_main]
//! Every decoder a decode rank runs on peer input: status, AUX_DATA,
//! STATE_DATA, CHUNK_READY, STAGING_REQ, ABORT_ACK.

use kvbridge_wire::{Limits, ToDecode};
use libfuzzer_sys::fuzz_target;

mod frames;

fuzz_target!(|data: &[u8]| {
    let frames = frames::split(data);
    if let Ok(message) = ToDecode::decode(&frames, &Limits::DEFAULT) {
        let encoded: Vec<Vec<u8>> = message
            .encode()
            .into_iter()
            .map(|f| f.into_owned())
            .collect();
        // Encoding is canonical: what decodes re-encodes to frames that
        // decode and re-encode to themselves (absent optionals become the
        // reference's defaults on the first encode).
        let again =
            ToDecode::decode(&encoded, &Limits::DEFAULT).expect("re-encoded message decodes");
        let twice: Vec<Vec<u8>> = again.encode().into_iter().map(|f| f.into_owned()).collect();
        assert_eq!(twice, encoded);
    }
});
