"""Near-tie classification: is a greedy divergence from ``ar`` a rounding tie, or a bug?

Greedy self-speculative decoding is lossless in exact arithmetic: it emits plain decoding's
tokens. In floating point the 1-token decode step and the q-token verify forward run different
GEMM / attention kernels (bf16 anywhere, fp32 on CUDA's cuBLAS; even on the CPU fp32 logits
differ in their last bits), so where two logits nearly tie, the argmax can flip and the outputs
diverge from then on. This module proves (or refutes) that a divergence is such a tie.

**Method.** At the first position ``i`` where a candidate's tokens differ from the reference's
(plain ``ar``), run the full model once on ``prompt + reference[:i]`` (one causal prefill, a
third computation independent of both decode paths) and read its logits ``z`` at the last
position. With ``r`` the reference token, ``c`` the candidate token and ``z_top`` the largest
logit, the **gap** is ``z_top - min(z[r], z[c])``. When one of the two tokens is the one-shot
argmax (the usual case) that is exactly ``|z[r] - z[c]|``; otherwise it also counts how far
both lie below a third token, which is evidence against a two-way tie.

**Tolerance (the rule).** Let ``ulp(x) = eps(dtype) * 2**floor(log2|x|)`` be the spacing of
the model's dtype at the top logit (bf16: ``eps = 2**-7``, 8 significant bits, so
``ulp = 2**(floor(log2|x|) - 7)``: 0.125 for logits in [16, 32); fp32: ``eps = 2**-23``,
about 1.9e-6 at logits in [16, 32)). Then, with ``m = max(|z_top|, |z[r]|, |z[c]|)``::

    tolerance = rule_ulps(dtype, device) * ulp(m)

with the ulps per (dtype, device) in ``model/precision.py`` ``BOUND_ULPS`` (bf16: 14; fp32 on
CUDA: 64; fp32 on CPUs and fp64: 0, identity), and the divergence is a near-tie iff
``gap <= tolerance`` and ``tolerance > 0``; anything else is a bug (so in fp32 on a CPU every
divergence is a bug, even at an exact fp32 tie).
Why a spread bounds the gap: let ``e_a = z_a - z`` be a decode path's logit error against the
one-shot logits. If path a chose ``r`` and path b chose ``c``, then
``|z[r] - z[c]| <= max(|e_a[r] - e_a[c]|, |e_b[r] - e_b[c]|)``: the gap is bounded by how
unevenly the paths' errors fall on the two tokens, the spread (:func:`logit_spread`). The
logits are summed and kept in fp32 (model/head.py ``head_logits``), so in bf16 the spread
comes from the hidden states, which differ from the one-shot's by other kernels' bf16 rounding
in every layer. Measured (SmolLM2, bf16, CPU, 2 documents x 64 positions, top-5 tokens; 1-token
decode and 2- and 5-token verify against the one-shot forward; ``scripts/logit_spread.py``):
median 0.7-0.9 ulps, p90 1.7-2.1, max 6.9; hence twice that, 14 ulps (1.75 at logits in
[16, 32)). Over 16 documents, alone and in batches of 4-16 rows (:func:`batch_logit_spread`),
the max is 32.7, at top logits below 2 only; the bound stays 14 (docs/bf16.md says why).
The price is the bound's false acceptance: where the runner-up lies within it of the top, a
bug emitting the runner-up would pass as a tie (:class:`RunCheck`; measured in docs/bf16.md).
Justification of FP32_CUDA_ULPS = 64: on CUDA a 1-token decode and a q-token verify run
different cuBLAS kernels (GEMV against GEMM, split-K or not), which sum in different orders, so
their fp32 logits differ by accumulated rounding, far below any real disagreement but enough to
flip an argmax at a near-tie. The same spread between two fp32 computations, measured on the
CPU (SmolLM2 fp32, a 300-token document, its last 40 positions, top-5 tokens by an fp64
forward, 1 thread; top logits 2.7-36): a causal prefill against 1-token decode steps 6.5
ulps of the top logit median, 12 p90, 27 max (the max at top logit 2.7, 17 at top logits >= 8);
4-token verify against 1-token decode 3 median, 15 max; each fp32 path against fp64, 32 max.
GPU reductions are of the same kind, and wider and deeper models add terms: hence twice the
largest measured, 64 ulps (1.2e-4 at logits in [16, 32)). A wrong token is typically 0.1 or
more below the top, 50,000 fp32 ulps there, so the rule still tells the two apart. (TF32
matmuls, off by torch's default, would round at 2**-10 and need a bf16-like rule.)
On CPUs exact identity stays the rule, since there the greedy tokens of every strategy have
been equal to ``ar``'s. The CPU logits of a verify and a decode are not bit-identical (above),
so an fp32 argmax could flip at a near-tie within about 15 ulps (~3e-5): rare enough not to
have happened in the tests and benchmarks, and a divergence there is a failure to look at.

**A check that keeps comparing.** A first divergence says nothing about the tokens after
it, which follow a different prefix. :func:`check_run` therefore goes on: after a near-tie at
``i`` it generates the candidate again from ``prompt + reference[:i + 1]`` (teacher-forced on
the reference's token), compares that with ``reference[i + 1:]``, and so on to the end, every
divergence classified (:class:`RunCheck`). A run is correct when every divergence is a
near-tie. Its figures: near-ties per 1,000 tokens, and the bound's false-acceptance rate, the
share of positions where the one-shot runner-up lies within the tolerance of the top: the
chance that a bug emitting the runner-up there would be called a tie.

:func:`classify` is the pure core (logits in, :class:`Divergence` out);
:func:`check_divergence` finds the first difference and runs the one-shot forward;
:func:`check_run` compares a whole run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from knapspec_dist.engine.model_runner import prefill
from knapspec_dist.model.cache import KVCache, kv_heads
from knapspec_dist.model.precision import rule_ulps
from knapspec_dist.model.transfer import upload
from knapspec_dist.model.weights import dtype_name

TIE, BUG = "tie", "BUG"


@dataclass(frozen=True)
class Divergence:
    """The first difference between a candidate's tokens and the reference's, classified."""

    position: int  # index into the generated tokens (0 = the first new token)
    reference_token: int | None  # None: the reference ended here (the candidate is longer)
    candidate_token: int | None  # None: the candidate ended here
    reference_logit: float | None  # one-shot full-model logits at ``position``
    candidate_logit: float | None
    top_token: int | None  # the one-shot argmax
    top_logit: float | None
    gap: float | None  # top_logit - min(reference_logit, candidate_logit); None: lengths differ
    tolerance: float
    dtype: str
    device: str  # the device type the model ran on (its rule: see rule_ulps)
    verdict: str  # TIE or BUG

    @property
    def is_tie(self) -> bool:
        return self.verdict == TIE

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        if self.gap is None:
            return (f"lengths differ at new token {self.position} (reference "
                    f"{'ended' if self.reference_token is None else 'continues'}): {self.verdict}")
        return (f"new token {self.position}: ar {self.reference_token} vs "
                f"{self.candidate_token}, logits {self.reference_logit:.4g} vs "
                f"{self.candidate_logit:.4g} (top {self.top_logit:.4g}), gap {self.gap:.4g} "
                f"{'<=' if self.is_tie else '>'} tolerance {self.tolerance:.4g} ({self.dtype} on "
                f"{self.device}): "
                f"{'near-tie' if self.is_tie else 'BUG'}")


def spacing(x: float, dtype: torch.dtype) -> float:
    """The distance between adjacent values of ``dtype`` around ``x``: eps * 2**floor(log2|x|)."""
    x = abs(float(x))
    tiny = torch.finfo(dtype).tiny
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(max(x, tiny)))


def tolerance(magnitude: float, dtype: torch.dtype, device: torch.device | str = "cpu") -> float:
    """The near-tie tolerance at logits of size ``magnitude`` (0 in fp32 on a CPU)."""
    ulps = rule_ulps(dtype, device)
    return ulps * spacing(magnitude, dtype) if ulps else 0.0


def first_difference(reference: list[int], candidate: list[int]) -> int | None:
    """The first index where the two differ (a shorter one ending counts), or None."""
    for i, (x, y) in enumerate(zip(reference, candidate)):
        if x != y:
            return i
    return None if len(reference) == len(candidate) else min(len(reference), len(candidate))


def classify(logits: torch.Tensor, position: int, reference_token: int | None,
             candidate_token: int | None, dtype: torch.dtype,
             device: torch.device | str = "cpu") -> Divergence:
    """Classify one divergence from the full model's one-shot ``logits`` [V] at ``position``,
    by the rule for a model of ``dtype`` on ``device``."""
    name, kind = dtype_name(dtype), torch.device(device).type
    if reference_token is None or candidate_token is None:
        # One output stops where the other goes on (e.g. EOS vs length): no tie explains it.
        return Divergence(position, reference_token, candidate_token, None, None, None, None,
                          None, tolerance(0.0, dtype, device), name, kind, BUG)
    logits = logits.detach().float().cpu()
    top_logit, top_token = (float(v) for v in logits.max(dim=-1))
    zr, zc = float(logits[reference_token]), float(logits[candidate_token])
    gap = top_logit - min(zr, zc)
    tol = tolerance(max(abs(top_logit), abs(zr), abs(zc)), dtype, device)
    return Divergence(position, int(reference_token), int(candidate_token), zr, zc,
                      int(top_token), top_logit, gap, tol, name, kind,
                      TIE if tol > 0 and reference_token != candidate_token and gap <= tol else BUG)


@torch.inference_mode()
def one_shot_logits(model, ids: list[int]) -> torch.Tensor:
    """The full model's next-token logits [V] after ``ids``, in one causal forward (no decode)."""
    cache = KVCache(model.cfg, 1, len(ids), dtype=model.dtype, device=model.device,
                    kv_heads=kv_heads(model))
    return prefill(model, cache, 0, list(ids))


def check_divergence(model, prompt: list[int], reference: list[int],
                     candidate: list[int]) -> Divergence | None:
    """None if ``candidate`` equals ``reference`` (both generated after ``prompt``), else the
    classified first difference (one full forward of prompt + the common prefix), by the rule
    for the model's dtype and device."""
    i = first_difference(reference, candidate)
    if i is None:
        return None
    r = reference[i] if i < len(reference) else None
    c = candidate[i] if i < len(candidate) else None
    if r is None or c is None:
        return classify(torch.empty(0), i, r, c, model.dtype, model.device)
    return classify(one_shot_logits(model, list(prompt) + list(reference[:i])), i, r, c,
                    model.dtype, model.device)


BLOCK = 256  # reference tokens per forward of reference_logits (bounds its activations)


@dataclass(frozen=True)
class RunCheck:
    """A candidate's run compared with the reference's at every position (:func:`check_run`)."""

    tokens: int  # reference tokens compared
    divergences: tuple[Divergence, ...]  # in order; the last one ends the check if a BUG
    inside_bound: int  # positions whose one-shot runner-up is within the tolerance of the top
    reruns: int  # candidate generations restarted on the reference's token

    @property
    def correct(self) -> bool:
        return all(d.is_tie for d in self.divergences)

    @property
    def ties(self) -> int:
        return sum(d.is_tie for d in self.divergences)

    @property
    def ties_per_1k(self) -> float:
        return 1000.0 * self.ties / self.tokens if self.tokens else 0.0

    @property
    def false_acceptance(self) -> float:
        """The share of positions where a bug emitting the runner-up would pass as a tie."""
        return self.inside_bound / self.tokens if self.tokens else 0.0

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "divergences": [d.to_dict() for d in self.divergences],
                "inside_bound": self.inside_bound, "reruns": self.reruns,
                "correct": self.correct, "ties": self.ties, "ties_per_1k": self.ties_per_1k,
                "false_acceptance": self.false_acceptance}


@torch.inference_mode()
def reference_logits(model, prompt: list[int], reference: list[int]) -> torch.Tensor:
    """The full model's logits [len(reference), V] (fp32, on the CPU) before each reference
    token: a prefill of the prompt, then the reference in blocks of ``BLOCK`` tokens (one
    computation, independent of both decode paths)."""
    return _path_logits(model, [prompt], [reference], BLOCK)[0]


def inside_bound(logits: torch.Tensor, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> int:
    """How many rows of ``logits`` [N, V] have their runner-up within the near-tie tolerance
    of their top logit (0 where the rule is identity)."""
    if not rule_ulps(dtype, device) or logits.shape[-1] < 2:
        return 0
    top2 = logits.topk(2, dim=-1).values
    return sum(1 for a, b in top2.tolist()
               if a - b <= tolerance(max(abs(a), abs(b)), dtype, device))


def check_run(model, prompt: list[int], reference: list[int], candidate: list[int],
              rerun: Callable[[list[int], int], list[int]],
              logits: torch.Tensor | None = None) -> RunCheck:
    """Compare ``candidate`` with ``reference`` (both generated after ``prompt``) at every
    position. After a near-tie at ``i``, ``rerun(prompt + reference[:i + 1], n)`` must return
    the candidate's next ``n`` tokens from there (``n = len(reference) - i - 1``); the check
    stops at the first BUG. ``logits``: :func:`reference_logits` of this prompt and reference
    when already computed (shared by the candidates of one reference); otherwise they are
    computed when needed (a divergence, or a rule other than identity)."""
    def one_shot() -> torch.Tensor:
        nonlocal logits
        if logits is None:
            logits = reference_logits(model, prompt, reference)
        return logits

    divergences, start, tail, reruns = [], 0, list(candidate), 0
    while (j := first_difference(reference[start:], tail)) is not None:
        i = start + j
        r = reference[i] if i < len(reference) else None
        c = tail[j] if j < len(tail) else None
        z = one_shot()[i] if r is not None and c is not None else torch.empty(0)
        divergences.append(classify(z, i, r, c, model.dtype, model.device))
        if not divergences[-1].is_tie or i + 1 >= len(reference):
            break
        start = i + 1
        tail = list(rerun(list(prompt) + list(reference[:start]), len(reference) - start))
        reruns += 1
    inside = (inside_bound(one_shot(), model.dtype, model.device)
              if reference and rule_ulps(model.dtype, model.device) else 0)
    return RunCheck(len(reference), tuple(divergences), inside, reruns)


@dataclass(frozen=True)
class Spread:
    """How unevenly a decode path's logit errors fall on the top tokens, in ulps of the
    model's dtype at the top logit: per position ``max_ij |e[i] - e[j]|`` over the one-shot
    top ``top`` tokens, with ``e`` the path's logits minus the one-shot logits. A divergence
    between two paths has a one-shot gap of at most the larger of their spreads (module doc),
    so the bound must cover it."""

    path: str  # "decode" (1-token steps) or "verify q=N"
    positions: int
    median: float
    p90: float
    max: float

    def to_dict(self) -> dict:
        return asdict(self)


@torch.inference_mode()
def logit_spread(model, prompt: list[int], tokens: list[int], qs: tuple[int, ...] = (5,),
                 top: int = 5) -> list[Spread]:
    """The spread (:class:`Spread`) of 1-token decode steps and of q-token verify blocks over
    ``tokens`` teacher-forced after ``prompt``, against :func:`reference_logits`."""
    return batch_logit_spread(model, [prompt], [tokens], qs, top)


@torch.inference_mode()
def batch_logit_spread(model, prompts: list[list[int]], tokens: list[list[int]],
                       qs: tuple[int, ...] = (5,), top: int = 5) -> list[Spread]:
    """:func:`logit_spread` of rows decoded together, one batch of ``len(prompts)`` rows per
    forward (each row's ``tokens``, all of one length, teacher-forced after its prompt), over
    every row's positions: a row's logits also depend on the kernels its batch size picks."""
    return [summarize_spread(name, v)
            for name, v in spread_values(model, prompts, tokens, qs, top).items()]


def summarize_spread(path: str, values: torch.Tensor) -> Spread:
    """The :class:`Spread` of per-position spreads ``values`` (ulps, any shape)."""
    s = values.double().flatten()
    return Spread(path, s.numel(), float(s.median()), float(s.quantile(0.9)), float(s.max()))


@torch.inference_mode()
def spread_values(model, prompts: list[list[int]], tokens: list[list[int]],
                  qs: tuple[int, ...] = (5,), top: int = 5) -> dict[str, torch.Tensor]:
    """Per path ("decode", "verify q=N"), the spread in ulps at every position of every row,
    [rows, len(tokens[0])], the rows decoded together (:func:`batch_logit_spread`)."""
    if len({len(t) for t in tokens}) != 1:
        raise ValueError("every row needs as many tokens as the others")
    one = torch.stack([reference_logits(model, p, t) for p, t in zip(prompts, tokens)])
    index = one.topk(min(top, one.shape[-1]), dim=-1).indices
    ulp = torch.tensor([[spacing(float(z), model.dtype) for z in row]
                        for row in one.max(dim=-1).values.tolist()])
    out = {}
    for name, q in [("decode", 1), *((f"verify q={q}", q) for q in qs)]:
        e = (_path_logits(model, prompts, tokens, q) - one).gather(-1, index)
        out[name] = (e.max(dim=-1).values - e.min(dim=-1).values) / ulp
    return out


def _path_logits(model, prompts: list[list[int]], tokens: list[list[int]], q: int
                 ) -> torch.Tensor:
    """Logits [rows, len(tokens[0]), V] before each row's tokens: a prefill of each row's
    prompt gives its first; then forwards of ``q`` tokens of every row at once (q = 1: decode
    steps) give the next ones."""
    n, rows = len(tokens[0]), len(prompts)
    cache = KVCache(model.cfg, rows, max(map(len, prompts)) + n, dtype=model.dtype,
                    device=model.device, kv_heads=kv_heads(model))
    out = [torch.stack([prefill(model, cache, b, list(p)) for b, p in enumerate(prompts)]
                       )[:, None].cpu()]
    for i in range(0, n - 1, q):
        blocks = [list(t[i:min(i + q, n - 1)]) for t in tokens]
        starts = [len(p) + i for p in prompts]
        out.append(model(upload(blocks, model.device), starts, cache, slice(0, rows)).cpu())
        for b, start in enumerate(starts):
            cache.commit(b, start + len(blocks[b]))
    return torch.cat(out, dim=1)[:, :n]
