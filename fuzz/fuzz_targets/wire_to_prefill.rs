#![no_main]
//! Every decoder a prefill rank runs on peer input: registration, transfer
//! request (both forms), ABORT, WATERMARK, STAGING_RSP, and the packed
//! arrays inside them. Anything that decodes must re-encode to canonical frames.

use kvbridge_wire::{Limits, ToPrefill};
use libfuzzer_sys::fuzz_target;

mod frames;

fuzz_target!(|data: &[u8]| {
    let frames = frames::split(data);
    if let Ok(message) = ToPrefill::decode(&frames, &Limits::DEFAULT) {
        let encoded: Vec<Vec<u8>> = message
            .encode()
            .into_iter()
            .map(|f| f.into_owned())
            .collect();
        // Encoding is canonical: what decodes re-encodes to frames that
        // decode and re-encode to themselves (absent optionals become the
        // reference's defaults on the first encode).
        let again =
            ToPrefill::decode(&encoded, &Limits::DEFAULT).expect("re-encoded message decodes");
        let twice: Vec<Vec<u8>> = again.encode().into_iter().map(|f| f.into_owned()).collect();
        assert_eq!(twice, encoded);
        if let ToPrefill::Register(r) = &message {
            // Walk the zero-copy views end to end.
            let _ = r.dst_state_data_ptrs.to_vecs();
            let _ = r.dst_state_item_lens.iter().map(|a| a.len()).sum::<usize>();
        }
    }
});
