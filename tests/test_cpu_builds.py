"""The builds of our CPU kernels (model/kernels/build.py): every one compiles, every one this
CPU executes gives the bits of the generic build (so no result depends on the vector unit),
the setting chooses a build or torch's ops, and a cache shared by several CPUs keeps their
builds apart. The kernels' values are checked per build in test_cpu_ops.py and
test_cpu_attention.py."""

import platform
import shutil
import subprocess

import pytest
import torch
from test_cpu_attention import pools, tables

import knapspec_dist.model.weights as weights
from knapspec_dist.errors import UserError
from knapspec_dist.model.attention import attention_backend
from knapspec_dist.model.decoder import RMSNorm
from knapspec_dist.model.forward_meta import ForwardMeta
from knapspec_dist.model.kernels import build
from knapspec_dist.model.kernels import elementwise as cpu_ops
from knapspec_dist.model.kernels.paged_attention import paged_attention

X86 = platform.machine().lower() in ("x86_64", "amd64")


def targets(isa: str) -> str | None:
    """Why the compiler here cannot build ``isa``, or None."""
    if build.compiler() is None:
        return "no C compiler on PATH"
    if isa in ("avx512", "avx2") and not X86:
        return f"the compiler here targets {platform.machine()}, not x86"
    if isa == "neon" and X86:
        return f"the compiler here targets {platform.machine()}, not Arm"
    return None


@pytest.mark.parametrize("isa", list(build.ISAS))
@pytest.mark.parametrize("source", ["elementwise", "paged_attention"])
def test_each_build_compiles_without_warnings(isa, source, tmp_path):
    """Compiled, not run: an AVX2-only machine still checks the AVX-512 build's source."""
    reason = targets(isa)
    if reason is not None:
        pytest.skip(reason)
    flags = build.COMMON_FLAGS + build.ISAS[isa]
    done = subprocess.run([build.compiler(), *flags, "-Wall", "-Wextra", "-Werror", "-o",
                           str(tmp_path / "k.so"), str(build.SOURCES / f"{source}.c"), "-lm"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def outputs(dtype) -> list[torch.Tensor]:
    """Every kernel over fixed random inputs, through the chosen build."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 7, 100, generator=g) * 3).to(dtype)  # a row that is no vector's
    w = torch.randn(100, generator=g).to(dtype)
    gate = (torch.randn(6, 1536, generator=g) * 8).to(dtype)
    up = torch.randn(6, 1536, generator=g).to(dtype)
    q = torch.randn(2, 7, 9, 64, generator=g).to(dtype)
    k = torch.randn(2, 7, 3, 64, generator=g).to(dtype)
    angles = torch.randn(2, 1, 7, 64, generator=g) * 40
    meta = ForwardMeta(torch.zeros(2), torch.zeros(2, 7), angles.cos().to(dtype),
                       angles.sin().to(dtype), slice(0, 2), 7)
    rq, rk = cpu_ops.rotary(q.clone(), k.clone(), meta)
    starts, t, pages = [3, 40], 5, 8
    _, kt, v = pools(3, pages, 64, seed=1)
    attended = paged_attention(torch.randn(2, 9, t, 64, generator=g).to(dtype), kt.to(dtype),
                               v.to(dtype), tables([s + t for s in starts], pages),
                               torch.tensor(starts))
    return [cpu_ops.rms_norm(x, w, 1e-5), cpu_ops.silu_mul(gate, up), rq, rk, attended]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("isa", [i for i in build.executable_isas() if i != "generic"])
def test_every_build_gives_the_generic_builds_bits(isa, dtype, monkeypatch):
    if build.compiler() is None:
        pytest.skip("no C compiler on PATH")
    monkeypatch.setenv(build.SETTING, "generic")
    generic = outputs(dtype)
    monkeypatch.setenv(build.SETTING, isa)
    for name, a, b in zip(["rms_norm", "silu_mul", "rotary q", "rotary k", "attention"],
                          outputs(dtype), generic):
        assert torch.equal(a, b), f"{isa} {name}"


def test_the_setting_chooses_a_build_or_torchs_ops(monkeypatch):
    monkeypatch.setattr(build, "executable_isas", lambda: ["avx2", "generic"])
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    build._chosen.cache_clear()
    try:
        for wanted, isa in [("auto", "avx2"), ("", "avx2"), ("AVX2", "avx2"),
                            ("generic", "generic"), ("off", None)]:
            monkeypatch.setenv(build.SETTING, wanted)
            assert build.chosen_isa() == isa, wanted
        monkeypatch.setenv(build.SETTING, "avx512")
        with pytest.raises(UserError, match="cannot execute.*avx2, generic"):
            build.chosen_isa()
        monkeypatch.setenv(build.SETTING, "sse9")
        with pytest.raises(UserError, match="KNAPSPEC_CPU_KERNELS='sse9'"):
            build.chosen_isa()
        monkeypatch.setattr(build, "executable_isas", lambda: ["generic"])  # x86 below AVX2
        build._chosen.cache_clear()
        monkeypatch.setenv(build.SETTING, "auto")
        assert build.chosen_isa() is None
        monkeypatch.setattr(build.platform, "machine", lambda: "riscv64")  # elsewhere: generic
        build._chosen.cache_clear()
        assert build.chosen_isa() == "generic"
    finally:
        build._chosen.cache_clear()


def test_off_keeps_torchs_ops(checkpoints, monkeypatch):
    monkeypatch.setenv(build.SETTING, "off")
    assert build.unavailable_reason() is not None
    model = weights.load_model(checkpoints["llama-gqa"])
    assert type(model.norm) is RMSNorm and attention_backend(model) == "sdpa"


def test_a_shared_cache_keeps_each_cpus_build_apart(tmp_path, monkeypatch):
    """Builds for two instruction sets, or for two architectures, never share a file."""
    if build.compiler() is None:
        pytest.skip("no C compiler on PATH")
    monkeypatch.setenv("KNAPSPEC_CACHE", str(tmp_path))
    cc, source = build.compiler(), build.SOURCES / "elementwise.c"
    build._load(source, cc, "generic")
    other = "avx2" if X86 else "neon"
    build._load(source, cc, other)
    monkeypatch.setattr(build.platform, "machine", lambda: "elsewhere")
    build._load(source, cc, "generic")
    names = sorted(p.name for p in (tmp_path / "kernels").iterdir())
    assert len(names) == 3 and sum(f"-{other}-" in n for n in names) == 1, names
    assert sum("-generic-" in n for n in names) == 2
    assert shutil.which(cc)
