"""kvbridge as sglang's PD transfer backend: ``KVManager``, ``KVSender``,
``KVReceiver`` and ``KVBootstrapServer`` implement sglang 0.5.23's backend
contract (``sglang/srt/disaggregation/base/conn.py``) with the constructor
signatures of its Mooncake classes, each a thin shell over kvbridge's Rust
roles (``kvbridge._kvbridge.PrefillManager`` / ``DecodeManager`` /
``BootstrapServer``).

Planning, transfers, heartbeats, aborts (acknowledged only once a room's
writes drained) and recovery (restarted peers, failed-session probes) run on
the roles' Rust threads. Index arrays cross as numpy arrays read in place;
``poll()`` reads the room state the Rust threads keep current, so the
scheduler does no Python work per transfer.

``kvbridge.sglang`` (``KVBRIDGE_SGLANG=backend``) makes sglang's
``--disaggregation-transfer-backend mooncake`` resolve to these classes.
Every sglang environment variable and server argument the Mooncake connector
reads is either mapped onto the roles' configuration or refused at start
with the reason (:func:`role_settings`; the table is in docs/sglang.md).

Importing this module imports sglang's disaggregation package.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import threading
from typing import Dict, List, Optional, Tuple

from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVPoll,
    KVTransferDestination,
    KVTransferMetric,
)
from sglang.srt.disaggregation.common.conn import KVTransferError
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.environ import envs
from sglang.srt.runtime_context import (
    get_disagg,
    get_memory,
    get_observability,
    get_parallel,
    get_schedule,
    get_serving,
)

from . import _kvbridge

logger = logging.getLogger(__name__)

__all__ = [
    "BackendConfigError",
    "KVBootstrapServer",
    "KVManager",
    "KVReceiver",
    "KVSender",
    "role_settings",
]


class BackendConfigError(ValueError):
    """A setting of sglang's that the kvbridge backend cannot honour; the
    message names each one and why."""


# ---------------------------------------------------------------------------
# Settings: sglang's environment and server arguments -> the roles' config
# ---------------------------------------------------------------------------

#: Environment variables the kvbridge backend refuses when set, with why.
REFUSED_ENV = {
    "SGLANG_RUST_SERVER": "the Rust HTTP server's bootstrap registry is not supported with this backend",
}

#: SGLANG_MOONCAKE_CUSTOM_MEM_POOL values that allocate the KV pools with a
#: Mooncake allocator (fabric-exportable memory kvbridge's engines do not
#: reach); INTRA_NODE_NVLINK allocates nothing and only splits Mooncake's
#: submissions, which kvbridge batches its own way.
REFUSED_MEM_POOLS = ("NVLINK", "BAREX")


def _env(name: str):
    """sglang's value of ``envs.<name>``; a malformed value is refused (sglang
    itself would fall back to the default with a warning)."""
    field = getattr(envs, name)
    if not field.is_set():
        return field.get()
    raw = os.environ[name]
    try:
        return field.parse(raw)
    except ValueError as e:
        raise BackendConfigError(f"{name}={raw!r} is malformed: {e}") from None


def _refusals(mode: DisaggregationMode, kv_args: KVArgs) -> List[str]:
    """Every setting in force that the backend cannot honour."""
    out = []
    for name, why in REFUSED_ENV.items():
        value = _env(name)
        if value not in (None, False, "") and getattr(envs, name).is_set():
            out.append(f"{name}={os.environ.get(name)!r}: {why}")
    pool = _env("SGLANG_MOONCAKE_CUSTOM_MEM_POOL")
    if pool is not None and ("NVLINK" if str(pool).lower() == "true" else pool) in REFUSED_MEM_POOLS:
        out.append(f"SGLANG_MOONCAKE_CUSTOM_MEM_POOL={os.environ.get('SGLANG_MOONCAKE_CUSTOM_MEM_POOL')!r}: "
                   "Mooncake's custom memory pools (NVLINK/BAREX allocators) are Mooncake-specific")
    parallel, disagg = get_parallel(), get_disagg()
    policy = disagg.disaggregation_decode_allocation_policy
    if policy != "early":
        out.append(f"--disaggregation-decode-allocation-policy {policy}: only 'early' is supported")
    if parallel.attn_cp_size > 1 and mode == DisaggregationMode.DECODE:
        out.append(f"attention context parallelism on decode (attn_cp_size={parallel.attn_cp_size}): sglang "
                   "requires 1")
    for flag in ("enable_kv_cache_sharding", "enable_dsa_cache_layer_split", "enable_cp_tp_group_sharing"):
        if getattr(parallel, flag, False):
            out.append(f"--{flag.replace('_', '-')}: not supported")
    if get_observability().enable_trace:
        out.append("--enable-trace: per-request connector traces are not emitted by kvbridge's roles")
    if getattr(kv_args, "rust_http_port", None) is not None:
        out.append("a Rust HTTP server bootstrap registry (rust_http_port): not supported")
    if mode == DisaggregationMode.DECODE and _hisparse_enabled():
        out.extend(_hisparse_refusals(kv_args, parallel))
    return out


def _hisparse_enabled() -> bool:
    """Whether this server runs HiSparse (``--enable-hisparse``), read where
    sglang's scheduler reads it (``get_memory().enable_hisparse``). sglang
    0.5.23 marks it in no ``KVArgs`` field outside NIXL: a HiSparse decode's
    ``kv_data_ptrs`` simply start with its host pool's buffers."""
    return bool(getattr(get_memory(), "enable_hisparse", False))


def _hisparse_refusals(kv_args: KVArgs, parallel) -> List[str]:
    """What a HiSparse decode asks that the roles cannot do. sglang sends
    device pages (``device_kv_indices``) beside the host pages for a
    DeepSeek-V4 pool (every KV buffer after the C4 KV group) or when a
    draft model's KV is appended; the roles place them only in a
    compressed-MLA pool, and not through the DCP relayout."""
    compressed = getattr(kv_args, "mla_compression_ratios", None) is not None
    draft = int(getattr(kv_args, "num_draft_entries", 0) or 0) > 0
    out = []
    if draft and not compressed:
        out.append("HiSparse (--enable-hisparse) with a draft model on a KV pool without compression ratios "
                   "(sglang sends the draft KV's device pages, device_kv_indices, which kvbridge's "
                   "roles place only in a compressed-MLA, DeepSeek-V4, pool)")
    dcp = getattr(parallel, "attn_dcp_size", 1) or 1
    if (draft or compressed) and dcp > 1:
        out.append(f"HiSparse (--enable-hisparse) with decode context parallelism (attn_dcp_size={dcp}): HiSparse "
                   "device pages cannot take the DCP relayout")
    return out


def _bootstrap_host() -> str:
    """The bootstrap server a prefill registers with, as sglang's
    ``register_to_bootstrap`` computes it."""
    dist = get_parallel().dist_init_addr
    if dist:
        from sglang.srt.utils.network import NetworkAddress

        return NetworkAddress.parse(dist).resolved().host
    host = get_serving().host
    return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def role_settings(mode: DisaggregationMode, kv_args: KVArgs, local_ip: str) -> dict:
    """The role configuration (kvbridge's field names) for ``mode``, from
    sglang's environment and server arguments; raises
    :class:`BackendConfigError` listing everything that cannot be honoured."""
    refused = _refusals(mode, kv_args)
    if refused:
        raise BackendConfigError(
            "the kvbridge backend cannot run with: " + "; ".join(refused)
            + " (unset KVBRIDGE_SGLANG to use sglang's own Mooncake connector)"
        )
    parallel = get_parallel()
    common = {
        "local_ip": local_ip,
        "kv_cache_dtype": getattr(kv_args, "kv_cache_dtype_str", None) or "auto",
        "zmq_send_timeout": float(_env("SGLANG_DISAGGREGATION_ZMQ_SEND_TIMEOUT")),
        "zmq_max_sockets": int(_env("SGLANG_DISAGGREGATION_ZMQ_MAX_SOCKETS")),
        "all_cp_ranks": bool(_env("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER")),
        "force_query_dp_rank": bool(_env("SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK")),
    }
    deferred = bool(_env("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"))
    common["staging"] = _staging_settings(kv_args)
    if mode == DisaggregationMode.PREFILL:
        host = _bootstrap_host()
        port = get_disagg().disaggregation_bootstrap_port
        pool = _env("SGLANG_DISAGGREGATION_THREAD_POOL_SIZE")
        if pool is None:  # sglang's default, from the CPU count
            pool = min(max(4, int(0.5 * (os.cpu_count() or 1)) // 8), 12)
        return dict(
            common,
            bootstrap_addr=f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
            rank={
                "attn_tp_size": parallel.attn_tp_size,
                "attn_tp_rank": parallel.attn_tp_rank,
                "attn_cp_size": parallel.attn_cp_size,
                "attn_cp_rank": parallel.attn_cp_rank,
                "attn_dp_size": parallel.attn_dp_size,
                "attn_dp_rank": parallel.attn_dp_rank,
                "pp_size": parallel.pp_size,
                "pp_rank": getattr(kv_args, "pp_rank", 0) or 0,
                "system_dp_size": parallel.dp_size,
                "system_dp_rank": getattr(kv_args, "system_dp_rank", 0) or 0,
            },
            queue_size=int(_env("SGLANG_DISAGGREGATION_QUEUE_SIZE")),
            thread_pool_size=int(pool),
            bootstrap_timeout=float(_env("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT")),
            send_aux_tcp=bool(_env("SGLANG_MOONCAKE_SEND_AUX_TCP")),
            # How rooms reach the DP ranks: decodes compute room % dp_size
            # under follow_bootstrap_room, else query what each room's
            # prefill registered.
            load_balance_method=getattr(parallel, "load_balance_method", None) or "follow_bootstrap_room",
            deferred_release=deferred,
            probe={
                "enabled": bool(_env("SGLANG_ENABLE_FAILED_SESSION_PROBE")),
                "interval": float(_env("SGLANG_FAILED_SESSION_PROBE_INTERVAL_S")),
                "max_interval": float(_env("SGLANG_FAILED_SESSION_PROBE_MAX_INTERVAL_S")),
                "idle_timeout": float(_env("SGLANG_FAILED_SESSION_IDLE_TIMEOUT_S")),
            },
        )
    return dict(
        common,
        attn_tp_size=parallel.attn_tp_size,
        pp_size=parallel.pp_size,
        pp_rank=parallel.pp_rank,
        heartbeat_interval=float(_env("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL")),
        heartbeat_max_failures=int(_env("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE")),
        waiting_timeout=float(_env("SGLANG_DISAGGREGATION_WAITING_TIMEOUT")),
        bootstrap_timeout=float(_env("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT")),
        deferred_release=deferred,
        # How long the scheduler holds an aborted room's pages for the ACKs:
        # past it, the role fences the silent prefill ranks.
        abort_ack_timeout=float(_env("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT")),
    )


def _staging_settings(kv_args: KVArgs) -> dict:
    """The roles' staging configuration from ``SGLANG_DISAGG_STAGING_BUFFER``,
    ``SGLANG_DISAGG_STAGING_POOL_SIZE_MB`` and the staging grid sglang's
    scheduler cuts sends on (``staging_grid_tokens`` of the chunked-prefill
    size)."""
    enabled = bool(_env("SGLANG_DISAGG_STAGING_BUFFER"))
    if enabled and envs.SGLANG_STAGING_USE_TORCH.is_set():
        logger.warning(
            "SGLANG_STAGING_USE_TORCH picks sglang's own gather/scatter kernels; the kvbridge "
            "backend stages with its own and ignores it"
        )
    page = max(1, int(getattr(kv_args, "page_size", 1) or 1))
    cps = getattr(get_schedule(), "chunked_prefill_size", None) or 8192
    if enabled and (cps <= 0 or cps % page != 0):
        raise BackendConfigError(
            f"SGLANG_DISAGG_STAGING_BUFFER requires a positive chunked_prefill_size that is a "
            f"multiple of page_size ({page}); got {cps}"
        )
    return {
        "enabled": enabled,
        "pool_bytes": int(_env("SGLANG_DISAGG_STAGING_POOL_SIZE_MB")) << 20,
        "chunk_tokens": max(1, cps // page) * page,
    }


class _StagingRing:
    """What sglang's scheduler checks of a staging allocator when
    ``SGLANG_DISAGG_STAGING_BUFFER`` is set (its ``DecodeStagingHandler``
    is created against the manager): kvbridge's decode ring. sglang's
    handler is never handed a room (every receiver says
    ``require_staging = False``); the Rust decode role allocates, scatters
    and reports watermarks itself."""

    def __init__(self, base_ptr: int, total_size: int):
        self.base_ptr = base_ptr
        self.total_size = total_size
        self._scatter_stream = None

    def get_base_ptr(self) -> int:
        return self.base_ptr

    def get_total_size(self) -> int:
        return self.total_size


def _staging_allocator(rust, mode, staging_enabled: bool) -> Optional[_StagingRing]:
    """The allocator sglang's decode scheduler finds on the manager: the
    decode role's ring, or an empty one when staging is on but the role
    keeps none (CUDA IPC copies head slices device to device; MLA never
    gets here, sglang turns staging off for it). sglang creates its staging
    handler whenever ``SGLANG_DISAGG_STAGING_BUFFER`` is set and refuses a
    manager without an allocator; no kvbridge receiver ever asks it to stage."""
    if mode != DisaggregationMode.DECODE:
        return None
    ring = rust.staging_ring()
    if ring is None and staging_enabled:
        ring = (0, 0)
    return _StagingRing(*ring) if ring is not None else None


class _StagingContext:
    """sglang's ``DecodeStagingContext`` shape over kvbridge's ring."""

    def __init__(self, ring: Optional[_StagingRing]):
        self.allocator = ring
        self.room_bootstrap: Dict = {}
        self.room_receivers: Dict = {}


#: KVArgs attributes kvbridge maps (the rest of what sglang may set is
#: either engine-level, listed in _ENGINE_LEVEL, or refused as unknown).
_KV_ARGS_FIELDS = (
    "engine_rank", "kv_data_ptrs", "kv_data_lens", "kv_item_lens", "kv_layer_ids",
    "kv_cache_dtype_str", "kv_layout", "aux_data_ptrs", "aux_data_lens",
    "aux_item_lens", "state_types", "state_data_ptrs", "state_data_lens", "state_item_lens",
    "state_layer_ids", "state_dim_per_tensor", "state_slice_outer_counts", "state_conv_shard_groups",
    "is_hybrid_mla_backend", "swa_kv_cache_layout", "kv_head_num", "total_kv_head_num", "page_size",
    "system_dp_rank", "pp_rank", "prefill_start_layer", "prefill_end_layer", "mla_compression_ratios",
    "num_draft_entries",
)
#: KVArgs attributes that concern the engine or other backends, not the roles.
_ENGINE_LEVEL = frozenset({
    "ib_device", "gpu_id", "rust_http_port", "kv_data_mem_kinds", "kv_buf_groups", "hidden_kv_layers",
    "draft_kv_layers",
})
#: Decode host destinations (``--disaggregation-decode-host-receive-threshold``
#: < 1), which the roles do not receive into. They are not handed to the
#: roles: the manager says ``supports_host_destination = False``, so sglang
#: refuses the setting itself right after creating the manager (as it does
#: for its own connectors) and never sends a room to host pages.
_HOST_DESTINATIONS = frozenset({
    "host_kv_data_ptrs", "host_kv_data_lens", "host_kv_item_lens", "host_state_data_ptrs",
    "host_state_data_lens", "host_state_item_lens",
})


def role_spec(kv_args: KVArgs, is_mla_backend: bool) -> str:
    """The role description JSON (``kvbridge-py``'s ``RoleSpec``): sglang's
    ``KVArgs`` fields that are set, the parallel layout and the manager
    settings. An attribute kvbridge does not know is passed on, and the
    Rust side refuses it by name."""
    fields = {}
    for name in set(_KV_ARGS_FIELDS) | set(vars(kv_args)):
        if name in _ENGINE_LEVEL or name in _HOST_DESTINATIONS:
            continue
        value = getattr(kv_args, name, None)
        if value is None:
            continue
        if name == "state_types":
            value = [getattr(t, "value", t) for t in value]
        fields[name] = value
    p = get_parallel()
    parallel = {
        "attn_tp_size": p.attn_tp_size, "attn_tp_rank": p.attn_tp_rank,
        "attn_cp_size": p.attn_cp_size, "attn_cp_rank": p.attn_cp_rank,
        "attn_dcp_size": getattr(p, "attn_dcp_size", 1), "attn_dcp_rank": getattr(p, "attn_dcp_rank", 0),
        "attn_dp_size": p.attn_dp_size, "attn_dp_rank": p.attn_dp_rank,
        "dp_size": p.dp_size, "pp_size": p.pp_size, "pp_rank": p.pp_rank,
    }
    return json.dumps({
        "kv_args": fields,
        "parallel": parallel,
        "is_mla_backend": bool(is_mla_backend),
        "max_transfer_batch_indices": int(_env("SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES")),
        "enable_unified_memory": bool(getattr(get_memory(), "enable_unified_memory", False)),
    })


def _process_engine():
    """This process's ``kvbridge.TransferEngine`` (sglang's shared engine,
    created by the scheduler before the manager)."""
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        get_mooncake_transfer_engine,
    )

    wrapper = get_mooncake_transfer_engine()
    if wrapper is None:
        raise RuntimeError("sglang's transfer engine is not initialized (init_mooncake_transfer_engine)")
    engine = wrapper.engine
    if not isinstance(engine, _kvbridge.TransferEngine):
        raise RuntimeError(
            f"the kvbridge backend needs kvbridge's TransferEngine, but sglang created "
            f"{type(engine).__module__}.{type(engine).__name__}: switch with KVBRIDGE_SGLANG=backend, "
            "which also installs the engine hook"
        )
    return engine


# ---------------------------------------------------------------------------
# The backend classes
# ---------------------------------------------------------------------------


class _PrefillInfoTable:
    """What sglang's decode scheduler reads of ``kv_manager.prefill_info_table``:
    ``.get(addr)`` -> an object with ``dp_size`` and ``follow_bootstrap_room``."""

    class Entry:
        def __init__(self, dp_size: int, follow_bootstrap_room: bool):
            self.dp_size = dp_size
            self.follow_bootstrap_room = follow_bootstrap_room

    def __init__(self, rust):
        self._rust = rust

    def get(self, addr: str, default=None):
        summary = self._rust.prefill_summary(addr)
        return default if summary is None else self.Entry(*summary)

    def __contains__(self, addr: str) -> bool:
        return self._rust.prefill_summary(addr) is not None

    def __getitem__(self, addr: str):
        entry = self.get(addr)
        if entry is None:
            raise KeyError(addr)
        return entry


class _PipelineConsensus:
    """A pipeline-parallel prefill's room states across its stages, what
    sglang's PP0 scheduler polls (``poll_pp_consensus``): every stage's
    Rust role journals its room state changes, a daemon thread of stages
    1.. mirrors them into sglang's own ``PPConsensusStore`` (which replicates
    them to stage 0 over the PP group's zmq channel, as with sglang's
    connector), and stage 0 combines its own state with the stages'.
    No Python runs per transfer: the mirror wakes only on a state change."""

    #: How long one wait for state changes lasts (so teardown is prompt).
    WAIT_S = 0.1

    def __init__(self, rust, parallel):
        from sglang.srt.disaggregation.pp_consensus_store import PPConsensusStore

        self.pp_size, self.pp_rank = parallel.pp_size, parallel.pp_rank
        self._rust = rust
        self._store = PPConsensusStore(self.pp_size, self.pp_rank, parallel.pp_group)
        self._stop = threading.Event()
        self._thread = None
        if self.pp_rank > 0:
            rust.watch_statuses()
            self._thread = threading.Thread(target=self._mirror, name="kvbridge-pp-mirror", daemon=True)
            self._thread.start()

    def _mirror(self) -> None:
        try:
            while not self._stop.is_set():
                for room, status in self._rust.status_changes(self.WAIT_S):
                    if status is None:
                        self._store.pop(room, None)
                    else:
                        self._store[room] = status
        except Exception:  # noqa: BLE001 - said once; stage 0 then times the rooms out
            logger.exception("kvbridge: PP stage %d stopped reporting room states to stage 0", self.pp_rank)

    def status(self, room: int, local: Optional[int]) -> Tuple[int, List[int]]:
        """Stage 0: the consensus state of ``room`` (``local``: this stage's)
        and the stages still bootstrapping it (or not reporting it yet)."""
        states = [local] + self._store.collect(room)[1:]
        lagging = [stage for stage, st in enumerate(states) if st is None or st == KVPoll.Bootstrapping]
        if KVPoll.Failed in states:  # a failed stage fails the room whatever the others say
            return KVPoll.Failed, lagging
        if any(st is None for st in states):
            return KVPoll.Bootstrapping, lagging
        return min(states), lagging

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.WAIT_S + 1)
        self._store.close()


class KVManager(BaseKVManager):
    """sglang's ``KVManager`` over kvbridge's prefill or decode role
    (``MooncakeKVManager``'s signature)."""

    supports_deferred_decode_kv_release = True
    supports_role_switch = False
    supports_host_destination = False
    is_dummy_cp_rank = False
    enable_all_cp_ranks_for_transfer = False
    enable_staging = False
    kv_shard_size = 1

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args,
        is_mla_backend: Optional[bool] = False,
    ):
        from sglang.srt.utils.network import get_local_ip_auto

        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = bool(is_mla_backend)
        self.kv_item_lens_sum = sum(args.kv_item_lens)
        self.state_item_lens_sum = sum(x for comp in getattr(args, "state_item_lens", []) or [] for x in comp)
        self.local_ip = get_local_ip_auto()
        settings = role_settings(disaggregation_mode, args, self.local_ip)
        self.enable_deferred_decode_kv_release = settings["deferred_release"]
        engine = _process_engine()
        spec = role_spec(args, self.is_mla_backend)
        config = json.dumps(settings)
        self._receivers: Dict[int, "KVReceiver"] = {}
        self._pp: Optional[_PipelineConsensus] = None
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._early_sends: Optional[concurrent.futures.ThreadPoolExecutor] = None
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self._rust = _kvbridge.PrefillManager(engine, spec, config)
            # Under context parallelism sglang's scheduler reads these.
            self.is_dummy_cp_rank, self.enable_all_cp_ranks_for_transfer = self._rust.cp_transfer
            self.transfer_infos: Dict = {}
            self.bootstrap_timeout = settings["bootstrap_timeout"]
            if get_parallel().pp_size > 1:
                self._pp = _PipelineConsensus(self._rust, get_parallel())
        elif disaggregation_mode == DisaggregationMode.DECODE:
            self._rust = _kvbridge.DecodeManager(engine, spec, config)
            self.prefill_info_table = _PrefillInfoTable(self._rust)
        else:
            raise ValueError(f"Unsupported DisaggregationMode: {disaggregation_mode}")
        self.rank_port = self._rust.rank_port
        self.attn_tp_size = get_parallel().attn_tp_size
        self.kv_buffer_tensors = None
        self._staging_ctx = _StagingContext(
            _staging_allocator(self._rust, disaggregation_mode, settings["staging"]["enabled"]))
        self._staging_handler = None
        logger.info("kvbridge %s manager on %s:%d (engine %s%s)", disaggregation_mode.value, self.local_ip,
                    self.rank_port, self._rust.session_id, ", staging" if settings["staging"]["enabled"] else "")

    def set_kv_buffer_tensors(self, k_buffers, v_buffers, page_size, slot_layer_ids=None):
        """Kept for sglang's scheduler (its staging handler reads the device
        of these tensors); kvbridge's roles gather and scatter from the
        registered KV buffers themselves.

        On a decode this is also where the KV head counts arrive: sglang's
        ``DecodePreallocQueue._init_kv_manager`` sets ``kv_args.kv_head_num``
        and ``total_kv_head_num`` only after creating the manager, right
        before this call; the decode role needs them to stage."""
        self.kv_buffer_tensors = {
            "k_buffers": k_buffers,
            "v_buffers": v_buffers,
            "page_size": page_size,
            "slot_layer_ids": list(slot_layer_ids or []),
        }
        if self.disaggregation_mode == DisaggregationMode.DECODE and not self.is_mla_backend:
            heads = getattr(self.kv_args, "kv_head_num", None)
            if heads:
                total = getattr(self.kv_args, "total_kv_head_num", None)
                self._rust.set_kv_heads(int(heads), int(total) if total else None)
            else:
                logger.warning("kvbridge: set_kv_buffer_tensors without KVArgs.kv_head_num; the decode "
                               "cannot stage (its rooms take the per-slice path)")

    def register_to_bootstrap(self):
        """Nothing to do: the prefill role registered with the bootstrap
        server when it started (and failed start-up if it could not)."""

    def _ensure_prefill_recompute_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The decode's executor for background bootstrap-server lookups:
        sglang's scheduler prefetches prefill DP ranks on it
        (``CommonKVReceiver.query_prefill_dp_ranks``)."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=4, thread_name_prefix="kvb-dp-query"
            )
        return self._executor

    def _early_send_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The prefill's one thread that waits for early-send events and then
        hands the chunks to the Rust sender, in the order they were sent."""
        if self._early_sends is None:
            self._early_sends = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="kvb-early-send"
            )
        return self._early_sends

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """One non-blocking attempt to resolve a prefill server (decode)."""
        return self._rust.try_ensure_parallel_info(bootstrap_addr)

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        """Whether every prefill rank that could write the room's pages has
        acknowledged its abort (or was fenced)."""
        if required_acks <= 0:
            return True
        receiver = self._receivers.get(bootstrap_room)
        return receiver is not None and receiver.abort_acknowledged()

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        """Nothing to keep: the receiver's ``clear()`` drops the room's ACK state."""

    def check_status(self, bootstrap_room: int) -> int:
        """The room's state on a prefill rank (Failed when unknown)."""
        status = self._rust.room_status(bootstrap_room)
        return KVPoll.Failed if status is None else status

    def check_status_pp_consensus(self, bootstrap_room: int) -> int:
        """Stage 0 of a PP prefill: the lowest state of the room over all
        stages (Bootstrapping until every stage reported it)."""
        local = self._rust.room_status(bootstrap_room)
        if self._pp is None:
            return KVPoll.Failed if local is None else local
        return self._pp.status(bootstrap_room, local)[0]

    def render_metrics(self) -> str:
        """kvbridge's own Prometheus metrics of this role, as text."""
        return self._rust.render_metrics()

    def deregister_buffer_to_engine(self):
        raise RuntimeError(
            "the kvbridge backend keeps sglang's KV pools registered for the process lifetime; "
            "release_memory_occupation is not supported with it"
        )

    def register_buffer_to_engine(self):
        raise RuntimeError("the kvbridge backend registers sglang's KV pools once, at start")

    def submit_prefill_recompute(self, receiver, payload) -> None:
        raise RuntimeError("PD retract re-bootstrap is not supported by the kvbridge backend")

    def teardown(self) -> None:
        """Stops the role's threads and deregisters its memory."""
        for pool in (self._executor, self._early_sends):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._executor = self._early_sends = None
        if self._pp is not None:
            self._pp.close()
            self._pp = None
        self._rust.teardown()


class _RoomEnds:
    """How a room ends on either side (``self._rust``: the Rust sender or
    receiver; ``self.bootstrap_room``)."""

    def failure_exception(self):
        self.conclude_state = KVPoll.Failed
        # The room stays known until clear(): sglang may hold its pages and
        # ask is_abort_release_safe() first.
        reason, other_rank = self._rust.failure()
        raise KVTransferError(self.bootstrap_room, reason, is_from_another_rank=other_rank)

    def abort(self):
        self.conclude_state = KVPoll.Failed
        self._rust.abort()


class KVSender(_RoomEnds, BaseKVSender):
    """One request's prefill side (``MooncakeKVSender``'s signature)."""

    #: ``send`` takes no ``indices_event``: sglang then hands it index arrays
    #: already on the host.
    supports_host_tensor_indices = False

    def __init__(
        self,
        mgr: KVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ):
        self.kv_mgr = mgr
        self.bootstrap_server_url = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self.conclude_state: Optional[int] = None
        # Set by sglang's scheduler before an early send of a cached prefix
        # (maybe_send_cached_prefix_chunk, overlap scheduling): a CUDA event
        # on the forward stream that may still be writing those pages.
        self._early_send_wait_event = None
        # The room's last chunk queued behind such an event, if any.
        self._behind: Optional[concurrent.futures.Future] = None
        # With several DP ranks and no router hint the Rust sender registers
        # the room's DP rank (or checks the bootstrap-room rule), as sglang's.
        self._rust = mgr._rust.sender(bootstrap_room, bool(req_has_disagg_prefill_dp_rank))

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None):
        self.num_kv_indices = num_kv_indices
        self._rust.init(num_kv_indices, aux_index)

    def send(self, kv_indices, state_indices: Optional[List] = None, num_kv_tokens: Optional[int] = None):
        """Queues the next chunk. A chunk with an early-send event (which
        belongs to it alone) is handed to the Rust sender only once the
        event completed, from the manager's early-send thread, so the
        scheduler thread does not wait; the room's later chunks follow it on
        that thread until it went, so none overtakes it."""
        wait_event, self._early_send_wait_event = self._early_send_wait_event, None
        behind = self._behind
        if wait_event is None and (behind is None or behind.done()):
            self._behind = None
            self._rust.send(kv_indices, state_indices, num_kv_tokens)
            return
        self._behind = self.kv_mgr._early_send_executor().submit(
            self._send_after, wait_event, kv_indices, state_indices, num_kv_tokens
        )

    def _send_after(self, wait_event, kv_indices, state_indices, num_kv_tokens) -> None:
        """On the early-send thread: waits for the event (torch releases the
        GIL meanwhile), then hands the chunk over; a chunk refused here
        fails the room with the reason, as no caller is left to raise to."""
        try:
            if wait_event is not None:
                wait_event.synchronize()
            self._rust.send(kv_indices, state_indices, num_kv_tokens)
        except Exception as e:  # noqa: BLE001 - the room must not wait for a chunk that never went
            logger.error("kvbridge: room %d: a chunk queued behind an early-send event failed: %s",
                         self.bootstrap_room, e)
            self._rust.fail(f"Request {self.bootstrap_room}: a chunk queued behind an early-send event "
                            f"failed: {e}")

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        # An empty last chunk still concludes the room (and carries aux/state).
        return num_pages > 0 or last_chunk

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        status = self._rust.poll()
        if status in (KVPoll.Success, KVPoll.Failed):
            self.conclude_state = status
        return status

    def poll_pp_consensus(self) -> int:
        """What sglang's PP0 scheduler polls: the room's lowest state over
        all pipeline stages. A room some stage never reported fails after
        the bootstrap timeout, naming the stages; a room another stage
        failed fails here with that reason."""
        pp = self.kv_mgr._pp
        if pp is None or self.conclude_state is not None:
            return self.poll()
        local = self._rust.poll()
        if local == KVPoll.Failed:
            self.conclude_state = KVPoll.Failed
            return local
        status, lagging = pp.status(self.bootstrap_room, local)
        room = self.bootstrap_room
        age = self._rust.age_s
        if status == KVPoll.Bootstrapping and age >= self.kv_mgr.bootstrap_timeout:
            self._rust.fail(f"Request {room} timed out after {age:.1f}s in KVPoll.Bootstrapping "
                            f"(still bootstrapping on pipeline stages {lagging})")
            status = KVPoll.Failed
        elif status == KVPoll.Failed:
            self._rust.fail(f"Request {room} failed on another pipeline stage")
        if status in (KVPoll.Success, KVPoll.Failed):
            self.conclude_state = status
        return status

    def pop_decode_prefix_len(self) -> int:
        return self._rust.pop_decode_prefix_len()

    def get_max_transfer_tokens(self) -> Optional[int]:
        return None

    def get_transfer_metric(self) -> KVTransferMetric:
        latency, total = self._rust.transfer_metric()
        return KVTransferMetric(transfer_latency_s=latency, transfer_total_bytes=total)

    def clear(self):
        self._rust.clear()


class KVReceiver(_RoomEnds, BaseKVReceiver):
    """One request's decode side (``MooncakeKVReceiver``'s signature)."""

    require_staging = False
    #: sglang never sends a room to host pages (``KVTransferDestination.HOST``).
    supports_host_destination = False

    def __init__(self, mgr: KVManager, bootstrap_addr: str, bootstrap_room: Optional[int] = None):
        if bootstrap_room is None:
            raise ValueError("the kvbridge backend needs a bootstrap_room for every receiver")
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self.conclude_state: Optional[int] = None
        self._rust = mgr._rust.receiver(bootstrap_addr, bootstrap_room)
        mgr._receivers[bootstrap_room] = self

    def init(self, prefill_dp_rank: int):
        if self._rust.init(prefill_dp_rank) == KVPoll.Failed:
            self.conclude_state = KVPoll.Failed

    @property
    def bootstrap_infos(self) -> List[Tuple[str, int]]:
        """``(ip, port)`` of every prefill rank the room talks to."""
        return self._rust.bootstrap_infos()

    def send_metadata(
        self,
        kv_indices,
        aux_index: Optional[int] = None,
        state_indices: Optional[List] = None,
        decode_prefix_len: Optional[int] = None,
        destination: KVTransferDestination = KVTransferDestination.DEVICE,
        device_kv_indices=None,
    ):
        """Tells the room's prefill ranks where its KV goes. A HiSparse
        decode passes ``device_kv_indices`` too (sglang's
        ``DecodePreallocQueue``): ``kv_indices`` are then the host pages of
        the C4 KV buffers and ``device_kv_indices`` the pages of every other
        KV buffer; on a pool without compression ratios the room fails,
        naming why."""
        if destination != KVTransferDestination.DEVICE:
            raise ValueError("the kvbridge backend receives into device KV only")
        if aux_index is None:
            raise ValueError("send_metadata needs the request's aux (metadata buffer) index")
        state = self._rust.send_metadata(kv_indices, aux_index, state_indices, decode_prefix_len,
                                         device_kv_indices)
        if state == KVPoll.Failed:
            self.conclude_state = KVPoll.Failed

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        status = self._rust.poll()
        if status in (KVPoll.Success, KVPoll.Failed):
            self.conclude_state = status
        return status

    @property
    def abort_notified(self) -> bool:
        """Whether the room's prefill ranks were told to stop writing."""
        return self._rust.abort_notified

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        self._rust.notify_abort()

    def abort_acknowledged(self) -> bool:
        return self._rust.abort_acknowledged()

    def clear(self):
        self._rust.clear()
        if self.kv_mgr._receivers.get(self.bootstrap_room) is self:
            del self.kv_mgr._receivers[self.bootstrap_room]


class KVBootstrapServer(BaseKVBootstrapServer):
    """kvbridge's bootstrap server (sglang's routes and JSON) on a Rust
    thread (``MooncakeKVBootstrapServer``'s signature)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        cleanup = float(_env("SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL"))
        self._rust = _kvbridge.BootstrapServer(host, port, cleanup)
        logger.info("kvbridge bootstrap server listening on %s:%d", *self._rust.address)

    def is_alive(self) -> bool:
        return self._rust.is_alive()

    def close(self) -> None:
        self._rust.close()
