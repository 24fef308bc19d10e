"""Building blocks for running sglang 0.5.23's released Mooncake PD connector
(imported from the installed wheel, never copied or edited) in plain Python
processes: the process environment, the engine switch, the runtime context a
scheduler would publish, KV pools, ``KVArgs``, and the byte pattern.

The model shape and the byte pattern are kvbridge's (``kvbridge-roles``
``synthetic.rs``: ``ModelSpec``, ``RankSpec``, ``RankPools::fill``/``verify``),
ported exactly, so a process of this harness and a ``kvbridge prefill`` /
``kvbridge decode`` rank agree on every byte of every request.

Order inside a process: :func:`setup_process` (environment, stubs, engine
hook) before anything imports sglang.
"""

from __future__ import annotations

import os
import pickle
import time
from dataclasses import asdict, dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np

# ---------------------------------------------------------------------------
# kvbridge's deterministic pattern (kvbridge-plan rng.rs, kvbridge-roles synthetic.rs)
# ---------------------------------------------------------------------------

#: SplitMix64's increment (``kvbridge_plan::rng::GOLDEN``).
GOLDEN = 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1


def mix(x):
    """SplitMix64's finalizer (``kvbridge_plan::rng::mix``), on a Python int
    or elementwise on a ``np.uint64`` array (wrapping arithmetic)."""
    if isinstance(x, np.ndarray):
        x = x.astype(np.uint64, copy=True)
        with np.errstate(over="ignore"):
            x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))
    x &= _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


@dataclass(frozen=True)
class ModelSpec:
    """The KV shape of a model (``kvbridge_roles::synthetic::ModelSpec``; the
    field names are the JSON ones a kvbridge rank file takes)."""

    name: str = "tiny"
    layers: int = 4
    kv_heads: int = 2  # KV heads of the whole model (MHA/GQA); 1 for MLA
    head_bytes: int = 128  # one head of one token (head_dim * dtype), or one MLA latent
    mla: bool = False
    page_size: int = 16
    aux_item_lens: Tuple[int, ...] = (64, 16)

    @classmethod
    def tiny_mla(cls) -> "ModelSpec":
        """A small MLA model: one latent of 576 bf16 per token and layer."""
        return cls(name="tiny-mla", layers=4, kv_heads=1, head_bytes=576 * 2, mla=True)

    def local_heads(self, tp: int) -> int:
        """KV heads one rank holds at attention TP ``tp`` (GQA replicates)."""
        return 1 if self.mla else max(self.kv_heads // max(tp, 1), 1)

    def global_head(self, tp: int, rank: int, h: int) -> int:
        """The model's head index of a rank's local head ``h``."""
        if self.mla:
            return 0
        tp = max(tp, 1)
        if self.kv_heads >= tp:
            return rank * (self.kv_heads // tp) + h
        return rank // (tp // max(self.kv_heads, 1))

    def item_len(self, tp: int) -> int:
        """Bytes of one page of one KV buffer at TP ``tp`` (sglang's ``kv_item_lens``)."""
        return self.page_size * self.local_heads(tp) * self.head_bytes

    def to_json(self) -> dict:
        """The ``model`` object of a kvbridge rank file."""
        d = asdict(self)
        d["aux_item_lens"] = list(self.aux_item_lens)
        return d


@dataclass(frozen=True)
class RankSpec:
    """Where one rank sits (``kvbridge_roles::synthetic::RankSpec``)."""

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0

    def layer_range(self, layers: int) -> Tuple[int, int]:
        """This PP stage's layers ``[start, end)``."""
        pp = max(self.pp_size, 1)
        per, extra = divmod(layers, pp)
        start = self.pp_rank * per + min(self.pp_rank, extra)
        return start, start + per + (1 if self.pp_rank < extra else 0)


def _slice_seeds(room: int, layer: int, kv: int, tokens: np.ndarray, heads: np.ndarray) -> np.ndarray:
    """``slice_seed(room, layer, kv, token, head)`` for every (token, head)
    pair: ``mix(room ^ mix((layer<<1|kv) ^ mix(token*0x1_0000_0001 ^ head<<40)))``."""
    t = tokens.astype(np.uint64)[:, None]
    h = heads.astype(np.uint64)[None, :]
    with np.errstate(over="ignore"):
        inner = mix((t * np.uint64(0x100000001)) ^ (h << np.uint64(40)))
    lk = np.uint64((layer << 1) | kv)
    return mix(np.uint64(room) ^ mix(lk ^ inner))


def page_pattern(model: ModelSpec, rank: RankSpec, room: int, layer: int, kv: int, k: int) -> np.ndarray:
    """The bytes of the ``k``-th page of request ``room`` in the buffer of
    (``layer``, ``kv``: 0 = K or MLA latent, 1 = V) on ``rank``: per token
    slot and local head, the words ``seed + j*GOLDEN`` (little-endian)."""
    heads = model.local_heads(rank.tp_size)
    tokens = np.arange(k * model.page_size, (k + 1) * model.page_size, dtype=np.uint64)
    ghead = np.array([model.global_head(rank.tp_size, rank.tp_rank, h) for h in range(heads)], dtype=np.uint64)
    seeds = _slice_seeds(room, layer, kv, tokens, ghead)  # [tokens, heads]
    nwords = -(-model.head_bytes // 8)
    with np.errstate(over="ignore"):
        words = seeds[:, :, None] + np.arange(nwords, dtype=np.uint64) * np.uint64(GOLDEN)
    raw = words.astype("<u8").view(np.uint8).reshape(model.page_size, heads, nwords * 8)
    return np.ascontiguousarray(raw[:, :, : model.head_bytes]).reshape(-1)


def aux_pattern(room: int, buffer: int, nbytes: int) -> np.ndarray:
    """The bytes of a request's row in aux buffer ``buffer``:
    words ``mix(base + j)``, ``base = mix(room*31 ^ buffer ^ 0xa0a0)``."""
    base = mix(((room * 31) & _M64) ^ buffer ^ 0xA0A0)
    nwords = -(-nbytes // 8)
    with np.errstate(over="ignore"):
        words = mix(np.uint64(base) + np.arange(nwords, dtype=np.uint64))
    return words.astype("<u8").view(np.uint8)[:nbytes].copy()


# ---------------------------------------------------------------------------
# kvbridge's synthetic workload (kvbridge-lab rank/workload.rs)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """One request: the room every rank agrees on and its prompt length."""

    index: int
    room: int
    tokens: int


@dataclass(frozen=True)
class Workload:
    """``kvbridge_lab::rank::Workload``: requests derived from a seed."""

    requests: int = 4
    prompt_tokens: int = 40
    chunk_tokens: int = 32
    concurrency: int = 4
    seed: int = 7
    room_timeout_s: float = 60.0
    #: kvbridge decode ranks abort this fraction of the requests (sglang ranks ignore it).
    abort_fraction: float = 0.0
    #: kvbridge prefill ranks: simulated forward pass (seconds) before a
    #: room's first chunk (sglang prefill ranks: ``pd_worker --send-delay``).
    forward_s: float = 0.0

    def plan(self) -> List[Request]:
        """The requests, in order."""
        out = []
        for index in range(self.requests):
            h = mix(self.seed ^ mix(index + 1))
            spread = self.prompt_tokens // 2
            tokens = self.prompt_tokens if spread == 0 else self.prompt_tokens - spread // 2 + h % (spread + 1)
            out.append(Request(index=index, room=h >> 1, tokens=max(tokens, 1)))
        return out

    def aborts(self, index: int) -> bool:
        """Whether a kvbridge decode rank aborts request ``index``
        (``Workload::aborts``)."""
        if self.abort_fraction <= 0.0:
            return False
        return (mix(self.seed ^ 0xAB0 ^ mix(index)) >> 11) / float(1 << 53) < self.abort_fraction

    def aborted_rooms(self) -> set:
        """The rooms a kvbridge decode rank aborts."""
        return {r.room for r in self.plan() if self.aborts(r.index)}

    def to_json(self) -> dict:
        """The ``workload`` object of a kvbridge rank file."""
        return asdict(self)


def pages_for(tokens: int, page_size: int) -> int:
    """Pages a request of ``tokens`` tokens needs."""
    return -(-tokens // max(page_size, 1))


# ---------------------------------------------------------------------------
# KV pools: host (numpy) or device (torch, CUDA)
# ---------------------------------------------------------------------------


class KVPool:
    """One rank's KV and aux buffers, laid out as sglang's pools are: one
    buffer per layer for K then one per layer for V (MLA: one per layer),
    page-major, ``[token][head][head_bytes]`` inside a page; aux buffers hold
    one row per in-flight request.

    ``device`` is ``"cpu"`` (numpy host memory) or ``"cuda[:N]"`` (KV buffers
    from ``torch.empty(..., device=...)``; aux stays in host memory, as
    sglang's metadata buffers). Device bytes are read and written through
    host copies.
    """

    def __init__(self, model: ModelSpec, rank: RankSpec, pages: int, aux_slots: int, device: str = "cpu"):
        self.model, self.rank, self.pages, self.aux_slots, self.device = model, rank, pages, aux_slots, device
        start, end = rank.layer_range(model.layers)
        halves = 1 if model.mla else 2
        self.item_len = model.item_len(rank.tp_size)
        nbytes = self.item_len * pages
        self.kv = [self._alloc(nbytes) for _ in range(halves * (end - start))]
        self.aux = [np.zeros(n * aux_slots, np.uint8) for n in model.aux_item_lens]

    def _alloc(self, nbytes: int):
        if self.device == "cpu":
            return np.zeros(nbytes, np.uint8)
        import torch  # real torch: only on a machine with CUDA

        return torch.zeros(nbytes, dtype=torch.uint8, device=self.device)

    @staticmethod
    def _ptr(buf) -> int:
        return buf.ctypes.data if isinstance(buf, np.ndarray) else buf.data_ptr()

    @property
    def kv_ptrs(self) -> List[int]:
        return [self._ptr(b) for b in self.kv]

    @property
    def kv_lens(self) -> List[int]:
        return [self.item_len * self.pages] * len(self.kv)

    def buffer_layer(self, b: int) -> Tuple[int, int]:
        """(global layer, kv) of KV buffer ``b``."""
        start, end = self.rank.layer_range(self.model.layers)
        n = end - start
        return (start + b, 0) if self.model.mla else (start + b % n, b // n)

    def layer_ids(self) -> List[int]:
        """Global layer id of every KV buffer (what kvbridge ranks publish)."""
        return [self.buffer_layer(b)[0] for b in range(len(self.kv))]

    def read_page(self, b: int, page: int) -> np.ndarray:
        buf = self.kv[b][page * self.item_len : (page + 1) * self.item_len]
        return buf if isinstance(buf, np.ndarray) else buf.cpu().numpy()

    def write_page(self, b: int, page: int, data: np.ndarray) -> None:
        dst = self.kv[b][page * self.item_len : (page + 1) * self.item_len]
        if isinstance(dst, np.ndarray):
            dst[:] = data
        else:
            import torch

            dst.copy_(torch.from_numpy(np.ascontiguousarray(data)))

    def aux_row(self, i: int, slot: int) -> np.ndarray:
        n = self.model.aux_item_lens[i]
        return self.aux[i][slot * n : (slot + 1) * n]

    def fill(self, room: int, pages: Sequence[int], aux_slot: int) -> None:
        """Writes request ``room``'s pattern into its pages and aux row."""
        for b in range(len(self.kv)):
            layer, kv = self.buffer_layer(b)
            for k, page in enumerate(pages):
                self.write_page(b, int(page), page_pattern(self.model, self.rank, room, layer, kv, k))
        for i, n in enumerate(self.model.aux_item_lens):
            self.aux_row(i, aux_slot)[:] = aux_pattern(room, i, n)

    def verify(self, room: int, pages: Sequence[int], aux_slot: int) -> Tuple[int, List[tuple]]:
        """Checks every byte of request ``room``; returns (bytes compared,
        the mismatching (buffer or "aux", page or slot) places)."""
        checked, bad = 0, []
        for b in range(len(self.kv)):
            layer, kv = self.buffer_layer(b)
            for k, page in enumerate(pages):
                want = page_pattern(self.model, self.rank, room, layer, kv, k)
                checked += want.size
                if not np.array_equal(self.read_page(b, int(page)), want):
                    bad.append((b, int(page)))
        for i, n in enumerate(self.model.aux_item_lens):
            checked += n
            if not np.array_equal(self.aux_row(i, aux_slot), aux_pattern(room, i, n)):
                bad.append(("aux", i, aux_slot))
        return checked, bad

    def untouched(self, used_pages: Sequence[int]) -> bool:
        """Whether every page outside ``used_pages`` is still all zero."""
        used = {int(p) for p in used_pages}
        return all(
            not self.read_page(b, p).any() for b in range(len(self.kv)) for p in range(self.pages) if p not in used
        )

    # Whole-request variants of fill / verify (the benchmark's pools are
    # large): one array operation per buffer instead of per page, on the
    # pool's own kind of array (numpy, or torch on the pool's device).

    def _pages_view(self, b: int):
        return self.kv[b].reshape(self.pages, self.item_len)

    def _on_pool(self, array: np.ndarray):
        """``array`` as the pool's kind of array (a host pool: itself)."""
        if isinstance(self.kv[0], np.ndarray):
            return array
        import torch

        return torch.from_numpy(np.ascontiguousarray(array)).to(self.kv[0].device)

    def request_patterns(self, room: int, npages: int) -> list:
        """Per KV buffer, the ``(npages, item_len)`` bytes request ``room``'s
        pages hold (:func:`pages_pattern`), on the pool's kind of array."""
        out = []
        for b in range(len(self.kv)):
            layer, kv = self.buffer_layer(b)
            out.append(self._on_pool(pages_pattern(self.model, self.rank, room, layer, kv, npages)))
        return out

    def fill_request(self, room: int, pages: Sequence[int], aux_slot: int,
                     patterns: Optional[list] = None) -> None:
        """:meth:`fill`, one buffer at a time."""
        patterns = patterns or self.request_patterns(room, len(pages))
        idx = self._on_pool(np.asarray(pages, dtype=np.int64))
        for b, want in enumerate(patterns):
            self._pages_view(b)[idx] = want
        for i, n in enumerate(self.model.aux_item_lens):
            self.aux_row(i, aux_slot)[:] = aux_pattern(room, i, n)

    def verify_request(self, room: int, pages: Sequence[int], aux_slot: int,
                       patterns: Optional[list] = None) -> Tuple[int, List[tuple]]:
        """:meth:`verify`, one buffer at a time (same return value)."""
        patterns = patterns or self.request_patterns(room, len(pages))
        idx = np.asarray(pages, dtype=np.int64)
        pool_idx = self._on_pool(idx)
        checked, bad = 0, []
        for b, want in enumerate(patterns):
            checked += int(want.numel() if hasattr(want, "numel") else want.size)
            differs = (self._pages_view(b)[pool_idx] != want).any(1)
            if not isinstance(differs, np.ndarray):
                differs = differs.cpu().numpy()
            bad += [(b, int(idx[k])) for k in np.flatnonzero(differs)]
        for i, n in enumerate(self.model.aux_item_lens):
            checked += n
            if not np.array_equal(self.aux_row(i, aux_slot), aux_pattern(room, i, n)):
                bad.append(("aux", i, aux_slot))
        return checked, bad

    def clear_request(self, pages: Sequence[int], aux_slot: int) -> None:
        """Zeroes a request's pages and aux rows (so a later write into them
        is seen, not an earlier one)."""
        idx = self._on_pool(np.asarray(pages, dtype=np.int64))
        for b in range(len(self.kv)):
            self._pages_view(b)[idx] = 0
        for i in range(len(self.model.aux_item_lens)):
            self.aux_row(i, aux_slot)[:] = 0


# ---------------------------------------------------------------------------
# Process set-up
# ---------------------------------------------------------------------------


def setup_env(host_ip: str = "127.0.0.1") -> None:
    """The environment every process (bootstrap, prefill, decode) needs."""
    defaults = {
        "SGLANG_HOST_IP": host_ip,  # get_local_ip_auto(): engine hostname, zmq binds
        "MOONCAKE_PROTOCOL": "tcp",  # sglang's default is rdma
        "MC_FORCE_TCP": "1",  # Mooncake: TcpTransport; sglang passes device_name=""
        "SGLANG_DISAGGREGATION_THREAD_POOL_SIZE": "4",
        "SGLANG_DISAGGREGATION_QUEUE_SIZE": "4",
        "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
        "PYTHONWARNINGS": "ignore",
        "HF_HUB_OFFLINE": "1",  # never touch the network
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


def setup_process(engine_module: Optional[str] = None, backend: str = "mooncake") -> None:
    """Environment, import stubs, then (when ``engine_module`` is given)
    the engine hook: ``mooncake.engine.TransferEngine`` becomes
    ``<engine_module>.TransferEngine``. None keeps Mooncake's engine.
    ``backend="kvbridge"`` switches to kvbridge's whole backend, as
    ``KVBRIDGE_SGLANG=backend`` does (its engine is always kvbridge's)."""
    import warnings

    from kvbridge import sglang as kvbridge_hook

    import sgl_stubs

    setup_env()
    warnings.filterwarnings("ignore")
    sgl_stubs.install()
    if backend == "kvbridge":
        if engine_module not in (None, "kvbridge"):
            raise ValueError(f"the kvbridge backend runs on kvbridge's engine, not {engine_module}")
        kvbridge_hook.install_backend("kvbridge")
    elif engine_module:
        kvbridge_hook.install(engine_module)


def publish_server_args(mode: str, *, bootstrap_port: int, rank: RankSpec, http_port: int,
                        dp_rank: Optional[int] = None, **extra):
    """Builds ``ServerArgs`` as a launcher would and publishes it as this
    process's runtime context, as sglang's scheduler process does
    (``dp_rank``: the spawn DP rank a DP controller passes, e.g. the
    attention-DP rank)."""
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, spawn_world_rank
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(
        model_path="dummy",  # skips every model-config-dependent resolution hook
        host="127.0.0.1",
        port=http_port,
        disaggregation_mode=mode,
        disaggregation_transfer_backend="mooncake",
        disaggregation_bootstrap_port=bootstrap_port,
        tp_size=rank.tp_size,
        pp_size=rank.pp_size,
        **{"device": "cpu", **extra},
    )
    publish(
        sa,
        role="scheduler",
        ranks=SpawnRanks(
            world_rank=spawn_world_rank(sa, tp_rank=rank.tp_rank, pp_rank=rank.pp_rank),
            dp_rank=dp_rank,
            gpu_id=rank.tp_rank,
        ),
    )
    # initialize_model_parallel() would write the process groups; the
    # connector reads only pp_group (PPConsensusStore when pp_size > 1).
    group = FileGroup(rank.pp_size, rank.pp_rank, name=f"{mode}-pp-tp{rank.tp_rank}")
    get_parallel().override_permanently(pp_group=group)
    return sa


def override_dp(size: int, rank: int, load_balance_method: str) -> None:
    """Makes this process attention-DP rank ``rank`` of ``size`` (one
    attention-TP rank per DP group), as a DP-attention launch would: the
    runtime context's TP/MoE widths grow with it."""
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(
        tp_size=size, tp_rank=rank, moe_tp_size=size, moe_tp_rank=rank,
        attn_dp_size=size, attn_dp_rank=rank, num_dp_ranks=size,
        load_balance_method=load_balance_method)


def override_cp(size: int, rank: int) -> None:
    """Makes this process attention-CP rank ``rank`` of ``size`` (one
    attention-TP rank per CP group), as a context-parallel launch would."""
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(
        tp_size=size, tp_rank=rank, moe_tp_size=size, moe_tp_rank=rank,
        attn_cp_size=size, attn_cp_rank=rank)


class FileGroup:
    """The part of sglang's ``GroupCoordinator`` the connector uses. With
    more than one rank, objects are broadcast through pickle files in
    ``$KVB_RDV_DIR`` (one directory per run)."""

    def __init__(self, world_size: int, rank: int, name: str):
        self.world_size = world_size
        self.rank_in_group = rank
        self.is_first_rank = rank == 0
        self.is_last_rank = rank == world_size - 1
        self._name = name
        self._count = 0

    def broadcast_object(self, obj, src: int = 0):
        if self.world_size == 1:
            return obj
        path = os.path.join(os.environ["KVB_RDV_DIR"], f"{self._name}-bcast-{self._count}")
        self._count += 1
        if self.rank_in_group == src:
            with open(path + ".tmp", "wb") as f:
                pickle.dump(obj, f)
            os.replace(path + ".tmp", path)
            return obj
        deadline = time.monotonic() + 60
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no broadcast at {path}")
            time.sleep(0.05)
        with open(path, "rb") as f:
            return pickle.load(f)

    def all_gather_object(self, obj):
        return [obj] * self.world_size


def init_engine(gpu_id: int = 0):
    """Creates the process-wide engine wrapper, as scheduler start-up does
    (``maybe_init_shared_mooncake_transfer_engine``); the manager picks it up."""
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        init_mooncake_transfer_engine,
    )
    from sglang.srt.utils.network import get_local_ip_auto

    return init_mooncake_transfer_engine(hostname=get_local_ip_auto(), gpu_id=gpu_id, ib_device=None)


def make_kv_args(pool: KVPool, *, kv_cache_dtype: str = "auto", publish_layer_ids: bool = False):
    """sglang's ``KVArgs`` for ``pool``, as the scheduler fills it for a plain
    MHA or MLA pool (no state pools, no draft). ``publish_layer_ids`` also
    publishes every buffer's layer id, as kvbridge ranks and sglang's hybrid
    pools do (needed to pair PP stages with a kvbridge peer)."""
    from sglang.srt.disaggregation.base.conn import KVArgs

    model, rank = pool.model, pool.rank
    start, end = rank.layer_range(model.layers)
    a = KVArgs()
    a.engine_rank = rank.tp_rank
    a.pp_rank = rank.pp_rank
    a.system_dp_rank = 0
    a.rust_http_port = None
    a.kv_cache_dtype_str = kv_cache_dtype
    a.kv_layout = None
    a.kv_data_ptrs = pool.kv_ptrs
    a.kv_data_lens = pool.kv_lens
    a.kv_item_lens = [pool.item_len] * len(pool.kv)  # bytes per PAGE
    a.kv_layer_ids = pool.layer_ids() if publish_layer_ids else []
    a.num_draft_entries = 0
    a.kv_head_num = model.local_heads(rank.tp_size)
    a.total_kv_head_num = model.kv_heads
    a.page_size = model.page_size
    a.prefill_start_layer, a.prefill_end_layer = start, end
    a.aux_data_ptrs = [b.ctypes.data for b in pool.aux]
    a.aux_data_lens = [b.nbytes for b in pool.aux]
    a.aux_item_lens = list(model.aux_item_lens)
    a.ib_device = None
    a.gpu_id = rank.tp_rank
    a.state_types = []
    a.state_data_ptrs = []
    a.state_data_lens = []
    a.state_item_lens = []
    a.state_dim_per_tensor = []
    a.state_slice_outer_counts = []
    a.state_layer_ids = []
    a.is_hybrid_mla_backend = False
    a.state_conv_shard_groups = []
    a.swa_kv_cache_layout = None
    a.mla_compression_ratios = None
    return a


@dataclass
class RoomPlan:
    """Where one request sits on one side: its pages and aux row."""

    room: int
    pages: List[int] = field(default_factory=list)
    aux_slot: int = 0


def allocate(
    requests: Sequence[Request], model: ModelSpec, pages: int, aux_slots: int, reverse: bool,
    scatter_seed: Optional[int] = None,
) -> List[RoomPlan]:
    """Gives each request its pages (lowest first, or from the top of the
    pool downwards with ``reverse``, so prefill and decode page numbers
    differ) and an aux row; raises when the pool is too small. With
    ``scatter_seed`` the pages are scattered instead (:func:`scatter_pages`
    over the whole pool, the seed varied by ``reverse`` so the two sides
    differ): no two pages of a request are neighbours in page order."""
    if scatter_seed is not None:
        if len(requests) > aux_slots:
            raise ValueError(f"pool of {pages} pages / {aux_slots} aux rows is too small")
        counts = [pages_for(r.tokens, model.page_size) for r in requests]
        runs = scatter_pages(pages, counts, mix(scatter_seed ^ (0x5CA7 if reverse else 0)))
        return [RoomPlan(r.room, run, (aux_slots - 1 - i) if reverse else i)
                for i, (r, run) in enumerate(zip(requests, runs))]
    plans, next_page = [], 0
    for i, r in enumerate(requests):
        n = pages_for(r.tokens, model.page_size)
        run = list(range(next_page, next_page + n))
        next_page += n
        if next_page > pages or i >= aux_slots:
            raise ValueError(f"pool of {pages} pages / {aux_slots} aux rows is too small")
        if reverse:
            run = [pages - 1 - p for p in run]
            if i % 2:
                run.reverse()  # ascending run: exercises contiguous-run merging
        plans.append(RoomPlan(r.room, run, (aux_slots - 1 - i) if reverse else i))
    return plans


# ---------------------------------------------------------------------------
# Scattered pages and the room-level benchmark's plan (bench_rooms.py)
# ---------------------------------------------------------------------------


def pages_pattern(model: ModelSpec, rank: RankSpec, room: int, layer: int, kv: int, npages: int) -> np.ndarray:
    """Pages ``0 .. npages-1`` of request ``room`` in one KV buffer, as an
    ``(npages, item_len)`` array: row ``k`` equals :func:`page_pattern` ``(...,
    k)`` (the same formula over all tokens at once, fast for small pages)."""
    heads = model.local_heads(rank.tp_size)
    tokens = np.arange(npages * model.page_size, dtype=np.uint64)
    ghead = np.array([model.global_head(rank.tp_size, rank.tp_rank, h) for h in range(heads)], dtype=np.uint64)
    seeds = _slice_seeds(room, layer, kv, tokens, ghead)  # [tokens, heads]
    nwords = -(-model.head_bytes // 8)
    with np.errstate(over="ignore"):
        words = seeds[:, :, None] + np.arange(nwords, dtype=np.uint64) * np.uint64(GOLDEN)
    raw = words.astype("<u8").view(np.uint8).reshape(tokens.size, heads, nwords * 8)
    return np.ascontiguousarray(raw[:, :, : model.head_bytes]).reshape(npages, -1)


def scatter_pages(pool_pages: int, counts: Sequence[int], seed: int) -> List[List[int]]:
    """Pages for requests of ``counts`` pages from a pool of ``pool_pages``:
    a seeded shuffle of the free list, cut into runs. Reshuffled until no run
    holds a page followed by the next page number, so sglang's merging of
    contiguous page runs (``group_concurrent_contiguous``) finds nothing and
    every page travels as its own block (descending runs if no shuffle
    manages within 1000 tries)."""
    import random

    need = sum(counts)
    if need > pool_pages:
        raise ValueError(f"pool of {pool_pages} pages is too small for {need}")
    rng = random.Random(seed)
    free = list(range(pool_pages))
    for _ in range(1000):
        rng.shuffle(free)
        runs, at = [], 0
        for n in counts:
            runs.append(free[at : at + n])
            at += n
        if all(b != a + 1 for run in runs for a, b in zip(run, run[1:])):
            return runs
    return [sorted(run, reverse=True) for run in runs]


def contiguous_blocks(src: Sequence[int], dst: Sequence[int]) -> int:
    """Blocks sglang makes of one buffer's pages ``src`` -> ``dst``: runs
    where both sides step by +1 merge (``group_concurrent_contiguous``)."""
    if not len(src):
        return 0
    return 1 + sum(1 for i in range(len(src) - 1) if not (src[i + 1] - src[i] == 1 and dst[i + 1] - dst[i] == 1))


@dataclass(frozen=True)
class BenchSpec:
    """The room-level benchmark's workload, derived alike by the prefill and
    the decode (``pd_worker.py --bench``).

    ``rooms`` requests of ``room_tokens`` tokens each (full pages), sent in
    chunks of ``chunk_tokens`` (0: one chunk per room), in waves of
    ``rooms_per_wave``: the decode sends the destinations of a wave's rooms
    together, waits for all of them, verifies and clears their pages, then
    starts the next wave. Both pools hold one wave. The prefill fills
    ``rooms_per_wave`` content slots once; room ``i`` sends slot
    ``i % rooms_per_wave`` (pattern seed :meth:`content_seed`), so the decode
    knows every byte it must receive. Pages are scattered on both sides
    (:func:`scatter_pages`; the decode draws new pages every wave)."""

    rooms: int = 8
    rooms_per_wave: int = 2
    room_tokens: int = 1024
    chunk_tokens: int = 0
    seed: int = 11
    #: Seconds between two polls of every open sender / receiver.
    poll_s: float = 0.001
    #: Both ranks call sglang's ``freeze_gc`` (what its ``/freeze_gc``
    #: endpoint does) once set up, before the first room.
    freeze_gc: bool = False

    def room_ids(self) -> List[int]:
        """The bootstrap rooms, in sending order."""
        return [r.room for r in Workload(requests=self.rooms, seed=self.seed).plan()]

    def pages_per_room(self, model: ModelSpec) -> int:
        return pages_for(self.room_tokens, model.page_size)

    def pool_pages(self, model: ModelSpec) -> int:
        return self.rooms_per_wave * self.pages_per_room(model)

    def chunk_pages(self, model: ModelSpec) -> int:
        return pages_for(self.chunk_tokens or self.room_tokens, model.page_size)

    def waves(self) -> List[List[int]]:
        """Room indices of each wave."""
        n = self.rooms_per_wave
        return [list(range(i, min(i + n, self.rooms))) for i in range(0, self.rooms, n)]

    def slot(self, index: int) -> int:
        """The content slot room ``index`` sends (also its prefill aux row)."""
        return index % self.rooms_per_wave

    def content_seed(self, slot: int) -> int:
        """The pattern's room value of content slot ``slot``."""
        return mix(self.seed ^ 0xC0DE ^ mix(slot + 1)) >> 1

    def prefill_pages(self, model: ModelSpec) -> List[List[int]]:
        """Prefill pages of each content slot."""
        n = self.pages_per_room(model)
        return scatter_pages(self.pool_pages(model), [n] * self.rooms_per_wave, self.seed)

    def decode_pages(self, model: ModelSpec, wave: int) -> List[List[int]]:
        """Decode pages of each room of wave ``wave``, in wave order."""
        n = self.pages_per_room(model)
        k = len(self.waves()[wave])
        return scatter_pages(self.pool_pages(model), [n] * k, mix(self.seed ^ 0xDEC0 ^ mix(wave + 1)))

    def kv_bytes_per_room(self, model: ModelSpec, rank: RankSpec = RankSpec()) -> int:
        start, end = rank.layer_range(model.layers)
        buffers = (1 if model.mla else 2) * (end - start)
        return self.pages_per_room(model) * buffers * model.item_len(rank.tp_size)

    def bytes_per_room(self, model: ModelSpec, rank: RankSpec = RankSpec()) -> int:
        """KV plus aux bytes the decode verifies per room."""
        return self.kv_bytes_per_room(model, rank) + sum(model.aux_item_lens)

    def to_json(self) -> dict:
        return asdict(self)
