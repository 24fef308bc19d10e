"""sglang 0.5.23's own scheduler code setting up its PD transfer backend, run
on stand-in pools: ``PrefillBootstrapQueue._init_kv_manager`` and
``DecodePreallocQueue._init_kv_manager`` run unchanged, so they fill
``KVArgs`` and create kvbridge's backend manager exactly as a scheduler
does. Only what they read is a stand-in: the queue and scheduler objects
(plain namespaces) and the KV pools (numpy buffers behind sglang's pool
methods; a DeepSeek-V4 pool is sglang's own class, made with
``object.__new__`` as sglang's tests do).

The backend classes are selected as a deployment selects them
(``kvbridge.sglang.install_backend``); only the transfer engine is a fresh
kvbridge engine per manager instead of the process-wide one, so a prefill
and a decode can run in one test process."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
import types
from typing import Dict, List, Optional, Sequence

import numpy as np
import pytest

from conftest import HOST, REPO, addr, dead_port, start_engine

AUX_ITEM = 64
AUX_SLOTS = 4


def sglang():
    """The sglang modules the tests drive (skipped where sglang is missing),
    with kvbridge's backend installed as ``KVBRIDGE_SGLANG=backend`` does."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed here")
    interop = os.path.join(REPO, "python", "interop")
    if interop not in sys.path:
        sys.path.insert(0, interop)
    os.environ.setdefault("SGLANG_HOST_IP", HOST)
    try:
        import sgl_stubs

        sgl_stubs.install()
        from kvbridge import sglang as hook

        hook.install_backend("kvbridge")
        from kvbridge import sglang_backend
        from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout
        from sglang.srt.disaggregation import decode, prefill
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.utils import TransferBackend
        from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
    except ImportError as e:
        pytest.skip(f"sglang does not import here: {e}")
    return types.SimpleNamespace(
        backend=sglang_backend, decode=decode, prefill=prefill, KVPoll=KVPoll, KVLayout=KVLayout,
        MOONCAKE=TransferBackend.MOONCAKE, V4Pool=DeepSeekV4TokenToKVPool,
    )


def publish(bootstrap_port: int):
    """sglang's runtime context for a one-rank server (what the scheduler
    process publishes before it builds its queues)."""
    from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(
        model_path="dummy", host=HOST, port=dead_port(), device="cpu", disaggregation_mode="prefill",
        disaggregation_transfer_backend="mooncake", disaggregation_bootstrap_port=bootstrap_port,
    )
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=spawn_world_rank(sa, tp_rank=0, pp_rank=0),
                                                    dp_rank=None, gpu_id=0))
    return sa


class Buffers:
    """Page buffers (one numpy array each) with sglang's
    ``get_contiguous_buf_infos`` answer."""

    def __init__(self, item_lens: Sequence[int], pages: int, seed: Optional[int] = None):
        self.item_lens = list(item_lens)
        rng = np.random.default_rng(seed)
        self.bufs = [
            rng.integers(0, 256, item * pages, dtype=np.uint8) if seed is not None
            else np.zeros(item * pages, dtype=np.uint8)
            for item in self.item_lens
        ]

    def infos(self):
        return [addr(b) for b in self.bufs], [b.nbytes for b in self.bufs], list(self.item_lens)

    def page(self, i: int, page: int) -> np.ndarray:
        item = self.item_lens[i]
        return self.bufs[i][page * item:(page + 1) * item]


class PlainPool(Buffers):
    """An MHA or MLA token-to-KV pool: no state, no layer ids."""

    def __init__(self, item_lens, pages, page_size, seed=None, head_num=1):
        super().__init__(item_lens, pages, seed)
        self.page_size, self.start_layer, self.end_layer, self.head_num = page_size, 0, None, head_num

    def get_contiguous_buf_infos(self):
        return self.infos()


#: Bytes per page of each V4 KV group (C4 KV, C4 indexer, C128 KV) and of
#: the SWA state; arbitrary, the roles move pages as bytes.
V4_ITEMS = {"c4": 96, "idx": 32, "c128": 16, "swa": 48}


def v4_pool(s, ratios: Sequence[int], pages: int, page_size: int, seed=None, layout=None):
    """sglang's ``DeepSeekV4TokenToKVPool`` over numpy pages: KV buffers
    [C4 KV | C4 indexer | C128 KV], the SWA state (one buffer per layer,
    then the C4 compressor and C4 indexer states), no request state."""
    c4, c128 = ratios.count(4), ratios.count(128)
    pool = object.__new__(s.V4Pool)
    pool.kv_layout = layout or s.KVLayout.V4
    pool.uniform_fp8 = False
    pool.compressed_kv_layout_option = None
    pool.compression_ratios = list(ratios)
    pool.page_size, pool.start_layer, pool.end_layer = page_size, 0, len(ratios)
    pool._unified_kv = False
    kv = Buffers([V4_ITEMS["c4"]] * c4 + [V4_ITEMS["idx"]] * c4 + [V4_ITEMS["c128"]] * c128, pages, seed)
    swa = Buffers([V4_ITEMS["swa"]] * (len(ratios) + 2 * c4), pages, None if seed is None else seed + 1)
    pool.kv, pool.swa = kv, swa
    pool.get_contiguous_buf_infos = kv.infos
    pool.get_state_buf_infos = swa.infos
    pool.get_request_state_buf_infos = lambda: ([], [], [])
    return pool


class HostPool(Buffers):
    """HiSparse's host pool (``hisparse_coordinator.mem_pool_host``)."""

    def __init__(self, item_lens, pages):
        super().__init__(item_lens, pages)
        self.layer_num = len(item_lens)

    def get_contiguous_buf_infos(self):
        return self.infos()


def metadata_buffers():
    aux = np.zeros(AUX_ITEM * AUX_SLOTS, dtype=np.uint8)
    return aux, types.SimpleNamespace(get_buf_infos=lambda: ([addr(aux)], [aux.nbytes], [AUX_ITEM]))


def scheduler(pool, *, layers: int, enable_hisparse=False, host_pool=None, heads=1):
    return types.SimpleNamespace(
        tp_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(kv_cache_dtype_str="auto")),
        model_config=types.SimpleNamespace(num_hidden_layers=layers, get_total_num_kv_heads=lambda: heads,
                                           hf_text_config=None),
        server_args=types.SimpleNamespace(enable_hisparse=enable_hisparse),
        enable_hisparse=enable_hisparse,
        hisparse_coordinator=types.SimpleNamespace(mem_pool_host=host_pool),
        rust_server=None,
    )


def prefill_manager(s, pool, *, is_mla: bool, layers: int, draft=None):
    """``PrefillBootstrapQueue._init_kv_manager`` over ``pool``: the KVArgs
    and the backend manager a prefill scheduler builds."""
    aux, meta = metadata_buffers()
    q = types.SimpleNamespace(
        transfer_backend=s.MOONCAKE, tp_rank=0, pp_rank=0, token_to_kv_pool=pool,
        draft_token_to_kv_pool=draft, metadata_buffers=meta, is_mla_backend=is_mla,
        scheduler=scheduler(pool, layers=layers, heads=getattr(pool, "head_num", 1)),
    )
    mgr = s.prefill.PrefillBootstrapQueue._init_kv_manager(q)
    mgr._test_aux = aux
    return mgr


def decode_manager(s, pool, *, is_mla: bool, layers: int, hisparse_host=None, draft=None, **queue):
    """``DecodePreallocQueue._init_kv_manager`` over ``pool`` (HiSparse when
    ``hisparse_host`` is the host pool; ``queue``: more queue attributes):
    the KVArgs and the backend manager a decode scheduler builds."""
    aux, meta = metadata_buffers()
    q = types.SimpleNamespace(
        transfer_backend=s.MOONCAKE, tp_rank=0, pp_rank=0, token_to_kv_pool=pool,
        draft_token_to_kv_pool=draft, metadata_buffers=meta, is_mla_backend=is_mla,
        enable_staging=False, req_to_token_pool=None,
        scheduler=scheduler(pool, layers=layers, enable_hisparse=hisparse_host is not None,
                            host_pool=hisparse_host),
    )
    q.__dict__.update(queue)
    from sglang.srt.runtime_context import get_memory

    # The scheduler reads HiSparse from here (``Scheduler.enable_hisparse``).
    with get_memory().override(enable_hisparse=hisparse_host is not None):
        mgr = s.decode.DecodePreallocQueue._init_kv_manager(q)
    mgr._test_aux = aux
    return mgr


def wait_for(what, predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def poll_until(obj, states, timeout=20.0):
    """Polls a sender or receiver until it reaches one of ``states``."""
    deadline = time.monotonic() + timeout
    while True:
        st = obj.poll()
        if st in states:
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"room {obj.bootstrap_room} still in state {st}")
        time.sleep(0.01)


def bootstrap_addr(port: int) -> str:
    return f"{HOST}:{port}"


class World:
    """A bootstrap server and the runtime context naming it; managers made
    here are torn down at the end."""

    def __init__(self, s, monkeypatch):
        self.s = s
        self.port = dead_port()
        publish(self.port)
        monkeypatch.setattr(s.backend, "_process_engine", lambda: start_engine())
        self.server = s.backend.KVBootstrapServer(HOST, self.port)
        self.addr = bootstrap_addr(self.port)
        self.managers: List = []

    def keep(self, mgr):
        self.managers.append(mgr)
        return mgr

    def close(self):
        from kvbridge import sglang as hook

        for m in reversed(self.managers):
            m.teardown()
        self.server.close()
        hook.uninstall_backend()
        hook.uninstall()


def transfer(s, world, prefill_mgr, decode_mgr, room, src_pages, dst_pages, *, state_src=None,
             state_dst=None, device_pages=None, aux_slot=1):
    """One room through the backend classes as sglang's scheduler drives
    them; returns the receiver and the sender once both concluded."""
    KVPoll = s.KVPoll
    wait_for("the prefill server", lambda: decode_mgr.try_ensure_parallel_info(world.addr))
    rx = s.backend.KVReceiver(decode_mgr, world.addr, room)
    rx.init(0)
    kwargs: Dict = {"decode_prefix_len": 0}
    if device_pages is not None:
        kwargs["device_kv_indices"] = np.asarray(device_pages, dtype=np.int32)
    rx.send_metadata(np.asarray(dst_pages, dtype=np.int32), aux_slot, state_dst, **kwargs)
    tx = s.backend.KVSender(prefill_mgr, world.addr, room)
    if rx.poll() != KVPoll.Failed:
        poll_until(tx, (KVPoll.WaitingForInput, KVPoll.Failed))
        tx.init(len(src_pages), 0)
        tx.send(np.asarray(src_pages, dtype=np.int32), state_src)
    return rx, tx
