"""Writes the staging golden file kvbridge's planner and decode ring are
tested against (``crates/kvbridge-plan/tests/fixtures/staging_sglang.json``):
sglang 0.5.23's own staging arithmetic, run on many inputs.

The functions come from the installed sglang wheel's
``disaggregation/common/staging_buffer.py`` and ``staging_handler.py``,
loaded from the source (their modules import torch and triton at the top,
which a CPU machine does not need for this arithmetic): the pure ones
(``compute_head_slice_params``, ``compute_staging_layout``,
``compute_grid_segments``, ``is_watermark_ready``) and
``StagingAllocator``'s ``assign``/``free``/``get_watermark`` on an instance
built without its GPU buffer. Nothing of sglang's is copied into kvbridge;
only the results are kept.

    python staging_fixture.py OUT.json     (from python/interop, in the interop venv)
"""

import ast
import importlib.util
import json
import random
import sys
import threading
import typing
from pathlib import Path


def _load(module: str, names: set) -> dict:
    """The top-level functions and classes ``names`` of sglang's ``module``
    (found without importing sglang, whose package imports torch)."""
    root = importlib.util.find_spec("sglang").submodule_search_locations[0]
    path = Path(root).joinpath(*module.split(".")[1:]).with_suffix(".py")
    tree = ast.parse(path.read_text())
    keep = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names]
    scope = {"List": typing.List, "Optional": typing.Optional, "Tuple": typing.Tuple, "threading": threading}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec"), scope)
    return scope


def main(out: str) -> None:
    buf = _load("sglang.srt.disaggregation.common.staging_buffer",
                {"compute_head_slice_params", "compute_staging_layout", "compute_grid_segments",
                 "StagingAllocator"})
    handler = _load("sglang.srt.disaggregation.common.staging_handler", {"is_watermark_ready"})
    rng = random.Random(18)
    head_slices, layouts = [], []
    sizes = [1, 2, 4, 8, 16]
    for src_tp in sizes:
        for dst_tp in sizes:
            for heads in [1, 2, 4, 8, 16, 32]:
                for src_rank in range(src_tp):
                    for dst_rank in range(dst_tp):
                        got = buf["compute_head_slice_params"](src_tp, dst_tp, src_rank, dst_rank, heads)
                        head_slices.append([src_tp, dst_tp, src_rank, dst_rank, heads, list(got)])
                for dst_rank in range(dst_tp):
                    tokens, bpht, layers = rng.choice([1, 16, 8192]), rng.choice([2, 128, 256]), rng.randint(1, 80)
                    n, parts, total = buf["compute_staging_layout"](src_tp, dst_tp, dst_rank, heads, tokens, bpht,
                                                                    layers)
                    layouts.append([src_tp, dst_tp, dst_rank, heads, tokens, bpht, layers, parts, total])
    grids = []
    for _ in range(300):
        base = rng.randint(0, 50)
        start = base + rng.randint(0, 100)
        end = start + rng.randint(0, 300)
        grid = rng.randint(1, 64)
        segs = buf["compute_grid_segments"](start, end, base, grid)
        grids.append([start, end, base, grid, [list(s) for s in segs]])
    rings = []
    allocator_cls = buf["StagingAllocator"]
    for _ in range(60):
        ring = allocator_cls.__new__(allocator_cls)  # no GPU buffer: the bookkeeping only
        size = rng.choice([100, 1000, 4096])
        ring.total_size, ring.head, ring.round = size, 0, 0
        ring.allocations, ring.alloc_order, ring.next_alloc_id = {}, [], 0
        ring.watermark_round = ring.watermark_tail = 0
        ring.lock = threading.Lock()
        ops, held = [], []
        for _ in range(rng.randint(1, 80)):
            if held and rng.random() < 0.45:
                alloc_id = held.pop(rng.randrange(len(held)))
                ring.free(alloc_id)
                ops.append(["free", alloc_id, list(ring.get_watermark())])
            else:
                n = rng.randint(1, size + size // 4)
                got = ring.assign(n)
                if got is not None:
                    held.append(got[0])
                ops.append(["assign", n, None if got is None else list(got), list(ring.get_watermark())])
        rings.append({"size": size, "ops": ops})
    marks = []
    for _ in range(400):
        wm = (rng.randint(0, 4), rng.randint(0, 200))
        rnd, end = rng.randint(-1, 5), rng.choice([-2, -1, rng.randint(0, 250), rng.randint(0, 250)])

        class Ctx:
            remote_watermarks = {"s": wm}

        marks.append([list(wm), rnd, end, handler["is_watermark_ready"](Ctx, "s", rnd, end)])
    Path(out).write_text(json.dumps({
        "source": "sglang 0.5.23 disaggregation/common/staging_buffer.py and staging_handler.py",
        "head_slice_params": head_slices,
        "staging_layout": layouts,
        "grid_segments": grids,
        "allocator": rings,
        "watermark_ready": marks,
    }, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
