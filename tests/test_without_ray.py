"""The GPU image has torch and transformers but neither Ray nor gguf. What runs there must import
without them: the module scripts/gpu_run.sh runs, and the ``gpu`` test files (``pytest -m gpu``
collects them there). Checked in a subprocess that hides both (conftest.without_ray), in
one interpreter, since each start imports torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from conftest import subprocess_env, without_ray

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
GPU_TEST_MODULES = ("test_gpu", "test_gpu_check")

# Imports the gpu test modules (an import of ray or gguf raises), runs the entry's
# `gpu-check --help` as `python -m` would, then imports `knapspec` (cli/main.py), which must fail
# on Ray: the proof that Ray is hidden.
PROBE = """
import json, runpy, sys
sys.path.insert(0, {tests!r})
for name in {modules!r}:
    __import__(name)
sys.argv, status = [{entry!r}, "gpu-check", "--help"], None
try:
    runpy.run_module({entry!r}, run_name="__main__", alter_sys=True)
except SystemExit as e:
    status = e.code
try:
    import knapspec_dist.cli.main
    knapspec = "imported"
except ModuleNotFoundError as e:
    knapspec = str(e)
print(json.dumps({{"status": status, "knapspec": knapspec}}))
"""


def gpu_run_entry() -> str:
    """The module scripts/gpu_run.sh runs with ``python -m``."""
    found = re.findall(r'"\$PY" -m (\S+)', (REPO / "scripts" / "gpu_run.sh").read_text())
    assert len(found) == 1, f"scripts/gpu_run.sh: expected one `\"$PY\" -m MODULE`, got {found}"
    return found[0]


def test_the_gpu_entry_and_the_gpu_tests_import_without_ray_or_gguf():
    entry = gpu_run_entry()
    code = PROBE.format(tests=str(TESTS), modules=GPU_TEST_MODULES, entry=entry)
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=without_ray(subprocess_env()),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    *shown, last = p.stdout.splitlines()
    result, shown = json.loads(last), "\n".join(shown)
    assert "ray" in result["knapspec"], "Ray is not hidden: the check would pass anyway"
    assert result["status"] in (0, None), p.stderr[-3000:]
    assert "--quick" in shown and "--budget" in shown  # gpu-check's own options
