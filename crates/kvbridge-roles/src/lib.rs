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

pub mod bootstrap;
pub mod config;
pub mod control;
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
mod staging_mem;
mod stop;

pub use config::{DecodeConfig, ParallelRank, PrefillConfig, ProbeConfig, StagingConfig};
pub use error::{ConfigError, KvTransferError, SendError, StartError};
pub use kv_args::KvArgs;
pub use kvbridge_wire::KvPoll;
pub use local::{nvlink_intra_env, nvlink_intra_vars};
pub use prefill::{KvSender, PrefillManager};
pub mod decode;

pub use decode::{DecodeManager, KvReceiver};
#[cfg(feature = "synthetic")]
pub mod synthetic;
