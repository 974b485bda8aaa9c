"""Online self-calibration (speculation/calibration.py), fed by a simulated clock: a drifted cost
model is detected and refitted and the selection follows the true costs; a clock that agrees
with the profile refits nothing; the tokens stay ``ar``'s."""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from knapspec_dist.clock import Clock
from knapspec_dist.engine.generation import GenerationConfig
from knapspec_dist.engine.model_runner import ModelRunner
from knapspec_dist.engine.scheduler import generate
from knapspec_dist.errors import UserError
from knapspec_dist.profiles import store
from knapspec_dist.profiles.profile import LatencyProfile, fit_profile, integer_weights
from knapspec_dist.speculation import calibration, tpt
from knapspec_dist.speculation.autoregressive import Autoregressive
from knapspec_dist.speculation.calibration import Calibration, RoundTiming
from knapspec_dist.speculation.factory import build_selector
from knapspec_dist.speculation.knapspec import Decision, KnapSpecConfig, KnapSpecSelector
from knapspec_dist.speculation.options import parse_strategy
from knapspec_dist.speculation.selfspec import Plan, SelfSpeculative
from knapspec_dist.speculation.spmd import SyncedSelector

LAYERS = 4
MLP = 7e-4
HEAD = 2e-4


def cost_model(attention_scale: float = 1.0, layers: int = LAYERS, shape=None,
               spread: float = 0.02, qs=range(1, 12)) -> LatencyProfile:
    """A profile from made-up samples: attention 1e-4 + 1.5e-7 n (x ``attention_scale``),
    MLP 7e-4, verify (measured at ``qs``) the sum of its sublayers growing 10 % per query
    token. Tests only."""
    ns = [256, 1024, 4096]

    def attn(n):
        return attention_scale * (1e-4 + 1.5e-7 * n)

    samples = {"attention": [[n, attn(n)] for n in ns], "mlp": [MLP] * 3, "head": [HEAD] * 3,
               "verify": [[q, n, (layers * (attn(n) + MLP) + HEAD) * (1 + 0.1 * (q - 1))]
                          for q in qs for n in ns],
               "spread": {"mlp": [[n, spread] for n in ns]}}
    return fit_profile(samples, device={"name": "synthetic", "threads": 1},
                       model=shape or {"layers": layers}, dtype="fp32", batch=1, tp=1,
                       torch_version=torch.__version__)


def timed(true: LatencyProfile, skip: frozenset[int], drafts: int, n: int, batch: int = 1,
          noise: float = 0.0) -> RoundTiming:
    """A round as a clock that runs at ``true``'s costs reads it (``noise``: relative)."""
    return RoundTiming(batch, n, skip, drafts,
                       drafts * true.draft_time(skip, n, LAYERS) * (1 + noise),
                       true.verify_time(drafts + 1, n) * (1 - noise))


ATTENTIONS = frozenset({2, 4})  # a draft that skips two attention sublayers
MLPS = frozenset({3, 5})  # ... and one that skips two MLPs


def rounds(true: LatencyProfile, count: int, noise: float = 0.0):
    """Plain and drafting rounds at contexts growing from 500 (as a run's do)."""
    plans = [(frozenset(), 0), (ATTENTIONS, 4), (MLPS, 3)]
    for i in range(count):
        skip, drafts = plans[i % 3]
        yield timed(true, skip, drafts, 500 + 40 * i, noise=noise * (-1) ** i)


def choice(profile: LatencyProfile, n: int) -> tpt.Choice:
    """The TPT search between the two drafts, at the same acceptance, priced by ``profile``."""
    times = [profile.draft_time(s, n, LAYERS) for s in (ATTENTIONS, MLPS)]
    return tpt.search([0.8, 0.8], times, lambda q: profile.verify_time(q, n))


def test_a_drifted_cost_model_is_detected_refitted_and_changes_the_selection(caplog):
    stored, true = cost_model(), cost_model(attention_scale=3.0)  # attention 3x dearer
    n = 2000
    assert choice(stored, n).candidate == 1 and choice(true, n).candidate == 0
    assert integer_weights(stored, n, LAYERS) != integer_weights(true, n, LAYERS)
    saved = []
    cal = Calibration(lambda b: stored, LAYERS, saved.append)
    caplog.set_level("INFO", logger=calibration.__name__)
    refitted_at = [i for i, t in enumerate(rounds(true, 3 * calibration.REFRESH))
                   if cal.observe(t)]
    assert refitted_at[0] == calibration.SUSTAIN - 1  # detected after a sustained run
    f = cal.factors(1)
    assert f.attention == pytest.approx(3.0, rel=0.05)
    assert f.mlp == pytest.approx(1.0, rel=0.05) and f.head == pytest.approx(1.0, rel=0.2)
    priced = cal.profile(1)
    for q in (1, 4, 5, 9):  # 9: never verified, priced by the pooled fit
        for c in (600, n, 8000):
            assert priced.verify_time(q, c) == pytest.approx(true.verify_time(q, c), rel=0.02)
    assert priced.attention_time(n) == pytest.approx(true.attention_time(n), rel=0.05)
    # the next selection: the DP's weights and the TPT choice are the true costs'
    assert integer_weights(priced, n, LAYERS) == integer_weights(true, n, LAYERS)
    assert choice(priced, n).candidate == 0
    # logged once per refit that departs from what was reported before, and saved as such
    infos = [r for r in caplog.records if r.levelname == "INFO"]
    assert 1 <= len(infos) <= len(refitted_at) and "attention x3.00" in infos[0].getMessage()
    assert saved and saved[0].origin == "online"
    online = saved[-1].samples["online"]
    assert len(online["rounds"]) >= calibration.SUSTAIN
    assert online["factors"]["attention"] == pytest.approx(3.0, rel=0.05)


def test_a_refit_of_batched_rounds_is_kept_at_batch_1_too():
    """The next run's starting point is this machine's batch-1 refit (store.starting_point):
    a job whose rounds all ran at batch 3 keeps its refit at batch 3 and at batch 1, both
    with the factors fitted from the batch-3 rounds."""
    stored, saved = cost_model(), []
    cal = Calibration(lambda b: replace(stored, batch=b), LAYERS, saved.append)
    true = cost_model(attention_scale=3.0)
    for t in rounds(true, 3 * calibration.REFRESH):
        cal.observe(replace(t, batch=3))
    assert saved and sorted({p.batch for p in saved}) == [1, 3]
    last = {p.batch: p for p in saved}
    assert all(p.origin == "online" for p in last.values())
    assert (last[1].samples["online"]["factors"]["attention"]
            == last[3].samples["online"]["factors"]["attention"] == pytest.approx(3.0, rel=0.05))


def test_no_refit_when_the_clock_agrees_with_the_profile():
    stored = cost_model()
    cal = Calibration(lambda b: stored, LAYERS, lambda p: pytest.fail("saved"))
    # within the profile's band (MIN_BAND: 10 %): 6 % off, alternately slow and fast
    assert not any(cal.observe(t) for t in rounds(stored, 200, noise=0.06))
    assert cal.refits == 0 and cal.profile(1) is stored
    # a short burst off the band (another process for a few rounds) is no drift either
    burst = [timed(stored, frozenset(), 0, 900, noise=0.5)] * (calibration.SUSTAIN - 1)
    assert not any(cal.observe(t) for t in [*burst, *rounds(stored, 10)])
    assert cal.refits == 0


def loaded(true: LatencyProfile, count: int, seed: int, bursts: bool = True):
    """Rounds as a busy machine times them: each +-6 % at random and, with ``bursts``, every
    150 rounds a burst of 10-60 rounds slowed 1.5-3x (another process running)."""
    gen = random.Random(seed)
    plans = [(frozenset(), 0), (ATTENTIONS, 4), (MLPS, 3)]
    burst_end, slow = -1, 1.0
    for i in range(count):
        if bursts and i % 150 == 0:
            burst_end, slow = i + gen.randint(10, 60), gen.uniform(1.5, 3.0)
        t = timed(true, *plans[i % 3], 500 + 40 * (i % 100))
        k = (1 + gen.uniform(-0.06, 0.06)) * (slow if i < burst_end else 1.0)
        yield replace(t, draft_s=k * t.draft_s, verify_s=k * t.verify_s)


def test_a_busy_machine_reports_rarely_and_a_real_drift_once(caplog):
    """Repeated bursts of load on a stationary machine refit (they price the next selection)
    but are not news; a real 3x drift of attention after them is reported once."""
    stored = cost_model()
    saved = []
    cal = Calibration(lambda b: stored, LAYERS, saved.append)
    caplog.set_level("INFO", logger=calibration.__name__)
    refits = sum(cal.observe(t) for t in loaded(stored, 3000, seed=1))
    assert refits >= 20  # every burst was refitted ...
    assert len(saved) <= 2  # ... and (almost) none was reported
    before = len(saved)
    assert sum(cal.observe(t) for t in loaded(cost_model(attention_scale=3.0), 1500, seed=2,
                                              bursts=False))
    assert len(saved) == before + 1
    assert saved[-1].samples["online"]["factors"]["attention"] == pytest.approx(3.0, rel=0.1)
    infos = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert len(infos) == len(saved) and "attention x3." in infos[-1]


def test_reports_are_spaced_unless_the_departure_is_large():
    """A drift of 1.15x after a reported one is news, but waits for ``REPORT_EVERY`` rounds
    since that report; one of 2x (past ``LARGE`` bands) is reported at its first refresh."""
    stored = cost_model()
    saved_at: list[int] = []
    cal = Calibration(lambda b: stored, LAYERS, lambda p: saved_at.append(cal.rounds))
    for scale, count in ((1.5, 100), (1.5 * 1.15, 400), (3.0, 100)):
        for t in rounds(stored, count):
            cal.observe(replace(t, draft_s=scale * t.draft_s, verify_s=scale * t.verify_s))
    refresh = calibration.SUSTAIN + calibration.REFRESH  # a drift's first refresh, after it
    first, spaced, large = saved_at
    assert first == refresh
    assert spaced - first >= calibration.REPORT_EVERY > 100 + refresh - first
    assert large == 500 + refresh


def test_a_busy_profiles_wide_spread_does_not_hide_a_2x_drift():
    """A profile measured on a busy machine states a spread of 0.78: the band is capped, so
    attention 2x dearer (rounds 20-50 % slower) is a drift, and so is everything 2x faster."""
    stored = cost_model(spread=0.78)
    assert stored.spread() == pytest.approx(0.78)
    for true in (cost_model(attention_scale=2.0), stored):
        cal = Calibration(lambda b: stored, LAYERS)
        half = 0.5 if true is stored else 1.0
        assert any(cal.observe(replace(t, draft_s=half * t.draft_s, verify_s=half * t.verify_s))
                   for t in rounds(true, 100))
        assert cal.band(1) == calibration.MAX_BAND


def test_the_fit_is_robust_and_keeps_unseparable_costs_in_proportion():
    stored = cost_model()
    # plain rounds at one context cannot tell attention from MLP: both scale alike
    same = [timed(stored, frozenset(), 0, 1000)] * 20
    slow = [RoundTiming(1, 1000, frozenset(), 0, 0.0, 2 * t.verify_s) for t in same]
    f = calibration.fit(slow, lambda b: stored, LAYERS)
    assert f.attention == pytest.approx(f.mlp) == pytest.approx(2.0, rel=1e-3)
    # a tenth of the rounds hit by a 10x stall moves the Huber fit by little
    stalled = [RoundTiming(1, t.context, t.skip, t.drafts, t.draft_s * 10, t.verify_s * 10)
               if i % 10 == 0 else t for i, t in enumerate(rounds(stored, 100))]
    f = calibration.fit(stalled, lambda b: stored, LAYERS)
    assert max(abs(k - 1) for k in (f.attention, f.mlp, f.head)) < 0.15
    assert max(abs(k - 1) for k in f.verify_at(1)) < 0.15


def test_the_prices_in_force_are_the_fitted_model_where_q_was_not_measured():
    """The refitted profile prices a round as the fitted model does, draft forwards at the
    sublayer factors and the verify at its own q's factors, also at a q the stored profile
    did not measure (between measured ones, or past them): the drift test and the selection
    price a round one way."""
    stored = cost_model(qs=(1, 5))
    f = calibration.Factors(attention=1.3, mlp=0.8, head=1.1,
                            verify={0: (2.0, 1.5), 3: (3.0, 0.5), 5: (0.7, 2.5)})
    cal = Calibration(lambda b: stored, LAYERS)
    cal.fits = {None: f}
    n, skip = 1500, frozenset({2, 5})
    attn, v1, v5 = stored.attention_time(n), stored.verify[1], stored.verify[5]
    for drafts in range(8):
        q = drafts + 1
        w = min(q - 1, 4) / 4  # the stored line at q: between q 1 and 5, q 5's past it
        slope = (1 - w) * v1.slope + w * v5.slope
        intercept = (1 - w) * v1.intercept + w * v5.intercept
        ks, ki = f.verify.get(q, f.verify[0])
        draft = (f.attention * (LAYERS - 1) * attn + f.mlp * (LAYERS - 1) * MLP
                 + f.head * stored.head)
        t = RoundTiming(1, n, skip, drafts, 0.0, 0.0)
        assert cal.predicted(t) == pytest.approx(
            drafts * draft + ks * slope * n + ki * intercept, rel=1e-9), q


def test_factors_per_batch_size():
    stored = cost_model()
    cal = Calibration(lambda b: stored, LAYERS)
    for i in range(40):  # batch 4 rounds run 2x the profile, batch 1 rounds 3x
        b, k = (4, 2.0) if i % 2 else (1, 3.0)
        t = timed(stored, frozenset(), 0, 800 + 10 * i, batch=b)
        cal.observe(RoundTiming(b, t.context, t.skip, 0, 0.0, k * t.verify_s))
    assert cal.factors(4).verify_at(1) == pytest.approx((2.0, 2.0))
    assert cal.factors(1).verify_at(1) == pytest.approx((3.0, 3.0))


def test_online_profile_round_trips_and_never_lands_under_profiles(tmp_path, monkeypatch):
    stored = cost_model()
    cal = Calibration(lambda b: stored, LAYERS)
    for t in rounds(cost_model(attention_scale=2.0), calibration.SUSTAIN):
        cal.observe(t)
    online = cal.online_profile(1)
    monkeypatch.setenv("KNAPSPEC_PROFILE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KNAPSPEC_PROFILES", str(tmp_path / "profiles"))
    path = store.keep_online(online)
    assert path == str(tmp_path / "cache" / "online" / f"{stored.key()}.json")
    again = LatencyProfile.load(path)
    assert again.origin == "online" and again.samples["online"]["rounds"]
    assert again.attention(2000) == pytest.approx(online.attention(2000))
    assert json.loads(open(path).read())["origin"] == "online"
    # the lookup never picks it up in place of a measured profile
    assert store.find_profile(store.search_dirs(), stored.device, stored.model, "fp32") is None
    monkeypatch.setenv("KNAPSPEC_PROFILE_CACHE", str(tmp_path / "profiles" / "cache"))
    assert store.keep_online(online) is None


# ---------------------------------------------------------------------- through the engine


class SimClock(Clock):
    """A clock that reads simulated seconds: each forward of ``ChargedRunner`` advances it by
    what the true cost model says that forward costs."""

    def __init__(self):
        super().__init__("cpu")
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def mark(self) -> float:
        return self.t

    def sync(self) -> None:
        pass


class ChargedRunner(ModelRunner):
    def __init__(self, model, clock: SimClock, true: LatencyProfile):
        super().__init__(model)
        self.clock, self.true = clock, true

    def __call__(self, tokens, starts, cache, rows=None, skip=frozenset(), **kw):
        n = round(statistics.fmean(starts))
        layers = self.model.cfg.num_layers
        self.clock.t += (self.true.draft_time(skip, n, layers) if skip
                         else self.true.verify_time(tokens.shape[1], n))
        return super().__call__(tokens, starts, cache, rows, skip, **kw)


@pytest.mark.parametrize("drift", [3.0, 1.0])
def test_calibration_through_the_engine_keeps_tokens_and_refits_only_a_drift(engine_model,
                                                                           drift):
    model = engine_model("llama-gqa")
    shape = model.cfg.shape()
    stored = cost_model(layers=model.cfg.num_layers, shape=shape)
    true = cost_model(drift, layers=model.cfg.num_layers, shape=shape)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 256, (n,), generator=gen).tolist() for n in (30, 300)]
    config = GenerationConfig(max_new_tokens=40, stop_at_eos=False)
    selector = KnapSpecSelector(stored, KnapSpecConfig(interval=8, overhead_budget=1e9,
                                                       calibrate=True))
    clock = SimClock()
    results = generate(SelfSpeculative(selector, tau_conf=0.0, name="knapspec"), model,
                       prompts, config, runner=ChargedRunner(model, clock, true), clock=clock)
    expected = generate(Autoregressive(), model, prompts, config)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    cal = selector.calibration
    if drift == 1.0:
        assert cal.refits == 0 and selector.price(2) is selector.pricing.at(2)
    else:
        assert cal.refits >= 1
        n = 400
        assert selector.price(2).verify_time(1, n) == pytest.approx(true.verify_time(1, n),
                                                                    rel=0.05)
    plans = [t for r in results for t in r.stats.plans.values()]
    assert sum(t.tokens for t in plans) == sum(len(r.token_ids) for r in results) - len(prompts)
    assert all(t.priced_s == pytest.approx(t.seconds) for t in plans)


def test_every_tp_rank_is_fed_rank0s_seconds():
    """Under TP each rank times its own rounds; its calibration is fed rank 0's seconds (on the
    plan's broadcast, one round later), so every rank prices the next DP alike."""
    class Inner:
        def __init__(self):
            self.fed = []

        def decide(self, model, batch):
            return Decision(Plan(frozenset({2}), 3))

        def adopt(self, decision):
            pass

        def timed(self, timing, report=True):
            self.fed.append(timing)

    model = SimpleNamespace(cfg=SimpleNamespace(num_items=8))
    sent, root, other = [], Inner(), Inner()
    rank0 = SyncedSelector(root, SimpleNamespace(
        device=torch.device("cpu"), rank=0, broadcast=lambda t, src: sent.append(t.clone())))
    rank1 = SyncedSelector(other, SimpleNamespace(
        device=torch.device("cpu"), rank=1, broadcast=lambda t, src: t.copy_(sent[-1])))
    rank0.plan(model, None)
    rank1.plan(model, None)
    assert root.fed == other.fed == []  # no round timed yet
    mine = RoundTiming(2, 700, frozenset({2}), 3, 0.0123, 0.0456)
    rank0.timed(mine)
    rank1.timed(RoundTiming(2, 700, frozenset({2}), 3, 0.02, 0.05))
    rank0.plan(model, None)
    rank1.plan(model, None)
    assert root.fed == other.fed == [mine]


def test_under_tp_only_rank0_logs_and_saves_the_refits(caplog):
    """Every rank refits alike from rank 0's seconds, but one online file is written and one
    line logged per report: rank 0's (a fake comm, no Ray or gloo)."""
    stored = cost_model()

    class Inner:  # as KnapSpecSelector: its calibration made at start, fed by ``timed``
        def start(self, model):
            self.saved = []
            self.calibration = Calibration(lambda b: stored, LAYERS, self.saved.append)

        def decide(self, model, batch):
            return Decision(Plan(frozenset(), 0))

        def adopt(self, decision):
            pass

        def timed(self, timing, report=True):
            self.calibration.observe(timing, report)

    model = SimpleNamespace(cfg=SimpleNamespace(num_items=2 * LAYERS))
    sent, root, other = [], Inner(), Inner()
    cpu = torch.device("cpu")
    ranks = [SyncedSelector(root, SimpleNamespace(
                 device=cpu, rank=0, broadcast=lambda t, src: sent.append(t.clone()))),
             SyncedSelector(other, SimpleNamespace(
                 device=cpu, rank=1, broadcast=lambda t, src: t.copy_(sent[-1])))]
    caplog.set_level("INFO", logger=calibration.__name__)
    for rank in ranks:
        rank.start(model)
    for t in rounds(cost_model(attention_scale=3.0), 3 * calibration.REFRESH):
        for rank in ranks:
            rank.timed(replace(t, verify_s=t.verify_s * (1 + 0.01 * rank.comm.rank)))
            rank.plan(model, None)
    assert root.calibration.refits == other.calibration.refits >= 2
    mine, theirs = root.calibration.factors(1), other.calibration.factors(1)
    assert (mine.attention, mine.mlp, mine.head) == pytest.approx(
        (theirs.attention, theirs.mlp, theirs.head), rel=1e-9)
    infos = [r for r in caplog.records if r.levelname == "INFO"]
    assert len(root.saved) == len(infos) >= 1 and other.saved == []


def test_on_for_knapspec_off_for_the_authors_and_named_by_flags(engine_model):
    model = engine_model("llama-gqa")
    profile = cost_model(layers=model.cfg.num_layers, shape=model.cfg.shape())

    def calibrates(text: str) -> bool:
        selector = build_selector(parse_strategy(text).options, model, [profile])
        return selector.config.calibrate

    assert calibrates("knapspec") and not calibrates("knapspec:fixed")
    assert not calibrates("knapspec:paper") and calibrates("knapspec:paper+calibrate")
    assert not calibrates("clasp@3")
    with pytest.raises(UserError, match="unknown flag 'calibrate'"):
        parse_strategy("clasp:calibrate")


@pytest.mark.parametrize("origin", ["borrowed", "measured"])
def test_borrowed_prices_are_checked_by_the_clock_before_any_dp_or_draft(engine_model, origin):
    """Another machine's profile (3x off here) prices nothing until SUSTAIN timed rounds
    have confirmed or refitted it: until then every round is plain and no DP runs. A profile
    of this machine selects from its first due round."""
    model = engine_model("llama-gqa")
    shape = model.cfg.shape()
    stored = replace(cost_model(layers=model.cfg.num_layers, shape=shape), origin=origin)
    true = cost_model(3.0, layers=model.cfg.num_layers, shape=shape)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 256, (n,), generator=gen).tolist() for n in (30, 300)]
    config = GenerationConfig(max_new_tokens=40, stop_at_eos=False)
    selector = KnapSpecSelector(stored, KnapSpecConfig(interval=4, m=2, overhead_budget=1e9,
                                                       calibrate=True))
    seen: list[tuple[bool, int]] = []  # per round: prices checked before it, its drafts
    dps: list[int] = []  # rounds timed when each DP ran
    timed_round, select = selector.timed, selector.select

    def timed_and_seen(timing, report=True):
        seen.append((selector.calibration.checked, timing.drafts))
        timed_round(timing, report)

    def select_and_seen(*args):
        dps.append(selector.calibration.rounds)
        return select(*args)

    selector.timed, selector.select = timed_and_seen, select_and_seen
    clock = SimClock()
    results = generate(SelfSpeculative(selector, tau_conf=0.0, name="knapspec"), model,
                       prompts, config, runner=ChargedRunner(model, clock, true), clock=clock)
    expected = generate(Autoregressive(), model, prompts, config)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert dps, "no DP ran"
    if origin == "borrowed":
        assert selector.calibration.refits >= 1  # 3x off: refitted, then checked
        assert min(dps) >= calibration.SUSTAIN
        assert all(drafts == 0 for checked, drafts in seen if not checked)
    else:
        assert min(dps) < calibration.SUSTAIN
