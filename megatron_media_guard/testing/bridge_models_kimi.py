"""A tiny instance of Megatron-Bridge 0.6.2's real ``KimiK25VLModel`` on CPU (tests only),
beside :mod:`.bridge_models` and :mod:`.bridge_models_hf`.

Call with :func:`megatron_media_guard.testing.bridge.install` in effect. Real: Bridge's
provider (``KimiK25VLModelProvider``, tiny, float32), the class's ``__init__`` (it loads the
tower's classes with ``get_class_from_dynamic_module`` and the vision config with Bridge's
``safe_load_config_with_retry`` from ``hf_model_path``), ``_extract_image_features``,
``_merge_input_ids_with_image_features`` and ``forward``. What stands in:

- the checkpoint's remote code: ``hf_model_path`` is a local directory written by
  :func:`write_hf_dir` (a ``config.json`` and :mod:`.kimi_k25_remote` as
  ``modeling_kimi_k25.py``: adapters over transformers' native Kimi K2.5 tower and projector).
  transformers loads a local directory's remote code offline; it copies it into its modules
  cache, which :func:`local_remote_code` points at a temporary folder;
- the language model (``provide_language_model``: megatron-core's MLA ``GPTModel`` needs
  CUDA): :class:`KimiLanguageModel`, transformers' tiny DeepSeek-V3 text model of the fixture's
  ``Kimi_K25ForConditionalGeneration``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from .bridge_models import TinyLanguageModel

KIMI_K25_VL = "megatron.bridge.models.kimi_vl.modeling_kimi_k25_vl"
PROVIDER = "megatron.bridge.models.kimi_vl.kimi_k25_vl_provider"
REMOTE = Path(__file__).with_name("kimi_k25_remote.py")


class KimiLanguageModel(TinyLanguageModel):
    """:class:`TinyLanguageModel` that decodes under the ``attention_mask`` it is handed (a
    ``[b, s]`` padding mask, or None: causal only), as megatron-core's ``GPTModel`` attends
    under the mask it gets: Bridge's merge hands it None, its text-only path the caller's."""

    def forward(
        self, decoder_input=None, position_ids=None, attention_mask=None, labels=None, **kw
    ):
        emb = decoder_input.transpose(0, 1)
        hidden = self.lm(
            inputs_embeds=emb, position_ids=position_ids, attention_mask=attention_mask
        )
        logits = self.output_layer(hidden.last_hidden_state)
        if labels is None:
            return logits
        ce = nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten().clamp(min=0), reduction="none"
        )
        return ce.view(labels.shape)


def write_hf_dir(path: str | os.PathLike, full: nn.Module) -> Path:
    """A local "checkpoint" directory for ``hf_model_path``: ``config.json`` (``full``'s
    config, its vision config with the projector fields the remote config carries) and the
    stand-in remote code :mod:`.kimi_k25_remote` as ``modeling_kimi_k25.py``. No weights."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = full.config.to_dict()
    cfg["vision_config"].update(
        mm_hidden_size=full.config.projection_hidden_size,
        projector_ln_eps=full.config.projection_layer_norm_eps,
        text_hidden_size=full.config.text_config.hidden_size,
    )
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    shutil.copyfile(REMOTE, path / "modeling_kimi_k25.py")
    return path


@contextmanager
def local_remote_code(cache: str | os.PathLike) -> Iterator[None]:
    """transformers' modules cache (where it copies remote code to import it) and Bridge's
    config lock folder under ``cache`` for the block; ``sys.path`` and the dynamic modules it
    imported are restored / forgotten afterwards."""
    from transformers import dynamic_module_utils as dmu

    old_cache, old_lock = dmu.HF_MODULES_CACHE, os.environ.get("MEGATRON_CONFIG_LOCK_DIR")
    old_path = list(sys.path)
    dmu.HF_MODULES_CACHE = str(Path(cache) / "modules")
    os.environ["MEGATRON_CONFIG_LOCK_DIR"] = str(Path(cache) / "locks")
    try:
        yield
    finally:
        dmu.HF_MODULES_CACHE = old_cache
        if old_lock is None:
            os.environ.pop("MEGATRON_CONFIG_LOCK_DIR", None)
        else:
            os.environ["MEGATRON_CONFIG_LOCK_DIR"] = old_lock
        sys.path[:] = old_path
        root = dmu.TRANSFORMERS_DYNAMIC_MODULE_NAME
        for name in [m for m in sys.modules if m == root or m.startswith(root + ".")]:
            del sys.modules[name]


def kimi_k25_vl(full: nn.Module, hf_dir: str | os.PathLike, *, pad_id: int = 0, seed: int = 0):
    """Bridge's real ``KimiK25VLModel`` from its real provider, eval mode: text sizes and token
    ids from ``full`` (transformers' tiny ``Kimi_K25ForConditionalGeneration``), the tower and
    projector Bridge's ``__init__`` builds from ``hf_dir`` (:func:`write_hf_dir`; call inside
    :func:`local_remote_code`), the language model :class:`KimiLanguageModel` on ``full``.
    ``pad_id``: the provider's ``pad_token_id`` (the fixture's batches pad with 0)."""
    import importlib

    mod = importlib.import_module(PROVIDER)

    class Provider(mod.KimiK25VLModelProvider):
        def provide_language_model(self, pre_process=None, post_process=None, vp_stage=None):
            return KimiLanguageModel(full, self)

    c, t = full.config, full.config.text_config
    provider = Provider(
        num_layers=t.num_hidden_layers,
        hidden_size=t.hidden_size,
        ffn_hidden_size=t.intermediate_size,
        num_attention_heads=t.num_attention_heads,
        vocab_size=t.vocab_size,
        q_lora_rank=t.q_lora_rank,
        kv_lora_rank=t.kv_lora_rank,
        qk_head_dim=t.qk_nope_head_dim,
        qk_pos_emb_head_dim=t.qk_rope_head_dim,
        v_head_dim=t.v_head_dim,
        bf16=False,
        params_dtype=torch.float32,
        autocast_dtype=torch.float32,
        share_embeddings_and_output_weights=False,
        hf_model_path=str(hf_dir),
        trust_remote_code=True,
        image_token_id=c.image_token_id,
        media_placeholder_token_id=c.image_token_id,
        pad_token_id=pad_id,
    )
    torch.manual_seed(seed)
    return provider.provide(pre_process=True, post_process=True).eval()
