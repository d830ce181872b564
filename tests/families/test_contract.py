"""The contract every registered family keeps, one :class:`FamilyCase` per family x class.

On the real transformers class of each family (tiny random config, CPU, batches from
``megatron_media_guard/testing/families/``), guarded by ``install_vlm`` as a user installs it:
an aligned call of any modality mix is the plain forward bit for bit, each sample its own
forward, with one device-to-host transfer; a fault (the shared ones of
``tests/test_check_batch.py`` and each family's own, ``FAMILY_FAULTS``) raises naming the sample
or is dropped (no feature in its row, its labels ignored, every other sample its own forward);
``remove()`` restores the model; ``keep_tower`` (``tests/tower_check.py``); ``repair`` where
the family has a geometry, a drop saying why where no resize reaches the count; the registry,
the markers named at install, ``set_items`` and a generated placeholder fed as text.
``check_batch`` (the data side) runs the same families in ``tests/test_check_batch.py``;
Bridge 0.6.2's classes (rows here) in ``tests/test_family_*bridge.py``. docs/FAMILIES.md's
capability table is checked against this table and the registry.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path

import pytest
import torch
from family_checks import (
    aud,
    decoder_inputs,
    img,
    internvl_items,
    logits,
    own_logits,
    raised_samples,
    records,
    response,
    spy,
    vid,
)
from test_check_batch import CASES as BATCH_CASES
from test_check_batch import FAULTS, NO_FIXTURE, faulty
from test_check_batch import fixture as check_batch_fixture
from test_family_qwen3_omni import AIV_FAULTS
from tower_check import check_keeps_tower

from megatron_media_guard import GuardConfig, MediaAlignmentError, MediaItem
from megatron_media_guard.adapters import install_vlm
from megatron_media_guard.adapters.vlm_install import guard_for
from megatron_media_guard.core.host import count_transfers
from megatron_media_guard.errors import MediaInputError
from megatron_media_guard.families import FAMILIES, find_family, kimi_k25

pytest.importorskip("transformers")
pytest.importorskip("PIL")

pytestmark = pytest.mark.timeout(300)


@dataclass(frozen=True)
class FamilyCase:
    """One family on one class.

    family: the registry's name; cls: the class the guard is installed on; towers / decoder:
    attribute paths from the model to the tower modules (tower first) and the decoder, for
    keep_tower; repair: the family builds a repair geometry from its config; bridge_cls: the
    class Bridge 0.6.2 trains the family with; embed: how the model embeds ids where not
    ``get_input_embeddings()`` (a dropped row reaches the decoder as exactly that). The
    tokenizer stand-in, the three aligned samples and the per-item counts are the family's
    ``tests/test_check_batch.py`` case."""

    family: str
    cls: str
    towers: tuple[str, ...]
    decoder: str = "model.language_model"
    repair: bool = False
    bridge_cls: str | None = None
    embed: Callable | None = None

    @property
    def tokens(self) -> dict | None:
        """The tokenizer stand-in for the markers the config lacks."""
        return BATCH_CASES[self.family].tokens or None

    @property
    def samples(self):
        """Three aligned samples (the faults shift samples 0 and 1)."""
        return BATCH_CASES[self.family].samples

    @property
    def per_item(self) -> bool:
        """The family's per-item counts come from ``set_items`` (InternVL's tiles)."""
        return BATCH_CASES[self.family].items


BY = [img(2, 4), vid(2, 2, 2)]  # Qwen3-Omni's bystander
VT, MMP = "model.vision_tower", "model.multi_modal_projector"
CASES = {c.family: c for c in [
    FamilyCase("nemotron_omni", "NemotronH_Omni_Reasoning_V3", ("vision_model",), "language_model",
               repair=True,
               bridge_cls="NemotronOmniModel (megatron-core LLaVAModel: the llava family)"),
    FamilyCase("gemma3", "Gemma3ForConditionalGeneration", (VT, MMP), repair=True,
               bridge_cls="Gemma3VLModel"),
    FamilyCase("kimi_k25", "Kimi_K25ForConditionalGeneration", (VT, "model.mm_projector"),
               embed=kimi_k25._embed,  # placeholders past the vocabulary embed as 0
               bridge_cls="KimiK25VLModel"),
    FamilyCase("internvl", "InternVLForConditionalGeneration", (VT, MMP)),
    FamilyCase("qwen2_audio", "Qwen2AudioForConditionalGeneration", ("model.audio_tower", MMP),
               bridge_cls="Qwen2AudioModel"),
    FamilyCase("qwen3_omni", "Qwen3OmniMoeThinkerForConditionalGeneration",
               ("model.visual", "model.audio_tower"), bridge_cls="Qwen3OmniThinkerModel"),
    FamilyCase("glm4v", "Glm4vForConditionalGeneration", ("model.visual",), repair=True,
               bridge_cls="GLM45VModel"),
    FamilyCase("ernie4_5_vl", "Ernie4_5_VLMoeForConditionalGeneration",
               (VT, "model.resampler_model"), repair=True, bridge_cls="Ernie45VLModel"),
    FamilyCase("mistral3", "Mistral3ForConditionalGeneration", (VT, MMP), repair=True,
               bridge_cls="Ministral3Model"),
    FamilyCase("llava_onevision", "LlavaOnevisionForConditionalGeneration", (VT, MMP),
               repair=True),
    FamilyCase("qwen_vl", "Qwen3_5ForConditionalGeneration", ("model.visual",), repair=True,
               bridge_cls="Qwen25VLModel, Qwen3VLModel"),
]}  # fmt: skip
NAMES = sorted(CASES)


def test_every_registered_family_has_a_case_and_the_registry_routes_its_classes():
    """A family added to the registry fails here until it has a row (megatron-core's LLaVA and
    MIMO merges have no processor batch: tests/test_adapter_llava*.py, test_adapter_mimo.py);
    each row's transformers and Bridge classes are the names the registry holds for it."""
    names = {s.name for s in FAMILIES}
    assert names == set(CASES) | set(NO_FIXTURE), names ^ (set(CASES) | set(NO_FIXTURE))
    assert set(BATCH_CASES) == set(CASES)  # test_check_batch runs the same families
    for case in CASES.values():
        specs = [s for s in FAMILIES if s.name == case.family]
        hf = {c for s in specs for c in s.classes.get("transformers.", ())}
        assert case.cls in hf, (case.family, hf)
        bridge = {c for s in specs for c in s.classes.get("megatron.bridge.", ())}
        if case.bridge_cls and "llava" not in case.bridge_cls:
            assert set(case.bridge_cls.split(", ")) <= bridge, (case.family, bridge)
        elif not case.bridge_cls:
            assert not bridge, case.family


def build(name: str):
    """(case, fixture module, model) of a row; the model (test_check_batch's) is built once
    per session."""
    case = CASES[name]
    _, F, model = check_batch_fixture(name)
    assert type(model).__name__ == case.cls
    return case, F, model


def guarded(name: str, model, b, config: GuardConfig | None = None, labels=None):
    """(output, last result) of one call under ``install_vlm``; InternVL's items from
    ``set_items`` (the tiles per image never reach the model)."""
    case = CASES[name]
    kw = b.kwargs if labels is None else dict(b.kwargs, labels=labels)
    with install_vlm(model, config or GuardConfig(), tokenizer=case.tokens) as h:
        if case.per_item:
            h.set_items(internvl_items(b))
        with torch.no_grad():
            out = model(**kw)
        return out, h.last_result


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
    case, F, model = build(name)
    _, b = Fault("+k/-k across two samples", None, K01).batch(case, F, model)
    plain = _outcome(model, b.kwargs)  # first: transformers adds its output-capturing hooks
    before = _state(model)
    h = install_vlm(model, GuardConfig(), tokenizer=case.tokens)
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
    case, F, model = build(name)
    check_keeps_tower(
        model,
        mode,
        runs,
        media=F.make_batch(model, [case.samples[0]]).kwargs,
        text=F.make_batch(model, [[], []]).kwargs,
        tokenizer=case.tokens,
        towers=[attrgetter(p)(model) for p in case.towers],
        decoder=attrgetter(case.decoder)(model),
    )


@pytest.mark.parametrize("name", NAMES)
def test_repair_where_the_family_has_a_geometry(name, tmp_path):
    """A geometry from the config alone; a short run repaired or dropped with a reason, every
    other sample its own forward; a family without one says so in the record."""
    case, F, model = build(name)
    spec = find_family(model)[1]
    geo = guard_for(spec, model, GuardConfig(policy="repair"), case.tokens).geometry
    assert (geo is not None) == case.repair, geo
    _, b = Fault("one run short", None, 1).batch(case, F, model)
    cfg = GuardConfig(policy="repair", fallback="drop", log_dir=str(tmp_path))
    out, res = guarded(name, model, b, cfg)
    assert res.report.actions[1] in ("repair", "drop") and res.report.actions[::2] == ("keep",) * 2
    for k in (0, 2):
        want = own_logits(F, model, case.samples[k])
        torch.testing.assert_close(out.logits[k, : b.lengths[k]], want, atol=1e-5, rtol=1e-5)
    if res.report.actions[1] == "drop":
        why = " ".join(str(r.get("reason")) for r in records(tmp_path) if r["sample"] == 1)
        assert why.strip() and why != "None", why
        if not case.repair:
            assert f"cannot repair: no geometry for {name}" in why, why


#: (family, samples, why): a run no resize reaches (any fidelity allowed) falls back to a drop
#: whose repair record says why; the other sample its own forward
REPAIR_FALLBACKS = [
    ("gemma3", [[img(32, 32, n=3)], [img(20, 64)]], "cannot be reached by resizing"),
    # 61 cells (prime): only 1x61, beyond the tower's 8 cells per side
    ("mistral3", [[img(56, 84, n=61)], [img(28, 56)]], "unreachable"),
    # 35: no size gives an odd 16 + r * (c + 1)
    ("llava_onevision", [[img(56, 56, n=35)], [img(80, 80)]], "^unreachable: no image size"),
    ("llava_onevision", [[img(56, 56), img(100, 40, n=26)], [img(80, 80)]],
     r"multi-image sample.*base \+ 1 = 17"),
    # videos: no repair encoder
    ("glm4v", [[vid(2, 4, 4, n=7)], [vid(2, 2, 4)]], "no encoder, pixels, media size given"),
    ("ernie4_5_vl", [[vid(2, 4, 4, n=3)], [vid(2, 2, 4)]], "no encoder, pixels, media size given"),
]  # fmt: skip


@pytest.mark.parametrize(
    "name,samples,why", REPAIR_FALLBACKS, ids=[f"{f}-{w[:20]}" for f, _, w in REPAIR_FALLBACKS]
)
def test_a_run_no_resize_reaches_falls_back_saying_why(name, samples, why, tmp_path):
    _case, F, model = build(name)
    b = F.make_batch(model, samples)
    cfg = GuardConfig(
        policy="repair",
        fallback="drop",
        allowed_fidelity=("engine-replay", "unique", "closest-aspect"),
        log_dir=str(tmp_path),
    )
    out, res = guarded(name, model, b, cfg)
    assert res.report.actions == ("drop", "keep")
    reps = [r["reason"] for r in records(tmp_path) if r["event"] == "repair" and r["sample"] == 0]
    assert reps and all(re.search(why, r) for r in reps), reps
    want = own_logits(F, model, samples[1])
    torch.testing.assert_close(out.logits[1, : b.lengths[1]], want, atol=1e-5, rtol=1e-5)


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


#: (family, two aligned samples): each family's; Nemotron Omni's videos (one item for all the
#: runs of a video's tubelets); Kimi K2.5's videos (an item per chunk of <= 4 frames, each its
#: own run: ``num_chunks_per_video`` never reaches the model)
SET_ITEMS = [(n, CASES[n].samples[:2]) for n in NAMES] + [
    ("nemotron_omni", [[vid(4, 4, 4)], [vid(4, 4, 4)]]),
    ("kimi_k25", [[vid(6, 4, 4)], [vid(3, 2, 4)]]),
]


@pytest.mark.parametrize(
    "name, samples", SET_ITEMS, ids=[*NAMES, "nemotron_omni-videos", "kimi_k25-video chunks"]
)
def test_set_items_names_the_sample_id_and_checks_the_count(name, samples, tmp_path):
    """Items given with ``set_items`` name the faulty sample by its id; a list one item short
    is refused before any check."""
    case, F, model = build(name)
    ok = F.make_batch(model, samples)
    b = F.make_batch(model, faulty(ok, samples, FAULTS["one run short"]))
    per = b.items
    if name == "kimi_k25":  # an item per video chunk: its runs
        per = [(s, m, n) for s, runs in enumerate(b.runs) for m, n in runs]
    items = [MediaItem(n, sample=s, modality=mod, sample_id="ab"[s]) for s, mod, n in per]
    for given, err, match in [
        (items, MediaAlignmentError, "sample_id 'b'"),
        (items[:-1], MediaInputError, "set_items (gave|declares)"),
    ]:
        cfg = GuardConfig(log_dir=str(tmp_path))
        with (
            install_vlm(model, cfg, tokenizer=case.tokens) as h,
            pytest.raises(err, match=match),
        ):
            h.set_items(given)
            logits(model, b.kwargs)


@pytest.mark.parametrize("name", NAMES)
def test_a_generated_placeholder_is_fed_as_text(name):
    """A placeholder the policy wrote in its response (under the labels, outside every region)
    is kept and fed as the family's text token: the plain forward of exactly that."""
    case, F, model = build(name)
    b = F.make_batch(model, case.samples[:2])
    spec = find_family(model)[1]
    placeholder = spec.modalities[0].placeholder.resolve(model, case.tokens)
    pos = b.lengths[1] - 2  # a text token of sample 1's response
    fixed = dict(b.kwargs, input_ids=b.input_ids.clone())
    fixed["input_ids"][1, pos] = spec.text.resolve(model, case.tokens)
    b.kwargs["input_ids"][1, pos] = placeholder
    b.kwargs["labels"] = response(b)
    out, res = guarded(name, model, b, GuardConfig(policy="drop"))
    assert res.report.actions == ("keep", "keep")
    assert res.report.generated == ((1, (pos,)),)
    torch.testing.assert_close(out.logits, logits(model, fixed), atol=1e-6, rtol=1e-6)


# ---- faults: the shared ones on every family, then each family's own ----


@dataclass(frozen=True)
class Fault:
    """samples: the batch (fault injected with ``Media(..., n=k)``); None: the shared fault
    ``name`` of ``tests/test_check_batch.py`` injected into the family's three aligned samples;
    bad: the sample that must be named (and dropped), or the set of samples that must be,
    exactly; ``swap``: items exchanged (``make_batch(swap=)``); ``item``: what the raise names
    on the first bad sample's line."""

    name: str
    samples: list | None
    bad: int | frozenset
    swap: tuple[int, int] | None = None
    item: str | None = None

    def check(self, got: set[int]) -> None:
        if isinstance(self.bad, int):
            assert self.bad in got, got
        else:
            assert got == self.bad, got

    def batch(self, case, F, model) -> tuple[list, object]:
        """(samples, batch) of the row."""
        samples = self.samples
        if samples is None:
            samples = faulty(F.make_batch(model, case.samples), case.samples, FAULTS[self.name])
        kw = BATCH_KW.get((case.family, self.name), {})
        return samples, F.make_batch(model, samples, swap=self.swap, **kw)


K01 = frozenset({0, 1})
FAMILY_FAULTS = {
    # pan-and-scan: sample 1's first run short, its crops' runs after it
    "gemma3": (Fault("short run before its crops", [[img(20, 64)], [img(20, 64, n=3)]], 1),),
    "ernie4_5_vl": (
        Fault("swap", [[img(2, 2), img(4, 6)], [img(8, 4)], [img(2, 4)]], 1, (1, 2)),
        Fault("video +k/-k", [[vid(2, 4, 4, n=5)], [vid(4, 2, 4, n=3)], [vid(2, 2, 4)]], 0),
        Fault("mixed batch, video short", [[img(4, 4)], [vid(2, 4, 4, n=3), img(2, 2)]], 1),
    ),
    "glm4v": (
        Fault("swap", [[img(2, 2), img(4, 6)], [img(8, 4)], [img(2, 4)]], 1, (1, 2)),
        Fault("video frame short", [[vid(2, 4, 4)], [vid(2, 4, 4, n=7)]], 1),
        Fault("mixed batch, image short", [[vid(2, 2, 4)], [img(4, 4, n=3), img(2, 2)]], 1),
    ),
    "mistral3": (
        Fault("surplus", [[img(28, 56)], [img(56, 84, n=7)]], 1),
        Fault("swap", [[img(56, 84)], [img(28, 28)], [img(28, 56)]], 0, (0, 1)),
    ),
    # a 56x56 image alone is 36 features (base 16 + 4 rows of 4 + 1 newline); one short image
    # of a two-image sample (base + 1 = 17) drops the whole sample; a kept two-image sample
    # beside a dropped one keeps its base + 1 counts
    "llava_onevision": (
        Fault("short video run", [[img(80, 80), vid(2)], [vid(2, n=8)]], 1),
        Fault("+k/-k videos", [[vid(2, n=10)], [vid(2, n=8)], [img(80, 80)]], 0),
        Fault("swap", [[img(56, 56)], [img(60, 130)], [img(80, 80)]], 0, (0, 1)),
        Fault("multi-image one short", [[img(56, 56), img(100, 40, n=16)], [img(80, 80)]], 0),
        Fault("beside a multi-image", [[img(56, 56, n=35)], [img(56, 56), img(100, 40)]], 0),
    ),
    # items from set_items (family_checks.internvl_items); unguarded, silent
    # (tests/test_fixture_plain.py): both samples named and dropped
    "internvl": (
        Fault(
            "+k/-k image and video frame", [[img(56, 56, n=5)], [vid(2, n=7)], [img(56, 56)]], K01
        ),
        Fault("swap of tile counts", [[img(56, 112)], [img(56, 56)], [img(100, 40)]], K01, (0, 1)),
        Fault("swap image and video", [[img(56, 56)], [vid(3)], [img(56, 112)]], K01, (0, 1)),
    ),
    # unguarded, silent (tests/test_fixture_plain.py); both samples named and dropped
    "kimi_k25": (
        Fault("+k/-k video chunks", [[vid(6, 4, 4, n=9)], [vid(2, 4, 4, n=3)], [img(2, 2)]], K01),
        Fault("swap of images", [[img(4, 4)], [img(2, 4)], [img(2, 2)]], K01, (0, 1)),
        Fault("swap of videos", [[vid(2, 4, 4)], [vid(2, 2, 4)], [img(2, 2)]], K01, (1, 2)),
    ),
    # an aligned bystander of the row's modality beside every fault
    "nemotron_omni": (
        Fault("swap", [[img(4, 4)], [img(2, 2)], [img(2, 4)]], 0, (0, 1)),
        Fault("video tubelet short", [[vid(4, 4, 4)], [vid(4, 4, 4, n=7)], [vid(4, 4, 4)]], 1),
        Fault("audio short", [[aud(40)], [aud(40, n=2)], [aud(40)]], 1),
    ),
    "qwen2_audio": (
        Fault("surplus", [[aud(40)], [aud(100, n=26)], [aud(61)]], 1),
        Fault("swap", [[aud(100)], [aud(40)], [aud(61)]], 0, (0, 1)),
        # every run <= 1 placeholder: the plain model's legacy path would expand them silently
        Fault("runs cut to one", [[aud(100, n=1)], [aud(40)], [aud(61)]], 0),
    ),
    # the bystander (BY) after the faulty samples in every modality's consumption order; no
    # audio clip beside an image swap (audio is consumed first and would shift its indices)
    "qwen3_omni": (
        Fault("swap of images", [[img(4, 6)], [img(8, 4)], BY], 0, (0, 1)),
        Fault("+k/-k videos", [[vid(2, 4, 4, n=10)], [vid(3, 2, 4, n=4)], [*BY, aud(50)]], 0),
        Fault("short audio run", [[aud(100, n=10)], [aud(60)], [*BY, aud(50)]], 0),
        Fault("surplus audio run", [[aud(60)], [aud(100, n=16)], [*BY, aud(50)]], 1),
        Fault("+k/-k audio", [[aud(100, n=16)], [aud(60, n=5)], [*BY, aud(50)]], 0),
        Fault("swap of audio clips", [[aud(100)], [aud(60)], [*BY, aud(50)]], 0, (0, 1)),
        Fault(
            "audio fault beside an image",
            [[aud(100, n=10), img(2, 2)], [aud(60)], [*BY, aud(50)]],
            0,
        ),
    ),
}
# Qwen3-Omni's videos with their audio track (test_family_qwen3_omni), the item the raise names
# checked, an aligned bystander last
FAMILY_FAULTS["qwen3_omni"] += tuple(
    Fault(f"audio in video, {n}", [*s, [img(2, 4), vid(2, 2, 4, 150)]], frozenset(bad), swap, item)
    for n, s, bad, swap, item in AIV_FAULTS
)
FAULT_ROWS = [(f, Fault(x, None, frozenset(d))) for f in NAMES for x, d in FAULTS.items()] + [
    (f, x) for f, xs in FAMILY_FAULTS.items() for x in xs
]
FAULT_IDS = [f"{f}-{x.name}" for f, x in FAULT_ROWS]


@pytest.mark.parametrize("name,fault", FAULT_ROWS, ids=FAULT_IDS)
def test_a_fault_raises_naming_the_sample(name, fault, tmp_path):
    case, F, model = build(name)
    _, b = fault.batch(case, F, model)
    cfg = GuardConfig(policy="raise", log_dir=str(tmp_path))
    raised = raised_samples(lambda: guarded(name, model, b, cfg), fault.bad, tmp_path, fault.item)
    fault.check(raised)


@pytest.mark.parametrize("name,fault", FAULT_ROWS, ids=FAULT_IDS)
def test_a_fault_dropped_feeds_no_feature_and_keeps_the_others(name, fault):
    """The dropped rows reach the decoder as their own tokens' embeddings (and no deepstack
    rows), their labels ignored; every other sample equals its own forward; the loss stays
    finite."""
    case, F, model = build(name)
    samples, b = fault.batch(case, F, model)
    vocab = model.config.get_text_config().vocab_size
    labels = torch.where(b.input_ids < vocab, b.input_ids, -100)
    cfg = GuardConfig(policy="drop")
    decoder = attrgetter(case.decoder)(model)
    with spy(decoder) as (seen, _):
        emb, (out, res) = decoder_inputs(decoder, lambda: guarded(name, model, b, cfg, labels))
    deepstack = seen.get("visual_pos_masks")
    dropped = {s for s, a in enumerate(res.report.actions) if a == "drop"}
    fault.check(dropped)
    assert len(dropped) < len(samples)
    ids, spec = b.input_ids, find_family(model)[1]
    if spec.apply == "inputs":  # the model embeds a dropped sample's placeholders as text
        ph = torch.tensor([m.placeholder.resolve(model, case.tokens) for m in spec.modalities])
        ids = ids.masked_fill(torch.isin(ids, ph), spec.text.resolve(model, case.tokens))
    text = (case.embed or (lambda m, ids: m.get_input_embeddings()(ids)))(model, ids)
    for k in range(len(samples)):
        if k in dropped:
            assert torch.equal(emb[k], text[k])
            assert deepstack is None or not deepstack[k].any()
            assert (res.labels[k] == -100).all()
        else:
            want = own_logits(F, model, samples[k], **BATCH_KW.get((name, fault.name), {}))
            torch.testing.assert_close(out.logits[k, : b.lengths[k]], want, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out.loss)


# ---- docs/FAMILIES.md's capability table is this table and the registry ----


def capability_rows() -> dict[str, tuple[str, ...]]:
    """family -> (install_vlm, check_batch, repair, keep_tower, Bridge), as the table says;
    keep_tower is no part of megatron-core's merges' contract ("-")."""
    yes = {True: "yes", False: "no"}
    return {
        **{c.family: (c.cls, yes[c.family in BATCH_CASES], yes[c.repair], "yes",
                      c.bridge_cls or "no") for c in CASES.values()},
        "llava": ("install_llava (megatron-core LLaVAModel)", "no", "no", "-", "yes"),
        "mimo": ("install_mimo (megatron-core MimoModel)", "no", "no", "-", "no"),
    }  # fmt: skip


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


#: family -> (name, samples): the family's other aligned batches (ragged, text-only samples,
#: edge counts), as rows of the same test
FAMILY_ALIGNED = {
    # images beside videos: each sample as its features placed by hand (family_checks)
    "nemotron_omni": (
        ("image and video in one sample", [[img(2, 4), vid(4, 4, 4)], [img(4, 4)]]),
        ("video then image", [[vid(4, 4, 4), img(2, 4)], [aud(40), img(4, 4)]]),
        ("every modality, one clip", [[img(4, 4)], [vid(4, 4, 4)], [aud(40), img(2, 4)]]),
    ),
    "glm4v": (
        ("image then video, equal runs", [[img(4, 4), vid(2, 4, 4)], [vid(2, 4, 4), img(4, 4)]]),
    ),
    "gemma3": (("pan-and-scan crops", [[img(40, 30), img(32, 32)], [img(20, 64)]]),),
    "llava_onevision": (
        ("multi-image and single", [[img(56, 56), img(100, 40)], [img(80, 80)]]),
        ("text-only sample", [[], [img(130, 60)]]),
    ),
    "internvl": (
        ("videos (a tile per frame)", [[vid(3)], [vid(2)]]),
        ("image and video", [[img(56, 112), vid(3)], [img(56, 56), img(100, 40)]]),
    ),
    "mistral3": (
        ("ragged, a text-only sample", [[img(28, 28), img(84, 84)], [], [img(56, 28)]]),
        ("two in one sample", [[], [img(112, 56), img(28, 56)]]),
    ),
    # videos with their audio track (3 and 2 grids, 400 and 230 mel frames): 5 and 3 runs
    "qwen3_omni": (
        ("two videos with their audio", [[vid(3, 4, 4, 400)], [vid(2, 4, 4, 230)]]),
        ("beside a plain image and a plain clip", [[vid(3, 4, 4, 400)], [img(2, 2), aud(100)]]),
        (
            "a plain clip and an image around a video with its audio",
            [[aud(60), vid(2, 4, 4, 230), img(2, 4)], [vid(3, 4, 4, 400)]],
        ),
    ),
    "qwen2_audio": (
        ("zero-feature clip", [[aud(2), aud(100)], [aud(9)]]),  # L=2: bos/eos, no placeholder
        ("one feature per clip (plain: legacy path)", [[aud(3)], [aud(4), aud(5)]]),
        ("full 30 s clip", [[aud(3000)], [aud(41)]]),
    ),
}
ALIGNED_ROWS = TRANSFER_ROWS + [(f, n, s) for f, xs in FAMILY_ALIGNED.items() for n, s in xs]


#: (family, mix) where the plain model does not give each sample its own forward (measured):
#: Nemotron's Parakeet encoder on a 40-frame clip padded to 60 frames
NOT_OWN = {("nemotron_omni", "audio"), ("nemotron_omni", "video + audio")}

#: (family, row) -> the fixture's ``make_batch`` keywords for that aligned or faulty batch
BATCH_KW = {
    ("gemma3", "pan-and-scan crops"): {"pan_and_scan": True},
    ("gemma3", "short run before its crops"): {"pan_and_scan": True},
}


def aligned_transfers(name: str, samples, own: bool = True, **kw) -> tuple[int, dict]:
    """(transfers, by reason) of one aligned call of ``samples`` (``kw``: the fixture's
    ``make_batch`` keywords) under ``install_vlm``; the call must keep every sample, be the
    plain forward bit for bit where the plain model takes the batch, and (``own``) give each
    sample its own forward (``own_logits``: by hand where the plain model cannot take it)."""
    _case, F, model = build(name)
    b = F.make_batch(model, samples, **kw)
    with count_transfers() as n:
        out, res = guarded(name, model, b)
    assert res.report.actions == ("keep",) * len(samples)
    plain = _outcome(model, b.kwargs)  # GLM-4V's, Nemotron's take no image beside a video
    if isinstance(plain, torch.Tensor):
        assert torch.equal(out.logits, plain)
    for k, s in enumerate(samples if own else ()):
        want = own_logits(F, model, s, **kw)
        torch.testing.assert_close(out.logits[k, : b.lengths[k]], want, atol=1e-5, rtol=0)
    return sum(n.values()), dict(n)


@pytest.mark.parametrize(
    "name,mix,samples", ALIGNED_ROWS, ids=[f"{f}-{m}" for f, m, _ in ALIGNED_ROWS]
)
def test_an_aligned_call_of_any_modality_mix_makes_one_transfer(name, mix, samples):
    """Mixed image + video + audio calls included: the plain forward bit for bit, each sample
    its own (``aligned_transfers``); the verdict is the one transfer, the run order, the audio
    clips' counts and the family's own refusals ride in it."""
    kw = BATCH_KW.get((name, mix), {})
    n, reasons = aligned_transfers(name, samples, (name, mix) not in NOT_OWN, **kw)
    assert n == 1, reasons
    assert reasons["aligned-path verdict"] == 1, reasons


def test_every_family_with_mixed_batches_has_transfer_rows():
    """Every embed family that takes several modalities has a row mixing them."""
    for s in FAMILIES:
        if s.apply == "embed" and len(s.modalities) > 1:
            mixes = [m for m, _ in TRANSFER_MIXES[s.name]]
            assert any("+" in m for m in mixes), s.name
