#![no_main]
//! Every decoder a decode rank runs on peer input: status, AUX_DATA,
//! STATE_DATA, CHUNK_READY, STAGING_REQ, ABORT_ACK, and kvbridge's
//! AUX_BATCH extension.

use kvbridge_wire::{AuxBatch, Limits, ToDecode};
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
    if let Ok(batch) = AuxBatch::decode(&frames, &Limits::DEFAULT) {
        // The slots cover the payload exactly, and re-encoding is canonical.
        let total: usize = batch.slots().map(|(_, d)| d.len()).sum();
        assert_eq!(total, frames[5].len());
        let encoded: Vec<Vec<u8>> = batch.encode().into_iter().map(|f| f.into_owned()).collect();
        let again = AuxBatch::decode(&encoded, &Limits::DEFAULT).expect("re-encoded batch decodes");
        assert_eq!(again, batch);
    }
});
