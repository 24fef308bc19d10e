#![no_main]
//! Random sequences of control messages fed into a live prefill inbox and
//! a live decode inbox (two harnesses for the whole run, one in open mode
//! and one in secret mode: a bootstrap server, prefill and decode ranks on
//! loopback engines, three open rooms). After every message: no panic, no
//! byte of a page that no live room owns has changed, and in secret mode no
//! byte of the rooms' own pages or aux slots either, no staging chunk was
//! scattered and no room concluded Success (the fuzzer, like a member that
//! serves none of the rooms, has no pair key to bind a message).
//!
//! Input: a sequence of messages, each `[target, frame count, (len u16 LE,
//! bytes)...]`; target bit 0 picks the prefill (1) or decode (0) inbox,
//! bit 1 polls the rooms afterwards, bit 2 rewrites the first frame into a
//! well-formed message name (so the fuzzer reaches the handlers quickly),
//! bit 3 picks the secret-mode harness. `fuzz/seeds/inbox_sequence` holds
//! the staging forgeries and the forged status, aux, state and ABORT_ACK
//! messages as seeds.

use std::sync::{Mutex, OnceLock};

use kvbridge_roles::fuzzing::InboxHarness;
use libfuzzer_sys::fuzz_target;

/// The message names of both directions.
const NAMES: [&[u8]; 8] = [
    b"STATE_DATA",
    b"AUX_DATA",
    b"ABORT_ACK",
    b"CHUNK_READY",
    b"STAGING_REQ",
    b"ABORT",
    b"WATERMARK",
    b"STAGING_RSP",
];

fn harness(secret: bool) -> &'static Mutex<InboxHarness> {
    static OPEN: OnceLock<Mutex<InboxHarness>> = OnceLock::new();
    static SECRET: OnceLock<Mutex<InboxHarness>> = OnceLock::new();
    let (cell, start): (_, fn() -> Result<InboxHarness, String>) = if secret {
        (&SECRET, InboxHarness::secret)
    } else {
        (&OPEN, InboxHarness::new)
    };
    cell.get_or_init(|| match start() {
        Ok(h) => Mutex::new(h),
        Err(e) => panic!("the inbox harness cannot start: {e}"),
    })
}

/// Splits the input into messages (see the file comment).
fn messages(mut data: &[u8]) -> Vec<(u8, Vec<Vec<u8>>)> {
    let mut out = Vec::new();
    while data.len() >= 2 && out.len() < 64 {
        let (target, count) = (data[0], usize::from(data[1] % 12));
        data = &data[2..];
        let mut frames = Vec::with_capacity(count);
        for _ in 0..count {
            if data.len() < 2 {
                break;
            }
            let len = usize::from(u16::from_le_bytes([data[0], data[1]])).min(data.len() - 2);
            frames.push(data[2..2 + len].to_vec());
            data = &data[2 + len..];
        }
        if target & 4 != 0
            && let Some(first) = frames.first_mut()
        {
            let pick = first.first().copied().unwrap_or(0);
            *first = NAMES[usize::from(pick) % NAMES.len()].to_vec();
        }
        out.push((target, frames));
    }
    out
}

fuzz_target!(|data: &[u8]| {
    for (target, frames) in messages(data) {
        let mut h = match harness(target & 8 != 0).lock() {
            Ok(h) => h,
            Err(poisoned) => poisoned.into_inner(),
        };
        if target & 1 == 1 {
            h.feed_prefill(&frames);
        } else {
            h.feed_decode(&frames);
        }
        if target & 2 != 0 {
            h.poll();
        }
        if let Err(e) = h.check() {
            panic!("invariant broken after {frames:?}: {e}");
        }
    }
});
