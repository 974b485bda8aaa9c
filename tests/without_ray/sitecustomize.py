"""Put this folder on ``PYTHONPATH`` and ``ray`` and ``gguf`` are absent, as on the GPU image,
which has neither: ``import ray`` raises ModuleNotFoundError and ``importlib.util.find_spec``
returns None (what an optional-dependency check sees where a package is not installed), so a
test's subprocess fails where the image would (tests/test_without_ray.py)."""

import sys

HIDDEN = ("ray", "gguf")

for _name in HIDDEN:
    sys.modules[_name] = None  # the import system's "not importable" marker
