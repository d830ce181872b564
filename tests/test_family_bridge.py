"""install_vlm on Megatron-Bridge 0.6.2's real classes (their ``__init__`` and forward from the
wheel, CPU) of the engine families Bridge trains with one merge each: ``Gemma3VLModel``,
``Ministral3Model``, ``Qwen2AudioModel`` (Bridge merges audio whenever ``input_features`` is
given: the guard passes it as None), ``KimiK25VLModel`` (``hf_model_path`` a local directory,
``testing/bridge_models_kimi.py``, its remote code loaded through
``get_class_from_dynamic_module``) and the M-RoPE classes ``GLM45VModel`` and ``Ernie45VLModel``
(Bridge computes its M-RoPE from ``input_ids``, ``mm_token_type_ids`` and the grids). The
language model is a tiny stand-in (megatron-core's GPTModel attention needs CUDA), the provider
config a stand-in with the attributes each class reads.

Bridge checks only the batch total before its ``masked_scatter``: what its own forward does with
each fault (silent, or an error naming no sample; docs/FAMILIES.md) is the :class:`Fault` row's
``plain``. One :class:`BridgeCase` per class, then each class's own checks. Runs under
``scripts/test_mcore019.sh``."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import SimpleNamespace

import pytest
import torch
from family_checks import aud, decoder_inputs, img, records, vid

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
class Fault:
    """A faulty batch of one class: ``samples`` (``swap``: items exchanged), the samples the
    guard names and drops (``bad``; every other sample is kept), and Bridge's own forward on it:
    silent (``plain`` None), or its error type and message (its batch-total or M-RoPE check,
    naming no sample)."""

    name: str
    samples: list
    bad: frozenset[int]
    swap: tuple[int, int] | None = None
    plain: tuple[type, str] | None = None

    def unguarded(self, case, model, b) -> None:
        """Bridge's own forward on the row's batch ``b``, as the row says it goes."""
        if self.plain is None:
            case.forward(model, b)
            return
        with pytest.raises(self.plain[0], match=self.plain[1]):
            case.forward(model, b)


@dataclass(frozen=True)
class BridgeCase:
    """fixture: the transformers model's ``testing/families`` module; build: Bridge's class
    around it; tokens: the tokenizer stand-in (or built from the transformers model); drop:
    a batch key Bridge's forward does not take; first: its output is a tuple (logits first);
    towers: the tower modules for keep_tower; aligned (also: more): batches; faults: the first
    samples 0 and 1 +k/-k beside an aligned sample 2 (the total right); tmp: ``build`` takes a
    temporary directory (Kimi's checkpoint); mixed_plain_ok: Bridge's forward takes images and
    videos in one batch (the M-RoPE classes; None: not one)."""

    cls: str
    fixture: str
    build: Callable
    aligned: list
    faults: tuple[Fault, ...]
    towers: tuple[str, str]
    tokens: dict | Callable | None = None
    drop: str | None = None
    first: bool = True
    tmp: bool = False
    also: tuple = ()
    mixed_plain_ok: bool | None = None

    @property
    def F(self):
        return importlib.import_module(f"{TESTING}.families.{self.fixture}")

    def forward(self, model, batch=None, **kw) -> torch.Tensor:
        """The logits (the per-token loss, given labels) of Bridge's forward on ``batch`` (less
        ``drop``) and ``kw``."""
        if batch is not None:
            kw = {**{k: v for k, v in batch.kwargs.items() if k != self.drop}, **kw}
        with torch.no_grad():
            out = model(**kw)
        return out[0] if self.first else out

    def install(self, model, config: GuardConfig):
        return install_vlm(model, config, tokenizer=self.tokens)


K01, S0, S1 = frozenset({0, 1}), frozenset({0}), frozenset({1})
M3_TOKENS = {"[IMG_BREAK]": M3.BREAK_ID, "[IMG_END]": M3.END_ID}
KIMI_SHORT = [[img(4, 4, n=3), img(2, 4)], [img(2, 2)]]  # sample 0's first run one short
CASES = {
    c.cls: c
    for c in [
        BridgeCase(
            "Gemma3VLModel", "gemma3", _hf("gemma3_vl"),
            aligned=[[img(40, 24)], [], [img(32, 32), img(24, 40)]],
            faults=(
                Fault("+k/-k", [[img(40, 24, n=5)], [img(24, 40, n=3)], [img(32, 32)]], K01),
                Fault("short", [[img(32, 32)], [img(32, 32, n=3)]], S1,
                      plain=(ValueError, "does not match")),
            ),
            towers=("vision_tower", "multi_modal_projector"),
            drop="token_type_ids",  # Bridge computes the image blocks from the ids
        ),
        BridgeCase(
            "Ministral3Model", "mistral3", _ministral3,
            aligned=[[img(56, 84)], [img(84, 56)], [img(28, 56)]],
            faults=(
                Fault("+k/-k", [[img(56, 84, n=7)], [img(56, 84, n=5)], [img(28, 56)]], K01),
            ),
            towers=("vision_tower", "multi_modal_projector"),
            tokens=M3_TOKENS,
            drop="attention_mask",
        ),
        BridgeCase(
            "Qwen2AudioModel", "qwen2_audio", _hf("qwen2_audio"),
            aligned=[[aud(100)], [], [aud(20), aud(61)]],
            faults=(  # 25 + 1, 15 - 1
                Fault("+k/-k", [[aud(100, n=26)], [aud(60, n=14)], [aud(61)]], K01),
                Fault("short", [[aud(100)], [aud(60, n=14)]], S1,
                      plain=(ValueError, "do not match")),
            ),
            towers=("audio_tower", "multi_modal_projector"),
            first=False,
        ),
        BridgeCase(
            "KimiK25VLModel", "kimi_k25", _kimi_k25,
            aligned=[[img(4, 4)], [], [img(2, 4), img(4, 2)]],
            faults=(  # 4 + 1, 2 - 1
                Fault("+k/-k", [[img(4, 4, n=5)], [img(2, 4, n=1)], [img(4, 2)]], K01),
                Fault("surplus", [[img(2, 2)], [img(4, 4, n=5)]], S1,
                      plain=(RuntimeError, "shape mismatch")),
                Fault("short", [*KIMI_SHORT, [img(4, 2)]], S0),
                Fault("swap", [[img(4, 4)], [img(2, 4)], [img(4, 2)]], K01, swap=(0, 1)),
            ),
            towers=("vision_tower", "mm_projector"),
            tokens=lambda full: {
                "<|media_begin|>": full.config.vision_start_token_id,
                "<|media_end|>": full.config.vision_end_token_id,
            },
            first=False,
            tmp=True,
        ),
        BridgeCase(
            "GLM45VModel", "glm4v", _mrope("GLM45V", "glm45v", "glm4v"),
            aligned=[[img(4, 6)], [img(6, 4)], [img(4, 4)]],
            also=([[vid(2, 4, 4)], [vid(1, 4, 6)]],),
            faults=(
                Fault("+k/-k", [[img(4, 6, n=7)], [img(4, 6, n=5)], [img(4, 4)]], K01,
                      plain=(RuntimeError, "shape mismatch")),
                Fault("short", [[img(4, 4)], [img(4, 6, n=5)]], S1, plain=(Exception, "")),
            ),
            towers=("visual",),
            drop="attention_mask",
            first=False,
            mixed_plain_ok=False,
        ),
        BridgeCase(
            "Ernie45VLModel", "ernie4_5_vl", _mrope("ERNIE45VL", "ernie45_vl", "ernie4_5_vl_moe"),
            aligned=[[img(4, 6)], [img(6, 4)], [img(4, 4)]],
            also=(
                [[vid(2, 4, 4)], [vid(2, 4, 6)]],
                [[img(4, 4), vid(2, 4, 4)], [vid(2, 4, 4)], [img(4, 6)]],
            ),
            faults=(
                Fault("+k/-k", [[img(4, 6, n=7)], [img(4, 6, n=5)], [img(4, 4)]], K01,
                      plain=(RuntimeError, "must match the existing size")),
                Fault("short", [[img(4, 4)], [img(4, 6, n=5)]], S1, plain=(Exception, "")),
            ),
            towers=("vision_tower", "resampler_model"),
            drop="attention_mask",
            first=False,
            mixed_plain_ok=True,
        ),
    ]
}  # fmt: skip
MROPE = [c for c in CASES if CASES[c].mixed_plain_ok is not None]
FAULTS = [(c, f) for c in sorted(CASES) for f in CASES[c].faults]


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


@pytest.mark.parametrize(
    "bridge, fault", FAULTS, ids=[f"{c}-{f.name}" for c, f in FAULTS], indirect=["bridge"]
)
def test_a_fault_is_named_guarded_dropped_alone_and_remove_restores(bridge, fault, tmp_path):
    """Bridge's own forward on the fault (the row's ``plain``). Guarded, the error and its
    ``raise`` records name exactly the faulty samples. Dropped, each dropped row decodes its own
    token embeddings (no feature placed; not compared on the M-RoPE classes; on Gemma 3 its soft
    tokens are text in the ids Bridge builds its attention biases from too: no bidirectional
    block), its labels ignored; every other sample is its own forward and its own loss; after
    ``remove()`` Bridge's own forward again."""
    case, model, full = bridge
    b = case.F.make_batch(full, fault.samples, swap=fault.swap)
    fault.unguarded(case, model, b)
    with (
        case.install(model, GuardConfig(log_dir=str(tmp_path))),
        pytest.raises(MediaAlignmentError) as err,
    ):
        case.forward(model, b)
    named = {int(n) for n in re.findall(r"^  sample (\d+)\b", str(err.value), re.M)}
    assert named == fault.bad
    assert {r["sample"] for r in records(tmp_path) if r["event"] == "raise"} == fault.bad
    h = case.install(model, GuardConfig(policy="drop"))
    with h:
        out = case.forward(model, b)
        loss = case.forward(model, b, labels=b.input_ids.clone())
    actions = tuple("drop" if s in fault.bad else "keep" for s in range(len(fault.samples)))
    assert h.last_result.report.actions == actions
    for s, sample in enumerate(fault.samples):
        n = b.lengths[s]
        if s not in fault.bad:
            alone = case.F.make_batch(full, [sample])
            want = case.forward(model, alone)[0]
            own_loss = case.forward(model, alone, labels=alone.input_ids.clone())[0]
            torch.testing.assert_close(loss[s, :n], own_loss, atol=1e-5, rtol=1e-5)
        else:
            assert (h.last_result.labels[s, :n] == -100).all()
            if case.mixed_plain_ok is not None:
                continue
            ids = b.input_ids[s : s + 1, :n]
            emb = bridge_embed(model, ids)
            if case.fixture == "gemma3":
                block = case.forward(model, input_ids=ids, inputs_embeds=emb)[0]
                assert not torch.allclose(out[s, :n], block, atol=1e-3)  # the biases differ
                ids = ids.masked_fill(ids == case.F.IMAGE, case.F.PAD)
            want = case.forward(model, input_ids=ids, inputs_embeds=emb)[0]
        torch.testing.assert_close(out[s, :n], want, atol=1e-5, rtol=1e-5)
    h.remove()
    fault.unguarded(case, model, b)


@pytest.mark.parametrize("mode, runs", [("always", 1), ("never", 0)])
def test_a_text_only_micro_batch_keeps_bridges_tower_in_step(bridge, mode, runs):
    """keep_tower (docs/PARALLEL.md): the dummy through Bridge's own tower and projector."""
    from tower_check import check_keeps_tower

    case, model, full = bridge
    media, text = (
        {k: v for k, v in case.F.make_batch(full, s).kwargs.items() if k != case.drop}
        for s in ([case.faults[0].samples[2]], [[], []])
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
def test_a_kimi_short_run_is_recut_silently_by_bridge(bridge):
    """Bridge's truncated pre-expanded branch runs: image 0's last feature fills image 1's run
    (guarded: the "short" fault row)."""
    case, model, full = bridge
    b = K_F.make_batch(full, KIMI_SHORT)
    emb, _ = decoder_inputs(model.language_model.lm, lambda: case.forward(model, b))
    with torch.no_grad():
        feats = model._extract_image_features(b.kwargs["pixel_values"], b.kwargs["image_grid_thw"])
    runs = (b.input_ids[0] == full.config.image_token_id).nonzero().flatten()
    second = runs[3]  # the first placeholder of image 1's run
    assert torch.equal(emb[0, second], feats[0][3])  # image 0's last feature, in image 1's run


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
