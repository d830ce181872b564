"""A family spec read from a transformers class itself, for the VLMs no written spec names
(docs/FAMILIES.md, "Derived families"): ``get_<m>_features(...)`` merged by ``masked_scatter``
onto ``config.<m>_token_id`` runs, its keywords read from the forward's source (``ast``).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from ..errors import MediaInputError
from .spec import Encoded, FamilySpec, ModalitySpec, Token

MODALITIES = ("image", "video", "audio")
TEXT = Token(
    ("text_config.pad_token_id", "pad_token_id", "text_config.eos_token_id", "eos_token_id"),
    None,
    0,
)
_LAST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> last media call


def _source(fn: Any) -> str | None:
    try:
        return textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None


def _calls(tree: ast.AST, attr: str | None = None) -> list[ast.Call]:
    """The method calls in ``tree`` (of ``attr`` only, if given), in source order."""
    found = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    found = [n for n in found if isinstance(n.func, ast.Attribute) and attr in (None, n.func.attr)]
    return sorted(found, key=lambda n: (n.lineno, n.col_offset))


def _scatter(owner: Any, tree: ast.AST, call: ast.Call) -> tuple[ast.Call | None, int]:
    """The first ``masked_scatter`` after the feature call: in the forward, else in a method of
    the class the forward calls after it (Idefics3's ``inputs_merger``); and the forward's
    last line up to it."""
    for c in (c for c in _calls(tree) if c.lineno >= call.lineno):
        if c.func.attr == "masked_scatter":
            return c, c.end_lineno
        src = _source(getattr(type(owner), c.func.attr, None))
        inner = _calls(ast.parse(src), "masked_scatter") if src else []
        if inner and isinstance(c.func.value, ast.Name):
            return inner[0], c.end_lineno
    return None, 0


def _modality(model: Any, m: str, fwd: set[str], notes: list[str]) -> ModalitySpec | str:
    """The spec of modality ``m`` read from the class, or what is missing (a string)."""
    method = f"get_{m}_features"
    tok = Token((f"{m}_token_id", f"{m}_token_index"))
    if tok.resolve(model) is None:
        return f"no config.{m}_token_id"
    for path in ("", "model"):
        owner = getattr(model, path) if path else model
        src = _source(type(owner).forward) if owner is not None else None
        if src and f"self.{method}(" in src:
            break
    else:
        return f"no forward calls self.{method}(...)"
    tree = ast.parse(src)
    call = _calls(tree, method)[0]
    scatter, end = _scatter(owner, tree, call)
    if scatter is None:
        puts = "index_put" if "index_put" in src else "no masked_scatter"
        return f"{m} merged by {puts} (not a scatter of placeholders): refused"
    seg = "\n".join(src.splitlines()[call.lineno - 1 : end])
    params = list(inspect.signature(getattr(owner, method)).parameters)
    args: dict[str, str] = {}
    for p, a in [*zip(params, call.args), *((k.arg, k.value) for k in call.keywords)]:
        if p is None or isinstance(a, ast.Constant):  # **kwargs, return_dict=True
            continue
        if isinstance(a, ast.Name) and a.id in fwd:
            args[p] = a.id
        else:
            notes.append(f"{method}'s {p} is computed in the forward: left to its default")
    if not args:
        return f"{method}'s media argument is no forward keyword"
    media = next(iter(args.values()))
    extra = [p for p in sorted(fwd) if m in p and not p.startswith("use_") and p != media]
    inputs = tuple(dict.fromkeys([media, *args.values(), *extra]))
    read = {a: seg.find(a) for a in ("pooler_output", "last_hidden_state") if a in seg}
    attr = min(read, key=read.__getitem__) if read else "pooler_output"
    adds = len(scatter.args) > 1 and isinstance(scatter.args[1], ast.BinOp)
    project, strip = "multi_modal_projector(" in seg, ".attention_mask" in seg
    how = dict(owner=path, method=method, args=args, attr=attr, project=project, strip=strip)
    how["adds"] = tok if adds else None
    if project:
        notes.append(f"{m}: the forward's multi_modal_projector applied after {method}")
    if adds:
        notes.append(f"{m}: the forward adds its features onto the placeholder embeddings")
    encode = lambda model, kw: _encode(model, kw, m, inputs, how)  # noqa: E731
    return ModalitySpec(m, tok, inputs, encode, keep=inputs[1:], rows=inputs[1:])


def _encode(model: Any, kw: Mapping[str, Any], m: str, inputs, how: dict) -> Encoded:
    owner = getattr(model, how["owner"]) if how["owner"] else model
    call = {p: kw.get(i) for p, i in how["args"].items()}
    media = kw.get(inputs[0])  # keep_tower's replay: the media's shape, not its values
    last = {i: kw.get(i) for i in inputs[1:]}
    _LAST.setdefault(model, {})[m] = {**last, inputs[0]: (media.shape, media.dtype, media.device)}
    out = getattr(owner, how["method"])(**call, return_dict=True)
    feats = getattr(out, how["attr"])
    if how["project"]:  # on the whole block, as the forward does, then back per row / item
        flat = torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats
        proj = owner.multi_modal_projector  # the module the forward calls it on
        sizes = [f.shape[0] for f in feats] if isinstance(feats, (list, tuple)) else None
        done = proj(flat.reshape(-1, flat.shape[-1]))
        feats = done.split(sizes) if sizes else done.reshape(*flat.shape[:-1], -1)
    if how["adds"] is not None:
        ph = torch.tensor([how["adds"].resolve(model)], device=model.device)
        base = model.get_input_embeddings()(ph)[0]
        many = isinstance(feats, (list, tuple))
        feats = tuple(base.to(f.dtype) + f for f in feats) if many else base + feats
    if isinstance(feats, (list, tuple)):  # per item; a [k, L, h] item (Idefics3): k tiles
        parts = [(k, r) for k, f in enumerate(feats) for r in (f if f.dim() == 3 else [f])]
        return Encoded(tuple(r for _, r in parts), parent=tuple(k for k, _ in parts), output=out)
    if feats.dim() == 3 and how["strip"] and getattr(out, "attention_mask", None) is not None:
        # each item's valid rows (on the device) cut it once the merge's verdict brings them
        return Encoded((feats,), output=out, counts=out.attention_mask.sum(-1))
    if feats.dim() == 3:
        return Encoded(tuple(feats), output=out)
    sizes = _lengths(owner, call)
    if sizes is None:  # one flat block: cut by the runs in the ids (only the total checked)
        return Encoded((feats,), split="items", output=out)
    return Encoded((feats,), output=out, counts=sizes)  # cut by the counts, after the verdict


def _lengths(owner: Any, call: dict) -> torch.Tensor | None:
    """Per item, its rows of a flat output (on the device), from the tower's own output-length
    function on the first mask / length argument (Whisper-style audio towers); None where
    there is none."""
    name = "_get_feat_extract_output_lengths"
    fn = next((getattr(s, name) for s in owner.modules() if hasattr(s, name)), None)
    given = [v for v in list(call.values())[1:] if isinstance(v, torch.Tensor) and v.dim() < 3]
    if fn is None or not given:
        return None
    lens = given[0].sum(-1) if given[0].dim() == 2 else given[0]
    out = fn(lens)
    return out[-1] if isinstance(out, tuple) else out


def _dummy(mods: tuple[ModalitySpec, ...]):
    """keep_tower: the first modality's last media call again, its media all ones (zeros are
    padding to Idefics3); nothing before the model's first media call: the class gives no
    minimal input."""

    def dummy(model: Any):
        last = _LAST.get(model, {})
        m = next((m for m in mods if m.name in last), None)
        if m is None:
            return None
        kw = dict(last[m.name])
        shape, dtype, device = kw[m.inputs[0]]
        kw[m.inputs[0]] = torch.ones(shape, dtype=dtype, device=device)  # zeros: padding to some
        return m.encode(model, kw).features

    return dummy


def _per_layer(placeholders: tuple[Token, ...]):
    """Gemma 3n / 4's per-layer inputs, computed as their forward does from the ids with every
    placeholder as the pad token (the forward cannot take them and ``inputs_embeds`` both)."""

    def after(model: Any, merged) -> dict:
        ids = merged.kwargs["input_ids"]
        lm = model.model.language_model
        pad = model.config.get_text_config().pad_token_id
        ph = torch.tensor([t.resolve(model) for t in placeholders], device=ids.device)
        text = ids.masked_fill(torch.isin(ids, ph), pad)
        return {"per_layer_inputs": lm.get_per_layer_inputs(text, None)}

    return after


def derive(model: Any) -> FamilySpec | None:
    """The spec of a transformers VLM class no written spec names; None for a model that is
    no transformers VLM at all; :class:`MediaInputError` naming what is missing for one that
    does not follow the convention. Warns once what was derived and what could not be."""
    cls = type(model)
    if not cls.__module__.startswith("transformers.") or not callable(
        getattr(model, "forward", None)
    ):
        return None  # no transformers model: nothing to derive from
    fwd = set(inspect.signature(model.forward).parameters)
    if not any("pixel_values" in p or "input_features" in p for p in fwd):
        return None
    notes: list[str] = []
    found = {m: _modality(model, m, fwd, notes) for m in MODALITIES}
    mods, ids = [], {}  # a placeholder two modalities share (Molmo2): the later one aliases
    for s in (s for s in found.values() if isinstance(s, ModalitySpec)):
        tid = s.placeholder.resolve(model)
        mods.append(replace(s, shares=ids[tid]) if tid in ids else s)
        ids.setdefault(tid, s.name)
    mods = tuple(mods)
    missing = [f"{m}: {why}" for m, why in found.items() if isinstance(why, str)]
    srcs = "".join(_source(type(o).forward) or "" for o in (model, getattr(model, "model", model)))
    if "masked_scatter" not in srcs:  # where else does it merge? (Phi-4: in its embedding)
        subs = {type(s).__name__: s for s in model.modules()}
        puts = sorted(n for n, s in subs.items() if "index_put(" in (_source(s.forward) or ""))
        if puts:
            missing.append(f"merged with index_put in {', '.join(puts)}: refused")
    if not mods or "inputs_embeds" not in fwd or any("refused" in w for w in missing):
        raise MediaInputError(
            f"install_vlm: no written spec knows {cls.__name__} and it does not follow the "
            f"transformers convention (get_<m>_features + config.<m>_token_id + masked_scatter): "
            + "; ".join(missing + ([] if "inputs_embeds" in fwd else ["no inputs_embeds"]))
        )
    both = "exactly one of input_ids or inputs_embeds" not in srcs
    per_layer = "per_layer_inputs" in fwd and bool(
        getattr(model.config.get_text_config(), "hidden_size_per_layer_input", 0)
    )
    spec = FamilySpec(
        name=f"derived:{cls.__name__}",
        classes={cls.__module__: frozenset({cls.__name__})},
        modalities=mods,
        text=TEXT,
        follow_ids=tuple(p for p in sorted(fwd) if p.endswith("token_type_ids")),
        ids_with_embeds=both,
        after_merge=_per_layer(tuple(m.placeholder for m in mods)) if per_layer else None,
        dummy=_dummy(mods),
    )
    warnings.warn(
        f"media guard: {cls.__name__} has no written family spec; derived from the class: "
        + ", ".join(f"{m.name} ({', '.join(m.inputs)})" for m in mods)
        + ". Not derived: repair geometry (a repair falls back), marker tokens (runs are bare), "
        "per-item counts the inputs do not carry (a tile or a flat block is cut as the ids "
        "say), audio in video; keep_tower replays the last media call's shapes"
        + "".join(f"; {n}" for n in notes)
        + "".join(f"; {w}" for w in missing if not w.split(": ", 1)[1].startswith("no ")),
        stacklevel=3,
    )
    return spec
