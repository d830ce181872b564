"""The plain transformers class of every family fixture (tiny random config, CPU), unguarded, as
measured: one table per behaviour the guard exists for, one row per family x batch.

- ``RAISES``: a fault the plain model catches, with its message (never naming a sample);
- ``SILENT``: a fault it runs through silently: the merged embeddings show another sample's
  feature in the victim's row (where the rig reads the features), or the victim's output
  differs from its own aligned forward (past its first placeholder, the ids before it agreeing);
- ``LAYOUTS``: the batch a fixture builds, as its processor lays it out.

Aligned batches (each sample its own forward): ``tests/families/test_contract.py``; each
family's own oracles: ``tests/test_family_<family>.py``, ``tests/test_fixture_<family>.py``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from family_checks import aud, decoder_inputs, img, logits, vid
from test_check_batch import fixture as check_batch_fixture

from megatron_media_guard.errors import MediaInputError
from megatron_media_guard.testing.families.base import Media

pytest.importorskip("transformers")
pytest.importorskip("PIL")
pytestmark = pytest.mark.timeout(120)


def _logits(model, b):
    return logits(model, b.kwargs)


def _hidden(model, b):
    """Final hidden states of ``model.model`` (the logits are ``lm_head`` of them, whose wide
    vocabulary costs most of the CPU time)."""
    with torch.no_grad():
        return model.model(**b.kwargs).last_hidden_state


def _pooled(method: str, *keys: str, on_model: bool = False, **named: str) -> Callable:
    """The features of the inner model's (``on_model``: the model's) own ``method`` on the
    inputs ``keys`` and ``named`` (``{parameter: key}``): its items' ``pooler_output`` back to
    back."""

    def feats(model, kw, _items):
        m = model if on_model else model.model
        out = getattr(m, method)(*(kw[k] for k in keys), **{p: kw[k] for p, k in named.items()})
        return torch.cat(list(out.pooler_output))

    return feats


def _qwen3_omni_audio(model, kw, _items):
    mask = kw["feature_attention_mask"]
    return model.model.get_audio_features(kw["input_features"], mask).last_hidden_state


def _qwen2_audio(model, kw, items):
    """The projector's rows of each clip, cut to the clip's feature count."""
    seen = []
    hook = model.model.multi_modal_projector.register_forward_hook(
        lambda m, a, o: seen.append(o.detach())
    )
    try:
        model.model(**kw)
    finally:
        hook.remove()
    return torch.cat([seen[0][q][:n] for q, (_, _, n) in enumerate(items)])


IMAGES = _pooled("get_image_features", "pixel_values", "image_grid_thw")
VIDEOS = _pooled("get_video_features", "pixel_values_videos", "video_grid_thw")


@dataclass(frozen=True)
class Rig:
    """How one fixture's plain model runs. out(model, batch): the per-position outputs compared;
    pads: modality -> the fixture's constant naming its placeholder id (default: the config's
    ``<modality>_token_id``); feats: modality -> (model, kwargs, items) -> the features the
    plain merge places, in item order (none: not read for this family)."""

    fixture: str
    out: Callable = _logits
    pads: dict | None = None
    feats: dict = field(default_factory=dict)

    @property
    def F(self):
        return importlib.import_module(f"megatron_media_guard.testing.families.{self.fixture}")

    def pad(self, model, mod: str) -> int:
        if self.pads is None:
            return getattr(model.config, f"{mod}_token_id")
        return getattr(self.F, self.pads[mod])


IMAGE = {"image": "IMAGE", "video": "IMAGE"}
RIGS = {
    r.fixture: r
    for r in [
        Rig("gemma3", _hidden, IMAGE),
        Rig("internvl", _hidden, IMAGE),
        Rig("nemotron_omni", pads={**IMAGE, "audio": "SO_EMBED"}, feats={"image": _pooled(
            "get_image_features", "pixel_values", "image_grid_hw", on_model=True)}),
        Rig("ernie4_5_vl"),
        Rig("glm4v"),
        Rig("kimi_k25", feats={"image": IMAGES,  # its videos through the image tower too
            "video": _pooled("get_image_features", "pixel_values_videos", "video_grid_thw")}),
        Rig("qwen3_omni", feats={"image": IMAGES, "video": VIDEOS, "audio": _qwen3_omni_audio}),
        Rig("mistral3", feats={"image": _pooled(
            "get_image_features", pixel_values="pixel_values", image_sizes="image_sizes")}),
        Rig("llava_onevision", _hidden, feats={
            "image": _pooled("get_image_features", "pixel_values", "image_sizes",
                             batch_num_images="batch_num_images"),
            "video": _pooled("get_video_features", "pixel_values_videos")}),
        Rig("qwen2_audio", _hidden, feats={"audio": _qwen2_audio}),
        Rig("qwen3_5", _hidden, {"image": "IMAGE", "video": "VIDEO"}),
    ]
}  # fmt: skip


def model_of(fixture: str):
    """The fixture's tiny model (seed 0), built once per session (test_check_batch's)."""
    return check_batch_fixture("qwen_vl" if fixture == "qwen3_5" else fixture)[2]


def own(rig: Rig, model, sample) -> torch.Tensor:
    """The sample, aligned, in a batch of its own: its outputs over its length."""
    b = rig.F.make_batch(model, [[Media(m.modality, m.size) for m in sample]])
    return rig.out(model, b)[0, : b.lengths[0]]


WIDE, TALL, SQUARE = img(20, 64), img(40, 30), img(32, 32)  # Gemma 3
ONE, IWIDE, ITALL, IVID = img(56, 56), img(56, 112), img(100, 40), vid(3)  # InternVL
NA, NC, NV = img(4, 4), img(4, 6), vid(3, 4, 4)  # Nemotron Omni
AA, AB, AC = aud(40), aud(17), aud(25)
Q6, Q4, Q6T = img(64, 96), img(64, 64), img(96, 64)  # Qwen3.5: 6, 4 and 6 (transposed) tokens
QV8, QV6 = vid(4, 64, 64), vid(2, 64, 96)  # 2 groups of 4 tokens, 1 group of 6

ONE_ITEM = {"gemma3": [SQUARE], "internvl": [ONE], "llava_onevision": [img(100, 60)],
            "qwen2_audio": [aud(100)], "qwen3_5": [Q4]}  # fmt: skip


@pytest.mark.parametrize("family", [f for f, r in RIGS.items() if r.out is _hidden])
def test_the_logits_are_lm_head_of_the_hidden_states_compared(family):
    rig, model = RIGS[family], model_of(family)
    b = rig.F.make_batch(model, [ONE_ITEM[family]])
    with torch.no_grad():
        want = model.lm_head(rig.out(model, b))
    torch.testing.assert_close(_logits(model, b), want)


# ---- unguarded: raises ------------------------------------------------------------------------


def _mistral3_total(b, model) -> str:
    """Mistral 3's message counts features x hidden."""
    n_tok = sum(n for r in b.runs for _, n in r)
    n_feat = sum(n for _, _, n in b.items) * model.config.text_config.hidden_size
    return f"tokens: {n_tok}, features: {n_feat}$"


def _glm4v_both_masks(b, _model) -> str:
    """GLM-4V's masks are both ``input_ids == image_token_id``: the image merge counts frames."""
    n_img = sum(n for _, m, n in b.items if m == "image")
    n_all = sum(n for _, _, n in b.items)
    return f"Image features and image tokens do not match, tokens: {n_all}, features: {n_img}"


@dataclass(frozen=True)
class Raises:
    """samples (faults injected with ``Media(..., n=k)``), swapped items, the error and its
    message (a regex, or built from the batch and model); ``without``: a key the collate left
    out of the batch."""

    family: str
    name: str
    samples: list
    error: type
    match: str | Callable
    swap: tuple[int, int] | None = None
    without: str | None = None


ROPE = r"shape mismatch: value tensor of shape \[3, \d+\] cannot be broadcast"
IMG_MSG = "Image features and image tokens do not match, tokens: {}, features: {}"
NEMO = r"Got {} feature vectors for {} placeholder tokens"
RAISES = [
    Raises("gemma3", "short run", [[img(32, 32, n=3)]], ValueError, IMG_MSG.format(3, 4)),
    Raises("gemma3", "long run", [[img(32, 32, n=5)]], ValueError, IMG_MSG.format(5, 4)),
    Raises("internvl", "short image", [[img(56, 56, n=3)]], ValueError, IMG_MSG.format(3, 4)),
    Raises("internvl", "surplus video", [[vid(3, n=13)]], ValueError, IMG_MSG.format(13, 12)),
    Raises("nemotron_omni", "short image run", [[img(4, 4, n=3)]], ValueError,
           NEMO.format(4, 3) + r" \(id 5\)"),
    Raises("nemotron_omni", "short video run", [[vid(4, 4, 4, n=7)]], ValueError,
           NEMO.format(8, 7) + r" \(id 5\)"),
    Raises("nemotron_omni", "short audio run", [[aud(40, n=5)]], ValueError,
           NEMO.format(6, 5) + r" \(id 8\)"),
    Raises("nemotron_omni", "surplus image run", [[img(4, 4, n=5)]], ValueError, NEMO.format(4, 5)),
    # both merges count every image-token position: the image merge sees 4 + 8 placeholders
    Raises("nemotron_omni", "aligned image and video, two samples", [[NA], [NV]], ValueError,
           NEMO.format(4, 12) + r" \(id 5\)"),
    Raises("nemotron_omni", "aligned image and video, one sample", [[NA, NV]], ValueError,
           NEMO.format(4, 12) + r" \(id 5\)"),
    Raises("ernie4_5_vl", "short run", [[img(4, 6, n=5)], [img(8, 4)]], ValueError,
           "tokens: 13, features: 14"),
    Raises("ernie4_5_vl", "short video run", [[vid(2, 4, 4, n=3)]], ValueError,
           "Video features and video tokens do not match"),
    Raises("ernie4_5_vl", "+k/-k images", [[img(4, 6, n=8)], [img(8, 4, n=6)]], RuntimeError, ROPE),
    Raises("ernie4_5_vl", "+k/-k videos", [[vid(2, 4, 4, n=6)], [vid(4, 2, 4, n=2)]],
           RuntimeError, ROPE),
    Raises("ernie4_5_vl", "swap of different counts", [[img(4, 6)], [img(8, 4), img(2, 2)]],
           RuntimeError, ROPE, (0, 1)),
    Raises("glm4v", "short run", [[img(4, 6, n=5)], [img(8, 4)]], ValueError,
           "tokens: 13, features: 14"),
    Raises("glm4v", "+k/-k images", [[img(4, 6, n=8)], [img(8, 4, n=6), img(2, 2)]],
           RuntimeError, ROPE),
    Raises("glm4v", "+k/-k videos", [[vid(2, 4, 4, n=10)], [vid(3, 2, 4, n=4)]], RuntimeError,
           ROPE),
    Raises("glm4v", "swap of different counts", [[img(4, 6)], [img(8, 4), img(2, 2)]],
           RuntimeError, ROPE, (0, 1)),
    Raises("glm4v", "aligned image and video across samples",
           [[vid(2, 2, 4)], [img(4, 4), img(2, 2)]], ValueError, _glm4v_both_masks),
    Raises("glm4v", "aligned image and video in one sample", [[img(4, 4), vid(2, 4, 4)]],
           ValueError, _glm4v_both_masks),
    Raises("kimi_k25", "short run", [[img(4, 6, n=5)], [img(8, 4)]], ValueError,
           IMG_MSG.format(13, 14)),
    Raises("qwen3_omni", "short image run", [[img(4, 6, n=5)], [img(8, 4)]], ValueError,
           "tokens: 13, features: 14"),
    Raises("qwen3_omni", "surplus audio run", [[aud(100, n=16)], [aud(60)]], RuntimeError,
           "source < number of ones in mask"),
    # with a grid present get_rope_index walks the audio runs by feature length and trips
    Raises("qwen3_omni", "short audio run beside an image", [[aud(100, n=10), img(2, 2)],
           [aud(60)]], ValueError, "151652 is not in list"),
    Raises("qwen3_omni", "+k/-k audio beside an image", [[aud(100, n=16), img(2, 2)],
           [aud(60, n=5)]], RuntimeError, r"shape mismatch: value tensor of shape \[3, 16\]"),
    Raises("mistral3", "short run", [[img(56, 84, n=5)]], ValueError, _mistral3_total),
    Raises("mistral3", "short in one sample of two", [[img(56, 84)], [img(28, 56, n=1)]],
           ValueError, _mistral3_total),
    Raises("mistral3", "surplus", [[img(56, 84, n=7)]], ValueError, _mistral3_total),
    Raises("llava_onevision", "short image run", [[img(100, 60, n=55)]], ValueError,
           IMG_MSG.format(55, 56) + "$"),
    Raises("llava_onevision", "surplus image run", [[img(100, 60, n=57)]], ValueError,
           "tokens: 57, features: 56$"),
    Raises("llava_onevision", "short video run", [[vid(2, n=8)]], ValueError,
           "Video features and video tokens do not match, tokens: 8, features: 9$"),
    Raises("llava_onevision", "surplus video beside an image", [[img(100, 60), vid(2, n=10)]],
           ValueError, "Video features .* tokens: 10, features: 9$"),
    # an aligned multi-image sample: without batch_num_images its images get anyres counts
    Raises("llava_onevision", "no batch_num_images", [[img(30, 300), img(56, 56)],
           [img(200, 200)]], ValueError, "Image features and image tokens do not match",
           without="batch_num_images"),
    Raises("qwen2_audio", "short run", [[aud(100, n=24)]], ValueError, "tokens: 24, features: 25$"),
    Raises("qwen2_audio", "surplus", [[aud(100, n=26)]], ValueError, "tokens: 26, features: 25$"),
    Raises("qwen2_audio", "short in one sample of two", [[aud(100)], [aud(40, n=7)]], ValueError,
           "tokens: 32, features: 35$"),
    # no placeholder at all takes the legacy path, which cannot count
    Raises("qwen2_audio", "legacy path, no placeholder", [[aud(100, n=0)]], ValueError,
           "The number of audio tokens is tensor"),
    Raises("qwen3_5", "short image run", [[img(64, 96, n=5)]], ValueError, IMG_MSG.format(5, 6)),
    Raises("qwen3_5", "short video run", [[vid(4, 64, 64, n=7)]], ValueError,
           "Video features and video tokens do not match, tokens: 7, features: 8"),
    # the merge passes (totals agree); get_rope_index then lays a grid's positions over a run
    # of another length
    Raises("qwen3_5", "+k/-k images", [[img(64, 96, n=8)], [img(64, 64, n=2)]], RuntimeError,
           ROPE + " to indexing result"),
    Raises("qwen3_5", "+k/-k video groups", [[vid(4, 64, 64, n=9)], [vid(4, 64, 64, n=7)]],
           RuntimeError, ROPE),
    Raises("qwen3_5", "swap images of different size", [[Q6], [Q4]], RuntimeError, ROPE, (0, 1)),
    Raises("qwen3_5", "swap videos of different size", [[QV8], [QV6]], RuntimeError, ROPE, (0, 1)),
]  # fmt: skip


@pytest.mark.parametrize("row", RAISES, ids=[f"{r.family}-{r.name}" for r in RAISES])
def test_unguarded_fault_raises_naming_no_sample(row):
    rig, model = RIGS[row.family], model_of(row.family)
    b = rig.F.make_batch(model, row.samples, swap=row.swap)
    b.kwargs.pop(row.without, None)
    match = row.match if isinstance(row.match, str) else row.match(b, model)
    with pytest.raises(row.error, match=match) as info:
        rig.out(model, b)
    assert "sample" not in str(info.value)


# ---- unguarded: silent ------------------------------------------------------------------------


@dataclass(frozen=True)
class Silent:
    """victim: the sample whose row receives another sample's features; modality: the
    placeholders read where the rig reads features; every: every sample's output differs from
    its own (else the victim's, past its first placeholder, the ids before agreeing); short:
    fewer placeholders than features, nothing raised."""

    family: str
    name: str
    samples: list
    swap: tuple[int, int] | None = None
    victim: int = 0
    modality: str | None = None
    every: bool = False
    short: bool = False


SILENT = [
    # sample 0's surplus takes image 1's first 2 features; sample 1's 2 placeholders its last 2
    Silent("gemma3", "+k/-k", [[img(32, 32, n=6)], [img(20, 64, n=2)]], victim=1),
    Silent("gemma3", "swap between samples", [[TALL, SQUARE], [WIDE]], (0, 2)),
    Silent("gemma3", "swap within a sample", [[TALL, SQUARE]], (0, 1)),
    Silent("internvl", "+k/-k images", [[img(56, 56, n=6)], [img(56, 112, n=10)]], victim=1),
    Silent("internvl", "+k/-k image/video frame", [[img(56, 56, n=8)], [vid(3, n=8)]], victim=1),
    Silent("internvl", "swap images of different tile counts", [[IWIDE], [ITALL]], (0, 1)),
    Silent("internvl", "swap image and video", [[IWIDE], [IVID]], (0, 1)),
    # sample 0's two surplus placeholders hold sample 1's first two image features
    Silent("nemotron_omni", "+k/-k images", [[img(4, 4, n=6)], [img(4, 6, n=4)]],
           modality="image"),
    Silent("nemotron_omni", "+k/-k audio", [[aud(40, n=8)], [aud(25, n=2)]], victim=1),
    Silent("nemotron_omni", "+k/-k video tubelets", [[vid(4, 4, 4, n=9)], [vid(4, 4, 4, n=7)]],
           victim=1),
    Silent("nemotron_omni", "swap images of different size", [[NA], [NC]], (0, 1)),
    Silent("nemotron_omni", "swap audio clips of different length", [[AA], [AC]], (0, 1)),
    Silent("nemotron_omni", "swap equal-shape videos", [[NV], [AB, NV]], (0, 1)),
    # a 4x6 and a 6x4 grid (6 tokens each): rope and the merge see equal counts
    Silent("ernie4_5_vl", "swap of equal counts", [[img(4, 6)], [img(6, 4)]], (0, 1), every=True),
    Silent("glm4v", "swap of equal counts", [[img(4, 6)], [img(6, 4)]], (0, 1), every=True),
    Silent("qwen3_5", "swap of equal counts", [[Q6], [Q6T]], (0, 1), every=True),
    Silent("kimi_k25", "+k/-k images", [[img(4, 6, n=8)], [img(8, 4, n=6)]], modality="image"),
    Silent("kimi_k25", "+k/-k videos", [[vid(6, 4, 4, n=10)], [vid(3, 2, 4, n=0)]],
           modality="video"),
    Silent("kimi_k25", "swap of images", [[img(4, 6)], [img(8, 4)]], (0, 1), modality="image",
           every=True),
    Silent("kimi_k25", "swap of videos", [[vid(6, 4, 4)], [vid(3, 2, 4)]], (0, 1),
           modality="video", every=True),
    Silent("qwen3_omni", "+k/-k images", [[img(4, 6, n=8)], [img(8, 4, n=6)]], modality="image"),
    Silent("qwen3_omni", "+k/-k videos", [[vid(2, 4, 4, n=10)], [vid(3, 2, 4, n=4)]],
           modality="video"),
    Silent("qwen3_omni", "swap of images", [[img(4, 6)], [img(8, 4)]], (0, 1), modality="image",
           every=True),
    Silent("qwen3_omni", "short audio run (no count check)", [[aud(100, n=10)], [aud(60)]],
           victim=1, modality="audio", short=True),
    Silent("qwen3_omni", "+k/-k audio", [[aud(100, n=16)], [aud(60, n=5)]], modality="audio"),
    Silent("qwen3_omni", "swap of audio clips", [[aud(100)], [aud(60)]], (0, 1),
           modality="audio", every=True),
    # sample 0: 6 features, 6 + k placeholders; sample 1: 6 features, 6 - k placeholders
    *(Silent("mistral3", f"+{k}/-{k}", [[img(56, 84, n=6 + k)], [img(84, 56, n=6 - k)]],
             modality="image") for k in (1, 2)),
    Silent("mistral3", "swap", [[img(56, 84)], [img(28, 56)]], (0, 1), modality="image",
           every=True),
    *(Silent("llava_onevision", f"+{k}/-{k} images",
             [[img(100, 60, n=56 + k)], [img(200, 200, n=172 - k)]], modality="image")
      for k in (1, 5)),
    Silent("llava_onevision", "+k/-k videos", [[vid(2, n=10)], [vid(2, n=8)]], modality="video"),
    # 56 and 66 features: sample 0's run takes the other image's first 56 rows, sample 1 the rest
    Silent("llava_onevision", "swap", [[img(100, 60)], [img(30, 300)]], (0, 1), victim=1,
           modality="image", every=True),
    *(Silent("qwen2_audio", f"+{k}/-{k}", [[aud(100, n=25 + k)], [aud(40, n=10 - k)]],
             modality="audio") for k in (1, 3)),
    Silent("qwen2_audio", "swap", [[aud(100)], [aud(40)]], (0, 1), modality="audio", every=True),
]  # fmt: skip


def _placed(rig: Rig, model, b, modality: str) -> list[tuple[int, int]]:
    """Per placeholder (row-major, as ``masked_scatter`` fills them): (its sample, the sample
    owning the feature put there), after checking that the merged embeddings are exactly the
    features in item order."""
    kw = b.kwargs
    lm = getattr(model, "model", model).language_model
    emb, _ = decoder_inputs(lm, lambda: rig.out(model, b))
    with torch.no_grad():
        feats = rig.feats[modality](model, kw, b.items)
    where = kw["input_ids"] == rig.pad(model, modality)
    n = int(where.sum())
    torch.testing.assert_close(emb[where], feats[:n], atol=1e-6, rtol=0)
    owners = [s for s, m, c in b.items if m == modality for _ in range(c)][:n]
    return list(zip(where.nonzero()[:, 0].tolist(), owners))


def _first_differs(rig: Rig, model, b, out, row: Silent) -> None:
    """The victim's ids agree with its aligned own batch's on a prefix covering part of its
    run; its outputs agree before its first placeholder and differ after it."""
    v = row.victim
    ref_b = rig.F.make_batch(model, [[Media(m.modality, m.size) for m in row.samples[v]]])
    ref = rig.out(model, ref_b)[0]
    a, r = b.input_ids[v], ref_b.input_ids[0]
    n = min(len(a), len(r))
    diff = (a[:n] != r[:n]).nonzero()
    same = int(diff[0]) if len(diff) else n
    first = int((r == rig.pad(model, row.samples[v][-1].modality)).nonzero()[0])
    assert same > first
    torch.testing.assert_close(out[v, :first], ref[:first], atol=1e-5, rtol=0)
    assert (out[v, first:same] - ref[first:same]).abs().max() > 1e-3


@pytest.mark.parametrize("row", SILENT, ids=[f"{r.family}-{r.name}" for r in SILENT])
def test_unguarded_fault_runs_silently_with_features_in_the_wrong_sample(row):
    rig, model = RIGS[row.family], model_of(row.family)
    b = rig.F.make_batch(model, row.samples, swap=row.swap)
    out = rig.out(model, b)  # no error
    if row.modality is not None:
        rows = _placed(rig, model, b, row.modality)
        assert any(s == row.victim and owner != row.victim for s, owner in rows)
        if row.short:  # the last clip's tail rows are dropped, nothing raised
            assert len(rows) < sum(c for _, m, c in b.items if m == row.modality)
    if row.every:
        for k, sample in enumerate(row.samples):
            assert not torch.allclose(out[k, : b.lengths[k]], own(rig, model, sample), atol=1e-3)
    elif row.modality is None:
        _first_differs(rig, model, b, out, row)


# ---- layouts ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """The batch ``make_batch`` gives ``samples``: its items and runs; kwargs values
    (``.tolist()``), shapes and dtypes; counts: (kwargs key, value, n) with ``n`` positions of
    row ``row`` (None: every row) equal to ``value`` (an int, ``"cfg.<attr>"`` of the model's
    config or ``"F.<name>"`` of the fixture); types: (kwargs key, value, id): the key equals
    value exactly where the ids are id; keys: every kwargs key, where given."""

    family: str
    samples: list
    items: list
    runs: list
    values: dict = field(default_factory=dict)
    shapes: dict = field(default_factory=dict)
    counts: tuple = ()
    dtypes: dict = field(default_factory=dict)
    row: int | None = 0
    keys: frozenset | None = None
    types: tuple = ()


LAYOUTS = [
    Layout("ernie4_5_vl", [[img(4, 6), vid(2, 2, 4)], [img(2, 2)]],
           [(0, "image", 6), (1, "image", 1), (0, "video", 2)],
           [[("image", 6), ("video", 2)], [("image", 1)]],
           {"image_grid_thw": [[1, 4, 6], [1, 2, 2]], "video_grid_thw": [[2, 2, 4]]},
           {"pixel_values": (24 + 4, "F.PATCH_DIM"), "pixel_values_videos": (16, "F.PATCH_DIM")},
           (("input_ids", "cfg.video_token_id", 2), ("mm_token_type_ids", 2, 2),
            ("moe_mm_token_type_ids", 2, 4),  # start + 2 placeholders + end
            *(("input_ids", f"cfg.{m}_{e}_token_id", 1) for m in ("image", "video")
              for e in ("start", "end")))),
    Layout("glm4v", [[img(4, 6), vid(2, 2, 4)], [img(2, 2)]],
           [(0, "image", 6), (1, "image", 1), (0, "video", 4)],
           [[("image", 6), ("video", 2), ("video", 2)], [("image", 1)]],
           {"image_grid_thw": [[1, 4, 6], [1, 2, 2]], "video_grid_thw": [[2, 2, 4]]},
           {"pixel_values": (24 + 4, "F.PATCH_DIM"), "pixel_values_videos": (16, "F.PATCH_DIM")},
           (("input_ids", "cfg.image_token_id", 10), ("mm_token_type_ids", 2, 4),
            ("input_ids", "cfg.image_start_token_id", 3), ("input_ids", "cfg.video_token_id", 0),
            ("input_ids", "cfg.video_start_token_id", 1), ("input_ids", "cfg.video_end_token_id", 1)),
           {"pixel_values": torch.float32}),
    Layout("qwen3_omni", [[img(4, 6), aud(230)], [vid(2, 2, 4), aud(60)]],
           [(0, "audio", 30), (1, "audio", 8), (0, "image", 6), (1, "video", 4)],
           [[("image", 6), ("audio", 30)], [("video", 4), ("audio", 8)]],
           {"image_grid_thw": [[1, 4, 6]], "video_grid_thw": [[2, 2, 4]],
            "video_second_per_grid": [2.0], "feature_attention_mask": [[1] * 230, [1] * 60 + [0] * 170]},
           {"pixel_values": (24, "F.PATCH_DIM"), "pixel_values_videos": (16, "F.PATCH_DIM"),
            "input_features": (2, 128, 230)},
           (("input_ids", "F.VISION_START", 2), ("input_ids", "F.VISION_END", 2),
            ("input_ids", "cfg.audio_start_token_id", 2), ("input_ids", "F.AUDIO_END", 2)),
           {"feature_attention_mask": torch.int32}, row=None),
    Layout("kimi_k25", [[img(4, 6), vid(9, 2, 4)], [img(2, 2)]],
           [(0, "image", 6), (1, "image", 1), (0, "video", 6)],
           [[("image", 6), ("video", 2), ("video", 2), ("video", 2)], [("image", 1)]],
           # a video is chunks of <= 4 frames, time-pooled: one grid row and one run each
           {"image_grid_thw": [[1, 4, 6], [1, 2, 2]],
            "video_grid_thw": [[4, 2, 4], [4, 2, 4], [1, 2, 4]]},
           {"pixel_values": (28, 3, 14, 14), "pixel_values_videos": (72, 3, 14, 14)},
           (("input_ids", "cfg.vision_start_token_id", 4), ("input_ids", "F.MEDIA_CONTENT", 4),
            ("input_ids", "cfg.vision_end_token_id", 4))),
    Layout("nemotron_omni", [[NA, AA, NV], [NC, AC]],
           [(0, "image", 4), (1, "image", 6), (0, "video", 8), (0, "audio", 6), (1, "audio", 4)],
           [[("image", 4), ("audio", 6), ("video", 4), ("video", 4)], [("image", 6), ("audio", 4)]],
           {"image_grid_hw": [[4, 4], [4, 6]],
            "input_features_mask": [[True] * 40 + [False], [True] * 25 + [False] * 16]},
           {"pixel_values": (16 + 24, 768), "pixel_values_videos": (1, 2, 6, 64, 64),
            "input_features": (2, 41, "F.MEL")},
           # one <img> per image and per tubelet
           (("input_ids", "F.IMAGE", 4 + 6 + 8), ("input_ids", "F.SO_EMBED", 10),
            ("input_ids", "F.IMG_START", 4)),
           {"pixel_values": torch.float32, "input_features_mask": torch.bool}, row=None),
    # tiles: IWIDE 2 + thumbnail, IVID 3 frames, ONE 1, ITALL 3 + thumbnail; no tile counts
    Layout("internvl", [[IWIDE, IVID], [ONE, ITALL]],
           [(0, "image", 12), (0, "video", 12), (1, "image", 4), (1, "image", 16)],
           [[("image", 12), ("video", 4), ("video", 4), ("video", 4)],
            [("image", 4), ("image", 16)]],
           shapes={"pixel_values": (3 + 3 + 1 + 4, 3, "F.TILE", "F.TILE")},
           keys=frozenset({"input_ids", "attention_mask", "pixel_values"})),
    Layout("qwen3_5", [[Q6, QV8], [Q4]], [(0, "image", 6), (1, "image", 4), (0, "video", 8)],
           [[("image", 6), ("video", 4), ("video", 4)], [("image", 4)]],
           {"image_grid_thw": [[1, 4, 6], [1, 4, 4]], "video_grid_thw": [[2, 4, 4]]},
           {"pixel_values": (24 + 16, 3 * 2 * 16 * 16), "pixel_values_videos": (2 * 16, 1536)},
           # one vision start per image and per temporal group
           (("input_ids", "F.VISION_START", 4),), row=None,
           types=(("mm_token_type_ids", 1, "F.IMAGE"), ("mm_token_type_ids", 2, "F.VIDEO"))),
]  # fmt: skip


def _resolve(rig: Rig, model, v):
    if isinstance(v, str) and v.startswith("cfg."):
        return getattr(model.config, v[4:])
    if isinstance(v, str) and v.startswith("F."):
        return getattr(rig.F, v[2:])
    return v


@pytest.mark.parametrize("row", LAYOUTS, ids=[r.family for r in LAYOUTS])
def test_the_batch_is_laid_out_as_the_processor_lays_it(row):
    rig, model = RIGS[row.family], model_of(row.family)
    b = rig.F.make_batch(model, row.samples)
    kw = b.kwargs
    assert (b.items, b.runs) == (row.items, row.runs)
    assert {k: kw[k].tolist() for k in row.values} == row.values
    for key, shape in row.shapes.items():
        assert tuple(kw[key].shape) == tuple(_resolve(rig, model, n) for n in shape), key
    assert {k: kw[k].dtype for k in row.dtypes} == row.dtypes
    for key, value, n in row.counts:
        got = kw[key] if row.row is None else kw[key][row.row]
        assert int((got == _resolve(rig, model, value)).sum()) == n, (key, value)
    for key, value, tid in row.types:
        assert torch.equal(kw[key] == value, b.input_ids == _resolve(rig, model, tid)), key
    assert row.keys is None or set(kw) == row.keys


def test_the_qwen3_omni_fixture_counts_audio_as_the_model_does():
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        _get_feat_extract_output_lengths,
    )

    lengths = torch.tensor([1, 50, 60, 99, 100, 101, 230, 3000])
    want = [RIGS["qwen3_omni"].F.audio_tokens(int(n)) for n in lengths]
    assert _get_feat_extract_output_lengths(lengths).tolist() == want


REFUSED = [
    ("ernie4_5_vl", [[vid(3, 2, 2)]], ValueError, "even frame count"),
    ("nemotron_omni", [[NV], [vid(5, 4, 4)]], MediaInputError, "stack"),
]


@pytest.mark.parametrize("family,samples,error,match", REFUSED, ids=[r[0] for r in REFUSED])
def test_a_batch_the_processor_refuses_is_refused(family, samples, error, match):
    with pytest.raises(error, match=match):
        RIGS[family].F.make_batch(model_of(family), samples)
