#![no_main]
//! The UCX engine's side channel: the info body a client receives (worker
//! address, published regions and their remote keys), and region lookups
//! in what it decoded. What decodes re-encodes to the same bytes.

use kvbridge_engine::fuzzing;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    fuzzing::ucx_info(data);
});
