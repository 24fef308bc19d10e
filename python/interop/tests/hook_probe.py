"""Stands in for ``sglang.launch_server`` in the launcher test: run as
``__main__`` by ``kvbridge_hook.main``, it reports its argv and spawns a child
with the ``spawn`` start method (as sglang starts its schedulers), which
reports which ``TransferEngine`` ``mooncake.engine`` gives it."""

import json
import multiprocessing as mp


def engine_origin() -> str:
    """Module of the TransferEngine that ``mooncake.engine`` resolves to here."""
    from mooncake.engine import TransferEngine

    return TransferEngine.__module__


def child(queue) -> None:
    queue.put(engine_origin())


if __name__ == "__main__":
    import sys

    import hook_probe  # by its real name, so the child can unpickle `child`

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=hook_probe.child, args=(queue,))
    proc.start()
    seen = queue.get(timeout=60)
    proc.join(60)
    print("PROBE " + json.dumps({"argv": sys.argv, "parent": engine_origin(), "child": seen}), flush=True)
