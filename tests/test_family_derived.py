"""install_vlm on transformers classes no written spec names (``families/derived.py``), one
case table (``testing/derived_models.py``), the same checks on every case; comparisons on the
decoder's last hidden states."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from family_checks import raised_samples, records, response

from megatron_media_guard import GuardConfig
from megatron_media_guard.core.host import count_transfers
from megatron_media_guard.errors import MediaInputError

pytest.importorskip("transformers.models.gemma4")

from megatron_media_guard.adapters import install_vlm
from megatron_media_guard.families import find_family
from megatron_media_guard.families import gemma3 as gemma3_spec
from megatron_media_guard.testing.derived_batch import hidden, make_batch
from megatron_media_guard.testing.derived_models import CASE, CASES
from megatron_media_guard.testing.families.base import Media as M

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:media guard.*derived:UserWarning"),
]

NAMES = [c.name for c in CASES]


@functools.cache
def model(name: str):
    return CASE[name].build()


def guarded(name, samples, config=None, labels=False, **kw):
    m, c = model(name), CASE[name]
    b = make_batch(c, m, samples, **kw)
    call = dict(b.kwargs)
    if labels:
        call["labels"] = response(b)
    with install_vlm(m, config or GuardConfig()) as h:
        return b, hidden(m, call), h.last_result


def own(name, sample):
    m = model(name)
    b = make_batch(CASE[name], m, [sample])
    return hidden(m, b.kwargs)[0, : b.lengths[0]]


def sizes(name):
    """Per modality of the case, (small, large) items (the same where counts are fixed)."""
    return [(mod, M(mod, s[0]), M(mod, s[-1])) for mod, s in CASE[name].sizes.items()]


def runs(name, item) -> list[int]:
    """The item's runs in the ids (one per image / clip, or one per tile)."""
    return [n for _, n in make_batch(CASE[name], model(name), [[item]]).runs[0]]


@pytest.mark.parametrize("name", NAMES)
def test_the_spec_is_derived_and_said_once(name):
    m = model(name)
    with pytest.warns(UserWarning, match="no written family spec; derived") as w:
        target, spec = find_family(m)
    assert len(w) == 1 and target is m and spec.name == f"derived:{type(m).__name__}"
    assert set(CASE[name].sizes) <= {x.name for x in spec.modalities}
    assert "repair geometry" in str(w[0].message)


#: per modality of each case, and a call mixing them (the runs' order and the clips' counts
#: ride in the verdict)
MODS = [(n, mod) for n in NAMES for mod in CASE[n].sizes]
MODS += [(n, "mixed") for n in NAMES if len(CASE[n].sizes) > 1]


@pytest.mark.parametrize("name,mod", MODS, ids=[f"{n}-{m}" for n, m in MODS])
def test_aligned_is_bit_identical_with_one_transfer(name, mod):
    if mod == "mixed":
        samples = [[small] for _, small, _ in sizes(name)] + [[b for _, _, b in sizes(name)]]
    else:
        _, small, big = next(s for s in sizes(name) if s[0] == mod)
        samples = [[small], [big]]
    with count_transfers() as n:
        b, out, res = guarded(name, samples)
    assert torch.equal(out, hidden(model(name), b.kwargs))
    assert res.report.actions == ("keep",) * len(samples)
    assert sum(n.values()) == 1, n


def faults(name):
    """(fault, samples, bad samples, a kept sample): per modality of the case."""
    out = []
    for mod, small, big in sizes(name):
        rs, rb = runs(name, small), runs(name, big)
        n, k = sum(rs), sum(rb)
        out += [
            (f"{mod} short run", [[M(mod, small.size, tokens=n - 1)], [big]], {0}, 1),
            (
                f"{mod} +k-k",
                [[M(mod, small.size, tokens=n + 1)], [M(mod, big.size, tokens=k - 1)], [big]],
                {0, 1},
                2,
            ),
        ]
        if len(rs) == len(rb) == 1 and n != k:  # tiles of equal counts: no count sees a swap
            out.append((f"{mod} swap", [[small], [big], [small]], {0, 1}, 2))
    return out


FAULTS = [(name, *f) for name in NAMES for f in faults(name)]
IDS = [f"{f[0]}-{f[1]}" for f in FAULTS]


def _swap(fault):
    return {"swap": (fault.split()[0], 0, 1)} if fault.endswith("swap") else {}


#: the plain model under each fault (measured): a short run raises with batch totals and no
#: sample, except Qwen2.5-Omni's audio (no check: the clip silently loses a feature row);
#: +k-k and swaps run silently, features in the other sample's positions
SILENT_SHORT = {("qwen2_5_omni", "audio short run")}


@pytest.mark.parametrize("name,fault,samples,bad,kept", FAULTS, ids=IDS)
def test_the_plain_model_sees_batch_totals_only(name, fault, samples, bad, kept):
    m = model(name)
    b = make_batch(CASE[name], m, samples, **_swap(fault))
    if fault.endswith("short run") and (name, fault) not in SILENT_SHORT:
        with pytest.raises(ValueError, match=r"features and .* tokens do not match") as e:
            hidden(m, b.kwargs)
        assert "sample" not in str(e.value)
        return
    out = hidden(m, b.kwargs)  # silent: mismatched runs taken; a swap: sample 0 not its own
    if fault.endswith("swap"):
        assert not torch.allclose(out[0, : b.lengths[0]], own(name, samples[0]), atol=1e-4)


@pytest.mark.parametrize("name,fault,samples,bad,kept", FAULTS, ids=IDS)
def test_raise_names_the_sample_and_drop_keeps_the_others(
    name, fault, samples, bad, kept, tmp_path
):
    cfg = GuardConfig(log_dir=str(tmp_path))
    run = lambda: guarded(name, samples, cfg, **_swap(fault))  # noqa: E731
    assert raised_samples(run, bad, tmp_path) >= bad
    b, out, res = guarded(name, samples, GuardConfig(policy="drop"), True, **_swap(fault))
    assert {s for s, a in enumerate(res.report.actions) if a == "drop"} == bad
    torch.testing.assert_close(out[kept, : b.lengths[kept]], own(name, samples[kept]))
    assert all((res.labels[s] == -100).all() for s in bad)


@pytest.mark.parametrize("name", NAMES)
def test_a_generated_placeholder_is_fed_as_text(name):
    m, c = model(name), CASE[name]
    _, small, _ = sizes(name)[0]
    b = make_batch(c, m, [[small], [small]])
    spec = find_family(m)[1]
    ph, text = spec.modalities[0].placeholder.resolve(m), spec.text.resolve(m)
    pos = b.lengths[1] - 1  # the last text token of sample 1, under the loss
    labels = response(b)
    fixed = dict(b.kwargs, input_ids=b.input_ids.clone())
    fixed["input_ids"][1, pos] = text
    b.kwargs["input_ids"][1, pos] = ph
    with install_vlm(m, GuardConfig(policy="drop")) as h:
        out = hidden(m, dict(b.kwargs, labels=labels))
    fixed["labels"] = labels
    assert h.last_result.report.actions == ("keep", "keep")
    assert h.last_result.report.generated == ((1, (pos,)),)
    torch.testing.assert_close(out, hidden(m, fixed), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_a_text_only_call_runs_the_tower_and_remove_restores(name):
    """keep_tower="always": the last media call's tower input again, on zeros, before the
    decoder; after remove() the plain model (a fault runs or raises as it did unguarded)."""
    m, c = model(name), CASE[name]
    mod, small, _ = sizes(name)[0]
    media = make_batch(c, m, [[small]]).kwargs
    text = make_batch(c, m, [[], []]).kwargs
    order: list[str] = []
    owner = m.model if hasattr(m, "model") else m
    fn = getattr(owner, f"get_{mod}_features")
    hook = m.get_decoder().register_forward_hook(lambda *a: order.append("decoder"))
    with install_vlm(m, GuardConfig(keep_tower="always")) as h:
        hidden(m, media)  # a media call first: the class gives no minimal input
        order.clear()
        setattr(owner, f"get_{mod}_features", lambda *a, **k: order.append("tower") or fn(*a, **k))
        try:
            hidden(m, text)
        finally:
            delattr(owner, f"get_{mod}_features")
    hook.remove()
    assert order == ["tower", "decoder"]
    assert getattr(m, "_media_guard_vlm", None) is None and not h.installed


def test_the_written_spec_wins():
    from megatron_media_guard.testing.families import gemma3

    m = gemma3.tiny_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing derived: no warning
        assert find_family(m)[1] is gemma3_spec.SPEC


def test_an_index_put_merge_is_refused_saying_so():
    """Phi-4-multimodal merges with index_put and has no feature method: refused, naming both."""
    from transformers import Phi4MultimodalConfig, Phi4MultimodalForCausalLM

    cfg = Phi4MultimodalConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
        ),
        audio_config=dict(
            hidden_size=32, intermediate_size=64, num_blocks=1, num_attention_heads=2
        ),
    )
    with pytest.raises(
        MediaInputError, match=r"does not follow the transformers convention.*index_put"
    ):
        find_family(Phi4MultimodalForCausalLM(cfg))


@pytest.mark.parametrize("name", NAMES)
def test_repair_falls_back_saying_no_geometry_was_derived(name, tmp_path):
    _, small, big = sizes(name)[0]
    n = sum(runs(name, small))
    cfg = GuardConfig(policy="repair", fallback="drop", log_dir=str(tmp_path))
    b, out, res = guarded(name, [[M(small.modality, small.size, tokens=n - 1)], [big]], cfg)
    assert res.report.actions == ("drop", "keep")
    why = " ".join(str(r.get("reason")) for r in records(tmp_path) if r["sample"] == 0)
    assert "no geometry for derived:" in why, why
    torch.testing.assert_close(out[1, : b.lengths[1]], own(name, [big]))
