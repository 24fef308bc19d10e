//! The UCX engine's side channel in secret mode: a client that does not
//! prove the cluster secret gets the challenge and a bare refusal — never
//! the worker address, a region or a remote key. Skipped without libucp.
#![cfg(feature = "ucx")]
#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use kvbridge_engine::{EngineConfig, TransferEngine, UcxEngine};
use kvbridge_mem::HostBuffer;

#[test]
fn an_unauthenticated_side_channel_client_gets_no_region_or_key() {
    if let Err(e) = kvbridge_engine::ucx::available() {
        eprintln!("skipping: {e}");
        return;
    }
    let e = UcxEngine::with_ucx_config(
        EngineConfig {
            listen_host: "127.0.0.1".into(),
            secret: Some("s3cret-s3cret-s3cret".into()),
            ..EngineConfig::default()
        },
        &[("TLS", "tcp")],
    )
    .unwrap();
    let buf = HostBuffer::new(1 << 16).unwrap();
    // SAFETY: the buffer outlives the engine (dropped first, below).
    unsafe { e.batch_register(&[buf.region()]) }.unwrap();
    for flags in [1u16, 0] {
        let mut s = TcpStream::connect(e.session_id()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut hello = b"KVBU".to_vec();
        hello.extend_from_slice(&1u16.to_le_bytes());
        hello.extend_from_slice(&flags.to_le_bytes());
        hello.extend_from_slice(&[7u8; 32]);
        s.write_all(&hello).unwrap();
        let mut ch = [0u8; 80];
        s.read_exact(&mut ch).unwrap();
        // A bogus proof, asking for the info (worker address, regions, keys).
        let mut resp = vec![9u8; 32];
        resp.extend_from_slice(&1u32.to_le_bytes());
        resp.extend_from_slice(&0u32.to_le_bytes());
        s.write_all(&resp).unwrap();
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        // Verdict "auth" with an empty body, and nothing else.
        assert_eq!(rest, [1, 0, 0, 0, 0, 0, 0, 0], "flags {flags}");
    }
    assert_eq!(e.stats().auth_failures, 2);
    drop(e);
}
