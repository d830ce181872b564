"""A rank whose micro-batch is text-only joins the guard's round as its peers do (before, the
family engine's text-only branch returned without a plan: its peer waited in the consensus
all-reduce, which hung FSDP2, crashed DDP and broke the next collective of a bare loop).

- every family with a fixture (and an ``apply="inputs"`` one), 2 gloo ranks: calls (media |
  text), (media | a text sample with a literal placeholder, dropped), (text | text),
  (dropped | media), each followed by an all-reduce: the same collectives on both ranks;
- Gemma 3 and Nemotron Omni under FSDP2 and DDP: a text-only rank trains in step, gradients
  equal to the plain model's averaged over the ranks;
- one process: a text-only call reaches the model untouched (one transfer), and a literal
  placeholder in it takes the policy (drop, ``generated="text"``, raise).
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
from dataclasses import dataclass

import pytest
import torch
from dist_harness import data_parallel, full_grads, run_ranks
from test_check_batch import CASES as BATCH_CASES

from megatron_media_guard import GuardConfig, MediaAlignmentError
from megatron_media_guard.core.host import count_transfers
from megatron_media_guard.testing import bridge as loader
from megatron_media_guard.testing import families as fixtures
from megatron_media_guard.testing.families.base import Media

pytest.importorskip("transformers")
pytest.importorskip("PIL")


@dataclass(frozen=True)
class Case:
    """One guarded family on one fixture: ``fixture`` (a ``testing/families`` module), one
    aligned item, and ``spec``: a ``families`` module whose ``SPEC`` is installed in place of
    the registry's choice. ``tokens``: the tokenizer stand-in for markers only a tokenizer
    knows (the fixture's in tests/test_check_batch.py)."""

    fixture: str
    media: Media
    spec: str | None = None

    @property
    def tokens(self) -> dict | None:
        return next(c.tokens for c in BATCH_CASES.values() if c.fixture == self.fixture) or None


CASES = {
    "gemma3": Case("gemma3", Media("image", (32, 32))),
    "nemotron_omni": Case("nemotron_omni", Media("image", (4, 4))),
    "kimi_k25": Case("kimi_k25", Media("image", (4, 4))),
    "internvl": Case("internvl", Media("image", (56, 56))),
    "qwen2_audio": Case("qwen2_audio", Media("audio", (40,))),
    "qwen3_omni": Case("qwen3_omni", Media("image", (4, 4))),
    "glm4v": Case("glm4v", Media("image", (4, 4))),
    "ernie4_5_vl": Case("ernie4_5_vl", Media("image", (4, 4))),
    "mistral3": Case("mistral3", Media("image", (56, 84))),
    "llava_onevision": Case("llava_onevision", Media("image", (56, 56))),
    "qwen3_5": Case("qwen3_5", Media("image", (4, 4))),  # the Qwen-VL family
    # apply="inputs": Bridge's Qwen3-Omni spec on transformers' thinker (the forward Bridge's
    # mirrors: the same keyword inputs, its own merge); Bridge's class itself below
    "qwen3_omni inputs": Case("qwen3_omni", Media("image", (4, 4)), "qwen3_omni_bridge"),
}
BRIDGE_CASE = "qwen3_omni_bridge"  # Bridge 0.6.2's Qwen3OmniThinkerModel (scripts/test_mcore019.sh)


def case_of(name: str) -> Case:
    return CASES["qwen3_omni" if name == BRIDGE_CASE else name]


def test_the_table_covers_every_fixture():
    found = {m.name for m in pkgutil.iter_modules(fixtures.__path__)} - {"base"}
    assert found == {c.fixture for c in CASES.values()}, "add the new fixture to CASES"


@contextlib.contextmanager
def built(name: str):
    """(model, fixture module, the fixture's model) of one case: the model the guard is
    installed on (Bridge's, around the fixture's transformers model, Bridge's modules in place
    while it is used) and the one the fixture builds batches from."""
    F = importlib.import_module(f"megatron_media_guard.testing.families.{case_of(name).fixture}")
    if name != BRIDGE_CASE:
        full = F.tiny_model()
        yield full, F, full
        return
    from megatron_media_guard.testing.bridge_models_omni import qwen3_omni

    with loader.bridge_modules(loader.find_root()):
        full = F.tiny_model()
        yield qwen3_omni(full), F, full


def install(name: str, model, config: GuardConfig):
    """The case's guard on ``model``, installed as a user installs it."""
    from megatron_media_guard.adapters import install_vlm
    from megatron_media_guard.adapters.vlm_install import INSTALLERS, guard_for

    case = case_of(name)
    if case.spec is None:
        return install_vlm(model, config, tokenizer=case.tokens)
    spec = importlib.import_module(f"megatron_media_guard.families.{case.spec}").SPEC
    guard = guard_for(spec, model, config, case.tokens)
    return INSTALLERS[spec.apply](model, guard, spec, case.tokens)


def batches(name: str, F, model, handle) -> dict[str, dict]:
    """The case's calls: one aligned media sample, one text-only sample, and the text sample
    with a literal placeholder of the media's modality in its text."""
    case = case_of(name)
    media = F.make_batch(model, [[case.media]]).kwargs
    text = F.make_batch(model, [[]]).kwargs
    ids = text["input_ids"].clone()
    ids[0, 2] = handle.guard.grammar.placeholders[case.media.modality]
    return {"media": media, "text": text, "stray": dict(text, input_ids=ids)}


# ---- no wrapper: every family ----------------------------------------------------------------

PAIRS = (("media", "text"), ("media", "stray"), ("text", "text"), ("stray", "media"))
ACTION = {"media": "keep", "text": "keep", "stray": "drop"}


def minimal_worker(rank: int, world: int, names: tuple[str, ...]) -> dict:
    import torch.distributed as dist

    out = {}
    for name in names:
        with built(name) as (model, F, full):
            handle = install(name, model, GuardConfig(policy="drop"))
            calls = batches(name, F, full, handle)
            seen = []
            for pair in PAIRS:
                with torch.no_grad():
                    model(**calls[pair[rank]])
                actions = handle.last_result.report.actions if handle.last_result else None
                seen.append((handle.guard.consensus.collectives, actions))
                t = torch.ones(4)
                dist.all_reduce(t)
                if not bool(t.eq(world).all()):
                    raise AssertionError(f"{name}: the all-reduce after {pair} gave {t.tolist()}")
            handle.remove()
        out[name] = seen
    return out


BRIDGE_SKIP = pytest.mark.skipif(loader.missing() is not None, reason=loader.missing() or "")


@pytest.mark.dist
@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "names",
    [
        pytest.param(tuple(CASES), id="every family"),
        pytest.param((BRIDGE_CASE,), marks=BRIDGE_SKIP, id="bridge"),
    ],
)
def test_every_family_joins_the_round_whatever_the_rank_holds(names):
    if names == (BRIDGE_CASE,):
        pytest.importorskip("transformers.models.qwen3_omni_moe")
    res = run_ranks(minimal_worker, 2, args=(names,), timeout=120, pg_timeout=20)
    for name in names:
        for rank in (0, 1):
            want = [(k + 1, (ACTION[p[rank]],)) for k, p in enumerate(PAIRS)]
            assert res[rank][name] == want, (name, rank, res[rank][name])


# ---- FSDP2 / DDP: a text-only rank trains in step ----------------------------------------------

TRAINED = ("gemma3", "nemotron_omni")


def _labels(kw: dict) -> torch.Tensor:
    return kw["input_ids"].masked_fill(kw["attention_mask"] == 0, -100)


def train_worker(rank: int, world: int, layout: str) -> dict:
    import copy

    import torch.distributed as dist

    from megatron_media_guard.adapters import install_vlm

    out = {}
    for name in TRAINED:
        case = CASES[name]
        F = importlib.import_module(f"megatron_media_guard.testing.families.{case.fixture}")
        model = F.tiny_model().train()
        media = F.make_batch(model, [[case.media]]).kwargs
        text = F.make_batch(model, [[]]).kwargs
        # the token tables are most of the parameters (Gemma 3: a 262k vocabulary): kept out for
        # speed; so are the parameters the plain model leaves unused on the media batch (Gemma
        # 3's SigLIP pooling head, Nemotron's audio tower): DDP would wait for them unguarded too
        for m in filter(None, (model.get_input_embeddings(), model.get_output_embeddings())):
            m.requires_grad_(False)
        model(**media, labels=_labels(media)).loss.backward()
        for p in model.parameters():
            if p.grad is None:
                p.requires_grad_(False)
        model.zero_grad(set_to_none=True)
        ref = copy.deepcopy(model)
        handle = install_vlm(model, GuardConfig(policy="drop"), tokenizer=case.tokens)
        layers = next(
            m for n, m in model.named_modules() if "language_model" in n and n.endswith("layers")
        )
        wrapped, inner = data_parallel(model, layout, shard=layers)
        params = {n: p for n, p in inner.named_parameters() if p.requires_grad}
        ref_params = {n: p for n, p in ref.named_parameters() if p.requires_grad}
        steps = []
        for per_rank in ((media, text), (text, media)):
            kw = per_rank[rank]
            loss = wrapped(**kw, labels=_labels(kw)).loss
            loss.backward()
            grads = full_grads(params)
            t = torch.ones(4)
            dist.all_reduce(t)
            want = {n: torch.zeros_like(p) for n, p in ref_params.items()}
            for b in per_rank:  # the plain model on each rank's batch, averaged over the ranks
                ref.zero_grad(set_to_none=True)
                ref(**b, labels=_labels(b)).loss.backward()
                for n, p in ref_params.items():
                    if p.grad is not None:
                        want[n] += p.grad / world
            missing = sorted(n for n, g in grads.items() if g is None)
            diff = max(
                float((g - want[n]).abs().max()) / max(1.0, float(want[n].abs().max()))
                for n, g in grads.items()
                if g is not None
            )
            steps.append(
                dict(
                    loss=float(loss),
                    reduced=t.tolist(),
                    missing=missing,
                    diff=diff,
                    actions=handle.last_result.report.actions,
                )
            )
            inner.zero_grad(set_to_none=True)
        out[name] = steps
        handle.remove()
    return out


@pytest.mark.dist
@pytest.mark.timeout(150)
@pytest.mark.parametrize("layout", ["fsdp2", "ddp"])
def test_a_text_only_rank_trains_in_step(layout):
    import math

    res = run_ranks(train_worker, 2, args=(layout,), timeout=120, pg_timeout=20)
    for rank, r in enumerate(res):
        for name, steps in r.items():
            for k, s in enumerate(steps):
                where = (layout, name, f"rank {rank}", f"step {k}")
                assert math.isfinite(s["loss"]) and s["reduced"] == [2.0] * 4, (where, s)
                assert not s["missing"], (where, s["missing"][:5])
                assert s["diff"] <= 1e-5, (where, s["diff"])
                assert s["actions"] == ("keep",), (where, s["actions"])


# ---- one process: the plan of a text-only call is applied ------------------------------------


class _Seen(Exception):
    """Raised by the capture hook: the model's body need not run."""


def _model_inputs(model, handle, kw: dict) -> dict:
    """The keyword arguments the guarded module's body receives (what the guard's pre gives
    it) when ``model`` is called (Bridge's wrapper calls the thinker the guard is on)."""
    got = {}
    pre = handle._pre_hook

    def grab(args, kwargs):
        args, kwargs = pre(args, kwargs) or (args, kwargs)
        got.update(handle.sig.bind(*args, **kwargs).arguments)
        raise _Seen

    handle._pre_hook = grab
    try:
        with torch.no_grad(), pytest.raises(_Seen):
            model(**kw)
    finally:
        del handle._pre_hook
    return got


BRIDGE = pytest.param(BRIDGE_CASE, marks=BRIDGE_SKIP)


@pytest.mark.parametrize("name", [*CASES, BRIDGE])
def test_a_text_only_call_applies_its_plan(name, tmp_path):
    with built(name) as (model, F, full):
        with install(name, model, GuardConfig(policy="drop")) as handle:
            calls = batches(name, F, full, handle)
            text, stray = calls["text"], calls["stray"]
            ph = int(stray["input_ids"][0, 2])
            not_under_loss = _labels(stray).masked_fill(stray["input_ids"] == ph, -100)
            text_id = handle.text_id
            # aligned: the caller's own tensors reach the model (the model's own forward)
            with count_transfers() as n:
                got = _model_inputs(model, handle, dict(text, labels=_labels(text)))
            assert got["input_ids"] is text["input_ids"]
            assert sum(n.values()) == 1, n  # the verdict's, as an aligned media call
            assert handle.last_result.report.actions == ("keep",)
            # a literal placeholder outside the loss, dropped: read as text, labels ignored
            got = _model_inputs(model, handle, dict(stray, labels=not_under_loss))
            assert handle.last_result.report.actions == ("drop",)
            assert int(got["input_ids"][0, 2]) == text_id
            assert torch.equal(got["input_ids"][0, 3:], stray["input_ids"][0, 3:])
            assert bool(got["labels"].eq(-100).all())
        # under the loss, outside any media region: generated by the policy, fed as text (a
        # grammar without start and end markers has no regions: the loss, which trains on every
        # placeholder here, tells nothing apart, and the sample is dropped)
        with install(name, model, GuardConfig(policy="drop", generated="text")) as handle:
            g = handle.guard.grammar
            regions = g.start_id is not None and g.end_id is not None
            labels = _labels(stray)
            got = _model_inputs(model, handle, dict(stray, labels=labels))
            assert handle.last_result.report.actions == (("keep",) if regions else ("drop",))
            assert int(got["input_ids"][0, 2]) == text_id
            assert torch.equal(got["labels"], labels if regions else torch.full_like(labels, -100))
        config = GuardConfig(policy="raise", log_dir=str(tmp_path))
        fault = pytest.raises(MediaAlignmentError, match=r"sample 0\b")
        with install(name, model, config), torch.no_grad(), fault:
            model(**dict(stray, labels=not_under_loss))
