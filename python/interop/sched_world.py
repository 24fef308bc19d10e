"""sglang 0.5.23's own scheduler code around a PD transfer backend, on CPU
torch (or CUDA torch on the GPU machine).

A :class:`World` is one prefill or decode rank as sglang's scheduler
process builds it: sglang's real ``ModelConfig`` (from a tiny
``config.json`` written here), its real KV pools (``MHATokenToKVPool`` /
``MLATokenToKVPool``), allocator (``PagedTokenToKVPoolAllocator``),
request pool (``ReqToTokenPool`` / ``DecodeReqToTokenPool``), radix tree
cache and ``Req`` objects, and a ``Scheduler`` instance whose
``init_disaggregation`` (sglang's own method) creates the disaggregation
queues: ``PrefillBootstrapQueue`` (which builds ``KVArgs`` in
``_init_kv_manager``) or ``DecodeTransferQueue`` + ``DecodePreallocQueue``.
The loops then call sglang's queue and mixin methods
(``pop_bootstrapped``, ``process_batch_result_disagg_prefill``,
``process_disagg_prefill_inflight_queue``, ``pop_preallocated``,
``pop_transferred``, ``release_aborted_prefill_waiting_req``, ...).
Hybrid layouts (``MODELS["mamba"]``, ``MODELS["swa"]``, ``MODELS["dsv4"]``)
get their pools, tree cache and the scheduler's hybrid fields from sglang's
``KVCacheConfigurator`` and ``build_kv_cache`` instead (``sched_hybrid``
and, for DeepSeek-V4's compressed MLA, ``sched_dsv4``, whose docstrings
list what they stand in for).

What is stood in for, and why (also in README.md, "The real scheduler"):

* ``Scheduler.__init__`` is not run (it loads a model and starts a model
  runner, TP workers and the detokenizer pipes): the instance is created
  with ``object.__new__`` and given the attributes sglang's disaggregation
  methods read (:func:`_scheduler_shell`), each set to the real object
  where one exists (pools, tree cache, model config, server args).
* The model forward (``run_batch``) is :meth:`World.forward`: it writes a
  deterministic byte pattern into the KV slots sglang's allocator handed
  the batch (``prepare_for_extend``) and returns the next token as a
  ``GenerationBatchResult``.
* The batch planner (``get_new_batch_prefill``: ``PrefillAdder``, the
  schedule policy) is not run: every bootstrapped request is admitted
  into one ``ScheduleBatch`` (``init_new`` + ``prepare_for_extend``, the
  real allocation path).
* The TP/CP all-reduce of poll states runs on gloo groups of one rank
  (each process is one rank of its role): ``torch.distributed`` really
  runs, over a group of size 1.
* The output streamer and metrics reporter are recorders.
"""

from __future__ import annotations

import os
import types
from array import array
from dataclasses import dataclass
from typing import Dict, List, Optional

import sched_hybrid
from sched_models import (  # noqa: F401  (the world's names, as before)
    MODELS,
    first_token,
    kv_pattern,
    layout_shape,
    local_kv_heads,
    mix64,
    write_model_dir,
)

#: chunked_prefill_size of a staging launch (sglang sizes its staging by
#: it; kvbridge's backend takes the same value when none is set).
STAGING_CHUNK_TOKENS = 8192


@dataclass
class Shape:
    """One rank's place: role, TP and PP."""

    layout: str = "mha"
    layers: int = 2
    page_size: int = 16
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    #: KV tokens in the pool (a multiple of page_size).
    pool_tokens: int = 4096
    max_running: int = 16
    max_context: int = 2048
    device: str = "cpu"


class Recorder:
    """Stands in for the scheduler's output streamer and metrics reporter:
    records what sglang hands them."""

    def __init__(self):
        self.streamed: List[object] = []
        self.enable_metrics = False

    def stream_output(self, reqs, *args, **kwargs):
        self.streamed.extend(reqs)

    def stream_abort(self, abort_output, req):
        """``Scheduler.send_abort_output``: the abort reaches the client."""
        self.streamed.append(req)

    def __getattr__(self, name):  # report_prefill_stats, kv_transfer_* ...
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *a, **k: None


def _init_process_groups(port: int, shape: Shape) -> None:
    """sglang's own process groups for this rank: one gloo world per role
    (every TP x PP rank of it), then ``initialize_model_parallel`` builds
    the TP, PP and attention groups from the published widths, as a
    scheduler process does. Stood in for: the GPU communicators (pynccl,
    custom all-reduce, mscclpp, symmetric memory), which need CUDA and carry
    no poll; every group keeps its gloo ``cpu_group``."""
    import functools

    import sglang.srt.distributed.parallel_state as ps

    if ps.model_parallel_is_initialized():
        return
    if not getattr(ps.init_model_parallel_group, "_kvb_cpu", False):
        group = functools.partial(ps.init_model_parallel_group, use_pynccl=False, use_custom_allreduce=False,
                                  use_mscclpp=False, use_torch_symm_mem_allreduce=False)
        group._kvb_cpu = True
        ps.init_model_parallel_group = group
    ps.init_distributed_environment(world_size=shape.tp_size * shape.pp_size,
                                    rank=shape.pp_rank * shape.tp_size + shape.tp_rank,
                                    distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=0,
                                    backend="gloo", timeout=120)
    ps.initialize_model_parallel(backend="gloo")


class World:
    """One rank of ``mode`` ("prefill" or "decode") through sglang's own
    scheduler-side classes (module docstring)."""

    def __init__(self, mode: str, shape: Shape, *, bootstrap_port: int, http_port: int, gloo_port: int,
                 server_args_extra: Optional[dict] = None):
        import torch

        import harness

        self.mode, self.shape = mode, shape
        self.hybrid = sched_hybrid.kind(shape.layout)
        rank = harness.RankSpec(shape.tp_size, shape.tp_rank, shape.pp_size, shape.pp_rank)
        extra = dict(sched_hybrid.server_args_extra(shape.layout, mode, shape) if self.hybrid else {},
                     **(server_args_extra or {}))
        # As a launch on the pools' device resolves them: sglang's staging
        # (prefill buffers and decode ring) is sized by chunked_prefill_size
        # and placed on get_device(), and refuses a CPU device.
        if shape.device.startswith("cuda"):
            extra.setdefault("device", "cuda")
        if os.environ.get("SGLANG_DISAGG_STAGING_BUFFER"):
            extra.setdefault("chunked_prefill_size", STAGING_CHUNK_TOKENS)
        self.server_args = harness.publish_server_args(
            mode, bootstrap_port=bootstrap_port, rank=rank, http_port=http_port,
            page_size=shape.page_size, **extra)
        _init_process_groups(gloo_port, shape)
        from sglang.srt.configs.model_config import ModelConfig

        self.model_dir = write_model_dir(shape.layout, shape.layers)
        self.model_config = ModelConfig.from_server_args(self.server_args, model_path=self.model_dir)
        if self.hybrid:
            # What sglang's model_config_of(server_args) builds from the real
            # model path (the published args name a dummy one): the hybrid
            # helpers (mamba_cache_chunk_size, ...) read the model from there.
            self.server_args._model_config = self.model_config
        device_index = int(shape.device.split(":")[1]) if ":" in shape.device else 0
        self.engine = harness.init_engine(gpu_id=device_index)
        self.torch = torch
        if self.hybrid:
            # sglang's configurator and build_kv_cache (sched_hybrid).
            self.kv_result, self.tp_worker = sched_hybrid.build(self)
            self.req_to_token_pool = self.kv_result.req_to_token_pool
            self.allocator = self.kv_result.token_to_kv_pool_allocator
            self.kv_pool = self.allocator.get_kvcache()
            self.tree_cache = self.kv_result.tree_cache
            self.global_heads = local_kv_heads(self.model_config.get_total_num_kv_heads(), shape.tp_size,
                                               shape.tp_rank)
        else:
            self._build_pools()
        self.scheduler = self._scheduler_shell()
        # sglang's own construction of the disaggregation queues (and so of
        # KVArgs and the backend's manager).
        self.scheduler.init_disaggregation()

    # -- construction ------------------------------------------------------

    def _build_pools(self) -> None:
        import torch
        from sglang.srt.disaggregation.decode import DecodeReqToTokenPool
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixCache
        from sglang.srt.runtime_context import get_parallel

        s, mc = self.shape, self.model_config
        start, end = self.layer_range()
        layer_num = end - start
        if mc.attention_arch.name == "MLA":
            self.kv_pool = MLATokenToKVPool(
                s.pool_tokens, s.page_size, torch.bfloat16, kv_lora_rank=mc.kv_lora_rank,
                qk_rope_head_dim=mc.qk_rope_head_dim, layer_num=layer_num, device=s.device,
                enable_memory_saver=False, start_layer=start, end_layer=end - 1)
            self.global_heads = [0]
        else:
            total = mc.get_total_num_kv_heads()
            # The attention-TP group's heads (the TP rank's unless attention
            # DP/CP split the TP group, sched_parallel).
            attn = get_parallel()
            self.global_heads = local_kv_heads(total, attn.attn_tp_size, attn.attn_tp_rank)
            self.kv_pool = MHATokenToKVPool(
                s.pool_tokens, s.page_size, torch.bfloat16, head_num=len(self.global_heads),
                head_dim=mc.head_dim, layer_num=layer_num, device=s.device, enable_memory_saver=False,
                start_layer=start, end_layer=end - 1)
        self.allocator = PagedTokenToKVPoolAllocator(
            s.pool_tokens, s.page_size, torch.bfloat16, s.device, self.kv_pool, need_sort=False)
        if self.mode == "decode":
            self.req_to_token_pool = DecodeReqToTokenPool(
                size=s.max_running, max_context_len=s.max_context, device=s.device,
                enable_memory_saver=False, pre_alloc_size=2 * s.max_running)
        else:
            self.req_to_token_pool = ReqToTokenPool(
                size=s.max_running, max_context_len=s.max_context, device=s.device, enable_memory_saver=False)
        self.tree_cache = RadixCache(CacheInitParams(
            disable=False, req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator, page_size=s.page_size))

    def layer_range(self):
        """This PP stage's layers, sglang's even split (``get_pp_indices``)."""
        from sglang.srt.distributed.utils import get_pp_indices

        return get_pp_indices(self.shape.layers, self.shape.pp_rank, self.shape.pp_size)

    def _scheduler_shell(self):
        """sglang's ``Scheduler`` without ``__init__``: the attributes its
        disaggregation methods read (module docstring)."""
        from sglang.srt.environ import envs
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.runtime_context import get_parallel
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        s = object.__new__(Scheduler)
        model_runner = types.SimpleNamespace(
            effective_logical_max_total_num_tokens=self.shape.pool_tokens, kv_cache_dtype_str="auto",
            swa_max_total_num_tokens=self.shape.pool_tokens, model_config=self.model_config)
        parallel = get_parallel()
        recorder = Recorder()
        s.__dict__.update(
            # The real objects.
            server_args=self.server_args, model_config=self.model_config,
            req_to_token_pool=self.req_to_token_pool, token_to_kv_pool_allocator=self.allocator,
            tree_cache=self.tree_cache, attn_tp_cpu_group=parallel.attn_tp_group.cpu_group,
            attn_cp_cpu_group=parallel.attn_cp_group.cpu_group,
            pp_group=parallel.pp_group, tp_size=parallel.tp_size,
            running_batch=ScheduleBatch(reqs=[], batch_is_full=False),
            # Sizes a scheduler derives from the model runner.
            max_running_requests=self.shape.max_running, max_total_num_tokens=self.shape.pool_tokens,
            tp_worker=types.SimpleNamespace(model_runner=model_runner, is_hybrid_swa=False),
            # Features this suite runs without (sglang's defaults for them).
            draft_worker=None, spec_algorithm=SpeculativeAlgorithm.NONE, kv_shard_widening=1, rust_server=None,
            enable_unified_memory=False, enable_overlap=False, enable_hisparse=False, enable_decode_hicache=False,
            enable_hierarchical_cache=False, enable_priority_scheduling=False,
            schedule_low_priority_values_first=False, enable_lora=False, enable_continuous_input_polling=False,
            enable_staging=bool(envs.SGLANG_DISAGG_STAGING_BUFFER.get()), kv_checksum_computer=None,
            sliding_window_size=None, dllm_config=None, is_generation=True, random_seed=0,
            forward_stream=None, schedule_stream=None, scheduler_stage_metrics=None,
            # Scheduler state at start.
            waiting_queue=[], last_batch=None, chunked_req=None, processed_tokens_counter=0,
            running_mbs=[], mbs=[], result_queue=[], return_health_check_ipcs=[],
            # Outputs: recorded.
            output_streamer=recorder, metrics_reporter=recorder, metrics_collector=recorder,
            batch_result_processor=recorder, beam_coordinator=recorder, grammar_manager=recorder,
            send_abort_output=recorder.stream_abort,
            pool_stats_observer=types.SimpleNamespace(
                get_pool_stats=lambda: types.SimpleNamespace(full_token_usage=0.0)),
        )
        if self.hybrid:
            s.__dict__.update(sched_hybrid.scheduler_fields(self))
        self.recorder = recorder
        return s

    # -- requests ----------------------------------------------------------

    def make_req(self, room: int, tokens: int, bootstrap_host: str = "127.0.0.1"):
        """A real sglang ``Req`` for ``room``, as the tokenizer manager sends
        it (prompt ids distinct per room, so no prefix is shared)."""
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        ids = array("q", [(room * 131 + i * 7) % 997 + 1 for i in range(tokens)])
        params = SamplingParams(max_new_tokens=1 if self.mode == "prefill" else 8)
        params.normalize(None)
        mode = DisaggregationMode.PREFILL if self.mode == "prefill" else DisaggregationMode.DECODE
        return Req(rid=f"room-{room}", origin_input_text="", origin_input_ids=ids, sampling_params=params,
                   bootstrap_host=bootstrap_host, bootstrap_port=self.server_args.disaggregation_bootstrap_port,
                   bootstrap_room=room, disagg_mode=mode, eos_token_ids=set(), vocab_size=1000)

    def layout_args(self) -> dict:
        """What sglang's ``_init_kv_manager`` put in ``KVArgs`` to name the
        pool's layout (the manager's own copy)."""
        a = self.kv_manager.kv_args
        return {"kv_layout": getattr(a, "kv_layout", None),
                "mla_compression_ratios": getattr(a, "mla_compression_ratios", None),
                "state_types": [getattr(t, "value", t) for t in getattr(a, "state_types", None) or []]}

    @property
    def kv_manager(self):
        s = self.scheduler
        queue = s.disagg_prefill_bootstrap_queue if self.mode == "prefill" else s.disagg_decode_prealloc_queue
        return queue.kv_manager

    # -- prefill -----------------------------------------------------------

    def prefill_add(self, req) -> None:
        """A new request reaches the prefill scheduler
        (``PrefillBootstrapQueue.add``, as ``_add_request_to_queue`` does)."""
        self.scheduler.disagg_prefill_bootstrap_queue.add(req, self.model_config.num_key_value_heads)
        sender = getattr(req, "disagg_kv_sender", None)
        if self.shape.device == "cpu" and getattr(sender, "supports_host_tensor_indices", False):
            # sglang's Mooncake sender would stage page indices in pinned
            # memory behind a CUDA event; without CUDA it takes sglang's
            # numpy page-index path (kv_to_page_indices) instead.
            sender.supports_host_tensor_indices = False

    def prefill_step(self, run_batches: bool = True) -> List[object]:
        """One iteration of ``event_loop_normal_disagg_prefill``: bootstrapped
        requests join the waiting queue, every one ready runs in one batch
        (allocation by ``prepare_for_extend``, the "forward" by
        :meth:`forward`, the result by ``process_batch_result_disagg_prefill``),
        then the inflight queue is polled. Returns the requests that
        concluded (sglang's ``done_reqs``). ``run_batches=False``: the GPU
        is busy, nothing new runs this iteration."""
        from sglang.srt.managers.schedule_batch import ScheduleBatch

        s = self.scheduler
        s.waiting_queue.extend(s.disagg_prefill_bootstrap_queue.pop_bootstrapped())
        s.resolve_waiting_queue_bootstrap()
        ready = self._admit() if run_batches else []
        if ready:
            batch = ScheduleBatch.init_new(ready, self.req_to_token_pool, self.allocator, self.tree_cache,
                                           self.model_config, False, s.spec_algorithm)
            batch.prepare_for_extend()
            # As sglang's loop does before it runs a batch: the STAGING_REQs of
            # its rooms go out now, so a decode allocates during the forward
            # (without them sglang's own connector waits for ring space forever).
            if s.enable_staging:
                s.maybe_prefetch_staging_for_batch(batch)
            s.process_batch_result_disagg_prefill(batch, self.forward(batch))
        return s.process_disagg_prefill_inflight_queue()

    def _admit(self) -> List[object]:
        """sglang's ``PrefillAdder`` over the waiting queue (prefix match,
        token budget, ``extend_end``): what fits runs in this batch."""
        from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

        s = self.scheduler
        adder = PrefillAdder(self.shape.page_size, self.tree_cache, self.allocator, s.running_batch,
                             new_token_ratio=0.0, rem_input_tokens=self.shape.pool_tokens, rem_chunk_tokens=None,
                             max_running_requests=self.shape.max_running)
        for req in list(s.waiting_queue):
            if req.finished_reason is not None or req.to_finish is not None:
                continue
            req.init_next_round_input(self.tree_cache)
            if adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None) != AddReqResult.CONTINUE:
                break
        ready = adder.can_run_list
        s.waiting_queue = [r for r in s.waiting_queue if r not in ready]
        return ready

    def kv_buffers(self):
        """``(global layer, K/V index, uint8 view [slots, heads, head bytes],
        is_swa)`` of every KV buffer of this stage (is_swa: a sliding-window
        layer of a hybrid pool, indexed by SWA slots)."""
        if self.hybrid:
            return sched_hybrid.kv_layers(self)
        start, _ = self.layer_range()
        pool = self.kv_pool
        out = []
        if hasattr(pool, "k_buffer"):
            for i, (k, v) in enumerate(zip(pool.k_buffer, pool.v_buffer)):
                out.append((start + i, 0, k.view(self.torch.uint8), False))
                out.append((start + i, 1, v.view(self.torch.uint8), False))
        else:
            for i, kv in enumerate(pool.kv_buffer):
                out.append((start + i, 0, kv.view(self.torch.uint8), False))
        return out

    def forward(self, batch):
        """Stands in for the model forward: writes :func:`kv_pattern` into
        the slots sglang's allocator gave each request's new tokens and
        "samples" :func:`first_token`. Hybrid pools: sliding-window layers at
        the SWA slots of the same tokens, and the request's mamba state
        (``sched_hybrid.write_state``)."""
        from sglang.srt.managers.utils import GenerationBatchResult

        torch = self.torch
        for req in batch.reqs:
            start, end = req.prefix_len, req.extend_end
            slots = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, start:end].long()
            for layer, kv, buf, is_swa in self.kv_buffers():
                at = sched_hybrid.swa_slots(self, slots) if is_swa else slots
                buf[at] = kv_pattern(req.bootstrap_room, layer, kv, range(start, end), self.global_heads,
                                     buf.shape[-1], buf.device.type)
            if self.hybrid:
                sched_hybrid.write_state(self, req)
        tokens = torch.tensor([first_token(r.bootstrap_room) for r in batch.reqs], dtype=torch.int64)
        copy_done = None
        if self.shape.device != "cpu":
            # What the model runner hands back: an event after the forward's
            # writes, which process_batch_result_disagg_prefill waits on.
            copy_done = torch.cuda.Event()
            copy_done.record()
        return GenerationBatchResult(next_token_ids=tokens, copy_done=copy_done)

    def abort(self, room: int) -> None:
        """The router aborts ``room``'s request: sglang's own
        ``Scheduler.abort_request`` (``AbortReq``), on either side."""
        from sglang.srt.managers.io_struct import AbortReq

        self.scheduler.abort_request(AbortReq(rid=f"room-{room}"))

    # -- decode ------------------------------------------------------------

    def decode_add(self, req) -> None:
        """A new request reaches the decode scheduler (``DecodePreallocQueue.add``)."""
        self.scheduler.disagg_decode_prealloc_queue.add(req)

    def decode_step(self) -> List[object]:
        """One ``process_decode_queue`` (sglang's own): preallocation,
        metadata, polling; returns the requests whose KV arrived."""
        s = self.scheduler
        before = len(s.waiting_queue)
        s.process_decode_queue()
        arrived = s.waiting_queue[before:]
        return arrived

    def verify(self, req) -> Dict[str, int]:
        """Checks every KV byte of ``req`` on this decode rank against what
        each prefill rank wrote, and the first token from the metadata
        buffers; returns ``{"bytes": n, "mismatched": m}``. Hybrid pools:
        sliding-window layers over the window the prefill sends (SWA
        payload), and every byte of the request's mamba state."""
        n = len(req.origin_input_ids)
        slots = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].long()
        checked = bad = 0
        for layer, kv, buf, is_swa in self.kv_buffers():
            positions, at = range(n), slots
            if is_swa:
                positions = sched_hybrid.swa_window(self, n)
                at = sched_hybrid.swa_slots(self, slots[positions.start:])
            want = kv_pattern(req.bootstrap_room, layer, kv, positions, self.global_heads, buf.shape[-1],
                              buf.device.type)
            got = buf[at]
            checked += got.numel()
            bad += int((got != want).sum())
        if self.hybrid:
            state = sched_hybrid.verify_state(self, req)
            checked, bad = checked + state["bytes"], bad + state["mismatched"]
        token_ok = list(req.output_ids[:1]) == [first_token(req.bootstrap_room)]
        return {"bytes": checked, "mismatched": bad, "token_ok": token_ok}
