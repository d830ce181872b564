"""Stand-in ``self`` objects for megatron-core's ``LLaVAModel._preprocess_data``: each holds
the attributes one release's method reads (checked by
``test_standin_has_every_attribute_the_release_reads``) and carries that release's real method;
``LLaVAStandIn`` is the one for the release on the path.
"""

from __future__ import annotations

import types

import megatron.core
import torch
from megatron.core.models.multimodal.llava_model import LLaVAModel
from omni_batches import IMAGE, SOUND

from megatron_media_guard import Grammar, GuardConfig, MediaGuard
from megatron_media_guard.diagnostics import RankInfo

MCORE = tuple(int(x) for x in megatron.core.__version__.split("+")[0].split(".")[:2])
HAS_MCORE019 = MCORE >= (0, 19)
NEEDS_MCORE019 = "needs megatron-core >= 0.19 on the path (run scripts/test_mcore019.sh)"


class Mcore016LLaVAStandIn:
    """What megatron-core 0.16.1's ``_preprocess_data`` reads; the real method."""

    _preprocess_data = LLaVAModel._preprocess_data

    def __init__(
        self, maxlen=64, pre=True, post=True, cp=1, pp=False, img_seq_len=3, image_token=-200
    ):
        self.pre_process, self.post_process, self.add_decoder = pre, post, True
        self.img_seq_len = img_seq_len
        self._language_is_pipeline_parallel = pp
        self._language_max_sequence_length = maxlen
        self.context_parallel_lm = cp
        self.vision_model = None
        self.image_token_index = image_token


class Mcore019LLaVAStandIn(Mcore016LLaVAStandIn):
    """0.19.2 also reads ``sound_token_index`` (default -300) and ``sound_model`` (its
    ``config.sound_pad_to_clip_duration`` picks every row of a clip)."""

    def __init__(self, *args, sound_token=-300, sound_pad_to_clip_duration=None, **kw):
        super().__init__(*args, **kw)
        self.sound_token_index = sound_token
        self.sound_model = None
        if sound_pad_to_clip_duration is not None:
            config = types.SimpleNamespace(sound_pad_to_clip_duration=sound_pad_to_clip_duration)
            self.sound_model = types.SimpleNamespace(config=config)


LLaVAStandIn = Mcore019LLaVAStandIn if HAS_MCORE019 else Mcore016LLaVAStandIn


def omni_standin(batch, maxlen=4096, **kw):
    """The 0.19.2 stand-in ``self`` for an ``omni_batches`` batch."""
    return Mcore019LLaVAStandIn(
        maxlen, img_seq_len=batch.img_seq_len, image_token=IMAGE, sound_token=SOUND, **kw
    )


def omni_guard(policy="raise", **cfg):
    """A guard for ``omni_batches`` batches, as rank 1."""
    return MediaGuard(
        GuardConfig(policy=policy, **cfg), Grammar.llava(IMAGE), rank=RankInfo(rank=1)
    )


def same(a, b):
    """Two ``_preprocess_data`` outputs are bit-identical (None where the other is None)."""
    return all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b)
    )


def kept_identical(out, ref, dropped, spans=None):
    """The samples of ``_preprocess_data`` outputs ``(emb [S, b, h], labels, loss_mask)``
    (rows, or the packed sub-samples' merged ``spans``) equal ``ref`` but ``dropped``, whose
    positions are zeroed, their labels ignored and their loss masked."""
    for i in range(ref[1].shape[0] if spans is None else len(spans)):
        if spans is None:
            emb, tok = (slice(None), i), (i,)
        else:
            emb = (slice(spans[i].merged_start, spans[i].merged_end),)
            tok = (slice(None), *emb)
        if i in dropped:
            assert (out[0][emb] == 0).all() and (out[1][tok] == -100).all(), i
            assert (out[2][tok] == 0).all(), i
        else:
            assert torch.equal(out[0][emb], ref[0][emb]), i
            assert torch.equal(out[1][tok], ref[1][tok]) and torch.equal(out[2][tok], ref[2][tok])
