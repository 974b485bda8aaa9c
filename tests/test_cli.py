"""The `knapspec generate` command line: bad input gives one clear `error:` line, a non-zero
exit and no traceback; `--json` prints token_ids / text / stats."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from knapspec_dist.cli import demo, standalone
from knapspec_dist.cli.main import main
from knapspec_dist.cli.main import parser as knapspec_parser
from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.memory import kv_bytes_per_token_of
from knapspec_dist.engine.pages import CPU_PAGE
from knapspec_dist.engine.scheduler import generate
from knapspec_dist.engine.sequence import row_capacity
from knapspec_dist.jobs.termination import JobTerminated
from knapspec_dist.model.config import load_config
from knapspec_dist.model.tokenizer import encode
from knapspec_dist.speculation.autoregressive import Autoregressive
from knapspec_dist.tools.corpus import document_of_tokens

from models import make_checkpoint

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


@pytest.fixture(scope="module")
def cli_model(tmp_path_factory, smollm2) -> Path:
    """A small random Llama (context window 4096) with SmolLM2's tokenizer: loads in a blink."""
    folder = make_checkpoint("llama-tied-llama3rope", tmp_path_factory.mktemp("cli"),
                             vocab_size=len(smollm2.tokenizer))
    for name in TOKENIZER_FILES:
        if (Path(smollm2.path) / name).is_file():
            shutil.copy(Path(smollm2.path) / name, folder / name)
    return folder


def user_error(capsys, argv: list[str], *needles: str) -> str:
    """Run the CLI in-process; it must fail with exactly one `error: ...` line."""
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc != 0
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert out == ""
    return lines[0]


def gen(model, *extra: str) -> list[str]:
    return ["generate", "--model", str(model), "--strategy", "ar", "--max-new-tokens", "4",
            *extra]


def test_unknown_model_path(capsys, tmp_path):
    missing = tmp_path / "no-such-model"
    user_error(capsys, gen(missing, "--prompt", "hello"), str(missing))


def test_folder_without_config(capsys, tmp_path):
    user_error(capsys, gen(tmp_path, "--prompt", "hello"), "config.json")


@pytest.mark.parametrize("text", ["{not json", "[1, 2, 3]",
                                  json.dumps({"architectures": ["LlamaForCausalLM"]})],
                         ids=["syntax", "not-an-object", "missing-fields"])
def test_malformed_config(capsys, tmp_path, text):
    (tmp_path / "config.json").write_text(text)
    user_error(capsys, gen(tmp_path, "--prompt", "hello"), "malformed")


def test_unsupported_architecture(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64,
        "n_layer": 2, "n_head": 2, "vocab_size": 100}))
    user_error(capsys, gen(tmp_path, "--prompt", "hello"), "GPT2LMHeadModel", "unsupported")


@pytest.mark.parametrize("prompt", ["", "   \n"], ids=["empty", "blank"])
def test_empty_prompt(capsys, cli_model, prompt):
    user_error(capsys, gen(cli_model, "--prompt", prompt), "empty")


def test_empty_and_missing_prompt_file(capsys, cli_model, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    user_error(capsys, gen(cli_model, "--prompt-file", str(empty)), "empty")
    user_error(capsys, gen(cli_model, "--prompt-file", str(tmp_path / "nope.txt")), "nope.txt")


def test_prompt_longer_than_context_window(capsys, cli_model, smollm2, tmp_path):
    long = tmp_path / "long.txt"
    long.write_text(document_of_tokens(smollm2.tokenizer, 4300))
    user_error(capsys, gen(cli_model, "--prompt-file", str(long)), "context window", "4096")


def test_generate_sizes_its_kv_cache_as_a_replica_does(capsys, cli_model):
    """``--kv-cache-memory`` in process: a budget that holds one row decodes the prompts one
    at a time with the tokens of the default budget's batch; one that holds none is one error
    naming the prompt; a bad size or utilization is one error naming the option."""
    per_token = kv_bytes_per_token_of(load_config(cli_model), 1, torch.float32)
    prompts = ["--prompt", "hello there", "--prompt", "one more prompt", "--json"]
    assert main(gen(cli_model, *prompts)) == 0
    batched = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    needs = [row_capacity(r["stats"]["prompt_tokens"], 4) for r in batched]
    pages = -(-max(needs) // CPU_PAGE)
    assert sum(-(-n // CPU_PAGE) for n in needs) > pages  # the two rows never fit together
    # the longer row's pages and the scratch page: not both rows at once
    one_row = str(per_token * (pages + 1) * CPU_PAGE)
    assert main(gen(cli_model, *prompts, "--kv-cache-memory", one_row)) == 0
    alone = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["token_ids"] for r in alone] == [r["token_ids"] for r in batched]
    user_error(capsys, gen(cli_model, "--prompt", "hello", "--kv-cache-memory", "1KB"),
               "prompt 0:", "cache positions",
               "the KV cache holds 0 (--kv-cache-memory 1000 bytes)")  # the bytes given
    user_error(capsys, gen(cli_model, "--prompt", "hello", "--kv-cache-memory", "lots"),
               "--kv-cache-memory")
    user_error(capsys, gen(cli_model, "--prompt", "hello", "--memory-utilization", "0"),
               "--memory-utilization")


@pytest.mark.parametrize("skip,needle", [("a99", "a99"), ("x3", "x3"), ("a1,m", "'m'")])
def test_invalid_skip_list(capsys, cli_model, skip, needle):
    user_error(capsys, ["generate", "--model", str(cli_model), "--prompt", "hello",
                        "--strategy", "static", "--skip", skip, "--max-new-tokens", "4"], needle)


@pytest.mark.parametrize("option,needle", [(["--gamma", "0"], "gamma"),
                                           (["--temperature", "-1"], "temperature"),
                                           (["--top-p", "0"], "top-p")])
def test_invalid_generation_options(capsys, cli_model, option, needle):
    user_error(capsys, ["generate", "--model", str(cli_model), "--prompt", "hello",
                        "--strategy", "static", "--skip", "a1", *option], needle)


def test_json_output_static_equals_ar_smollm2(capsys, smollm2):
    """`--json` on the embedded model: one JSON object with token_ids (generated only), text
    and stats; the static tokens equal plain `ar` decoding of the same chat prompt."""
    prompt = "Name three colours of the rainbow."
    rc = main(["generate", "--model", "smollm2", "--prompt", prompt, "--chat", "--strategy",
               "static", "--skip", "a3,a5,m7,a20,m21", "--gamma", "3", "--tau-conf", "0",
               "--max-new-tokens", "12",
               "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1
    data = json.loads(lines[0])
    assert {"token_ids", "text", "stats"} <= set(data)
    ids = data["token_ids"]
    assert 1 <= len(ids) <= 12 and all(isinstance(t, int) for t in ids)
    assert data["text"] == smollm2.tokenizer.decode(ids, skip_special_tokens=True)
    stats = data["stats"]
    for key in ("rounds", "drafted", "accepted", "acceptance_rate", "wall_s", "draft_s",
                "verify_s", "prompt_tokens", "new_tokens"):
        assert key in stats, key
    assert stats["new_tokens"] == len(ids) and stats["drafted"] > 0
    want = generate(Autoregressive(), smollm2.model, [encode(smollm2.tokenizer, prompt, chat=True)],
                                     GenerationConfig(max_new_tokens=12))[0]
    assert ids == want.token_ids
    assert stats["prompt_tokens"] == want.stats.prompt_tokens


def test_many_prompts_are_batched_and_each_equals_ar_alone(capsys, smollm2, tmp_path):
    """Repeated --prompt / --prompt-file go through one continuous batch (--max-num-seqs 2):
    one JSON line per prompt, in order, each the tokens plain ar gives that prompt alone."""
    texts = ["Name three colours of the rainbow.", "What is the capital of France?",
             "Write one sentence about the sea."]
    (tmp_path / "p.txt").write_text(texts[2])
    rc = main(["generate", "--model", "smollm2", "--prompt", texts[0], "--prompt", texts[1],
               "--prompt-file", str(tmp_path / "p.txt"), "--chat", "--strategy", "ar",
               "--max-num-seqs", "2", "--max-new-tokens", "8", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    lines = [json.loads(line) for line in out.strip().splitlines()]
    assert len(lines) == 3
    for text, line in zip(texts, lines):
        prompt = encode(smollm2.tokenizer, text, chat=True)
        want = generate(Autoregressive(), smollm2.model, [prompt],
                        GenerationConfig(max_new_tokens=8))[0]
        assert line["token_ids"] == want.token_ids
    assert max(line["stats"]["mean_batch"] for line in lines) > 1


@pytest.mark.e2e
def test_console_script_subprocess_long_prompt(smollm2, tmp_path):
    """The installed `knapspec` script, in its own process, on the real model: a prompt past
    SmolLM2's 8192-token window gives exit code 2 and exactly one stderr line, no traceback
    (nor transformers' own "sequence length is longer" warning)."""
    script = Path(sys.executable).parent / "knapspec"
    script = str(script) if script.is_file() else shutil.which("knapspec")
    assert script, "the knapspec console script is not installed"
    long = tmp_path / "long.txt"
    long.write_text(document_of_tokens(smollm2.tokenizer, 9000))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    proc = subprocess.run([script, "generate", "--model", "smollm2", "--prompt-file", str(long),
                           "--strategy", "ar"], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "8192" in lines[0] and "context window" in lines[0]
    assert proc.stdout == ""


@pytest.mark.parametrize("stop, code", [(JobTerminated(signal.SIGTERM), 143),
                                        (KeyboardInterrupt(), 130)])
@pytest.mark.e2e
def test_every_command_stops_on_a_signal_with_one_line_and_the_shells_code(
        monkeypatch, caplog, stop, code):
    """`knapspec demo` under SIGTERM printed a JobTerminated traceback (only `job` handled it)."""
    def run(args):
        raise stop
    monkeypatch.setattr(demo, "cmd_demo", run)
    with caplog.at_level(logging.WARNING):
        assert main(["demo"]) == code
    assert "the finished rows are written and kept" in caplog.text


def subcommand_options(p: argparse.ArgumentParser) -> dict[str, list[tuple]]:
    """Each subcommand's options: flags, destination, default, choices, help."""
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return {name: [(tuple(a.option_strings), a.dest, a.default, a.choices, a.help)
                   for a in command._actions] for name, command in sub.choices.items()}


def test_the_commands_without_ray_have_the_options_knapspec_gives_them():
    """``python -m knapspec_dist.cli.standalone`` (the GPU image's entry) and ``knapspec``
    register gpu-check, bench and throughput from the same modules: the same options."""
    alone, full = subcommand_options(standalone.parser()), subcommand_options(knapspec_parser())
    assert sorted(alone) == ["bench", "gpu-check", "throughput"]
    assert {name: full[name] for name in alone} == alone
    # these need Ray, or (peer) vLLM's venv, which the GPU image lacks
    assert set(full) - set(alone) == {"generate", "demo", "profile", "job", "peer", "books"}


@pytest.mark.parametrize("command", ["throughput", "job"])
@pytest.mark.parametrize("value", ["0", "-4"])
def test_a_bad_prefill_budget_is_one_error_line(capsys, tmp_path, command, value):
    """Refused before any model, input or Ray is touched."""
    where = (["--out", str(tmp_path / "bench")] if command == "throughput"
             else ["--input", str(tmp_path / "none.parquet"), "--output", str(tmp_path / "o")])
    user_error(capsys, [command, *where, "--max-num-batched-tokens", value],
               "--max-num-batched-tokens", value)
    assert not (tmp_path / "bench").exists() and not (tmp_path / "o").exists()
