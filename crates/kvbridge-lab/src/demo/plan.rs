//! What a demo run starts: the model, the workload and one rank file per
//! prefill and decode process, from the demo's flags.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use kvbridge_engine::{EngineConfig, TcpConfig};
use kvbridge_roles::decode::topology::{self, LocalTopology};
use kvbridge_roles::synthetic::{ModelSpec, Placement, RankSpec};
use kvbridge_roles::{DecodeConfig, PrefillConfig, StagingConfig};
use kvbridge_wire::bootstrap::PrefillServerInfo;

use super::DemoArgs;
use crate::rank::workload::Workload;
use crate::rank::{EngineKind, ModelChoice, RankFile};

pub(super) struct Plan {
    pub(super) model: ModelSpec,
    pub(super) workload: Workload,
    pub(super) prefill_files: Vec<RankFile>,
    pub(super) decode_files: Vec<RankFile>,
}

/// Refuses GPU options on a machine without CUDA, with one clear line.
fn check_gpu(args: &DemoArgs) -> Result<()> {
    let wants_gpu = args.device.is_some() || args.engine == EngineKind::Ipc;
    if !wants_gpu {
        return Ok(());
    }
    crate::gpu::require_cuda("--device and --engine ipc")
}

/// The most requests a demo run takes (each prefill rank fills its pages
/// for all of them up front).
const MAX_REQUESTS: u64 = 2_000_000;

/// Refuses sizes that cannot make a run, naming the flag (none is clamped).
fn validate_sizes(args: &DemoArgs) -> Result<()> {
    let at_least_one = [
        ("requests", args.requests),
        ("prompt-tokens", args.prompt_tokens),
        ("chunk-tokens", args.chunk_tokens),
        ("concurrency", args.concurrency as u64),
        ("page-size", args.page_size.unwrap_or(1)),
        ("layers", args.layers.unwrap_or(1)),
    ];
    for (name, v) in at_least_one {
        if v == 0 {
            bail!("--{name} must be at least 1");
        }
    }
    if args.requests > MAX_REQUESTS {
        bail!(
            "--requests {} is more than a demo run takes ({MAX_REQUESTS})",
            args.requests
        );
    }
    for (name, v) in [
        ("room-timeout-s", args.room_timeout_s),
        ("fault-secs", args.fault_secs),
        ("drain-after-s", args.drain_after_s.unwrap_or(1.0)),
    ] {
        if !(v.is_finite() && v > 0.0 && v <= 86_400.0) {
            bail!("--{name} must be a number of seconds above 0 (at most a day), not {v}");
        }
    }
    if !(0.0..=1.0).contains(&args.abort_fraction) {
        bail!(
            "--abort-fraction must be between 0 and 1, not {}",
            args.abort_fraction
        );
    }
    Ok(())
}

/// Refuses a prefill/decode pairing that every decode rank's topology
/// lookup would reject (TP sizes neither of which divides the other, DCP
/// against a CP prefill, ...), with the rule the decode ranks apply.
fn check_pairing(args: &DemoArgs, model: &ModelSpec) -> Result<()> {
    let info: PrefillServerInfo = serde_json::from_value(serde_json::json!({
        "attn_tp_size": args.prefill_tp,
        "attn_cp_size": args.prefill_cp,
        "dp_size": args.dp,
        "pp_size": args.prefill_pp,
        "page_size": model.page_size,
        "kv_cache_dtype": "auto",
        "follow_bootstrap_room": true,
    }))
    .context("building the prefill topology")?;
    for rank in 0..args.decode_tp {
        let local = LocalTopology {
            attn_tp_size: args.decode_tp,
            engine_rank: rank,
            pp_size: 1,
            pp_rank: 0,
            page_size: model.page_size,
            is_mla: model.mla,
            is_hybrid_mla: false,
            all_cp_ranks: args.all_cp_ranks,
            dcp_size: args.decode_cp,
        };
        topology::resolve(&info, &local, "auto", None).map_err(|e| {
            anyhow::anyhow!(
                "--prefill-tp {} --prefill-pp {} --prefill-cp {} cannot feed --decode-tp {} \
                 --decode-cp {}: {e}",
                args.prefill_tp,
                args.prefill_pp,
                args.prefill_cp,
                args.decode_tp,
                args.decode_cp
            )
        })?;
    }
    Ok(())
}

pub(super) fn plan(args: &DemoArgs, bootstrap: SocketAddr) -> Result<Plan> {
    check_gpu(args)?;
    let mut model = ModelSpec::preset(&args.model)
        .with_context(|| format!("unknown model {:?}", args.model))?;
    validate_sizes(args)?;
    if let Some(p) = args.page_size {
        model.page_size = p;
    }
    if let Some(l) = args.layers {
        model.layers = l;
        if let Some(c) = &mut model.compressed {
            c.ratios.resize(model.layers as usize, 0);
        }
    }
    if args.hisparse && model.compressed.is_none() {
        bail!(
            "--hisparse needs a compressed-MLA model (deepseek-v4), not {}",
            model.name
        );
    }
    model.draft_layers = args.draft_layers;
    for (name, v) in [
        ("prefill-tp", args.prefill_tp),
        ("prefill-pp", args.prefill_pp),
        ("decode-tp", args.decode_tp),
        ("decode-cp", args.decode_cp),
        ("prefill-cp", args.prefill_cp),
        ("dp", args.dp),
    ] {
        if v == 0 {
            bail!("--{name} must be at least 1");
        }
    }
    if args.prefill_pp > model.layers {
        bail!(
            "--prefill-pp {} exceeds the model's {} layers",
            args.prefill_pp,
            model.layers
        );
    }
    if args.decode_cp > 1 {
        if !model.mla {
            bail!(
                "--decode-cp needs an MLA model (deepseek-v3), not {}",
                model.name
            );
        }
        if !args.decode_tp.is_multiple_of(args.decode_cp) {
            bail!(
                "--decode-cp {} must divide --decode-tp {}",
                args.decode_cp,
                args.decode_tp
            );
        }
    }
    for tp in [args.prefill_tp, args.decode_tp] {
        model
            .validate(tp)
            .map_err(|e| anyhow::anyhow!("--model {} at TP {tp}: {e}", model.name))?;
    }
    check_pairing(args, &model)?;
    let workload = Workload {
        requests: args.requests,
        prompt_tokens: args.prompt_tokens,
        chunk_tokens: args.chunk_tokens,
        concurrency: args.concurrency,
        seed: args.seed,
        abort_fraction: args.abort_fraction,
        only: None,
        from: 0,
        room_timeout_s: args.room_timeout_s,
        forward_s: 0.0,
        dp_size: args.dp,
        dp_rank: None,
        dp_round_robin: args.dp_round_robin,
    };
    let requests = workload.requests();
    let pages_of = |r: &crate::rank::workload::Request| Workload::pages(r.tokens, model.page_size);
    let max_pages = requests.iter().map(pages_of).max().unwrap_or(1);
    let all_pages: u64 = requests.iter().map(pages_of).sum();
    let window = workload.concurrency as u64 * max_pages;
    let prefill_pages = all_pages.min(window * 8).max(window) + 1;
    let decode_pages = window + max_pages + 1;
    let engine = EngineConfig {
        // Chunks of a few MiB: 2 MiB requests spread one chunk's batch over
        // the engine's connections (measured best on loopback).
        tcp: TcpConfig {
            request_bytes: 2 << 20,
            ..TcpConfig::default()
        },
        io_timeout_ms: args
            .engine_io_timeout_ms
            .unwrap_or(EngineConfig::default().io_timeout_ms),
        ..EngineConfig::default()
    };
    // A killed decode can take a room's transfer request down with it (sent
    // but not yet delivered): that prefill room then waits out this
    // timeout, so the fault demo uses a short one.
    let bootstrap_timeout = if args.kill_decode_after.is_some() {
        Duration::from_secs(10)
    } else {
        Duration::from_secs(120)
    };
    // The staging grid follows the prefill chunks, as sglang's follows
    // its chunked-prefill size.
    let staging = StagingConfig {
        mode: args.staging,
        pool_bytes: args.staging_pool_mb.saturating_mul(1 << 20),
        chunk_tokens: workload.chunk_tokens,
        ..StagingConfig::default()
    };
    let timeouts = |p: &mut PrefillConfig| {
        p.bootstrap_timeout = bootstrap_timeout;
        // A restarted bootstrap server (`--fault bootstrap-down`) knows the
        // prefill ranks again within 2 s.
        p.bootstrap_refresh = Duration::from_secs(2);
        p.probe.interval = Duration::from_millis(200);
    };
    let mut prefill_files = Vec::new();
    // Both sides are kvbridge: with PP, pair buffers by layer id, exact for
    // any split of the layers. Without ids (sglang's plain pools) positional
    // K/V-halves pairing assumes equal stages: an uneven split (3 layers over
    // 2 stages) is read as "the decode has draft layers" and V lands on the
    // wrong buffers (docs/sglang.md, "Layer ids").
    // Hybrid models publish layer ids like sglang's hybrid pools: their KV
    // buffers are only the full-attention layers.
    let publish_layer_ids =
        (args.prefill_pp > 1 || model.full_attention_interval > 1) && model.compressed.is_none();
    let ranks = (0..args.dp).flat_map(|dp| {
        (0..args.prefill_pp).flat_map(move |pp| {
            (0..args.prefill_cp)
                .flat_map(move |cp| (0..args.prefill_tp).map(move |tp| (dp, pp, cp, tp)))
        })
    });
    for (dp, pp, cp, tp) in ranks {
        {
            let mut prefill = PrefillConfig {
                bootstrap_addr: bootstrap.to_string(),
                nvlink_intra: args.nvlink_intra,
                staging: staging.clone(),
                all_cp_ranks: args.all_cp_ranks,
                ..PrefillConfig::default()
            };
            // Every CP rank holds the whole KV of its TP slice.
            prefill.rank.attn_cp_size = args.prefill_cp;
            prefill.rank.attn_cp_rank = cp;
            // DP groups share the bootstrap server; each serves its rooms.
            prefill.rank.attn_dp_size = args.dp;
            prefill.rank.attn_dp_rank = dp;
            if args.dp_round_robin {
                prefill.load_balance_method = "round_robin".into();
            }
            timeouts(&mut prefill);
            prefill_files.push(RankFile {
                model: ModelChoice::Spec(model.clone()),
                page_size: None,
                rank: RankSpec {
                    tp_size: args.prefill_tp,
                    tp_rank: tp,
                    pp_size: args.prefill_pp,
                    pp_rank: pp,
                    ..Default::default()
                },
                pages: prefill_pages,
                // A request holds at least one page: no more can hold an
                // aux slot at once than there are pages (a soak plans
                // millions of requests; a slot each cost ~1 KiB apiece).
                aux_slots: (requests.len() as u64).min(prefill_pages)
                    + workload.concurrency as u64
                    + 1,
                engine_kind: args.engine,
                engine: engine.clone(),
                placement: Placement {
                    device: args.device,
                    host_kv_buffers: args.host_kv_buffers,
                    hisparse: false,
                },
                prefill,
                decode: DecodeConfig::default(),
                bootstrap_addr: None,
                workload: Some(Workload {
                    dp_rank: (args.dp > 1).then_some(dp),
                    ..workload.clone()
                }),
                publish_layer_ids,
                // Until the decode ranks are done: a restarted decode's
                // retries must find the prefill still answering.
                linger: true,
                supervised: true,
            });
        }
    }
    let decode_files = (0..args.decode_tp)
        .map(|tp| RankFile {
            model: ModelChoice::Spec(model.clone()),
            page_size: None,
            rank: RankSpec {
                tp_size: args.decode_tp,
                tp_rank: tp,
                dcp_size: args.decode_cp,
                dcp_rank: tp % args.decode_cp,
                ..Default::default()
            },
            pages: decode_pages,
            aux_slots: workload.concurrency as u64 + 1,
            engine_kind: args.engine,
            engine: engine.clone(),
            placement: Placement {
                device: args.device,
                host_kv_buffers: 0,
                hisparse: args.hisparse,
            },
            prefill: PrefillConfig::default(),
            decode: DecodeConfig {
                heartbeat_interval: Duration::from_secs(2),
                bootstrap_timeout: Duration::from_secs(60),
                waiting_timeout: Duration::from_secs(120),
                nvlink_intra: args.nvlink_intra,
                staging: staging.clone(),
                all_cp_ranks: args.all_cp_ranks,
                // Short runs: give silent prefill ranks 10 s, not sglang's 30 s.
                abort_ack_timeout: Duration::from_secs(10),
                ..DecodeConfig::default()
            },
            bootstrap_addr: Some(bootstrap.to_string()),
            workload: Some(workload.clone()),
            publish_layer_ids,
            linger: false,
            supervised: true,
        })
        .collect();
    Ok(Plan {
        model,
        workload,
        prefill_files,
        decode_files,
    })
}
