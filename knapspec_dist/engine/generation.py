"""What a generation is asked for and what it returns: config, per-row stats and results,
prompt checks and the stop rule, shared by every strategy and the scheduler."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields

from knapspec_dist.engine.sampling import SamplingConfig
from knapspec_dist.errors import UserError
from knapspec_dist.model.decoder import Transformer
from knapspec_dist.option_rules import check_fields
from knapspec_dist.ratio import ratio

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationConfig:
    """What rows are generated with. ``max_num_batched_tokens`` is how they are scheduled,
    not what they say: the prompt tokens a scheduler step prefills at most (vLLM's name;
    None: the device's default, engine/scheduler.py ``default_max_num_batched_tokens``). It
    travels here because this config is what every shard's scheduler is built from; no token
    depends on it."""

    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_at_eos: bool = True
    max_num_batched_tokens: int | None = None

    def __post_init__(self):
        check_fields(self, ("max_num_batched_tokens",))

    @classmethod
    def of(cls, *, max_new_tokens: int = 128, stop_at_eos: bool = True, temperature: float = 0.0,
           top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
           sampling: str = "coupled", max_num_batched_tokens: int | None = None
           ) -> GenerationConfig:
        """The one builder from flat fields (command lines, job options, keyword arguments);
        ``sampling``: how sampled drafts are verified (``SamplingConfig.method``)."""
        return cls(max_new_tokens, SamplingConfig(temperature=temperature, top_k=top_k,
                                                  top_p=top_p, seed=seed, method=sampling),
                   stop_at_eos, max_num_batched_tokens)


@dataclass
class PlanTally:
    """A row's rounds under one plan: tokens it committed, their seconds (draft and verify,
    not the selection) and, where the selection priced the plan, the tokens it predicted
    over the seconds priced. Sums field by field across rows and replicas."""

    rounds: int = 0
    tokens: int = 0
    seconds: float = 0.0
    predicted_tokens: float = 0.0
    priced_s: float = 0.0

    def add(self, tokens: int, seconds: float, rate: float | None) -> None:
        """One round: ``rate``, the predicted tokens per second (None: not priced)."""
        self.rounds += 1
        self.tokens += tokens
        self.seconds += seconds
        if rate is not None:
            self.predicted_tokens += rate * seconds
            self.priced_s += seconds


PLAN_KEYS = tuple(f.name for f in fields(PlanTally))


def plan_records(plans: dict[str, PlanTally]) -> list[dict]:
    """A row's per-plan tallies as records, ``{"plan": label, **PlanTally}``: the jobs'
    ``plans`` column and what ``add_plans`` sums."""
    return [{"plan": label, **asdict(t)} for label, t in plans.items()]


def add_plans(sums: dict[str, dict], plans: Iterable[list[dict] | None]) -> None:
    """Add rows' per-plan tallies (per row, its plans' ``{"plan": label, **PlanTally}``, as
    the jobs' ``plans`` column and the bench's runs hold them) into ``sums``, plan by plan."""
    for tallies in plans:
        for t in tallies or ():
            acc = sums.setdefault(t["plan"], dict.fromkeys(PLAN_KEYS, 0) | {"rows": 0})
            acc["rows"] += 1
            for k in PLAN_KEYS:
                acc[k] += t[k] or 0


def ranked_plans(sums: dict[str, dict], shown: int) -> list[dict]:
    """The summed tallies' ``shown`` plans with the most seconds, the rest summed as
    ``other``: rounds, tokens, the realized tokens per second (over the rounds' seconds) and
    the predicted (over the seconds priced); what a job's summary and the bench report give."""
    ranked = sorted(sums.items(), key=lambda kv: -kv[1]["seconds"])
    if len(ranked) > shown:
        rest = dict.fromkeys(PLAN_KEYS, 0) | {"rows": 0}
        for _, acc in ranked[shown:]:
            for k in rest:
                rest[k] += acc[k]
        ranked = ranked[:shown] + [("other", rest)]
    return [{"plan": label, "rows": acc["rows"], "rounds": acc["rounds"], "tokens": acc["tokens"],
             "tokens_per_s": ratio(acc["tokens"], acc["seconds"]),
             "predicted_tokens_per_s": ratio(acc["predicted_tokens"], acc["priced_s"])}
            for label, acc in ranked]


@dataclass
class Split:
    """Where a row's time went when the Ray engine served it (runtime/accounting.py): its
    share of each shard call it took part in, plus its Ray round trips; the seconds sum to
    the coordinator-observed time of the request. Zero when run in-process."""

    compute_s: float = 0.0  # model forwards and the KnapSpec DP, without communication
    comm_s: float = 0.0  # inside torch.distributed collectives (all-reduce, all-gather, ...)
    ray_s: float = 0.0  # Ray round trips (dispatch to the shards, the coordinator's calls)
    other_s: float = 0.0  # Python of the decode loop outside the above
    comm_calls: float = 0.0  # collective calls (a row's share of a call's: fractional)

    def add(self, other: Split, rows: int = 1) -> None:
        """Add ``other`` shared among ``rows`` (a shard call's split, to each of its rows)."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name) / rows)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0  # decoding rounds it took part in: one full-model forward each, after prefill
    drafted: int = 0  # drafts judged, from either source
    accepted: int = 0
    copied_drafted: int = 0  # of them, copied from the row's own tokens (lookup.py)
    copied_accepted: int = 0
    wall_s: float = 0.0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    select_s: float = 0.0  # subnet selection (KnapSpec DP, TPT search)
    selections: int = 0
    fallbacks: int = 0  # speculative plans dropped for plain decoding by KnapSpec's guard
    attention_skipped: float = 0.0  # mean attention sublayers skipped per drafted token
    mlp_skipped: float = 0.0
    split: Split = field(default_factory=Split)  # served by the Ray engine: where time went
    # Batching (engine/scheduler.py): when the row was admitted and finished (epoch
    # seconds, comparable across a job's replicas) and the mean number of rows decoding with
    # it per round. Its wall_s spans admission to finish, shared with the rows beside it.
    admitted_at: float = 0.0
    finished_at: float = 0.0
    mean_batch: float | None = 0.0  # summed per round while it decodes; None: no round
    plans: dict[str, PlanTally] = field(default_factory=dict)  # Plan.label -> its rounds

    @property
    def acceptance_rate(self) -> float | None:
        return ratio(self.accepted, self.drafted)

    @property
    def tokens_per_s(self) -> float | None:
        return ratio(self.new_tokens, self.wall_s)

    def to_dict(self) -> dict:
        return {**asdict(self), "acceptance_rate": self.acceptance_rate,
                "tokens_per_s": self.tokens_per_s}


@dataclass
class GenerationResult:
    token_ids: list[int]
    stats: GenerationStats
    finish_reason: str  # "eos" | "length"
    text: str = ""
    replica: int | None = None  # the engine replica that generated it (None: in-process)


def check_prompt(model: Transformer, prompt: list[int], config: GenerationConfig) -> int:
    """Validate one prompt; return how many new tokens fit in the context window."""
    window = model.cfg.max_position_embeddings
    if not prompt:
        raise UserError("prompt is empty")
    if len(prompt) >= window:
        raise UserError(f"prompt has {len(prompt)} tokens; the model's context window is {window}")
    if config.max_new_tokens < 1:
        raise UserError(f"max new tokens must be >= 1, got {config.max_new_tokens}")
    room = window - len(prompt)
    if config.max_new_tokens > room:
        log.warning("prompt of %d tokens leaves room for %d new tokens, not %d",
                    len(prompt), room, config.max_new_tokens)
    return min(config.max_new_tokens, room)


def finish(tokens: list[int], limit: int, model: Transformer, config: GenerationConfig
           ) -> tuple[list[int], str | None]:
    """Cut generated tokens at the first EOS or at the limit; the reason, or None to go on."""
    if config.stop_at_eos:
        for i, t in enumerate(tokens):
            if t in model.cfg.eos_token_ids:
                return tokens[:i + 1], "eos"
    if len(tokens) >= limit:
        return tokens[:limit], "length"
    return tokens, None
