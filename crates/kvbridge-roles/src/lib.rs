//! # kvbridge-roles
//!
//! The working system around the lower layers: the bootstrap server, the
//! prefill and decode role managers (sglang's `MooncakeKVManager`), and the
//! per-request `KvSender` / `KvReceiver` with their `KVPoll` state machine.
//! Where these docs say "the reference", they mean sglang's Mooncake
//! connector (`sglang/srt/disaggregation/mooncake/conn.py`), whose behaviour
//! and zmq frames the roles match.
//!
//! **Owns:** control-plane sockets (zmq), threads, room state, timeouts,
//! heartbeats, abort, failure recovery and teardown.
//! **Never:** computes byte ranges itself (that is `kvbridge-plan`'s job),
//! moves data-plane bytes except through a `TransferEngine`, or trusts a
//! peer: every frame is decoded by `kvbridge-wire` and every address a peer
//! names is checked against our registered regions.
//!
//! ## Example: one request from a prefill to a decode
//!
//! Both managers run in this process here, over the TCP engine on
//! loopback; in production each rank runs its own, on its own host. The
//! prefill registers its pools with the bootstrap server; the decode looks
//! the prefill up there, allocates pages for the request and tells the
//! prefill where to write; the prefill sends the request's pages chunk by
//! chunk; both sides see `Success` once every byte is known written.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::{Duration, Instant};
//! use kvbridge_engine::{EngineConfig, TcpEngine, TransferEngine};
//! use kvbridge_mem::HostBuffer;
//! use kvbridge_plan::PrefillLayout;
//! use kvbridge_roles::bootstrap::BootstrapServer;
//! use kvbridge_roles::{DecodeConfig, DecodeManager, KvArgs, KvPoll, PrefillConfig,
//!     PrefillManager};
//!
//! const PAGES: usize = 16;
//! const PAGE_BYTES: u64 = 4096; // 16 tokens x 1 KV head x 256 bytes
//! // One layer: a K buffer and a V buffer of PAGES pages, and one aux
//! // (metadata) buffer of 4 slots of 64 bytes.
//! fn pools() -> (Vec<HostBuffer>, HostBuffer) {
//!     let kv = (0..2).map(|_| HostBuffer::new(PAGES * PAGE_BYTES as usize).unwrap());
//!     (kv.collect(), HostBuffer::new(4 * 64).unwrap())
//! }
//! fn kv_args(kv: &[HostBuffer], aux: &HostBuffer) -> KvArgs {
//!     KvArgs {
//!         layout: PrefillLayout {
//!             page_size: 16,
//!             kv_head_num: 1,
//!             kv_data_ptrs: kv.iter().map(HostBuffer::addr).collect(),
//!             kv_item_lens: vec![PAGE_BYTES; kv.len()],
//!             aux_data_ptrs: vec![aux.addr()],
//!             aux_item_lens: vec![64],
//!             ..PrefillLayout::default()
//!         },
//!         kv_data_lens: kv.iter().map(|b| b.len() as u64).collect(),
//!         aux_data_lens: vec![aux.len() as u64],
//!         state_data_lens: Vec::new(),
//!     }
//! }
//! fn engine() -> Arc<dyn TransferEngine> {
//!     Arc::new(TcpEngine::new(EngineConfig::default()).unwrap())
//! }
//! fn wait(mut poll: impl FnMut() -> KvPoll, until: impl Fn(KvPoll) -> bool) -> KvPoll {
//!     let deadline = Instant::now() + Duration::from_secs(20);
//!     loop {
//!         let s = poll();
//!         if until(s) || Instant::now() > deadline {
//!             return s;
//!         }
//!         std::thread::sleep(Duration::from_millis(5));
//!     }
//! }
//!
//! let bootstrap = BootstrapServer::start("127.0.0.1:0".parse()?, Duration::from_secs(120))?;
//! let (mut p_kv, p_aux) = pools();
//! let (d_kv, d_aux) = pools();
//! p_kv[0].as_mut_slice()[3 * 4096..4 * 4096].fill(0xab); // K of prefill page 3
//!
//! let prefill_config = PrefillConfig {
//!     bootstrap_addr: bootstrap.local_addr().to_string(),
//!     ..PrefillConfig::default()
//! };
//! // SAFETY: the pools outlive both managers (torn down below).
//! let prefill = unsafe { PrefillManager::start(prefill_config, kv_args(&p_kv, &p_aux), engine()) }?;
//! let decode = unsafe { DecodeManager::start(DecodeConfig::default(), kv_args(&d_kv, &d_aux), engine()) }?;
//!
//! let room = 42; // the request's bootstrap room, shared by both sides
//! let mut receiver = decode.receiver(&bootstrap.local_addr().to_string(), room);
//! assert_eq!(receiver.init(0), KvPoll::WaitingForInput);
//! receiver.send_metadata(&[10, 11], 0, &[], None); // decode pages 10 and 11, aux slot 0
//!
//! let mut sender = prefill.sender(room);
//! sender.init(2, Some(1)); // 2 pages; prefill aux slot 1
//! wait(|| sender.poll(), |s| s == KvPoll::WaitingForInput);
//! sender.send(&[3], None, None)?; // chunk 1: prefill page 3
//! sender.send(&[4], None, None)?; // the last chunk (all pages sent): page 4 and the aux slot
//! assert_eq!(wait(|| sender.poll(), KvPoll::is_terminal), KvPoll::Success);
//! assert_eq!(wait(|| receiver.poll(), KvPoll::is_terminal), KvPoll::Success);
//! assert!(d_kv[0].as_slice()[10 * 4096..11 * 4096].iter().all(|b| *b == 0xab));
//!
//! prefill.teardown();
//! decode.teardown();
//! bootstrap.shutdown();
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod bootstrap;
pub mod config;
pub mod control;
mod env;
pub mod error;
#[cfg(feature = "synthetic")]
#[doc(hidden)]
pub mod fuzzing;
pub mod health;
mod http;
pub mod kv_args;
mod local;
pub mod metrics;
pub mod prefill;
mod role;
pub mod rooms;
pub mod seal;
pub mod stage;
mod staging_mem;
mod stop;

pub use config::{
    DecodeConfig, ParallelRank, PrefillConfig, ProbeConfig, StagingConfig, StagingMode,
};
pub use env::{nvlink_intra_env, nvlink_intra_vars};
pub use error::{ConfigError, KvTransferError, SendError, StartError};
pub use kv_args::KvArgs;
pub use kvbridge_wire::KvPoll;
pub use prefill::{KvSender, PrefillManager};
pub mod decode;

pub use decode::{DecodeManager, KvReceiver};
#[cfg(feature = "synthetic")]
pub mod synthetic;
