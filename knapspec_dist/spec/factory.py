"""Build a generation strategy by name, from the options the CLI and the engine accept."""

from __future__ import annotations

from knapspec_dist.engine.strategy import Strategy
from knapspec_dist.spec.autoregressive import Autoregressive
from knapspec_dist.spec.options import StrategyOptions, check_options, parse_skip
from knapspec_dist.spec.selfspec import SelfSpeculative, StaticSelector


def build_strategy(options: StrategyOptions, model) -> Strategy:
    check_options(options, model.cfg)
    if options.name == "ar":
        return Autoregressive()
    if options.name == "static":
        skip = parse_skip(options.skip, model.cfg.num_layers)
        return SelfSpeculative(StaticSelector(skip, options.gamma), options.tau_conf, "static")
    from knapspec_dist.spec.knapspec import build_selector

    return SelfSpeculative(build_selector(options, model), options.tau_conf, options.name)
