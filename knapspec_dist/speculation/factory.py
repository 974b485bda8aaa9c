"""Build a generation strategy by name, from the options the CLI and the engine accept."""

from __future__ import annotations

from knapspec_dist.engine.strategy import Strategy
from knapspec_dist.model.decoder import Transformer
from knapspec_dist.profiles.profile import LatencyProfile
from knapspec_dist.profiles.store import resolve_for_model
from knapspec_dist.speculation.autoregressive import Autoregressive
from knapspec_dist.speculation.clasp import ClaspSelector
from knapspec_dist.speculation.knapspec import (
    KnapsackSelector,
    KnapSpecConfig,
    KnapSpecSelector,
)
from knapspec_dist.speculation.lookup import CopiedDrafts
from knapspec_dist.speculation.options import StrategyOptions, check_options, parse_skip
from knapspec_dist.speculation.paper import PaperSelector
from knapspec_dist.speculation.selfspec import SelfSpeculative, StaticSelector

CLASP_SKIP_LAYERS = 0.25  # the share of layers CLaSp's drafts skip
PRICED = ("knapspec", "clasp")  # the strategies a latency profile prices


def build_strategy(options: StrategyOptions, model: Transformer,
                   profiles: list[LatencyProfile] | None = None) -> Strategy:
    """``profiles``: what prices knapspec / clasp (one profile, or several at different batch
    sizes); None: ``options.profile``'s file, else a stored or newly measured one."""
    check_options(options, model.cfg)
    if options.name == "ar":
        return Autoregressive()
    if options.name == "static":
        skip = parse_skip(options.skip, model.cfg.num_layers)
        return SelfSpeculative(StaticSelector(skip, options.gamma), options.tau_conf, "static")
    copied = None
    if options.name == "knapspec" and not options.paper and options.drafts != "subnet":
        config = KnapSpecConfig()
        copied = CopiedDrafts(config.min_gain, config.noise_z)
    return SelfSpeculative(build_selector(options, model, profiles), options.tau_conf,
                           options.name, copied)


def build_selector(options: StrategyOptions, model: Transformer,
                   profiles: list[LatencyProfile] | None = None) -> KnapsackSelector:
    """The knapspec or clasp selector. Without ``profiles`` the profile is resolved in this
    process (profiles/store.py): the file ``options.profile`` names, used alone, or a stored
    or measured one with the stored profiles at other batch sizes beside it."""
    if profiles is None:
        profiles = resolve_for_model(options.profile, model).profiles
    if options.name == "clasp":
        return ClaspSelector(profiles, options.gamma, CLASP_SKIP_LAYERS,
                             KnapSpecConfig(interval=options.interval, calibrate=False))
    # online calibration: on for the default, off for the authors' (their code has none)
    calibrate = options.calibrate if options.calibrate is not None else not options.paper
    config = KnapSpecConfig(interval=options.interval, coupled=options.coupled,
                            objective=options.objective, select_once=options.select_once,
                            calibrate=calibrate, subnets=options.drafts != "copy")
    return (PaperSelector if options.paper else KnapSpecSelector)(profiles, config)


class StrategyBuilder:
    """Builds a run's strategies afresh, each as often as the run asks, resolving the latency
    profile at most once per ``options.profile`` (a file, or None: stored or measured).

    A profile measured on a busy machine is not kept in the cache (profiles/store.py
    ``keep``), so each lookup of a fresh ``build_strategy`` would measure one again: a
    benchmark that builds a strategy per run (``knapspec throughput``) would measure a profile
    per run. The builder keeps what it resolved for the rest of its run, and no longer."""

    def __init__(self, model: Transformer, kv: str = "fixed"):
        self.model, self.kv = model, kv  # kv: the KV layout the runs decode over
        self.resolved: dict[str | None, list[LatencyProfile]] = {}

    def __call__(self, options: StrategyOptions) -> Strategy:
        profiles = None
        if options.name in PRICED:
            if options.profile not in self.resolved:
                check_options(options, self.model.cfg)  # a bad option is refused before
                self.resolved[options.profile] = resolve_for_model(
                    options.profile, self.model, kv=self.kv).profiles
            profiles = self.resolved[options.profile]
        return build_strategy(options, self.model, profiles)
