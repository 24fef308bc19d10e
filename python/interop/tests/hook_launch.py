"""Main module for the launcher test: ``python -m hook_launch ARGS`` does what
``python -m kvbridge.sglang ARGS`` does, with ``hook_probe`` in place of
``sglang.launch_server``. Spawned children re-import this module as
``__mp_main__``; its ``import kvbridge_hook`` then installs the hook there."""

import sys

from kvbridge import sglang as kvbridge_hook

if __name__ == "__main__":
    kvbridge_hook.main(sys.argv[1:], module="hook_probe")
