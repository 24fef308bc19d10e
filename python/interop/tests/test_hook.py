"""The engine switch (kvbridge.sglang): install/uninstall, the environment
switch, the package stub when Mooncake is absent, sglang's plugin entry point
and the launcher, with the pure-Python stand-in engine as the target."""

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
from kvbridge import sglang as kvbridge_hook

from conftest import INTEROP

TESTS = os.path.dirname(os.path.abspath(__file__))
TARGET = "kvtcp_engine"


def run_py(code: str, env=None, args=(), timeout=120) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter with python/interop and the tests on the path."""
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join([INTEROP, TESTS]))
    for key in (kvbridge_hook.ENV_ENABLE, kvbridge_hook.ENV_TARGET):
        full_env.pop(key, None)
    full_env.update(env or {})
    return subprocess.run([sys.executable, *args, "-c", textwrap.dedent(code)], env=full_env,
                          capture_output=True, text=True, timeout=timeout, cwd=TESTS)


@pytest.fixture
def hooked():
    """Installs the hook for one test and removes it afterwards."""
    yield kvbridge_hook.install(TARGET)
    kvbridge_hook.uninstall()


def test_install_replaces_transfer_engine(hooked):
    from mooncake.engine import TransferEngine

    import kvtcp_engine

    assert hooked == TARGET and kvbridge_hook.installed_target() == TARGET
    assert TransferEngine is kvtcp_engine.TransferEngine
    # sglang probes the module with find_spec (model_path_hook.py): it must have a spec.
    assert importlib.util.find_spec("mooncake.engine") is not None


def test_install_is_idempotent_and_uninstall_restores(hooked):
    kvbridge_hook.install(TARGET)
    assert sum(isinstance(f, kvbridge_hook._EngineFinder) for f in sys.meta_path) == 1
    kvbridge_hook.uninstall()
    assert kvbridge_hook.installed_target() is None
    assert "mooncake.engine" not in sys.modules or not isinstance(
        sys.modules["mooncake.engine"].__loader__, kvbridge_hook._EngineFinder)


def test_already_imported_engine_is_replaced():
    if importlib.util.find_spec("mooncake") is None:
        pytest.skip("Mooncake is not installed")
    p = run_py(f"""
        import mooncake.engine
        from kvbridge import sglang as kvbridge_hook
        real = mooncake.engine.TransferEngine
        kvbridge_hook.install({TARGET!r})
        import mooncake.engine as m
        from mooncake.engine import TransferEngine
        import mooncake
        print(TransferEngine.__module__, m.TransferEngine is TransferEngine, mooncake.engine is m,
              real is not TransferEngine)
    """)
    assert p.stdout.split() == [TARGET, "True", "True", "True"], p.stderr


def test_env_switch_and_default_target():
    p = run_py("""
        from kvbridge import sglang as kvbridge_hook
        print(kvbridge_hook.installed_target())
    """, env={"KVBRIDGE_SGLANG": "1", "KVBRIDGE_SGLANG_TARGET": TARGET})
    assert p.stdout.split() == [TARGET], p.stderr
    p = run_py("""
        from kvbridge import sglang as kvbridge_hook
        print(kvbridge_hook.installed_target(), kvbridge_hook.install())
    """, env={"KVBRIDGE_SGLANG": "0"})
    assert p.stdout.split() == ["None", "kvbridge"], p.stderr


def test_missing_target_fails_at_engine_import():
    p = run_py("""
        from kvbridge import sglang as kvbridge_hook
        kvbridge_hook.install("no_such_engine_module")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            print("ImportError", e.name)
    """)
    assert p.stdout.split() == ["ImportError", "no_such_engine_module"], p.stderr


def test_package_stub_without_mooncake():
    # -S: no site-packages, so no Mooncake (and no installed kvbridge: the
    # hook, standard library only, is loaded from its file); the hook
    # supplies the package.
    p = run_py(f"""
        import sys
        sys.path[:0] = {[INTEROP, TESTS]!r}
        import importlib.util
        assert importlib.util.find_spec("mooncake") is None
        spec = importlib.util.spec_from_file_location("kvbridge_sglang", {kvbridge_hook.__file__!r})
        kvbridge_hook = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(kvbridge_hook)
        kvbridge_hook.install({TARGET!r})
        import mooncake
        from mooncake.engine import TransferEngine
        print(TransferEngine.__module__, mooncake.__path__)
    """, args=("-S",))
    assert p.stdout.split() == [TARGET, "[]"], p.stderr


def test_sglang_plugin_entry_point(tmp_path):
    """sglang's own plugin loader installs the hook (as it does in every
    scheduler process), and sglang's engine wrapper then runs on the target."""
    dist = tmp_path / "kvbridge_hook_test-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvbridge-hook-test\nVersion: 0\n")
    (dist / "entry_points.txt").write_text("[sglang.srt.plugins]\nkvbridge = kvbridge_hook:plugin\n")
    p = run_py(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import harness
        harness.setup_process()          # env + stubs; no engine module given
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from kvbridge import sglang as kvbridge_hook
        eng = harness.init_engine()
        print(kvbridge_hook.installed_target(), type(eng.engine).__module__, eng.get_session_id())
    """, env={"KVBRIDGE_SGLANG": "1", "KVBRIDGE_SGLANG_TARGET": TARGET})
    out = p.stdout.split()
    assert out[:2] == [TARGET, TARGET], p.stdout + p.stderr
    host, port = out[2].rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0


def test_launcher_reaches_spawned_children():
    """``main(argv)`` runs the server module as __main__ with the arguments,
    and a child started with the spawn method resolves the target too."""
    p = subprocess.run([sys.executable, "-m", "hook_launch", "--model-path", "x", "--port", "1"],
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join([INTEROP, TESTS]),
                                KVBRIDGE_SGLANG_TARGET=TARGET),
                       capture_output=True, text=True, timeout=120, cwd=TESTS)
    lines = [line for line in p.stdout.splitlines() if line.startswith("PROBE ")]
    assert lines, p.stdout + p.stderr
    probe = json.loads(lines[0][len("PROBE "):])
    assert probe["argv"] == ["hook_probe", "--model-path", "x", "--port", "1"]
    assert probe["parent"] == TARGET and probe["child"] == TARGET
