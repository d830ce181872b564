"""What one LLaVA call's arguments say about their own shapes (batch-level checks) and the
release-specific inputs the checks read: the packed THD boundaries and the sound mode."""

from __future__ import annotations

from typing import Any

import torch

from .measure import LlavaFacts


def sound_padded(model: Any) -> bool:
    """megatron-core 0.19 takes every row of every clip when the sound model's config sets
    ``sound_pad_to_clip_duration`` (else ``sound_embeddings_len[c]`` rows of clip c)."""
    cfg = getattr(getattr(model, "sound_model", None), "config", None)
    return bool(getattr(cfg, "sound_pad_to_clip_duration", False))


def packed_cu_seqlens(packed_seq_params: Any, input_ids: torch.Tensor) -> torch.Tensor | None:
    """Sub-sample boundaries (merged positions) of a single packed THD row: the padded ones
    when given (they are the physical layout), else ``cu_seqlens_q``; None for other calls."""
    if packed_seq_params is None or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        return None
    if getattr(packed_seq_params, "qkv_format", "thd") != "thd":
        return None
    cu = getattr(packed_seq_params, "cu_seqlens_q_padded", None)
    if cu is None:
        cu = getattr(packed_seq_params, "cu_seqlens_q", None)
    return cu if isinstance(cu, torch.Tensor) and cu.numel() >= 2 else None


def _image_problem(a: dict[str, Any], facts: LlavaFacts) -> str | None:
    emb = a.get("image_embeddings")
    lang = a.get("language_embeddings")
    L, T = facts.img_seq_len, sum(facts.entries)
    packed = bool(a.get("is_packed_dynamic_res"))
    want = f"[{T} (sum of num_image_tiles), 1, h]" if packed else f"[{L}, {T}, h]"
    if not isinstance(emb, torch.Tensor) or emb.dim() != 3:
        shape = tuple(emb.shape) if isinstance(emb, torch.Tensor) else type(emb).__name__
        return f"image_embeddings must be {want}, got {shape}"
    if (packed and (emb.shape[0], emb.shape[1]) != (T, 1)) or (
        not packed and (emb.shape[0], emb.shape[1]) != (L, T)
    ):
        layout = "is_packed_dynamic_res" if packed else "img_seq_len x tiles"
        return f"image_embeddings is {tuple(emb.shape)}, expected {want} ({layout})"
    if isinstance(lang, torch.Tensor) and emb.shape[2] != lang.shape[-1]:
        return f"image_embeddings hidden size {emb.shape[2]} != language hidden {lang.shape[-1]}"
    return None


def _sound_problem(a: dict[str, Any], facts: LlavaFacts, padded: bool) -> str | None:
    snd, lang = a.get("sound_embeddings"), a.get("language_embeddings")
    if snd.dim() != 3:
        return f"sound_embeddings must be [rows, clips, h], got {tuple(snd.shape)}"
    T, C = snd.shape[0], snd.shape[1]
    if C and a.get("sound_embeddings_len") is None and not padded:
        return f"sound_embeddings has {C} clips and no sound_embeddings_len"
    if len(facts.clip_rows) != C:
        return f"sound_embeddings has {C} clips, sound_embeddings_len {len(facts.clip_rows)}"
    if facts.clip_rows and max(facts.clip_rows) > T:
        return f"sound_embeddings_len {list(facts.clip_rows)} exceeds the {T} rows per clip"
    if C and isinstance(lang, torch.Tensor) and snd.shape[2] != lang.shape[-1]:
        return f"sound_embeddings hidden size {snd.shape[2]} != language hidden {lang.shape[-1]}"
    return None


def layout_problems(
    a: dict[str, Any], model: Any, facts: LlavaFacts
) -> tuple[list[str], bool, bool]:
    """``(batch-level problems, image embeddings usable, sound embeddings usable)``.

    The image embeddings are checked on the first stage when the call has entries; the
    sound embeddings when the call passes a sound tensor to a model with a sound token and
    either sound tokens or ``sound_embeddings_len``.
    A wrong layout names no sample (rows are concatenated): always fatal."""
    problems: list[str] = []
    img_ok = snd_ok = False
    if model.pre_process and facts.num_entries:
        problem = _image_problem(a, facts)
        if problem:
            problems.append(f"layout: {problem}")
        img_ok = problem is None
    snd = a.get("sound_embeddings")
    # a stage without the encoders passes its encoder_hidden_state and no lengths: megatron-core
    # only reads it at sound tokens
    used = any(facts.sound) or a.get("sound_embeddings_len") is not None
    if (
        model.pre_process
        and used
        and isinstance(snd, torch.Tensor)
        and facts.sound_token_index is not None
    ):
        problem = _sound_problem(a, facts, sound_padded(model))
        if problem:
            problems.append(f"layout: {problem}")
        snd_ok = problem is None
    return problems, img_ok, snd_ok
