//! The CUDA IPC engine: intra-node transfers between processes on the same
//! node (same GPU, or GPUs linked by NVLink / PCIe peer access), the role
//! Mooncake's `nvlink_intra` transport plays for sglang.
//!
//! * Control plane: an engine host started without the data plane
//!   (`tcp::EngineHost`) gives the listening port (on the session layer's
//!   accept loop), session id, authenticated handshake (cluster secret),
//!   incarnation and registry, and refuses every data request; the IPC
//!   engine reaches peers only through the session layer's control
//!   protocol (`session::control`). On the engine wire: `Exports` (the receiver's table of
//!   registered device regions with the CUDA IPC handle of the allocation
//!   holding each), `Lease` / `Release` / `Revoke`: a session *holds* the
//!   peer's regions it copies into across batches; a deregistration on the
//!   receiver revokes the holds on the region and waits until each peer
//!   released, which it does once its copies in flight finished.
//! * Only device memory can be registered (host regions are refused, as by
//!   Mooncake's NVLink transport); host-resident blocks travel over the
//!   roles' zmq channel instead (`STATE_DATA`, see `kvbridge-roles`).
//! * Per peer session: state (control connection, export table, opened IPC
//!   mappings, holds, streams), descriptor slots and a completion thread.
//!   Mappings are opened on first use and cached; closed when the peer
//!   deregisters their region, when the peer restarts (new incarnation:
//!   everything is dropped and fetched again) and at teardown.
//! * A batch is checked (sources in our device regions, destinations in
//!   the peer's table), translated into this process's view of the peer's
//!   memory and packed in one pass (`schedule::prepare`, on several threads
//!   for large batches), uploaded as it is packed and launched on the
//!   session's streams once all of it checked out: large blocks with
//!   `cuMemcpyAsync`, the others with one batched copy kernel (`schedule`
//!   decides, `kernel` holds the source). Submission returns while the
//!   copy runs; several batches can be in flight.
//! * Measurement: [`CopyBench`] times the copy paths alone on one GPU
//!   (for `kvbridge bench ipc` and the GPU tests), on device buffers it
//!   checks every block against; the copy machinery itself stays private.
//!
//! **Never:** registers host memory, copies into a peer's region it does
//! not hold, lets a peer write into its regions over TCP, or imports
//! another transport's internals (its host is the engine wire's serving
//! side alone; peers are reached through the session layer).

// The copy planning and the kernel source are pure (no CUDA): built and
// tested everywhere, used only by the engine the `cuda` feature builds.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) mod idle;
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) mod kernel;
#[cfg_attr(not(feature = "cuda"), allow(dead_code, unused_imports))]
pub(crate) mod schedule;
pub(crate) mod table;

#[cfg(feature = "cuda")]
mod bench;
#[cfg(feature = "cuda")]
mod copier;
#[cfg(feature = "cuda")]
mod engine;
#[cfg(feature = "cuda")]
mod local;
#[cfg(feature = "cuda")]
mod peer;
#[cfg(feature = "cuda")]
mod pipe;

#[cfg(feature = "cuda")]
pub use bench::{BenchError, Copies, CopyBench, KernelPieces};
#[cfg(feature = "cuda")]
pub use copier::CopyStats;
#[cfg(feature = "cuda")]
pub use engine::IpcEngine;
#[cfg(feature = "cuda")]
pub use local::DeviceCopier;
pub use schedule::{CopyMode, CopyTuning};
