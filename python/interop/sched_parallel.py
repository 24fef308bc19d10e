"""Prefill parallelism beyond TP through sglang 0.5.23's own scheduler code
(``sched_world``): attention data parallelism, attention context
parallelism and pipeline parallelism.

* **Attention DP** (``--attn-dp N``, the TP ranks split into N attention
  groups, one scheduler each): the launch sglang's
  ``DataParallelController`` makes, rank by rank: ``ServerArgs(tp_size,
  attn_dp_size, load_balance_method)`` and the spawn DP rank from sglang's
  ``compute_dp_attention_world_info``, so ``initialize_model_parallel``
  builds attention-TP groups per DP group, the KV pool holds the attention
  group's heads, ``KVArgs.system_dp_rank`` is the DP rank, and the
  backend's sender registers the room's DP rank with the bootstrap server
  when the method is not ``follow_bootstrap_room``. The decode finds the
  prefill DP rank through its own ``DecodePreallocQueue`` (``room % dp``
  or ``query_prefill_dp_ranks``). Stood in for: the DP controller's
  dispatch, :func:`routed` (by room for ``follow_bootstrap_room``, round
  robin by arrival otherwise, as its schedulers do).
* **Attention CP** (``--attn-cp N``): ``ServerArgs(attn_cp_size)``; every
  CP rank runs the same batches and all-reduces its polls over the real
  ``attn_cp_cpu_group``; only CP rank 0 sends unless
  ``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER`` (``is_dummy_cp_rank``).
  Stood in for: the CP forward (token split and KV all-gather):
  ``World.forward`` writes the whole KV on every CP rank, what each holds
  after the all-gather.
* **PP** (``--pp N R``): sglang's own ``event_loop_pp_disagg_prefill`` runs
  (:func:`run_pp_prefill`): its bootstrap polls (``pop_bootstrapped`` →
  ``poll_and_all_reduce_prefill_pp``, PP0's polls relayed by
  ``pp_sync_polls``), the transferred-rid intersection
  (``_pp_pd_get_prefill_transferred_ids``), the release consensus sent
  around the ring (``_pp_pd_send_consensus_release_ids``,
  ``_pp_recv_pyobj_from_prev_stage``) and
  ``process_disagg_prefill_inflight_queue(release_rids)``, every relay over
  the real world group (gloo). Stood in for, on the instance, what carries
  the model and not the transfer: the request feed (``ingest_requests``:
  requests are queued on every stage up front; it also ends the loop once
  every stage concluded, one all-reduce over the PP group), the batch
  planner (``get_new_batch_prefill``: ``World._admit``), the MLP-sync
  adapter of DP attention, the forward (``_pp_launch_batch``:
  ``World.forward``), the hidden-state relay between stages
  (``_pp_recv_proxy_tensors`` / ``_pp_send_proxy_to_next_stage``), the
  output relay from the last stage (every stage "samples" the same token
  itself), the result dispatch's metrics (``_pp_process_batch_result``
  calls ``process_batch_result_disagg_prefill``, which sglang's
  ``process_batch_result`` calls for a prefill extend batch) and the idle
  housekeeping (``on_idle``).
"""

from __future__ import annotations

import os
import time
import types
from typing import Dict, Iterable, List, Tuple


def server_args_extra(args) -> dict:
    """Server args and the spawn DP rank of this prefill rank's launch."""
    from sglang.srt.layers.dp_attention import compute_dp_attention_world_info

    s, extra = args.shape, {}
    if args.attn_dp > 1:
        _, _, dp_rank, _ = compute_dp_attention_world_info(s.tp_rank, s.tp_size, args.attn_dp, args.attn_cp)
        extra.update(attn_dp_size=args.attn_dp, load_balance_method=args.load_balance_method, dp_rank=dp_rank)
    if args.attn_cp > 1:
        extra.update(attn_cp_size=args.attn_cp)
    return extra


def routed(args, rooms: Iterable[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """The requests the DP controller hands this rank's attention-DP group
    (``follow_bootstrap_room_scheduler``: by room; ``round_robin``: by
    arrival)."""
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    if p.attn_dp_size <= 1:
        return list(rooms)
    by_room = args.load_balance_method == "follow_bootstrap_room"
    return [(room, n) for i, (room, n) in enumerate(rooms)
            if (room if by_room else i) % p.attn_dp_size == p.attn_dp_rank]


class _Stop(Exception):
    """Every stage concluded (or the deadline passed): the loop ends."""


class _Done:
    """The output copy's event (``d2h_event``): the stand-in forward is done."""

    def synchronize(self):
        pass


def run_pp_prefill(w, rooms: set, deadline: float, rdv: str) -> None:
    """sglang's ``event_loop_pp_disagg_prefill`` on ``w``'s scheduler until
    every stage concluded ``rooms`` (each concluded request reaches the
    output streamer, ``w.recorder``) or ``deadline``.

    The loop never ends in sglang, and its relays around the ring always
    have one message in flight, so no iteration is a clean stop: each stage
    marks a file in ``rdv`` once it concluded and leaves the loop at its
    next ``ingest_requests`` once every stage did; a stage still blocked in
    a relay to a stage that left sees gloo's "Connection closed by peer",
    which ends it too (every stage having concluded)."""
    from sglang.srt.distributed.parallel_state import get_world_group
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    s = w.scheduler
    pp = s.pp_group
    results: Dict[int, object] = {}
    os.makedirs(rdv, exist_ok=True)
    mine = os.path.join(rdv, f"stage{pp.rank_in_group}")
    if os.path.exists(mine):  # an earlier run's (ports are reused); no stage concludes before all run
        os.remove(mine)

    def all_concluded() -> bool:
        if rooms <= {r.bootstrap_room for r in w.recorder.streamed}:
            open(mine, "w").close()
        return all(os.path.exists(os.path.join(rdv, f"stage{k}")) for k in range(pp.world_size))

    def ingest_requests(stop_at_pause: bool = False) -> List:
        if all_concluded() or time.monotonic() > deadline:
            raise _Stop()
        if not pp.is_first_rank:
            # What the previous stage relays (recv_requests' PP path).
            s._pp_recv_pyobj_from_prev_stage()
        return []

    def get_new_batch_prefill(running_batch):
        ready, batch = w._admit(), None
        if ready:
            batch = ScheduleBatch.init_new(ready, w.req_to_token_pool, w.allocator, w.tree_cache, w.model_config,
                                           False, s.spec_algorithm)
            batch.prepare_for_extend()
        return types.SimpleNamespace(batch_to_run=batch, running_batch=running_batch)

    def launch(mb_id, batch, *_):
        results[mb_id] = w.forward(batch)
        return results[mb_id], None

    def outputs(next_first_rank_mb_id, next_mb_id):
        return None, results.pop(next_mb_id, None), _Done()

    s.__dict__.update(
        world_group=get_world_group(), enable_unified_cache_external_linker=False, enable_lmcache=False,
        ingest_requests=ingest_requests, get_new_batch_prefill=get_new_batch_prefill,
        dp_attn_adapter=types.SimpleNamespace(maybe_prepare_mlp_sync_batch=lambda batch: batch),
        _pp_recv_proxy_tensors=lambda: None, _pp_send_proxy_to_next_stage=lambda result: None,
        _pp_launch_batch=launch, _pp_commit_send_output_work_and_preprocess_output_tensors=outputs,
        _pp_process_batch_result=s.process_batch_result_disagg_prefill, on_idle=lambda: time.sleep(0.002))
    try:
        s.event_loop_pp_disagg_prefill()
    except _Stop:
        pass
    except RuntimeError as e:
        if "Connection closed by peer" not in str(e) or not all_concluded():
            raise
