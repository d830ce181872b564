"""install_vlm on Megatron-Bridge 0.6.2's real classes (their ``__init__`` and forward from the
wheel, CPU) of the engine families Bridge trains with one merge each: ``Gemma3VLModel``,
``Ministral3Model``, ``Qwen2AudioModel`` (Bridge merges audio whenever ``input_features`` is
given: the guard passes it as None), ``KimiK25VLModel`` (``hf_model_path`` a local directory,
``testing/bridge_models_kimi.py``, its remote code loaded through
``get_class_from_dynamic_module``) and the M-RoPE classes ``GLM45VModel`` and ``Ernie45VLModel``
(Bridge computes its M-RoPE from ``input_ids``, ``mm_token_type_ids`` and the grids). The
language model is a tiny stand-in (megatron-core's GPTModel attention needs CUDA), the provider
config a stand-in with the attributes each class reads.

Bridge checks only the batch total before its ``masked_scatter``: +k/-k runs silently unguarded
(on the M-RoPE classes it then fails in their rope with a shape error naming no sample), a net
short run raises naming no sample. Kimi's pre-expanded merge: +k/-k and swaps run silently; a
short run re-cuts the features per sample, silently too; more placeholders than features crash
with a bare shape error. One :class:`BridgeCase` per class, then each class's own checks.
Runs under ``scripts/test_mcore019.sh``."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import SimpleNamespace

import pytest
import torch
from family_checks import aud, decoder_inputs, img, raised_samples, vid

from megatron_media_guard import GuardConfig, MediaAlignmentError
from megatron_media_guard.testing import bridge as loader

pytest.importorskip("transformers")
REASON = loader.missing()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.timeout(180)]

from megatron_media_guard.adapters import install_vlm  # noqa: E402
from megatron_media_guard.adapters.launcher import find_vlm  # noqa: E402
from megatron_media_guard.families import find_family  # noqa: E402
from megatron_media_guard.families.spec import bridge_embed  # noqa: E402
from megatron_media_guard.testing.families import kimi_k25 as K_F  # noqa: E402
from megatron_media_guard.testing.families import mistral3 as M3  # noqa: E402

TESTING = "megatron_media_guard.testing"


def _hf(build: str):
    """A builder of ``testing/bridge_models_hf`` (Bridge's class around transformers' modules),
    imported once Bridge's modules are on the path."""
    return lambda full: getattr(importlib.import_module(f"{TESTING}.bridge_models_hf"), build)(full)


def _ministral3(full):
    from megatron_media_guard.testing.bridge_models import TinyLanguageModel, one_rank_groups

    mod = importlib.import_module("megatron.bridge.models.ministral3.modeling_ministral3")
    cfg = SimpleNamespace(
        hf_config=full.config,
        image_token_id=full.config.image_token_id,
        share_embeddings_and_output_weights=False,
        sequence_parallel=False,
        _pg_collection=one_rank_groups(),
        provide_language_model=lambda **kw: TinyLanguageModel(full),
    )
    return mod.Ministral3Model(cfg).eval()


def _kimi_k25(full, tmp):
    from megatron_media_guard.testing import bridge_models_kimi as K

    hf_dir = K.write_hf_dir(tmp / "checkpoint", full)
    with K.local_remote_code(tmp):
        return K.kimi_k25_vl(full, hf_dir, pad_id=K_F.PAD_ID)


def _mrope(const: str, build: str, hf: str):
    """GLM-4.5V's / Ernie 4.5 VL's builder: Bridge computes its M-RoPE itself from the ids,
    ``mm_token_type_ids`` and the grids."""

    def make(full):
        from megatron_media_guard.testing import bridge_models

        importlib.import_module(getattr(bridge_models, const))
        return getattr(bridge_models, build)(full)

    pytest.importorskip(f"transformers.models.{hf}")
    return make


@dataclass(frozen=True)
class BridgeCase:
    """fixture: the transformers model's ``testing/families`` module; build: Bridge's class
    around it; tokens: the tokenizer stand-in (or built from the transformers model); drop:
    a batch key Bridge's forward does not take; first: its output is a tuple (logits first);
    towers: the tower modules for keep_tower; aligned (also: more) / plus_minus: batches
    (``plus_minus``: samples 0 and 1 +k/-k, sample 2 aligned, the total right); short: a net
    short (or surplus) run in sample 1, Bridge's error and its message; tmp: ``build`` takes a
    temporary directory (Kimi's checkpoint); rope_error: Bridge's own M-RoPE error on
    ``plus_minus`` (None: silent); mixed_plain_ok: Bridge's forward takes images and videos in
    one batch (M-RoPE classes; None: not checked)."""

    cls: str
    fixture: str
    build: Callable
    aligned: list
    plus_minus: list
    towers: tuple[str, str]
    tokens: dict | Callable | None = None
    drop: str | None = None
    first: bool = True
    short: tuple[list, type, str] | None = None
    tmp: bool = False
    also: tuple = ()
    rope_error: str | None = None
    mixed_plain_ok: bool | None = None

    @property
    def F(self):
        return importlib.import_module(f"{TESTING}.families.{self.fixture}")

    def forward(self, model, batch=None, **kw) -> torch.Tensor:
        """The logits of Bridge's forward on ``batch`` (less ``drop``) or on ``kw``."""
        if batch is not None:
            kw = {k: v for k, v in batch.kwargs.items() if k != self.drop}
        with torch.no_grad():
            out = model(**kw)
        return out[0] if self.first else out

    def install(self, model, config: GuardConfig):
        return install_vlm(model, config, tokenizer=self.tokens)


M3_TOKENS = {"[IMG_BREAK]": M3.BREAK_ID, "[IMG_END]": M3.END_ID}
CASES = {
    c.cls: c
    for c in [
        BridgeCase(
            "Gemma3VLModel", "gemma3", _hf("gemma3_vl"),
            aligned=[[img(40, 24)], [], [img(32, 32), img(24, 40)]],
            plus_minus=[[img(40, 24, n=5)], [img(24, 40, n=3)], [img(32, 32)]],
            towers=("vision_tower", "multi_modal_projector"),
            drop="token_type_ids",  # Bridge computes the image blocks from the ids
            short=([[img(32, 32)], [img(32, 32, n=3)]], ValueError, "does not match"),
        ),
        BridgeCase(
            "Ministral3Model", "mistral3", _ministral3,
            aligned=[[img(56, 84)], [img(84, 56)], [img(28, 56)]],
            plus_minus=[[img(56, 84, n=7)], [img(56, 84, n=5)], [img(28, 56)]],
            towers=("vision_tower", "multi_modal_projector"),
            tokens=M3_TOKENS,
            drop="attention_mask",
        ),
        BridgeCase(
            "Qwen2AudioModel", "qwen2_audio", _hf("qwen2_audio"),
            aligned=[[aud(100)], [], [aud(20), aud(61)]],
            plus_minus=[[aud(100, n=26)], [aud(60, n=14)], [aud(61)]],  # 25 + 1, 15 - 1
            towers=("audio_tower", "multi_modal_projector"),
            first=False,
            short=([[aud(100)], [aud(60, n=14)]], ValueError, "do not match"),
        ),
        BridgeCase(
            "KimiK25VLModel", "kimi_k25", _kimi_k25,
            aligned=[[img(4, 4)], [], [img(2, 4), img(4, 2)]],
            plus_minus=[[img(4, 4, n=5)], [img(2, 4, n=1)], [img(4, 2)]],  # 4 + 1, 2 - 1
            towers=("vision_tower", "mm_projector"),
            tokens=lambda full: {
                "<|media_begin|>": full.config.vision_start_token_id,
                "<|media_end|>": full.config.vision_end_token_id,
            },
            first=False,
            # surplus: Bridge's dynamic expansion crashes bare
            short=([[img(2, 2)], [img(4, 4, n=5)]], RuntimeError, "shape mismatch"),
            tmp=True,
        ),
        BridgeCase(
            "GLM45VModel", "glm4v", _mrope("GLM45V", "glm45v", "glm4v"),
            aligned=[[img(4, 6)], [img(6, 4)], [img(4, 4)]],
            also=([[vid(2, 4, 4)], [vid(1, 4, 6)]],),
            plus_minus=[[img(4, 6, n=7)], [img(4, 6, n=5)], [img(4, 4)]],
            towers=("visual",),
            drop="attention_mask",
            first=False,
            short=([[img(4, 4)], [img(4, 6, n=5)]], Exception, ""),  # Bridge's total check
            rope_error="shape mismatch",
            mixed_plain_ok=False,
        ),
        BridgeCase(
            "Ernie45VLModel", "ernie4_5_vl", _mrope("ERNIE45VL", "ernie45_vl", "ernie4_5_vl_moe"),
            aligned=[[img(4, 6)], [img(6, 4)], [img(4, 4)]],
            also=(
                [[vid(2, 4, 4)], [vid(2, 4, 6)]],
                [[img(4, 4), vid(2, 4, 4)], [vid(2, 4, 4)], [img(4, 6)]],
            ),
            plus_minus=[[img(4, 6, n=7)], [img(4, 6, n=5)], [img(4, 4)]],
            towers=("vision_tower", "resampler_model"),
            drop="attention_mask",
            first=False,
            short=([[img(4, 4)], [img(4, 6, n=5)]], Exception, ""),
            rope_error="must match the existing size",
            mixed_plain_ok=True,
        ),
    ]
}  # fmt: skip
MROPE = [c for c in CASES if CASES[c].rope_error]


@pytest.fixture(scope="module", params=sorted(CASES))
def bridge(request, tmp_path_factory):
    """(case, Bridge's model, the transformers model it was built around)."""
    case = CASES[request.param]
    with loader.bridge_modules(loader.find_root()):
        full = case.F.tiny_model()
        tmp = (tmp_path_factory.mktemp(case.fixture),) if case.tmp else ()
        if callable(case.tokens):
            case = replace(case, tokens=case.tokens(full))
        yield case, case.build(full, *tmp), full


def test_the_registry_finds_bridges_class(bridge):
    case, model, _ = bridge
    assert type(model).__module__.startswith("megatron.bridge.")
    assert type(model).__name__ == case.cls
    spec = importlib.import_module(f"megatron_media_guard.families.{case.fixture}").BRIDGE
    assert find_family(model)[1] is spec  # its own forward keywords, not the transformers spec


def test_aligned_batch_is_bit_identical(bridge):
    case, model, full = bridge
    for samples in (case.aligned, *case.also):
        b = case.F.make_batch(full, samples)
        ref = case.forward(model, b)
        with case.install(model, GuardConfig()) as h:
            assert torch.equal(case.forward(model, b), ref), samples
        assert h.last_result.report.actions == ("keep",) * len(samples)


def unguarded(case, model, b) -> None:
    """Bridge's own forward on the +k/-k batch: its batch-total check passes; an M-RoPE class
    then gives the longer run its grid's positions (a shape error naming no sample)."""
    if case.rope_error is None:
        case.forward(model, b)
        return
    with pytest.raises(RuntimeError, match=case.rope_error):
        case.forward(model, b)


@pytest.mark.parametrize("bridge", [c for c in CASES if CASES[c].short], indirect=True)
def test_short_run_raises_in_bridge_and_names_the_sample_guarded(bridge, tmp_path):
    case, model, full = bridge
    samples, error, message = case.short
    b = case.F.make_batch(full, samples)
    with pytest.raises(error, match=message):  # Bridge's batch total: no sample
        case.forward(model, b)
    with case.install(model, GuardConfig(log_dir=str(tmp_path))):
        assert 1 in raised_samples(lambda: case.forward(model, b), 1, tmp_path)


def test_plus_minus_k_is_silent_unguarded_and_raises_guarded(bridge):
    case, model, full = bridge
    b = case.F.make_batch(full, case.plus_minus)
    unguarded(case, model, b)
    h = case.install(model, GuardConfig())
    with h, pytest.raises(MediaAlignmentError, match=r"sample 0\b"):
        case.forward(model, b)


def test_drop_keeps_the_aligned_sample_feeds_no_feature_and_remove_restores(bridge):
    """Samples 0 and 1 dropped: each row decodes its own token embeddings (no feature placed;
    Gemma 3's soft tokens also leave the ids its image blocks are built from:
    :func:`test_a_gemma3_dropped_sample_gets_no_image_block`); sample 2 is its own forward."""
    case, model, full = bridge
    b = case.F.make_batch(full, case.plus_minus)
    h = case.install(model, GuardConfig(policy="drop"))
    with h:
        out = case.forward(model, b)
    assert h.last_result.report.actions == ("drop", "drop", "keep")
    alone = case.F.make_batch(full, [case.plus_minus[2]])
    n = alone.lengths[0]
    torch.testing.assert_close(out[2, :n], case.forward(model, alone)[0], atol=1e-5, rtol=1e-5)
    if case.fixture != "gemma3" and case.rope_error is None:
        for s in (0, 1):
            ids = b.input_ids[s : s + 1, : b.lengths[s]]
            text = case.forward(model, input_ids=ids, inputs_embeds=bridge_embed(model, ids))[0]
            torch.testing.assert_close(out[s, : b.lengths[s]], text, atol=1e-5, rtol=1e-5)
    h.remove()
    unguarded(case, model, b)  # Bridge's own forward again


@pytest.mark.parametrize("bridge", ["Gemma3VLModel"], indirect=True)
def test_a_gemma3_dropped_sample_gets_no_feature_and_no_image_block(bridge):
    """A dropped sample keeps its soft tokens' own embeddings (no feature placed) and its soft
    tokens are text in the ids Bridge builds its attention biases from (no bidirectional
    block): its row equals Bridge's forward on exactly that, the sample alone."""
    case, model, full = bridge
    F = case.F
    b = F.make_batch(full, case.plus_minus)
    with case.install(model, GuardConfig(policy="drop")):
        out = case.forward(model, b)
    n = b.lengths[0]
    ids = b.kwargs["input_ids"][:1, :n]
    text = ids.masked_fill(ids == F.IMAGE, F.PAD)
    with torch.no_grad():
        alone = model(input_ids=text, inputs_embeds=bridge_embed(model, ids))[0]
        image_block = model(input_ids=ids, inputs_embeds=bridge_embed(model, ids))[0]
    torch.testing.assert_close(out[0, :n], alone[0], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out[0, :n], image_block[0], atol=1e-3)  # the biases differ


@pytest.mark.parametrize("mode, runs", [("always", 1), ("never", 0)])
def test_a_text_only_micro_batch_keeps_bridges_tower_in_step(bridge, mode, runs):
    """keep_tower (docs/PARALLEL.md): the dummy through Bridge's own tower and projector."""
    from tower_check import check_keeps_tower

    case, model, full = bridge
    media, text = (
        {k: v for k, v in case.F.make_batch(full, s).kwargs.items() if k != case.drop}
        for s in ([case.plus_minus[2]], [[], []])
    )
    check_keeps_tower(
        model,
        mode,
        runs,
        media=media,
        text=text,
        tokenizer=case.tokens,
        out=(lambda o: o[0]) if case.first else (lambda o: o),
        towers=[getattr(model, t) for t in case.towers],
        decoder=model.language_model.lm,  # Bridge calls language_model.forward: no hook there
    )


# ---- Kimi K2.5's own merge ----

KIMI = pytest.mark.parametrize("bridge", ["KimiK25VLModel"], indirect=True)
SHORT = [[img(4, 4, n=3), img(2, 4)], [img(2, 2)]]  # sample 0's first run one short
SWAP = [[img(4, 4)], [img(2, 4)], [img(4, 2)]]  # images 0 and 1 exchanged: 2 for 4, 4 for 2


@KIMI
def test_kimis_bridge_builds_its_tower_from_the_local_remote_code(bridge):
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25VisionModel

    _, model, _ = bridge
    assert type(model).__module__ == "megatron.bridge.models.kimi_vl.modeling_kimi_k25_vl"
    tower = type(model.vision_tower)
    assert tower.__name__ == "MoonViT3dPretrainedModel"
    assert tower.__module__.startswith("transformers_modules.")  # get_class_from_dynamic_module
    assert isinstance(model.vision_tower, Kimi_K25VisionModel)  # transformers' own tower
    wrapped = SimpleNamespace(module=model)  # a DDP-style wrapper, as install_from_args sees it
    assert find_vlm(wrapped) == ("kimi_k25", model)


@KIMI
@pytest.mark.parametrize(
    "extra",
    [{"labels": True}, {"attention_mask": None}, {"labels": True, "position_ids": True}],
    ids=["labels", "no-attention-mask", "caller-positions"],
)
def test_a_kimi_aligned_batch_is_bit_identical_with_bridges_after_merge_steps(bridge, extra):
    """Bridge's merge also sets the positions from the attention mask (over a caller's), the
    labels' placeholders to ignore_index (the stand-in's per-token loss sees any other label)
    and no attention mask: the guard's after-merge step does the same."""
    case, model, full = bridge
    b = K_F.make_batch(full, case.aligned)
    kw = dict(b.kwargs)
    if extra.get("labels"):
        kw["labels"] = b.input_ids.clone()
    if extra.get("position_ids"):
        kw["position_ids"] = torch.zeros_like(b.input_ids)
    if "attention_mask" in extra:
        kw["attention_mask"] = None
    ref = case.forward(model, **kw)
    h = case.install(model, GuardConfig())
    with h:
        assert torch.equal(case.forward(model, **kw), ref)
    assert h.last_result.report.actions == ("keep", "keep", "keep")


@KIMI
def test_a_kimi_short_run_is_recut_silently_by_bridge_and_raises_guarded(bridge, tmp_path):
    case, model, full = bridge
    b = K_F.make_batch(full, SHORT)
    # Bridge's truncated pre-expanded branch: no error
    emb, _ = decoder_inputs(model.language_model.lm, lambda: case.forward(model, b))
    with torch.no_grad():
        feats = model._extract_image_features(b.kwargs["pixel_values"], b.kwargs["image_grid_thw"])
    runs = (b.input_ids[0] == full.config.image_token_id).nonzero().flatten()
    second = runs[3]  # the first placeholder of image 1's run
    assert torch.equal(emb[0, second], feats[0][3])  # image 0's last feature, in image 1's run
    with case.install(model, GuardConfig(log_dir=str(tmp_path))):
        assert 0 in raised_samples(lambda: case.forward(model, b), 0, tmp_path)


@KIMI
def test_a_kimi_swap_silent_in_bridge_names_both_samples_guarded(bridge):
    """(+k/-k: test_plus_minus_k_is_silent_unguarded_and_raises_guarded.)"""
    case, model, full = bridge
    b = K_F.make_batch(full, SWAP, swap=(0, 1))
    case.forward(model, b)  # the batch total matches: Bridge's 1:1 scatter runs
    h = case.install(model, GuardConfig())
    with h, pytest.raises(MediaAlignmentError) as err:
        case.forward(model, b)
    found = {int(n) for n in re.findall(r"^  sample (\d+)\b", str(err.value), re.M)}
    assert found == {0, 1}  # the aligned sample 2 is not named


@KIMI
@pytest.mark.parametrize(
    "samples, swap, actions",
    [
        ([*SHORT, [img(4, 2)]], None, ("drop", "keep", "keep")),
        (SWAP, (0, 1), ("drop", "drop", "keep")),
    ],
    ids=["short", "swap"],
)
def test_a_kimi_drop_keeps_each_aligned_sample_and_its_loss(bridge, samples, swap, actions):
    """(+k/-k: test_drop_keeps_the_aligned_sample_feeds_no_feature_and_remove_restores.)"""
    case, model, full = bridge
    b = K_F.make_batch(full, samples, swap=swap)
    h = case.install(model, GuardConfig(policy="drop"))
    with h:
        logits = case.forward(model, b)
        loss = case.forward(model, **b.kwargs, labels=b.input_ids.clone())
    assert h.last_result.report.actions == actions
    for s, act in enumerate(actions):
        n = b.lengths[s]
        if act == "keep":
            alone = K_F.make_batch(full, [samples[s]])
            ref = case.forward(model, alone)[0]
            ref_loss = case.forward(model, **alone.kwargs, labels=alone.input_ids.clone())[0]
            torch.testing.assert_close(loss[s, :n], ref_loss, atol=1e-5, rtol=1e-5)
        else:  # a dropped row decodes its own token embeddings: no feature placed
            ids = b.input_ids[s : s + 1, :n]
            ref = case.forward(model, input_ids=ids, inputs_embeds=bridge_embed(model, ids))[0]
            assert (h.last_result.labels[s, :n] == -100).all()  # its loss is ignored
        torch.testing.assert_close(logits[s, :n], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bridge", MROPE, indirect=True)
def test_images_and_videos_in_one_batch_run_guarded_as_each_alone(bridge):
    """On GLM-4.5V the plain forward cannot take them (the images' features meet every image
    token); guarded, each sample is its own forward."""
    case, model, full = bridge
    samples = [[img(4, 4)], [vid(2, 4, 4)]]
    b = case.F.make_batch(full, samples)
    if not case.mixed_plain_ok:
        with pytest.raises(Exception):  # noqa: B017 - Bridge's own total check, no sample named
            case.forward(model, b)
    with case.install(model, GuardConfig()):
        out = case.forward(model, b)
    for k, sample in enumerate(samples):
        alone = case.F.make_batch(full, [sample])
        want = case.forward(model, alone)[0, : alone.lengths[0]]
        torch.testing.assert_close(out[k, : b.lengths[k]], want, atol=1e-5, rtol=1e-5)
