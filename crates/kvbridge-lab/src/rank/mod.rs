//! `kvbridge prefill` / `kvbridge decode`: one rank of a role as a
//! long-running process, configured by a JSON file (or flags), optionally
//! running a synthetic workload (what `kvbridge demo` starts).
//!
//! Progress goes to stdout as one JSON event per line, for the demo (or any
//! supervisor) to read; logs go to stderr.

pub mod control;
mod decode;
pub mod events;
mod prefill;
pub mod workload;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use clap::Args;
use kvbridge_engine::{EngineConfig, TransferEngine, Transport};
use kvbridge_roles::synthetic::{ModelSpec, Placement, RankPools, RankSpec};
use kvbridge_roles::{DecodeConfig, KvArgs, PrefillConfig};
use serde::{Deserialize, Serialize};

pub use workload::Workload;

/// A model given by preset name or in full.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ModelChoice {
    /// A preset (`llama3-8b`, `deepseek-v3`).
    Preset(String),
    /// A full description.
    Spec(ModelSpec),
}

impl ModelChoice {
    /// The model this names.
    pub fn resolve(&self) -> Result<ModelSpec> {
        match self {
            ModelChoice::Preset(name) => {
                ModelSpec::preset(name).with_context(|| format!("unknown model preset {name:?}"))
            }
            ModelChoice::Spec(spec) => Ok(spec.clone()),
        }
    }
}

/// Which transfer engine a rank uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// The TCP engine (any machine).
    #[default]
    Tcp,
    /// The CUDA IPC engine (intra-node, device memory; `cuda` feature).
    Ipc,
    /// The UCX engine (RDMA, shared memory or TCP, as `UCX_TLS` says; `ucx` feature).
    Ucx,
}

/// Everything one rank process needs.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankFile {
    /// The KV shape.
    pub model: ModelChoice,
    /// Page size override (tokens per page).
    #[serde(default)]
    pub page_size: Option<u64>,
    /// Where this rank sits.
    pub rank: RankSpec,
    /// KV pages per buffer in this rank's pools.
    pub pages: u64,
    /// Aux slots per aux buffer.
    #[serde(default = "default_aux_slots")]
    pub aux_slots: u64,
    /// Transfer engine.
    #[serde(default)]
    pub engine_kind: EngineKind,
    /// Transfer engine settings.
    #[serde(default)]
    pub engine: EngineConfig,
    /// Where the KV pools live (host by default, or a GPU).
    #[serde(default)]
    pub placement: Placement,
    /// Prefill settings (prefill ranks).
    #[serde(default)]
    pub prefill: PrefillConfig,
    /// Decode settings (decode ranks).
    #[serde(default)]
    pub decode: DecodeConfig,
    /// Decode ranks: the prefill server's bootstrap address.
    #[serde(default)]
    pub bootstrap_addr: Option<String>,
    /// A synthetic workload to run, then exit; none: serve until SIGTERM.
    #[serde(default)]
    pub workload: Option<Workload>,
    /// Publish `kv_layer_ids` (pair buffers by layer id, as sglang's hybrid
    /// pools do); off: none, as sglang publishes for a plain MHA/MLA pool.
    /// Both peers must agree when PP > 1.
    #[serde(default)]
    pub publish_layer_ids: bool,
    /// Prefill ranks: after the workload, keep serving (late transfer
    /// requests, aborts) until stdin closes, so a peer's retry gets an answer.
    #[serde(default)]
    pub linger: bool,
    /// Started by a supervisor (the demo) that holds this rank's stdin:
    /// when stdin closes the supervisor is gone (or done), and the rank
    /// exits at once rather than outlive it.
    #[serde(default)]
    pub supervised: bool,
}

fn default_aux_slots() -> u64 {
    64
}

impl RankFile {
    /// The model with the page size override applied.
    pub fn model(&self) -> Result<ModelSpec> {
        let mut m = self.model.resolve()?;
        if let Some(p) = self.page_size {
            if p == 0 {
                bail!("page_size must be at least 1");
            }
            m.page_size = p;
        }
        Ok(m)
    }

    /// This rank's registration of `pools`, with or without layer ids.
    pub fn kv_args(&self, pools: &RankPools) -> KvArgs {
        if self.publish_layer_ids {
            pools.kv_args_with_layer_ids()
        } else {
            pools.kv_args()
        }
    }

    /// The transfer engine this rank uses.
    pub fn engine(&self) -> Result<Arc<dyn TransferEngine>> {
        let transport = match self.engine_kind {
            EngineKind::Tcp => Transport::Tcp,
            EngineKind::Ipc => Transport::Ipc,
            EngineKind::Ucx => Transport::Ucx,
        };
        Ok(kvbridge_engine::factory::build(transport, &self.engine)?)
    }
}

/// Arguments of `kvbridge prefill` / `kvbridge decode`: a configuration
/// file, flags, or a file with flags overriding it.
#[derive(Debug, Args)]
pub struct RankArgs {
    /// The rank's JSON configuration file (see `docs/roles.md`).
    #[arg(long)]
    config: Option<PathBuf>,
    /// The bootstrap server (`host:port`): where a prefill registers and a
    /// decode looks prefill ranks up. Either role exits with the reason when
    /// it is malformed, or unreachable for 30 s at start-up.
    #[arg(long)]
    bootstrap_addr: Option<String>,
    /// Model preset (`llama3-8b`, `deepseek-v3`).
    #[arg(long)]
    model: Option<String>,
    /// Attention TP size and this rank's TP rank.
    #[arg(long, num_args = 2, value_names = ["SIZE", "RANK"])]
    tp: Option<Vec<u64>>,
    /// Pipeline size and this rank's PP rank.
    #[arg(long, num_args = 2, value_names = ["SIZE", "RANK"])]
    pp: Option<Vec<u64>>,
    /// KV pages per buffer.
    #[arg(long)]
    pages: Option<u64>,
    /// The IP peers reach this rank's control socket at.
    #[arg(long)]
    local_ip: Option<String>,
    /// Host the transfer engine listens on (and advertises).
    #[arg(long)]
    engine_host: Option<String>,
    /// Port the transfer engine listens on (0 picks one).
    #[arg(long)]
    engine_port: Option<u16>,
    /// File holding the cluster secret that guards every channel (engine,
    /// control plane, bootstrap writes). Without it the secret comes from
    /// the environment (KVBRIDGE_SECRET_FILE, then KVBRIDGE_SECRET); with
    /// neither the rank runs in open mode (sglang-compatible, unauthenticated).
    #[arg(long, value_name = "PATH")]
    secret_file: Option<std::path::PathBuf>,
    /// Transfer engine (overrides the file's `engine_kind`); the UCX engine
    /// takes its transports from UCX's environment (`UCX_TLS`, ...).
    #[arg(long, value_enum)]
    engine: Option<EngineKind>,
    /// Serve Prometheus metrics on this address.
    #[arg(long)]
    metrics_addr: Option<std::net::SocketAddr>,
    /// The zmq control port peers send to (default: any free port).
    #[arg(long)]
    control_port: Option<u16>,
}

impl RankArgs {
    /// The configuration: the file (if any) with the flags applied over it.
    fn resolve(self) -> Result<RankFile> {
        let mut file = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading {}", path.display()))?;
                serde_json::from_str(&text)
                    .with_context(|| format!("parsing {}", path.display()))?
            }
            None => RankFile {
                model: ModelChoice::Preset("llama3-8b".into()),
                page_size: None,
                rank: RankSpec {
                    tp_size: 1,
                    tp_rank: 0,
                    pp_size: 1,
                    pp_rank: 0,
                    ..Default::default()
                },
                pages: 1024,
                aux_slots: default_aux_slots(),
                engine_kind: EngineKind::Tcp,
                engine: EngineConfig::default(),
                placement: Placement::default(),
                prefill: PrefillConfig::default(),
                decode: DecodeConfig::default(),
                bootstrap_addr: None,
                workload: None,
                publish_layer_ids: false,
                linger: false,
                supervised: false,
            },
        };
        if let Some(addr) = self.bootstrap_addr {
            file.prefill.bootstrap_addr = addr.clone();
            file.bootstrap_addr = Some(addr);
        }
        if let Some(m) = self.model {
            file.model = ModelChoice::Preset(m);
        }
        if let Some(tp) = self.tp {
            file.rank.tp_size = tp[0];
            file.rank.tp_rank = tp[1];
        }
        if let Some(pp) = self.pp {
            file.rank.pp_size = pp[0];
            file.rank.pp_rank = pp[1];
        }
        if let Some(p) = self.pages {
            file.pages = p;
        }
        if let Some(ip) = self.local_ip {
            file.prefill.local_ip = ip.clone();
            file.decode.local_ip = ip;
        }
        if let Some(h) = self.engine_host {
            file.engine.listen_host = h;
        }
        if let Some(p) = self.engine_port {
            file.engine.port = p;
        }
        let secret = kvbridge_engine::ClusterSecret::load(self.secret_file.as_deref())?;
        if file.engine.secret.is_some() {
            bail!(
                "the configuration file sets engine.secret; keep the cluster secret out of \
                 configuration files and pass it with --secret-file or KVBRIDGE_SECRET_FILE"
            );
        }
        file.engine.secret = secret.as_ref().map(|s| s.to_env_value());
        file.prefill.secret = secret.clone();
        file.decode.secret = secret;
        if let Some(kind) = self.engine {
            file.engine_kind = kind;
        }
        if let Some(port) = self.control_port {
            file.prefill.control_port = port;
            file.decode.control_port = port;
        }
        if let Some(m) = self.metrics_addr {
            file.prefill.metrics_addr = Some(m);
            file.decode.metrics_addr = Some(m);
        }
        if file.rank.tp_size == 0 || file.rank.tp_rank >= file.rank.tp_size {
            bail!(
                "TP rank {} is outside TP size {}",
                file.rank.tp_rank,
                file.rank.tp_size
            );
        }
        if file.rank.pp_size == 0 || file.rank.pp_rank >= file.rank.pp_size {
            bail!(
                "PP rank {} is outside PP size {}",
                file.rank.pp_rank,
                file.rank.pp_size
            );
        }
        file.prefill = file.prefill.clone().with_env();
        file.decode = file.decode.clone().with_env();
        Ok(file)
    }
}

/// Pools from this size on are announced before they are allocated (and
/// filled or verified), which takes seconds per GiB.
const ANNOUNCE_POOL_BYTES: u64 = 2 << 30;

/// Says on stderr how much KV memory `role` is about to allocate when it is
/// a lot, so that a slow start is not a silent one.
fn announce_pools(role: &str, file: &RankFile, model: &ModelSpec) {
    let tokens = file.pages.saturating_mul(model.page_size);
    let tp = file.rank.tp_size.max(1);
    let bytes = model.token_bytes().saturating_mul(tokens) / tp.min(model.kv_heads.max(1));
    if bytes >= ANNOUNCE_POOL_BYTES {
        eprintln!(
            "kvbridge {role} rank {}: allocating about {:.1} GiB of KV pools ({} pages per \
             buffer); this takes a few seconds per GiB",
            file.rank.tp_rank,
            bytes as f64 / (1u64 << 30) as f64,
            file.pages
        );
    }
}

/// Which role a rank process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A prefill rank.
    Prefill,
    /// A decode rank.
    Decode,
}

/// Loads the configuration and runs the rank.
pub fn run(role: Role, args: RankArgs) -> ExitCode {
    let result = (|| -> Result<bool> {
        let file = args.resolve()?;
        if file.supervised {
            control::follow_supervisor()?;
        }
        match role {
            Role::Prefill => prefill::run(&file),
            Role::Decode => decode::run(&file),
        }
    })();
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("kvbridge: {e:#}");
            events::emit(&events::Event::Error {
                message: format!("{e:#}"),
            });
            ExitCode::FAILURE
        }
    }
}
