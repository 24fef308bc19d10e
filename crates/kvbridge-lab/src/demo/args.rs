//! `kvbridge demo`'s flags.

use clap::Args;
use kvbridge_roles::StagingMode;

use super::faults::FaultKind;
use crate::rank::EngineKind;

/// `kvbridge demo` flags; every one has a default.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Model preset: `llama3-8b` (MHA/GQA), `deepseek-v3` (MLA),
    /// `deepseek-v32` (MLA + DSA indexer pages), `deepseek-v4` (compressed
    /// MLA: C4 KV, C4 indexer and C128 KV pages), `qwen3-next` (hybrid:
    /// full attention every 4th layer, mamba slots TP-sliced on the rest) or
    /// `gpt-oss` (alternating full and 128-token sliding-window layers).
    #[arg(long, default_value = "llama3-8b")]
    pub(super) model: String,
    /// Speculative draft layers (MTP/EAGLE) after the model's, same KV
    /// shape, on the last prefill stage and every decode rank.
    #[arg(long, default_value_t = 0)]
    pub(super) draft_layers: u64,
    /// Decode ranks as HiSparse decodes (`--model deepseek-v4`): their C4
    /// KV lives in host memory with its own page numbers, the rest in the
    /// device page space (`dst_device_kv_indices`).
    #[arg(long)]
    pub(super) hisparse: bool,
    /// Prefill context parallelism: each prefill TP rank has this many CP
    /// peers holding the same KV; CP rank 0 sends unless `--all-cp-ranks`.
    #[arg(long, default_value_t = 1)]
    pub(super) prefill_cp: u64,
    /// With `--prefill-cp`: every CP rank sends its share of each request
    /// (`SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER`).
    #[arg(long)]
    pub(super) all_cp_ranks: bool,
    /// Prefill data parallelism: this many prefill groups (each TP × CP ×
    /// PP ranks) on one bootstrap server; each room goes to one group.
    #[arg(long, default_value_t = 1)]
    pub(super) dp: u64,
    /// With `--dp`: dispatch rooms round robin instead of by the bootstrap
    /// room; prefills register each room's DP rank and decodes query it.
    #[arg(long)]
    pub(super) dp_round_robin: bool,
    /// Decode context parallelism (MLA models): decode ranks form groups of
    /// this size, each rank holding every N-th token; must divide
    /// `--decode-tp`.
    #[arg(long, default_value_t = 1)]
    pub(super) decode_cp: u64,
    /// Tokens per KV page (default: the preset's).
    #[arg(long)]
    pub(super) page_size: Option<u64>,
    /// Use only this many of the preset's layers (a smaller, faster run).
    #[arg(long)]
    pub(super) layers: Option<u64>,
    /// Prefill attention TP size.
    #[arg(long, default_value_t = 1)]
    pub(super) prefill_tp: u64,
    /// Prefill pipeline stages.
    #[arg(long, default_value_t = 1)]
    pub(super) prefill_pp: u64,
    /// Decode attention TP size.
    #[arg(long, default_value_t = 1)]
    pub(super) decode_tp: u64,
    /// Requests to stream.
    #[arg(long, default_value_t = 32)]
    pub(super) requests: u64,
    /// Mean prompt length in tokens (each request varies ±25%).
    #[arg(long, default_value_t = 256)]
    pub(super) prompt_tokens: u64,
    /// Tokens per prefill chunk.
    #[arg(long, default_value_t = 64)]
    pub(super) chunk_tokens: u64,
    /// Requests in flight per rank.
    #[arg(long, default_value_t = 8)]
    pub(super) concurrency: usize,
    /// Seed for rooms, lengths and aborts.
    #[arg(long, default_value_t = 1)]
    pub(super) seed: u64,
    /// Print one JSON object (stdout) instead of the table.
    #[arg(long)]
    pub(super) json: bool,
    /// Kill decode rank 0 (SIGKILL) after N of its rooms, then restart it.
    #[arg(long)]
    pub(super) kill_decode_after: Option<u64>,
    /// Fraction of requests the decode aborts mid-transfer.
    #[arg(long, default_value_t = 0.0)]
    pub(super) abort_fraction: f64,
    /// Transfer engine.
    #[arg(long, value_enum, default_value = "tcp")]
    pub(super) engine: EngineKind,
    /// Run without a cluster secret (sglang-compatible open mode, every
    /// channel unauthenticated). By default the demo generates a secret and
    /// hands it to its processes through their environment.
    #[arg(long)]
    pub(super) open: bool,
    /// Attack the run from a hostile host without the secret: forged
    /// control messages for the run's rooms to every rank, idle connections
    /// on every engine port, unsigned bootstrap writes. The summary says
    /// what it did; in secret mode the run must not notice.
    #[arg(long)]
    pub(super) rogue: bool,
    /// KV pools in GPU memory (`--device` = GPU 0, `--device N`).
    #[arg(long, num_args = 0..=1, default_missing_value = "0", value_name = "GPU")]
    pub(super) device: Option<i32>,
    /// With `--device`: keep the first N KV buffers of each prefill rank in
    /// host memory, so their blocks take the intra-node host path (STATE_DATA).
    #[arg(long, default_value_t = 0)]
    pub(super) host_kv_buffers: u64,
    /// Intra-node transport mode (as `MC_INTRANODE_NVLINK`): only device
    /// memory goes to the engine, host blocks over zmq. On with `--engine ipc`.
    #[arg(long)]
    pub(super) nvlink_intra: bool,
    /// Heterogeneous TP through the staging path (`on`, as sglang's
    /// `SGLANG_DISAGG_STAGING_BUFFER=1`; a bare `--staging` is `on`): each
    /// prefill rank gathers a chunk's head slices for a decode rank into
    /// one bulk write into that rank's staging ring, which the decode
    /// scatters into its pages. `auto` stages where the engine is faster
    /// staged (UCX; TCP with KV on the GPU), `off` never. Pairs of equal TP,
    /// MLA models and PP stages are not staged.
    #[arg(long, value_name = "on|off|auto", default_value = "auto", num_args = 0..=1,
          default_missing_value = "on")]
    pub(super) staging: StagingMode,
    /// When staging: each decode rank's staging ring, MiB
    /// (`SGLANG_DISAGG_STAGING_POOL_SIZE_MB`).
    #[arg(long, default_value_t = 256)]
    pub(super) staging_pool_mb: u64,
    /// Give up on the whole run after this many seconds.
    #[arg(long, default_value_t = 600)]
    pub(super) timeout_s: u64,
    /// Run as a cluster on this machine (Linux, root): the bootstrap
    /// server and every rank on a host of its own, each a network
    /// namespace with its own address on a bridge.
    #[arg(long)]
    pub(super) netns: bool,
    /// A scripted fault: `partition` (the link between prefill rank 0's
    /// and decode rank 0's hosts; --netns), `stop-decode` (SIGSTOP decode
    /// rank 0), `bootstrap-down` (kill the bootstrap host; --netns),
    /// `random` (one of those each time) or `role-switch` (under load,
    /// prefill hosts become decode hosts and decode hosts prefill hosts;
    /// --netns, as many prefill ranks as decode ranks).
    #[arg(long, value_enum)]
    pub(super) fault: Option<FaultKind>,
    /// With `--fault`: start it once decode rank 0 has concluded this many rooms.
    #[arg(long, default_value_t = 8)]
    pub(super) fault_after: u64,
    /// A decode rank aborts a room not complete after this many seconds.
    #[arg(long, default_value_t = 60.0)]
    pub(super) room_timeout_s: f64,
    /// Engine I/O timeout, ms (default: the engine's 30 s): how long a
    /// transfer to a peer that stopped answering may take before it fails.
    #[arg(long)]
    pub(super) engine_io_timeout_ms: Option<u64>,
    /// With `--fault`: start another this many seconds (half to one and
    /// a half times) after each is undone, until the run ends (a soak).
    #[arg(long)]
    pub(super) fault_every: Option<f64>,
    /// With `--fault`: undo it after this many seconds.
    #[arg(long, default_value_t = 6.0)]
    pub(super) fault_secs: f64,
    /// End the run this many seconds after its first room: no room is
    /// started past then, the ones in flight finish, the rest of the
    /// workload is reported as drained (a soak sized in time).
    #[arg(long, value_name = "SECONDS", conflicts_with = "kill_decode_after")]
    pub(super) drain_after_s: Option<f64>,
}
