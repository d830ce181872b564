"""The family engine's ``apply="embed"`` mode (docs/FAMILIES.md): one forward pre-hook that
encodes each modality through the model's *own* feature method and merges the items with
:meth:`MediaGuard.merge` (the one fault path) in token order, read with the verdict where the
call mixes modalities or its counts live on the device (:class:`~..core.interleave.RunOrder`);
the forward runs on the merged ``inputs_embeds``. A text-only call is planned with no items
(it joins the stage's round, docs/CONSENSUS.md), passed on untouched unless a placeholder
stands in it."""

from __future__ import annotations

import functools

import torch

from ..core.interleave import RunOrder, order_runs, queued, take_per_run
from ..core.outcome import MergeResult
from ..core.repairs import media_hw
from ..core.runs import TokenLayout, parse_layout
from ..families.inputs import generated_as_text, gone_items
from ..families.inputs_items import call_items, typed_keys, typed_runs_order
from ..families.spec import Merged, present
from .forward_hook import CallArgs, ForwardHookHandle
from .vlm_items import counted, cut_blocks

PIXELS_FLAG = "_media_guard_pixels"  # tells a spec's encode to cut per-item pixels (repair)


class VLMHandle(ForwardHookHandle):
    """The installed pre-hook of one ``apply="embed"`` model instance. A video's tubelets
    inherit its ``set_items`` item's fields; the list's order is taken as the token order (it
    decides where modalities share a placeholder)."""

    def _guarded(self, call: CallArgs):
        ids = call.get("input_ids")
        if not isinstance(ids, torch.Tensor) or call.get("inputs_embeds") is not None:
            return None  # no token ids to check (or the caller merged already)
        kw = {"input_ids": ids, **{n: call.get(n) for m in self.spec.modalities for n in m.inputs}}
        mods = present(self.spec, kw)
        if not mods:  # text only: a guarded call all the same (it joins the stage's round)
            return self.call(self.label, lambda step, mb: self._text_only(call, ids, step, mb))
        return self.call(self.label, lambda step, mb: self._run(call, ids, kw, mods, step, mb))

    # ---- one call -----------------------------------------------------------------------

    def _run(self, call: CallArgs, ids: torch.Tensor, kw: dict, mods, step, mb):
        guard, spec, model = self.guard, self.spec, self.module
        if guard.config.policy == "repair":
            kw = {**kw, PIXELS_FLAG: True}
        encoded = {m.name: m.encode(model, kw) for m in mods}
        meta = self.take_items()
        encoded = cut_blocks(
            mods, encoded, meta, ids, guard.grammar, lambda *a: self.note(step, mb, *a)
        )
        items, feats, listed, parent = call_items(mods, encoded, meta)
        # several modalities, or counts on the device: the token order and the counts come
        # with the verdict, in its one transfer (core/interleave.RunOrder)
        late, decided, cut, sized = None, [], [], counted(mods, encoded, items, parent)
        checks = tuple(encoded[m.name].check for m in mods if encoded[m.name].check is not None)
        mixed = listed is None and len({it.modality for it in items}) > 1
        if sized is not None or mixed or checks:
            types = call.get(spec.token_types) if spec.token_types else None
            types = typed_keys(mods, types)

            def order_of(runs, got) -> list[int]:
                typed = None if types is None else typed_runs_order(runs, guard.grammar, mods, got)
                decided.append(listed or typed or order_runs(runs, guard.grammar, got, parent))
                return decided[-1]

            def resize(sizes: list[int], runs: list[int] | None):
                nonlocal parent, listed  # a video cut into its runs: each run's parent is the video
                got, fs, parent, source = sized[2](sizes, runs)
                if listed is not None:  # set_items' order: each item's runs in its place
                    listed = [k for i in listed for k, s in enumerate(source) if s == i]
                cut.append((got, fs))
                return cut[-1]

            counts, runs, _, probe, samples = sized or (None,) * 5
            late = RunOrder(
                order_of,
                keys=types,
                counts=counts,
                runs=runs,
                samples=samples,
                resize=resize if sized else None,
                probe=probe,
                checks=checks,
                types={m.name: m.type_id for m in mods if types is not None and m.type_id},
            )
        order = listed or list(range(len(items)))
        if late is None:  # token order known: the set_items order, or one modality's
            items, feats = [items[i] for i in order], [feats[i] for i in order]
        emb = self._embed(ids)
        labels = call.tensor("labels")
        remod = next((m for m in mods if m.reencode is not None), None)  # the repair's encoder
        res = guard.merge(
            emb,
            ids,
            feats,
            items,
            labels=labels,
            step=step,
            microbatch=mb,
            encoder=None if remod is None else lambda pixels, **_: remod.reencode(model, pixels),
            order=late,
        )
        if late is not None:  # the items as the merge cut them, in the order it found
            items, feats = cut[-1] if cut else (items, feats)
            order = decided[-1] if decided else list(range(len(items)))  # aligned: per modality
            items, feats = [items[i] for i in order], [feats[i] for i in order]
        owners = [parent[i] for i in order]  # per item (token order) its model-level item
        self.record(MergeResult(None, res.loss_mask, res.labels, res.report), ids, None)
        emb, ids = self._generated_as_text(res, ids)
        call.set("inputs_embeds", emb)
        for m in spec.modalities:
            for name in m.inputs:
                if call.get(name) is not None and name not in m.keep:
                    call.set(name, None)
        if labels is not None:
            call.set("labels", res.labels)
        if res.report.repaired:
            kw = self._regrid(call, kw, mods, items, owners, res)
        dropped = set(res.report.dropped)
        if dropped:
            gone = gone_items(res.report, [(it.modality, p) for it, p in zip(items, owners)])
            ids = self._drop_rewrite(call, ids, kw, mods, dropped, gone)
        if spec.reuse is not None:  # placed: every item (aligned), else those of kept samples
            rep_all = res.report.alignment
            owner = {i: r.sample for r in rep_all.samples for i in r.items} if rep_all else {}
            placed = range(len(items)) if rep_all is None else owner
            kept: dict[str, list[int]] = {m.name: [] for m in mods}
            for k in placed:
                if owner.get(k) not in dropped:
                    kept[items[k].modality].append(owners[k])
            kept = {m: sorted(set(v)) for m, v in kept.items()}
            for name, value in spec.reuse(model, encoded, kept).items():
                call.set(name, value)
        if spec.positions is not None and call.get("position_ids") is None:
            call.set("position_ids", spec.positions(model, call.view(ids)))
        call.set("input_ids", ids if spec.ids_with_embeds else None)
        self.keeper.planned(res.report.actions)  # the tower ran (encode): its features anchored
        if spec.after_merge is not None:
            self._after_merge(call, ids, items, feats, res, owners)
        return call.rebuild()

    def _text_only(self, call: CallArgs, ids: torch.Tensor, step, mb):
        """A call with no media: the tower kept in step where a media call encodes
        (docs/PARALLEL.md), then planned with no items (:meth:`MediaGuard.last_stage`, the
        stage's round as in a media call's merge). Aligned: the call as given; a literal
        placeholder is fed as text, dropped or raised, as the plan says."""
        self.keep_tower(had_media=False, feeds_media=False)
        call_items((), {}, self.take_items())  # set_items for this call: it holds no item
        labels = call.tensor("labels")
        res = self.guard.last_stage(ids, (), labels=labels, step=step, microbatch=mb)
        self.record(res, ids, None)
        _, new = self._generated_as_text(res, ids)
        dropped = set(res.report.dropped)
        if not dropped and new is ids:
            return None
        if dropped:
            new = self._drop_rewrite(call, new, {}, (), dropped, set())
            if labels is not None:
                call.set("labels", res.labels)
            self.keeper.planned(res.report.actions)
        call.set("input_ids", new)
        return call.rebuild()

    def _after_merge(self, call: CallArgs, ids, items, feats, res, owners) -> None:
        """The family's step after the merge (Nemotron's EVS) on this call's runs."""

        def runs() -> tuple:
            # the runs' positions, read only when the step asks (a transfer sized by the runs)
            g = self.guard.grammar
            parsed = parse_layout(TokenLayout(ids, g))
            if len(parsed.runs) != len(items):
                return ()  # runs the merge could not pair with items: nothing to act on
            # each run takes the next item of its token (items are in each modality's order)
            tokens = queued([g.token_modality(it.modality) for it in items])
            took, _ = take_per_run(tokens, [r.modality for r in parsed.runs])
            if -1 in took:
                return ()
            acts = res.report.actions
            return tuple(
                (items[k], (r.row, r.start, r.end), acts[r.sample] != "drop", owners[k])
                for r, k in zip(parsed.runs, took)
            )

        merged = Merged(call.view(ids), tuple(items), tuple(feats), functools.cache(runs))
        for name, value in self.spec.after_merge(self.module, merged).items():
            call.set(name, value)

    def _regrid(self, call: CallArgs, kw, mods, items, parent, res) -> dict:
        """Each repaired item's row of its modality's kept patch grids (``patches`` values in
        ``keep``) takes the grid the repair solved (a geometry is pure), so positions follow
        the re-encoded features; returns ``kw`` with the new grids."""
        grids = {m.name: [g for g in m.patches.values() if g in m.keep] for m in mods}
        out = dict(kw)
        report = res.report.alignment
        target = {i: n for r in report.samples for i, n in zip(r.items, r.expected)}
        for k in res.report.repaired:
            it = items[k]
            for name in grids.get(it.modality, ()):
                t = out.get(name)
                if not isinstance(t, torch.Tensor):
                    continue
                hw, kind = media_hw(it)  # as the repair solved it
                sol = self.guard.geometry.solve(
                    target[k], hw, num_frames=it.num_frames or 1, hw_kind=kind
                )
                t = t.clone()
                t[parent[k], -2:] = torch.tensor(sol.grid, dtype=t.dtype, device=t.device)
                out[name] = t
                call.set(name, t)
        return out

    def _generated_as_text(self, res, ids: torch.Tensor):
        """Placeholders the policy generated (``generated="text"``, kept samples) as the text
        token, in the ids and (when the call merged) the embeddings; labels untouched."""
        cfg = self.guard.config
        ids, at = generated_as_text(res.report, ids, self.text_id, cfg.generated)
        if at is None:
            return res.embeddings, ids
        if res.embeddings is None:  # a text-only call: the model embeds the ids itself
            return None, ids
        text = self._embed(ids[at][None])[0]
        return res.embeddings.index_put(at, text.to(res.embeddings.dtype)), ids

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.spec.embed is not None:
            return self.spec.embed(self.module, ids)
        return self.module.get_input_embeddings()(ids)

    def _drop_rewrite(self, call: CallArgs, ids, kw, mods, dropped, gone) -> torch.Tensor:
        """:meth:`rewrite` on the ids, the tensors that follow them and the kept inputs (the
        others left the call with the merge); returns the new ids."""
        given = {
            **{n: call.get(n) for n in self.spec.follow_ids},
            **{n: kw.get(n) for m in mods for n in m.keep},
            "input_ids": ids,
        }
        return self.rewrite(call, given, mods, dropped, gone)["input_ids"]


__all__ = ["VLMHandle"]
