"""kvbridge: moves LLM KV caches between prefill and decode GPUs.

* ``TransferEngine``: Mooncake's ``mooncake.engine.TransferEngine`` API as
  sglang's Mooncake connector calls it (``initialize``, ``get_rpc_port``,
  ``batch_register_memory``, ``batch_transfer_sync_write``, ``send_probe``,
  ...), over a kvbridge engine. Runtime failures are return codes (0 ok,
  -1 failed); misuse raises.
* ``plan(scenario)``: the kvbridge planner on one scenario in the format
  ``kvbridge plan`` reads; returns a ``(n, 3)`` ``uint64`` array of
  ``src, dst, len`` rows. Raises ``ScenarioError`` or ``PlanError``.

See docs/python.md in the kvbridge repository.
"""

from ._kvbridge import (
    PlanError,
    ScenarioError,
    TransferEngine,
    __version__,
    plan,
)

__all__ = ["PlanError", "ScenarioError", "TransferEngine", "__version__", "plan"]
