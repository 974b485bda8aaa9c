"""Session-wide fixtures: random test checkpoints, the embedded SmolLM2 and its references.

Everything heavy is built once per session and cached:

* ``checkpoints``: every config of ``tests/models.py`` written as a random Hugging Face
  checkpoint into one temporary folder (name -> folder);
* ``engine_model(name)`` / ``hf_reference(name)``: our Transformer and transformers'
  ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` loaded from the same folder;
* ``smollm2`` (``knapspec_dist.llm.load("smollm2")``) and ``smollm2_hf`` (transformers
  loading the same converted folder);
* ``tiny_vocab_checkpoint`` / ``tiny``: a 3-layer model with an 8-token vocabulary (the
  checkpoint, and our model of it), for distribution tests;
* ``corpus_prompt``: a ~1k-token document from the corpus (shared corpus, else the bundled
  sample), as SmolLM2 token ids;
* ``cpu_build``: each build of our CPU kernels this CPU executes in turn
  (model/kernels/build.py), chosen by its setting (tests/test_cpu_builds.py compiles the
  others and says which it cannot run).

The SmolLM2 fixtures fail (they do not skip) when the embedded model is not installed: the
tests that use them are must-show tests of the foundation.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import models` under any runner

from knapspec_dist import llm as local  # noqa: E402
from knapspec_dist.model import attention  # noqa: E402
from knapspec_dist.model.kernels import build  # noqa: E402
from knapspec_dist.model.tokenizer import encode  # noqa: E402
from knapspec_dist.model.weights import load_model  # noqa: E402
from knapspec_dist.tools.corpus import document_of_tokens  # noqa: E402

from models import CONFIGS, hf_model, make_checkpoint  # noqa: E402

# One intra-op thread: these tests are dominated by small ops (tiny models, one-token decode
# steps) where extra threads only add synchronization; on a busy 2-core machine two threads
# cost about 3.5x the CPU time of one (measured on the ar-vs-transformers test).
torch.set_num_threads(1)

# Profiles measured by tests are kept here, never in the user's cache (where later jobs would
# find them); set before any Ray start so that actors inherit it.
os.environ["KNAPSPEC_PROFILE_CACHE"] = tempfile.mkdtemp(prefix="knapspec-test-profiles-")

CONFIG_NAMES = sorted(CONFIGS)


@pytest.fixture(params=build.executable_isas())
def cpu_build(request, monkeypatch) -> str:
    """Every test that uses it runs once per build of our CPU kernels this CPU executes: the
    lower builds too (AVX2 and generic on an AVX-512 machine), so no path goes untested for
    want of a machine with that vector unit."""
    reason = build.unavailable_reason(request.param)
    if reason is not None:
        pytest.skip(f"{request.param} build: {reason}")
    monkeypatch.setenv(build.SETTING, request.param)
    return request.param


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {name: make_checkpoint(name, root) for name in CONFIG_NAMES}


@pytest.fixture(scope="session")
def engine_model(checkpoints):
    """name -> our fp32 Transformer loaded from the test checkpoint (cached)."""
    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = load_model(checkpoints[name], dtype=torch.float32, device="cpu")
        return cache[name]

    return get


@pytest.fixture(scope="session")
def hf_reference(checkpoints):
    """name -> transformers' reference model loaded from the same checkpoint (cached)."""
    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = hf_model(checkpoints[name])
        return cache[name]

    return get


@pytest.fixture(scope="session")
def tiny_vocab_checkpoint(tmp_path_factory) -> Path:
    """A random 3-layer Llama with an 8-token vocabulary, for distribution tests."""
    return make_checkpoint("llama-tied-llama3rope", tmp_path_factory.mktemp("tiny_vocab"),
                           vocab_size=8, seed=3)


@pytest.fixture(scope="module")
def tiny(tiny_vocab_checkpoint):
    return load_model(tiny_vocab_checkpoint)


@pytest.fixture(scope="session")
def smollm2():
    return local.load("smollm2")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2):
    return hf_model(Path(smollm2.path))


@pytest.fixture(scope="session")
def corpus_prompt(smollm2) -> list[int]:
    """About 1000 SmolLM2 tokens of a public-domain chapter (shared corpus or bundled)."""
    ids = encode(smollm2.tokenizer, document_of_tokens(smollm2.tokenizer, 1000))
    assert 950 <= len(ids) <= 1050, len(ids)
    return ids


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (length,), generator=g).tolist()  # never the EOS id 1


def subprocess_env() -> dict:
    """The environment of a user's command run by a test: this checkout's package, one torch
    thread per process, no inherited Ray address (each command starts its own Ray)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    repo = str(Path(__file__).resolve().parent.parent)
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=repo + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def without_ray(env: dict) -> dict:
    """``env`` with Ray and gguf hidden from its Python, as on the GPU image, which has
    neither (tests/without_ray/sitecustomize.py)."""
    hide = str(Path(__file__).resolve().parent / "without_ray")
    return {**env, "PYTHONPATH": hide + os.pathsep + env.get("PYTHONPATH", "")}


@pytest.fixture
def flex_compiles(monkeypatch) -> CompileCounterWithBackend:
    """Compiled flex through dynamo's counting backend (eager kernels), from a clean dynamo
    cache: the count of flex graphs a test makes."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    real = attention.compiled_flex
    monkeypatch.setattr(attention, "compiled_flex", lambda: real(counter))
    return counter
