"""The contract every registered family keeps, one :class:`FamilyCase` per family x class.

On the real transformers class of each family (tiny random config, CPU, batches from
``megatron_media_guard/testing/families/``), guarded by ``install_vlm`` as a user installs it:

- an aligned single-modality call is the plain forward bit for bit, with ``transfers``
  device-to-host transfers (``core.host.count_transfers``); an aligned batch of three samples
  (mixed modalities where the family takes them) equals the plain forward;
- one run short, or +k in one sample and -k in another, raises naming the sample (message and
  ``raise`` record), or drops it with every other sample equal to its own forward and the
  dropped sample's labels ignored;
- ``remove()`` leaves every module as it was (attributes and hooks) and the plain forward's
  outcome on a faulty batch;
- ``keep_tower``: a text-only call runs the tower once, before the decoder, at zero weight,
  only under ``"always"`` (``tests/tower_check.py``);
- ``policy="repair"``: a family with a geometry (built from the model's config, no
  ``geometry=`` from the user) repairs or falls back on a short run with every other sample
  equal to its own forward; one without says why in the record;
- the registry guards the outermost class (and the inner model alone where it is registered);
  markers the config lacks are named at install; ``set_items`` names the faulty sample's id
  and refuses a list of the wrong length; a placeholder the policy generated (under the loss,
  outside every region) is fed as the family's text token;
- ``check_batch``: the family's case in ``tests/test_check_batch.py`` (the data side, its own
  table: keep / raise naming the sample / drop, the plain model taking the returned batch).
- each family's own batches, as rows of the same checks: ``FAMILY_ALIGNED`` (ragged, text-only
  samples, mixed modalities: the plain forward and each sample's own) and ``FAMILY_FAULTS``
  (its swaps, videos, audio, multi-image samples: raised naming the sample; dropped with no
  feature in the dropped rows, their labels ignored, every other sample its own forward).

The samples and the tokenizer stand-ins come from the tables of ``tests/test_check_batch.py``
and ``tests/test_text_only_rank.py`` (imported, not copied). Bridge 0.6.2's classes are rows of
the table too (the registry must hold each under the family); their routing and behaviour run
in ``tests/test_family_*bridge.py`` under ``bash scripts/test_mcore019.sh`` (skipped without
Bridge). A family registered without a case fails
:func:`test_every_registered_family_has_a_case`; docs/FAMILIES.md's capability table is checked
against this table and the registry.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from family_checks import raised_samples, records
from test_check_batch import CASES as BATCH_CASES
from test_check_batch import FAULTS, NO_FIXTURE, faulty
from test_text_only_rank import CASES as ONE_ITEM

from megatron_media_guard import GuardConfig, MediaItem
from megatron_media_guard.core.host import count_transfers
from megatron_media_guard.families import FAMILIES, kimi_k25
from megatron_media_guard.testing.families.base import Media as M

pytest.importorskip("transformers")
pytest.importorskip("PIL")

pytestmark = pytest.mark.timeout(300)


@dataclass(frozen=True)
class FamilyCase:
    """One family on one class.

    family: the registry's name; cls: the class the guard is installed on; fixture: its
    ``testing/families`` module; towers / decoder: attribute paths from the model to the
    tower modules (tower first) and the decoder, for keep_tower; transfers: device-to-host
    transfers of an aligned single-modality call; check_batch: the data-side check takes
    the family's processor batch; repair: the family builds a repair geometry from its
    config; bridge_cls: the class Bridge 0.6.2 trains the family with; aligned: the batch of the
    bit-identical call (default: one item of ``tests/test_text_only_rank.py`` in each of two
    samples); embed: how the model embeds ids where not ``get_input_embeddings()`` (a dropped
    row reaches the decoder as exactly that)."""

    family: str
    cls: str
    fixture: str
    towers: tuple[str, ...]
    decoder: str = "model.language_model"
    transfers: int = 1
    check_batch: bool = True
    repair: bool = False
    bridge_cls: str | None = None
    aligned: tuple | None = None
    embed: Callable | None = None

    @property
    def one_item(self):
        """(media of one aligned item, tokenizer stand-in) from test_text_only_rank."""
        c = ONE_ITEM["qwen3_5" if self.family == "qwen_vl" else self.family]
        return c.media, c.tokens

    @property
    def samples(self):
        """Three aligned samples from test_check_batch (the faults shift samples 0 and 1)."""
        return BATCH_CASES[self.family].samples

    @property
    def per_item(self) -> bool:
        """The family's per-item counts come from ``set_items`` (InternVL's tiles)."""
        return BATCH_CASES[self.family].items


def img(*size, n=None):
    return M("image", size, n)


def vid(*size, n=None):
    return M("video", size, n)


def aud(*size, n=None):
    return M("audio", size, n)


BY = [img(2, 4), vid(2, 2, 2)]  # Qwen3-Omni's bystander


CASES = {
    c.family: c
    for c in [
        FamilyCase(
            "nemotron_omni",
            "NemotronH_Omni_Reasoning_V3",
            "nemotron_omni",
            ("vision_model",),
            "language_model",
            repair=True,
            bridge_cls="NemotronOmniModel (megatron-core LLaVAModel: the llava family)",
            aligned=([img(4, 4)], [img(2, 4)]),
        ),
        FamilyCase(
            "gemma3",
            "Gemma3ForConditionalGeneration",
            "gemma3",
            ("model.vision_tower", "model.multi_modal_projector"),
            repair=True,
            bridge_cls="Gemma3VLModel",
        ),
        FamilyCase(
            "kimi_k25",
            "Kimi_K25ForConditionalGeneration",
            "kimi_k25",
            ("model.vision_tower", "model.mm_projector"),
            embed=kimi_k25._embed,  # placeholders past the vocabulary embed as 0
            bridge_cls="KimiK25VLModel",
            aligned=([img(4, 6)], [img(8, 4), img(2, 2)]),
        ),
        FamilyCase(
            "internvl",
            "InternVLForConditionalGeneration",
            "internvl",
            ("model.vision_tower", "model.multi_modal_projector"),
            aligned=([img(56, 112), img(56, 56)], [img(100, 40)]),
        ),
        FamilyCase(
            "qwen2_audio",
            "Qwen2AudioForConditionalGeneration",
            "qwen2_audio",
            ("model.audio_tower", "model.multi_modal_projector"),
            bridge_cls="Qwen2AudioModel",
        ),
        FamilyCase(
            "qwen3_omni",
            "Qwen3OmniMoeThinkerForConditionalGeneration",
            "qwen3_omni",
            ("model.visual", "model.audio_tower"),
            bridge_cls="Qwen3OmniThinkerModel",
        ),
        FamilyCase(
            "glm4v",
            "Glm4vForConditionalGeneration",
            "glm4v",
            ("model.visual",),
            repair=True,
            bridge_cls="GLM45VModel",
            aligned=([img(4, 6)], [img(8, 4), img(2, 2)]),
        ),
        FamilyCase(
            "ernie4_5_vl",
            "Ernie4_5_VLMoeForConditionalGeneration",
            "ernie4_5_vl",
            ("model.vision_tower", "model.resampler_model"),
            repair=True,
            bridge_cls="Ernie45VLModel",
            aligned=([img(4, 6)], [img(8, 4), img(2, 2)]),
        ),
        FamilyCase(
            "mistral3",
            "Mistral3ForConditionalGeneration",
            "mistral3",
            ("model.vision_tower", "model.multi_modal_projector"),
            repair=True,
            bridge_cls="Ministral3Model",
            aligned=([img(56, 84)], [img(84, 56), img(28, 28)]),
        ),
        FamilyCase(
            "llava_onevision",
            "LlavaOnevisionForConditionalGeneration",
            "llava_onevision",
            ("model.vision_tower", "model.multi_modal_projector"),
            repair=True,
            aligned=([img(56, 56), img(100, 40)], [img(80, 80)]),
        ),
        FamilyCase(
            "qwen_vl",
            "Qwen3_5ForConditionalGeneration",
            "qwen3_5",
            ("model.visual",),
            repair=True,
            bridge_cls="Qwen25VLModel, Qwen3VLModel",
        ),
    ]
}
NAMES = sorted(CASES)


def test_every_registered_family_has_a_case():
    """A family added to the registry fails here until it has a row (megatron-core's LLaVA and
    MIMO merges have no processor batch: tests/test_adapter_llava*.py, test_adapter_mimo.py)."""
    names = {s.name for s in FAMILIES}
    assert names == set(CASES) | set(NO_FIXTURE), names ^ (set(CASES) | set(NO_FIXTURE))
    assert set(BATCH_CASES) == set(CASES)  # test_check_batch runs the same families


def test_the_registry_routes_every_class_of_the_table():
    """Each row's transformers class and Bridge class are the names the registry holds for
    the family (a renamed class in either fails)."""
    for case in CASES.values():
        specs = [s for s in FAMILIES if s.name == case.family]
        hf = {c for s in specs for c in s.classes.get("transformers.", ())}
        assert case.cls in hf, (case.family, hf)
        bridge = {c for s in specs for c in s.classes.get("megatron.bridge.", ())}
        if case.bridge_cls and "llava" not in case.bridge_cls:
            assert set(case.bridge_cls.split(", ")) <= bridge, (case.family, bridge)
        elif not case.bridge_cls:
            assert not bridge, case.family


_MODELS: dict = {}


def build(name: str):
    """(case, fixture module, model) of a row; the model is built once per session."""
    case = CASES[name]
    F = importlib.import_module(f"megatron_media_guard.testing.families.{case.fixture}")
    if name not in _MODELS:
        _MODELS[name] = F.tiny_model(seed=0)
    model = _MODELS[name]
    assert type(model).__name__ == case.cls
    return case, F, model


def attr(model, path: str):
    for part in path.split("."):
        model = getattr(model, part)
    return model


def logits(model, kw: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**kw).logits


def guarded(name: str, model, b, config: GuardConfig | None = None, labels: bool = False):
    """(logits, last result) of one call under ``install_vlm``; InternVL's items from
    ``set_items`` (the tiles per image never reach the model)."""
    from megatron_media_guard.adapters import install_vlm

    case = CASES[name]
    kw = dict(b.kwargs, labels=b.input_ids.clone()) if labels else b.kwargs
    with install_vlm(model, config or GuardConfig(), tokenizer=case.one_item[1]) as h:
        if case.per_item:
            h.set_items([MediaItem(n, modality=mod) for _, mod, n in b.items])
        out = logits(model, kw)
        return out, h.last_result


def own(F, model, sample) -> torch.Tensor:
    b = F.make_batch(model, [sample])
    return logits(model, b.kwargs)[0, : b.lengths[0]]


def fault_batch(F, model, case, fault: str):
    ok = F.make_batch(model, case.samples)
    return F.make_batch(model, faulty(ok, case.samples, FAULTS[fault]))


@pytest.mark.parametrize("name", NAMES)
def test_an_aligned_call_is_the_plain_forward_bit_for_bit(name):
    case, F, model = build(name)
    media, _ = case.one_item
    b = F.make_batch(model, list(case.aligned or ([media], [media])))
    ref = logits(model, b.kwargs)
    with count_transfers() as n:
        out, res = guarded(name, model, b)
    assert res.report.actions == ("keep", "keep")
    assert torch.equal(out, ref)
    assert sum(n.values()) == case.transfers, n


@pytest.mark.parametrize("name", NAMES)
def test_an_aligned_batch_equals_the_plain_forward(name):
    case, F, model = build(name)
    b = F.make_batch(model, case.samples)
    out, res = guarded(name, model, b)
    assert res.report.actions == ("keep",) * 3
    torch.testing.assert_close(out, logits(model, b.kwargs), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("name", NAMES)
def test_a_fault_raises_naming_the_sample(name, fault, tmp_path):
    case, F, model = build(name)
    b = fault_batch(F, model, case, fault)
    cfg = GuardConfig(policy="raise", log_dir=str(tmp_path))
    bad = set(FAULTS[fault])
    assert raised_samples(lambda: guarded(name, model, b, cfg), bad, tmp_path) >= {min(bad)}


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("name", NAMES)
def test_a_drop_keeps_every_other_sample_equal_to_its_own_forward(name, fault):
    case, F, model = build(name)
    b = fault_batch(F, model, case, fault)
    bad = set(FAULTS[fault])
    out, res = guarded(name, model, b, GuardConfig(policy="drop"), labels=True)
    assert {s for s, a in enumerate(res.report.actions) if a == "drop"} == bad
    for k in {0, 1, 2} - bad:
        want = own(F, model, case.samples[k])
        torch.testing.assert_close(out[k, : b.lengths[k]], want, atol=1e-5, rtol=1e-5)
    for k in bad:
        assert (res.labels[k] == -100).all()


def _state(model) -> dict:
    """Every module's attributes and hooks, and the class of the model."""
    return {
        name: (
            type(m),
            sorted(vars(m)),
            dict(m._forward_pre_hooks),
            dict(m._forward_hooks),
            dict(m._forward_pre_hooks_with_kwargs),
        )
        for name, m in model.named_modules()
    }


def _outcome(model, kw):
    try:
        return logits(model, kw)
    except Exception as e:  # the plain model's own error on a faulty batch
        return type(e)


@pytest.mark.parametrize("name", NAMES)
def test_remove_leaves_the_model_as_it_was(name):
    from megatron_media_guard.adapters import install_vlm

    case, F, model = build(name)
    b = fault_batch(F, model, case, "+k/-k across two samples")
    plain = _outcome(model, b.kwargs)  # first: transformers adds its output-capturing hooks
    before = _state(model)
    h = install_vlm(model, GuardConfig(), tokenizer=case.one_item[1])
    assert _state(model) != before
    h.remove()
    assert _state(model) == before
    after = _outcome(model, b.kwargs)
    if isinstance(plain, torch.Tensor):
        assert torch.equal(after, plain)
    else:
        assert after is plain


@pytest.mark.parametrize("mode, runs", [("always", 1), ("on_drop", 0), ("never", 0)])
@pytest.mark.parametrize("name", NAMES)
def test_a_text_only_micro_batch_keeps_the_tower_in_step(name, mode, runs):
    from tower_check import check_keeps_tower

    case, F, model = build(name)
    _media, tokens = case.one_item
    check_keeps_tower(
        model,
        mode,
        runs,
        media=F.make_batch(model, [case.samples[0]]).kwargs,
        text=F.make_batch(model, [[], []]).kwargs,
        tokenizer=tokens,
        towers=[attr(model, p) for p in case.towers],
        decoder=attr(model, case.decoder),
    )


@pytest.mark.parametrize("name", NAMES)
def test_repair_where_the_family_has_a_geometry(name, tmp_path):
    """A geometry from the config alone; a short run repaired or dropped with a reason, every
    other sample its own forward; a family without one says so in the record."""
    from megatron_media_guard.adapters.vlm_install import guard_for

    case, F, model = build(name)
    spec = next(
        s for s in FAMILIES if s.name == name and case.cls in s.classes.get("transformers.", ())
    )
    geo = guard_for(spec, model, GuardConfig(policy="repair"), case.one_item[1]).geometry
    assert (geo is not None) == case.repair, geo
    b = fault_batch(F, model, case, "one run short")
    cfg = GuardConfig(policy="repair", fallback="drop", log_dir=str(tmp_path))
    out, res = guarded(name, model, b, cfg)
    assert res.report.actions[1] in ("repair", "drop") and res.report.actions[::2] == ("keep",) * 2
    for k in (0, 2):
        want = own(F, model, case.samples[k])
        torch.testing.assert_close(out[k, : b.lengths[k]], want, atol=1e-5, rtol=1e-5)
    if res.report.actions[1] == "drop":
        why = " ".join(str(r.get("reason")) for r in records(tmp_path) if r["sample"] == 1)
        assert why.strip() and why != "None", why
        if not case.repair:
            assert f"cannot repair: no geometry for {name}" in why, why


#: family -> what ``install_vlm`` without a tokenizer says, where the markers are tokenizer-only
MARKERS = {
    "nemotron_omni": "'<img>'",
    "internvl": "'<img>'",
    "mistral3": r"\[IMG_END\].*\[IMG_BREAK\]",
    "qwen3_omni": "audio start/end markers",
}


@pytest.mark.parametrize("name", NAMES)
def test_the_registry_finds_the_model_and_its_inner_model(name):
    """``find_family`` guards the outermost class the family knows (and its inner model alone,
    where the registry holds that class too); markers the config lacks are named at install."""
    from megatron_media_guard.adapters import install_vlm
    from megatron_media_guard.errors import MediaInputError
    from megatron_media_guard.families import find_family

    _case, _F, model = build(name)
    target, spec = find_family(model)
    assert target is model and spec.name == name
    inner = getattr(model, "model", None)
    if type(inner).__name__ in spec.classes.get("transformers.", ()):
        assert find_family(inner) == (inner, spec)
    if name in MARKERS:
        with pytest.raises(MediaInputError, match=MARKERS[name]):
            install_vlm(model, GuardConfig())
    with pytest.raises(MediaInputError, match=name):  # an unknown model lists the families
        install_vlm(torch.nn.Linear(2, 2), GuardConfig())


@pytest.mark.parametrize("name", NAMES)
def test_set_items_names_the_sample_id_and_checks_the_count(name, tmp_path):
    """Items given with ``set_items`` name the faulty sample by its id; a list one item short
    is refused before any check."""
    from megatron_media_guard import MediaAlignmentError
    from megatron_media_guard.adapters import install_vlm
    from megatron_media_guard.errors import MediaInputError

    case, F, model = build(name)
    ok = F.make_batch(model, case.samples[:2])
    b = F.make_batch(model, faulty(ok, case.samples[:2], FAULTS["one run short"]))
    items = [MediaItem(n, sample=s, modality=mod, sample_id="ab"[s]) for s, mod, n in b.items]
    for given, err, match in [
        (items, MediaAlignmentError, "sample_id 'b'"),
        (items[:-1], MediaInputError, "set_items (gave|declares)"),
    ]:
        cfg = GuardConfig(log_dir=str(tmp_path))
        with (
            install_vlm(model, cfg, tokenizer=case.one_item[1]) as h,
            pytest.raises(err, match=match),
        ):
            h.set_items(given)
            logits(model, b.kwargs)


@pytest.mark.parametrize("name", NAMES)
def test_a_generated_placeholder_is_fed_as_text(name):
    """A placeholder the policy wrote in its response (under the labels, outside every region)
    is kept and fed as the family's text token: the plain forward of exactly that."""
    from megatron_media_guard.families import find_family

    case, F, model = build(name)
    b = F.make_batch(model, case.samples[:2])
    spec = find_family(model)[1]
    placeholder = spec.modalities[0].placeholder.resolve(model, case.one_item[1])
    pos = b.lengths[1] - 2  # a text token of sample 1's response
    fixed = dict(b.kwargs, input_ids=b.input_ids.clone())
    fixed["input_ids"][1, pos] = spec.text.resolve(model, case.one_item[1])
    b.kwargs["input_ids"][1, pos] = placeholder
    labels = torch.full_like(b.input_ids, -100)  # the responses: each sample's last 2 tokens
    for k, n in enumerate(b.lengths):
        labels[k, n - 2 : n] = b.input_ids[k, n - 2 : n]
    b.kwargs["labels"] = labels
    out, res = guarded(name, model, b, GuardConfig(policy="drop"))
    assert res.report.actions == ("keep", "keep")
    assert res.report.generated == ((1, (pos,)),)
    torch.testing.assert_close(out, logits(model, fixed), atol=1e-6, rtol=1e-6)


# ---- each family's own aligned batches (ragged, text-only samples, mixed modalities) ----

FAMILY_ALIGNED = {
    "ernie4_5_vl": (
        ("images", [[img(4, 6)], [img(8, 4), img(2, 2)]]),
        ("videos", [[vid(2, 4, 4)], [vid(4, 2, 4)]]),
        ("image and video", [[vid(2, 2, 4), img(4, 4)], [img(2, 2)]]),
    ),
    "kimi_k25": (
        ("images", [[img(4, 6)], [img(8, 4), img(2, 2)]]),
        ("videos (chunks of <= 4 frames)", [[vid(6, 4, 4)], [vid(3, 2, 4)]]),
        ("mixed", [[img(4, 4)], [vid(6, 4, 4)], [vid(2, 2, 2), img(2, 2)]]),
    ),
    "llava_onevision": (
        ("image", [[img(56, 56)], [img(60, 130)]]),
        ("multi-image and single", [[img(56, 56), img(100, 40)], [img(80, 80)]]),
        ("text-only sample", [[], [img(130, 60)]]),
        ("video", [[vid(2)], [vid(2)]]),
        ("image and video mixed", [[img(56, 56), vid(2)], [vid(2)], [img(90, 50), img(50, 90)]]),
    ),
    "mistral3": (
        ("one each", [[img(56, 84)], [img(84, 56)]]),
        ("ragged, a text-only sample", [[img(28, 28), img(84, 84)], [], [img(56, 28)]]),
        ("two in one sample", [[], [img(112, 56), img(28, 56)]]),
    ),
    "qwen3_omni": (
        ("images", [[img(4, 6)], [img(8, 4), img(2, 2)]]),
        ("videos", [[vid(2, 4, 4)], [vid(3, 2, 4)]]),
        ("audio", [[aud(100)], [aud(60), aud(230)]]),
        ("mixed", [[img(4, 4), aud(80)], [vid(2, 4, 4)], [aud(50), img(2, 2)]]),
        ("image and video in one sample", [[vid(2, 2, 4), img(2, 4)], [img(4, 4)]]),
    ),
    "qwen2_audio": (
        ("one each", [[aud(100)], [aud(40)]]),
        ("ragged, a text-only sample", [[aud(20), aud(61)], [], [aud(400)]]),
        ("zero-feature clip", [[aud(2), aud(100)], [aud(9)]]),  # L=2: bos/eos, no placeholder
        ("one feature per clip (plain: legacy path)", [[aud(3)], [aud(4), aud(5)]]),
        ("full 30 s clip", [[aud(3000)], [aud(41)]]),
    ),
}
ALIGNED_ROWS = [(f, n, s) for f, xs in FAMILY_ALIGNED.items() for n, s in xs]


@pytest.mark.parametrize(
    "name,_batch,samples", ALIGNED_ROWS, ids=[f"{f}-{n}" for f, n, _ in ALIGNED_ROWS]
)
def test_a_family_aligned_batch_is_the_plain_forward_and_each_samples_own(name, _batch, samples):
    _case, F, model = build(name)
    b = F.make_batch(model, samples)
    out, res = guarded(name, model, b)
    assert res.report.actions == ("keep",) * len(samples)
    torch.testing.assert_close(out, logits(model, b.kwargs), atol=1e-6, rtol=1e-6)
    for k, s in enumerate(samples):
        torch.testing.assert_close(out[k, : b.lengths[k]], own(F, model, s), atol=1e-5, rtol=0)


# ---- each family's own faults (its swaps, its modalities, its multi-item samples) ----


@dataclass(frozen=True)
class Fault:
    """samples (fault injected with ``Media(..., tokens=k)``); bad: the sample that must be
    named (and dropped), or the set of samples that must be, exactly; ``swap``: items exchanged
    (``make_batch(swap=)``); every sample not dropped is compared with its own forward."""

    name: str
    samples: list
    bad: int | frozenset
    swap: tuple[int, int] | None = None

    def check(self, got: set[int]) -> None:
        if isinstance(self.bad, int):
            assert self.bad in got, got
        else:
            assert got == self.bad, got


FAMILY_FAULTS = {
    "ernie4_5_vl": (
        Fault("short run", [[img(4, 6, n=5)], [img(8, 4)]], 0, None),
        Fault("+k/-k", [[img(4, 6, n=8)], [img(8, 4, n=6), img(2, 2)], [img(2, 4)]], 0, None),
        Fault("swap", [[img(2, 2), img(4, 6)], [img(8, 4)], [img(2, 4)]], 1, (1, 2)),
        Fault("video +k/-k", [[vid(2, 4, 4, n=5)], [vid(4, 2, 4, n=3)], [vid(2, 2, 4)]], 0, None),
        Fault("mixed batch, video short", [[img(4, 4)], [vid(2, 4, 4, n=3), img(2, 2)]], 1, None),
    ),
    "glm4v": (
        Fault("short run", [[img(4, 6, n=5)], [img(8, 4)]], 0, None),
        Fault("+k/-k", [[img(4, 6, n=8)], [img(8, 4, n=6), img(2, 2)], [img(2, 4)]], 0, None),
        Fault("swap", [[img(2, 2), img(4, 6)], [img(8, 4)], [img(2, 4)]], 1, (1, 2)),
        Fault("video frame short", [[vid(2, 4, 4)], [vid(2, 4, 4, n=7)]], 1, None),
        Fault("mixed batch, image short", [[vid(2, 2, 4)], [img(4, 4, n=3), img(2, 2)]], 1, None),
    ),
    "mistral3": (
        Fault("short run", [[img(56, 84, n=5)], [img(28, 56)]], 0, None),
        Fault("surplus", [[img(28, 56)], [img(56, 84, n=7)]], 1, None),
        Fault("+k/-k", [[img(56, 84, n=7)], [img(56, 84, n=5)], [img(28, 56)]], 0, None),
        Fault("swap", [[img(56, 84)], [img(28, 28)], [img(28, 56)]], 0, (0, 1)),
    ),
    # a 56x56 image alone is 36 features (base 16 + 4 rows of 4 + 1 newline); one short image
    # of a two-image sample (base + 1 = 17) drops the whole sample; a kept two-image sample
    # beside a dropped one keeps its base + 1 counts
    "llava_onevision": (
        Fault("short image run", [[img(56, 56, n=35)], [img(80, 80)]], 0, None),
        Fault("short video run", [[img(80, 80), vid(2)], [vid(2, n=8)]], 1, None),
        Fault("+k/-k images", [[img(56, 56, n=38)], [img(56, 56, n=34)], [img(80, 80)]], 0, None),
        Fault("+k/-k videos", [[vid(2, n=10)], [vid(2, n=8)], [img(80, 80)]], 0, None),
        Fault("swap", [[img(56, 56)], [img(60, 130)], [img(80, 80)]], 0, (0, 1)),
        Fault("multi-image one short", [[img(56, 56), img(100, 40, n=16)], [img(80, 80)]], 0, None),
        Fault("beside a multi-image", [[img(56, 56, n=35)], [img(56, 56), img(100, 40)]], 0, None),
    ),
    # unguarded, all but the short run are silent (tests/test_fixture_plain.py)
    "kimi_k25": (
        Fault("short run", [[img(4, 4, n=3)], [img(2, 4)]], frozenset({0}), None),
        Fault(
            "+k/-k images",
            [[img(4, 4, n=6)], [img(4, 4, n=2)], [img(2, 2)]],
            frozenset({0, 1}),
            None,
        ),
        Fault(
            "+k/-k video chunks",
            [[vid(6, 4, 4, n=9)], [vid(2, 4, 4, n=3)], [img(2, 2)]],
            frozenset({0, 1}),
            None,
        ),
        Fault("swap of images", [[img(4, 4)], [img(2, 4)], [img(2, 2)]], frozenset({0, 1}), (0, 1)),
        Fault(
            "swap of videos",
            [[vid(2, 4, 4)], [vid(2, 2, 4)], [img(2, 2)]],
            frozenset({0, 1}),
            (1, 2),
        ),
    ),
    # an aligned bystander of the row's modality beside every fault
    "nemotron_omni": (
        Fault("short run", [[img(4, 4, n=3)], [img(2, 4)], [img(2, 4)]], 0, None),
        Fault("+k/-k", [[img(4, 4, n=5)], [img(4, 4, n=3)], [img(2, 4)]], 0, None),
        Fault("swap", [[img(4, 4)], [img(2, 2)], [img(2, 4)]], 0, (0, 1)),
        Fault(
            "video tubelet short", [[vid(4, 4, 4)], [vid(4, 4, 4, n=7)], [vid(4, 4, 4)]], 1, None
        ),
        Fault("audio short", [[aud(40)], [aud(40, n=2)], [aud(40)]], 1, None),
    ),
    "qwen2_audio": (
        Fault("short run", [[aud(100, n=24)], [aud(40)], [aud(61)]], 0, None),
        Fault("surplus", [[aud(40)], [aud(100, n=26)], [aud(61)]], 1, None),
        Fault("+k/-k", [[aud(100, n=28)], [aud(40, n=7)], [aud(61)]], 0, None),
        Fault("swap", [[aud(100)], [aud(40)], [aud(61)]], 0, (0, 1)),
        # every run <= 1 placeholder: the plain model's legacy path would expand them silently
        Fault("runs cut to one", [[aud(100, n=1)], [aud(40)], [aud(61)]], 0, None),
    ),
    # the bystander (BY) after the faulty samples in every modality's consumption order; no
    # audio clip beside an image swap (audio is consumed first and would shift its indices)
    "qwen3_omni": (
        Fault("short image run", [[img(4, 6, n=5)], [img(8, 4)], [*BY, aud(50)]], 0, None),
        Fault("+k/-k images", [[img(4, 6, n=8)], [img(8, 4, n=6)], [*BY, aud(50)]], 0, None),
        Fault("swap of images", [[img(4, 6)], [img(8, 4)], BY], 0, (0, 1)),
        Fault("+k/-k videos", [[vid(2, 4, 4, n=10)], [vid(3, 2, 4, n=4)], [*BY, aud(50)]], 0, None),
        Fault("short audio run", [[aud(100, n=10)], [aud(60)], [*BY, aud(50)]], 0, None),
        Fault("surplus audio run", [[aud(60)], [aud(100, n=16)], [*BY, aud(50)]], 1, None),
        Fault("+k/-k audio", [[aud(100, n=16)], [aud(60, n=5)], [*BY, aud(50)]], 0, None),
        Fault("swap of audio clips", [[aud(100)], [aud(60)], [*BY, aud(50)]], 0, (0, 1)),
        Fault(
            "audio fault beside an image",
            [[aud(100, n=10), img(2, 2)], [aud(60)], [*BY, aud(50)]],
            0,
            None,
        ),
    ),
}
FAULT_ROWS = [(f, x) for f, xs in FAMILY_FAULTS.items() for x in xs]
FAULT_IDS = [f"{f}-{x.name}" for f, x in FAULT_ROWS]


@pytest.mark.parametrize("name,fault", FAULT_ROWS, ids=FAULT_IDS)
def test_a_family_fault_raises_naming_the_sample(name, fault, tmp_path):
    _case, F, model = build(name)
    b = F.make_batch(model, fault.samples, swap=fault.swap)
    cfg = GuardConfig(policy="raise", log_dir=str(tmp_path))
    fault.check(raised_samples(lambda: guarded(name, model, b, cfg), fault.bad, tmp_path))


@pytest.mark.parametrize("name,fault", FAULT_ROWS, ids=FAULT_IDS)
def test_a_family_fault_dropped_feeds_no_feature_and_keeps_the_others(name, fault):
    """The dropped rows reach the decoder as their own tokens' embeddings, their labels
    ignored; every other sample equals its own forward; the loss stays finite."""
    from megatron_media_guard.adapters import install_vlm

    case, F, model = build(name)
    b = F.make_batch(model, fault.samples, swap=fault.swap)
    vocab = model.config.get_text_config().vocab_size
    labels = torch.where(b.input_ids < vocab, b.input_ids, -100)
    seen = []
    hook = attr(model, case.decoder).register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["inputs_embeds"].detach().clone()), with_kwargs=True
    )
    try:
        with install_vlm(model, GuardConfig(policy="drop"), tokenizer=case.one_item[1]) as h:
            with torch.no_grad():
                out = model(**b.kwargs, labels=labels)
            res = h.last_result
    finally:
        hook.remove()
    dropped = {s for s, a in enumerate(res.report.actions) if a == "drop"}
    fault.check(dropped)
    assert len(dropped) < len(fault.samples)
    text = (case.embed or (lambda m, ids: m.get_input_embeddings()(ids)))(model, b.input_ids)
    for k in range(len(fault.samples)):
        if k in dropped:
            assert torch.equal(seen[0][k], text[k])
            assert (res.labels[k] == -100).all()
        else:
            want = own(F, model, fault.samples[k])
            torch.testing.assert_close(out.logits[k, : b.lengths[k]], want, atol=1e-5, rtol=0)
    assert torch.isfinite(out.loss)


# ---- docs/FAMILIES.md's capability table is this table and the registry ----

_YES = {True: "yes", False: "no"}


def capability_rows() -> dict[str, tuple[str, ...]]:
    """family -> (install_vlm, check_batch, repair, keep_tower, Bridge), as the table says."""
    rows = {
        c.family: (
            c.cls,
            _YES[c.check_batch],
            _YES[c.repair],
            "yes",
            c.bridge_cls or "no",
        )
        for c in CASES.values()
    }
    rows.update(
        {
            # keep_tower: not part of megatron-core's merges' contract ("-")
            "llava": ("install_llava (megatron-core LLaVAModel)", "no", "no", "-", "yes"),
            "mimo": ("install_mimo (megatron-core MimoModel)", "no", "no", "-", "no"),
        }
    )
    return rows


def test_the_capability_table_in_the_docs_is_the_registrys():
    text = (Path(__file__).parents[2] / "docs" / "FAMILIES.md").read_text()
    section = text.split("## Capabilities", 1)[1].split("\n## ", 1)[0]
    found = {}
    for line in section.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and not set(cells[0]) <= {"-"} and cells[0] != "family":
            found[cells[0]] = tuple(re.sub(r"`", "", c) for c in cells[1:])
    assert found == capability_rows()
    assert set(found) == {s.name for s in FAMILIES}


# ---- one device-to-host transfer per aligned call, any modality mix (issue 24, 5a) ----

#: family -> (mix, samples): aligned batches of every modality mix the family's batches take
#: (the engine's families; Qwen-VL runs on the inputs mode)
TRANSFER_MIXES = {
    "nemotron_omni": (
        ("image", [[img(4, 4)], [img(2, 4)]]),
        ("video", [[vid(4, 4, 4)], [vid(4, 4, 4)]]),
        ("audio", [[aud(40)], [aud(60), aud(20)]]),
        ("image + audio", [[img(4, 4), aud(40)], [img(2, 4)], [aud(40)]]),
        ("image + video", [[img(4, 4)], [vid(4, 4, 4)], [img(2, 4), vid(4, 4, 4)]]),
        ("video + audio", [[vid(4, 4, 4), aud(40)], [aud(60)]]),
        ("image + video + audio", [[img(4, 4), aud(40)], [vid(4, 4, 4)], [aud(20), img(2, 4)]]),
    ),
    "gemma3": (("image", [[img(32, 32)], [img(20, 64)]]),),
    "mistral3": (("image", [[img(56, 84)], [img(84, 56), img(28, 28)]]),),
    "internvl": (("image", [[img(56, 112), img(56, 56)], [img(100, 40)]]),),
    "kimi_k25": (
        ("image", [[img(4, 6)], [img(8, 4), img(2, 2)]]),
        ("video", [[vid(6, 4, 4)], [vid(3, 2, 4)]]),
        ("image + video", [[img(4, 4)], [vid(6, 4, 4)], [vid(2, 2, 2), img(2, 2)]]),
    ),
    "glm4v": (
        ("image", [[img(4, 6)], [img(8, 4), img(2, 2)]]),
        ("video", [[vid(2, 4, 4)], [vid(2, 2, 4)]]),
        ("image + video", [[vid(2, 2, 4)], [img(4, 4), img(2, 2)], [img(2, 4), vid(2, 4, 4)]]),
    ),
    "ernie4_5_vl": (
        ("image", [[img(4, 6)], [img(8, 4), img(2, 2)]]),
        ("video", [[vid(2, 4, 4)], [vid(4, 2, 4)]]),
        ("image + video", [[vid(2, 2, 4), img(4, 4)], [img(2, 2)]]),
    ),
    "llava_onevision": (
        ("image", [[img(56, 56)], [img(60, 130)]]),
        ("video", [[vid(2)], [vid(2)]]),
        ("image + video", [[img(56, 56), vid(2)], [vid(2)], [img(90, 50), img(50, 90)]]),
    ),
    "qwen2_audio": (
        ("audio", [[aud(100)], [aud(40)]]),
        ("audio, ragged, a text-only sample", [[aud(20), aud(61)], [], [aud(400)]]),
    ),
    "qwen3_omni": (
        ("image", [[img(4, 6)], [img(8, 4), img(2, 2)]]),
        ("video", [[vid(2, 4, 4)], [vid(3, 2, 4)]]),
        ("audio", [[aud(100)], [aud(60), aud(230)]]),
        ("image + video", [[vid(2, 2, 4), img(2, 4)], [img(4, 4)]]),
        ("image + audio", [[img(4, 4), aud(80)], [aud(50), img(2, 2)]]),
        ("video + audio", [[vid(2, 4, 4), aud(80)], [aud(50)]]),
        ("image + video + audio", [[img(4, 4), aud(80)], [vid(2, 4, 4)], [aud(50), img(2, 2)]]),
        ("video with its audio", [[vid(2, 4, 4, 80)], [vid(2, 4, 4, 50), img(2, 2)]]),
    ),
    # the inputs mode: the runs checked against the grids' count tables on the device
    "qwen_vl": (
        ("image", [[img(64, 64)], [img(64, 96), img(96, 64)]]),
        ("video", [[vid(4, 64, 64)], [vid(2, 64, 96)]]),
        ("image + video", [[img(64, 64), vid(4, 64, 64)], [img(96, 64)], [vid(2, 64, 96)]]),
    ),
}
TRANSFER_ROWS = [(f, mix, s) for f, xs in TRANSFER_MIXES.items() for mix, s in xs]


def aligned_transfers(name: str, samples) -> tuple[int, dict]:
    """(transfers, by reason) of one aligned call of ``samples`` under ``install_vlm``; the
    call must keep every sample and equal the plain forward."""
    _case, F, model = build(name)
    b = F.make_batch(model, samples)
    with count_transfers() as n:
        out, res = guarded(name, model, b)
    assert res.report.actions == ("keep",) * len(samples)
    plain = _outcome(model, b.kwargs)  # Nemotron's plain forward takes no image beside a video
    if isinstance(plain, torch.Tensor):
        torch.testing.assert_close(out, plain, atol=1e-6, rtol=1e-6)
    return sum(n.values()), dict(n)


@pytest.mark.parametrize(
    "name,mix,samples", TRANSFER_ROWS, ids=[f"{f}-{m}" for f, m, _ in TRANSFER_ROWS]
)
def test_an_aligned_call_of_any_modality_mix_makes_one_transfer(name, mix, samples):
    """Mixed image + video + audio calls included: the verdict is the one transfer; the run
    order, the audio clips' counts and the family's own refusals ride in it."""
    n, reasons = aligned_transfers(name, samples)
    assert n == 1, reasons
    assert reasons["aligned-path verdict"] == 1, reasons


def test_every_family_with_mixed_batches_has_transfer_rows():
    """Every embed family that takes several modalities has a row mixing them."""
    for s in FAMILIES:
        if s.apply == "embed" and len(s.modalities) > 1:
            mixes = [m for m, _ in TRANSFER_MIXES[s.name]]
            assert any("+" in m for m in mixes), s.name
