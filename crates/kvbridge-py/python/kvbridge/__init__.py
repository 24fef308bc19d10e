"""kvbridge: moves LLM KV caches between prefill and decode GPUs.

* ``TransferEngine``: Mooncake's ``mooncake.engine.TransferEngine`` API as
  sglang's Mooncake connector calls it (``initialize``, ``get_rpc_port``,
  ``batch_register_memory``, ``batch_transfer_sync_write``, ``send_probe``,
  ...), over a kvbridge engine. Runtime failures are return codes (0 ok,
  -1 failed); misuse raises.
* ``plan(scenario)``: the kvbridge planner on one scenario in the format
  ``kvbridge plan`` reads; returns a ``(n, 3)`` ``uint64`` array of
  ``src, dst, len`` rows. Raises ``ScenarioError`` or ``PlanError``.

* ``kvbridge.sglang``: the switch that makes sglang use kvbridge's engine
  (``KVBRIDGE_SGLANG=1``) or kvbridge's whole PD backend
  (``KVBRIDGE_SGLANG=backend``: ``kvbridge.sglang_backend``, sglang's
  ``KVManager``/``KVSender``/``KVReceiver``/``KVBootstrapServer`` over
  kvbridge's Rust roles; ``PrefillManager``, ``DecodeManager``,
  ``BootstrapServer`` here are those roles; ``KvSender`` / ``KvReceiver``
  are the rooms their ``sender`` / ``receiver`` return).

See docs/python.md and docs/sglang.md in the kvbridge repository.
"""

from ._kvbridge import (
    BootstrapServer,
    DecodeManager,
    KvArgsError,
    KvReceiver,
    KvSender,
    KvSendError,
    PlanError,
    PrefillManager,
    RoleStartError,
    ScenarioError,
    TransferEngine,
    __version__,
    plan,
)

__all__ = [
    "BootstrapServer",
    "DecodeManager",
    "KvArgsError",
    "KvReceiver",
    "KvSender",
    "KvSendError",
    "PlanError",
    "PrefillManager",
    "RoleStartError",
    "ScenarioError",
    "TransferEngine",
    "__version__",
    "plan",
]
