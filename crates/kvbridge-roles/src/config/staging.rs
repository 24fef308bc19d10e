//! The staging path's settings (heterogeneous TP): whether a rank stages,
//! and the sizes of its ring and gather memory.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::duration_secs;
use crate::env::{Vars, env, env_bool, process_env};

/// Whether a rank stages heterogeneous-TP transfers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StagingMode {
    /// Never: head slices go per slice (strided runs where the engine
    /// copies runs).
    Off,
    /// Always where the pairing can stage (sglang's
    /// `SGLANG_DISAGG_STAGING_BUFFER=1`).
    On,
    /// Where the engine moves head slices faster staged than per slice
    /// (`TransferEngine::prefers_staging`: UCX; TCP with KV in device
    /// memory); the choice is logged once at start.
    #[default]
    Auto,
}

impl<'de> Deserialize<'de> for StagingMode {
    /// `"off" | "on" | "auto"`, or a bool (`true` = on, `false` = off: the
    /// `enabled` field of configuration files written before the mode).
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Repr {
            Flag(bool),
            Name(String),
        }
        match Repr::deserialize(d)? {
            Repr::Flag(true) => Ok(StagingMode::On),
            Repr::Flag(false) => Ok(StagingMode::Off),
            Repr::Name(name) => name.parse().map_err(serde::de::Error::custom),
        }
    }
}

impl std::str::FromStr for StagingMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "off" => Ok(StagingMode::Off),
            "on" => Ok(StagingMode::On),
            "auto" => Ok(StagingMode::Auto),
            other => Err(format!(
                "staging mode {other:?}: expected \"on\", \"off\" or \"auto\""
            )),
        }
    }
}

impl std::fmt::Display for StagingMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StagingMode::Off => "off",
            StagingMode::On => "on",
            StagingMode::Auto => "auto",
        })
    }
}

/// The staging path for heterogeneous TP (sglang's
/// `SGLANG_DISAGG_STAGING_BUFFER`): a prefill rank gathers a chunk's head
/// slices for one decode rank into one contiguous write into the decode's
/// staging ring, which the decode scatters into its pages. Both sides must
/// stage; a pair that cannot stage (equal TP, MLA, PP, draft layers) takes
/// the per-slice path.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StagingConfig {
    /// Whether this rank stages: `on`, `off` or `auto` (the default), or
    /// as `enabled` with a bool (`SGLANG_DISAGG_STAGING_BUFFER`).
    #[serde(alias = "enabled")]
    pub mode: StagingMode,
    /// Decode: the staging ring's size in bytes
    /// (`SGLANG_DISAGG_STAGING_POOL_SIZE_MB` × 2^20; sglang's default 4096 MiB).
    pub pool_bytes: u64,
    /// Tokens per staging chunk (sglang's `--chunked-prefill-size`, 8192):
    /// a room's pages are staged in slots of this many tokens.
    pub chunk_tokens: u64,
    /// Prefill: each transfer worker's gather memory in bytes, used as
    /// [`STAGING_SLOTS`] slots so gathering one piece overlaps writing the
    /// previous ones; a chunk larger than a slot is written in several
    /// pieces, never refused (a slot holds at least one layer of a chunk).
    pub buffer_bytes: u64,
    /// Prefill: longest a chunk waits for its ring allocation or for ring
    /// space (back-pressure) before its room fails.
    #[serde(with = "duration_secs")]
    pub wait_timeout: Duration,
}

/// Gather slots per prefill transfer worker.
pub const STAGING_SLOTS: u64 = 4;

impl Default for StagingConfig {
    fn default() -> Self {
        Self {
            mode: StagingMode::Auto,
            pool_bytes: 4096 << 20,
            chunk_tokens: 8192,
            buffer_bytes: 64 << 20,
            wait_timeout: Duration::from_secs(60),
        }
    }
}

impl StagingConfig {
    /// Applies sglang's staging environment variables over `self`.
    pub fn with_env(self) -> Self {
        self.with_vars(&process_env)
    }

    /// [`StagingConfig::with_env`] reading variables from `get`.
    pub fn with_vars(mut self, get: Vars<'_>) -> Self {
        if let Some(v) = env_bool(get, "SGLANG_DISAGG_STAGING_BUFFER") {
            self.mode = if v { StagingMode::On } else { StagingMode::Off };
        }
        if let Some(v) = env::<u64>(get, "SGLANG_DISAGG_STAGING_POOL_SIZE_MB") {
            self.pool_bytes = v.saturating_mul(1 << 20);
        }
        self
    }

    /// Pages per staging chunk for `page_size`-token pages.
    pub fn chunk_pages(&self, page_size: u64) -> u64 {
        (self.chunk_tokens / page_size.max(1)).max(1)
    }
}
