#![no_main]
//! The bootstrap server's HTTP bodies, as a server parses them from peers.

use kvbridge_wire::bootstrap::{
    PrefillRankInfo, PrefillServerInfo, QueryDpRanks, RegisterDpRank, RouteRegistration,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = serde_json_parse::<RouteRegistration>(data);
    let _ = serde_json_parse::<RegisterDpRank>(data);
    let _ = serde_json_parse::<QueryDpRanks>(data);
    let _ = serde_json_parse::<PrefillServerInfo>(data);
    let _ = serde_json_parse::<PrefillRankInfo>(data);
});

fn serde_json_parse<T: serde::de::DeserializeOwned>(data: &[u8]) -> Option<T> {
    serde_json::from_slice(data).ok()
}
