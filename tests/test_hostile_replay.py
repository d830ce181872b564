"""Hostile bundles for ``media-guard replay``: bundles that declare more than they hold
(stride-0 views, zip bombs, safetensors headers that lie) or whose metadata has the wrong
types and sizes. Each exits 2 with one line saying why, before anything big is allocated;
exit 1 stays for a reproduced mismatch. And ``MediaItem`` refuses sample ids that no
diagnostic could carry."""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from family_checks import saved_bundle

from megatron_media_guard import MediaItem
from megatron_media_guard.cli import main
from megatron_media_guard.errors import MediaInputError
from megatron_media_guard.replay.bundle import FORMAT, BundleError, load_bundle
from megatron_media_guard.replay.bundle_save import save_bundle
from megatron_media_guard.testing import TEST_GRAMMARS

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("quiet_logger")]
Q = TEST_GRAMMARS["qwen"]


# ---- replay: hostile bundles ----------------------------------------------------------------
def _meta_and_tensors(path: Path) -> tuple[dict, dict]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as fh:
        return json.loads(fh.metadata()[FORMAT]), {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118


def _torch_bundle(d: Path, meta: dict, tensors: dict) -> Path:
    p = d / "hostile.bundle"
    torch.save({FORMAT: json.dumps(meta), "tensors": tensors}, p)
    return p


def _stride0(d, meta, tensors):
    """A few KB on disk; a [1, 3e8] int64 view of one element (2.4 GB once expanded)."""
    n = 300_000_000
    meta["tensors"]["input_ids"] = {"dtype": "int64", "shape": [1, n]}
    return _torch_bundle(d, meta, {"input_ids": torch.zeros(1, 1, dtype=torch.long).expand(1, n)})


def _zip_bomb(d, meta, tensors):
    """A deflated torch zip: small on disk, its directory declares 8 MB (limit here 1 MB)."""
    n = 1_000_000
    meta["tensors"]["input_ids"] = {"dtype": "int64", "shape": [1, n]}
    plain = _torch_bundle(d, meta, {"input_ids": torch.zeros(1, n, dtype=torch.long)})
    out = d / "bomb.bundle"
    with zipfile.ZipFile(plain) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename))
    assert out.stat().st_size < 100_000
    return out


def _st_file(d: Path, header: dict, data: bytes) -> Path:
    raw = json.dumps(header).encode()
    p = d / "hostile.bundle"
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return p


def _st_huge_shape(d, meta, tensors):
    spec = {"dtype": "I64", "shape": [1, 10**12], "data_offsets": [0, 8 * 10**12]}
    return _st_file(d, {"__metadata__": {FORMAT: json.dumps(meta)}, "input_ids": spec}, b"\0" * 8)


def _st_metadata(text: str):
    """A safetensors file of no tensors whose bundle metadata is ``text``."""
    return lambda d, meta, tensors: _st_file(d, {"__metadata__": {FORMAT: text}}, b"")


def _meta(mutate, drop: str | None = None):
    """The saved bundle with its metadata mutated (and the tensor ``drop`` left out)."""

    def make(d, meta, tensors):
        from safetensors.torch import save_file

        mutate(meta)
        p = d / "hostile.bundle"
        kept = {k: t for k, t in tensors.items() if k != drop}
        save_file(kept, str(p), metadata={FORMAT: json.dumps(meta)})
        return p

    return make


def _bytes(edit):
    """The saved bundle's bytes edited (cut, emptied, replaced)."""

    def make(d, meta, tensors):
        p = _meta(lambda m: None)(d, meta, tensors)
        p.write_bytes(edit(p.read_bytes()))
        return p

    return make


def _item(key, value):
    return _meta(lambda m: m["items"][0].__setitem__(key, value))


def _empty_dir(d, meta, tensors):
    (d / "junk").mkdir()
    return d / "junk"


HOSTILE_BUNDLES = {
    "stride0_view": (_stride0, "limit"),
    "zip_bomb": (_zip_bomb, "uncompressed"),
    "st_shape_past_the_file": (_st_huge_shape, "data offsets"),
    "st_header_length": (_bytes(lambda b: struct.pack("<Q", 1 << 60) + b"{}"), "header declares"),
    "st_deep_metadata": (_st_metadata("[" * 5000 + "]" * 5000), "invalid"),
    "items_not_a_list": (_meta(lambda m: m.__setitem__("items", 5)), "items"),
    "num_features_str": (_item("num_features", "five"), "num_features"),
    "num_features_huge": (_item("num_features", 10**30), "num_features"),
    "frame_hw_garbage": (_item("frame_hw", [1, 2, 3, {"a": 1}]), "frame_hw"),
    "sample_id_huge": (_item("sample_id", "x" * 100_000), "sample_id"),
    "sample_id_object": (_item("sample_id", {"a": 1}), "sample_id"),
    "grammar_missing": (_meta(lambda m: m.pop("grammar")), "grammar"),
    "grammar_id_str": (_meta(lambda m: m["grammar"].__setitem__("start_id", "x")), "start_id"),
    "rank_extra_key": (_meta(lambda m: m.__setitem__("rank", {"bogus": 1})), "rank"),
    "config_bad": (_meta(lambda m: m.__setitem__("config", {"policy": 7})), "policy"),
    "report_a_list": (_meta(lambda m: m.__setitem__("report", [1])), "report"),
    "mismatched_sample_str": (
        _meta(lambda m: m["report"].__setitem__("mismatched", [{"sample": "z"}])),
        "mismatched",
    ),
    "step_str": (_meta(lambda m: m.__setitem__("step", "x")), "step"),
    "tensors_a_list": (_meta(lambda m: m.__setitem__("tensors", [1])), "tensors"),
    # corrupt, partial or foreign bundles
    "truncated": (_bytes(lambda b: b[: len(b) // 2]), "not a readable bundle"),
    "empty": (_bytes(lambda b: b""), "not a media-guard bundle"),
    "garbage": (
        _bytes(lambda b: b"\x07garbage" * 8),
        "not a media-guard bundle: neither a torch zip nor a safetensors file",
    ),
    "bad_json": (_st_metadata("{no"), "invalid"),
    "newer_schema": (_meta(lambda m: m.update(schema=2)), "schema 2"),
    "not_a_bundle": (_meta(lambda m: m.update(format="other")), "not a media_guard.bundle"),
    "missing_tensor": (_meta(lambda m: None, drop="input_ids"), "partial bundle"),
    "dtype_lies": (
        _meta(lambda m: m["tensors"]["input_ids"].update(dtype="float32")),
        "metadata says",
    ),
    "num_features_negative": (_item("num_features", -1), "num_features"),
    "no_placeholders": (_meta(lambda m: m["grammar"].update(placeholders={})), "placeholders"),
    "no_items_key": (_meta(lambda m: m.pop("items")), "items"),
    "sample_not_in_batch": (_item("sample", 9), "inconsistent"),  # loads, fails the replay
    # no bundle file at all
    "a_directory": (_empty_dir, "is a directory: give one bundle file"),
    "the_bundles_directory": (lambda d, m, t: d, "(it holds media_guard.rank00001.step3"),
    "missing": (lambda d, m, t: d / "missing.bundle", "no bundle file at"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_BUNDLES))
@pytest.mark.parametrize("as_json", [False, True])
def test_hostile_bundle_exits_2_with_one_line(tmp_path, case, as_json, capsys):
    make, why = HOSTILE_BUNDLES[case]
    meta, tensors = _meta_and_tensors(saved_bundle(tmp_path))
    path = make(tmp_path, meta, tensors)
    code = main(["replay", str(path), "--max-bytes", str(1 << 20), *(["--json"] * as_json)])
    out, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("media-guard replay: ") and why in err and path.name in err, err
    assert "Traceback" not in err
    if as_json:  # the shape every subcommand's --json error has (test_report: report's)
        why = err.strip().removeprefix("media-guard replay: ")
        assert json.loads(out) == {"error": why, "exit_code": 2}
    else:
        assert out == ""
    if case != "sample_not_in_batch":  # a file that is no bundle: a wrong call, named
        with pytest.raises(BundleError, match=path.name):
            load_bundle(path, max_bytes=1 << 20)


@pytest.mark.parametrize("field", ["modality", "sample_id"])
def test_escape_sequences_in_a_bundle_never_reach_the_terminal(tmp_path, capsys, field):
    meta, tensors = _meta_and_tensors(saved_bundle(tmp_path))
    value = "\x1b[2Jevil" if field == "modality" else "\x1b]0;title\x07id"
    path = _item(field, value)(tmp_path, meta, tensors)
    code = main(["replay", str(path), "--max-bytes", str(1 << 20)])
    out, err = capsys.readouterr()
    assert code in (1, 2)
    assert "\x1b" not in out + err and "\x07" not in out + err


def test_the_limit_is_configurable_and_checked_before_loading(tmp_path, monkeypatch, capsys):
    path = saved_bundle(tmp_path)
    loaded = []
    real = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loaded.append(1) or real(*a, **k))
    assert main(["replay", str(path), "--max-bytes", "16"]) == 2
    err = capsys.readouterr().err
    assert "limit of 16 bytes" in err and "0.0 MiB" not in err and not loaded
    monkeypatch.setenv("MEDIA_GUARD_REPLAY_MAX_BYTES", "16")
    assert main(["replay", str(path)]) == 2
    monkeypatch.setenv("MEDIA_GUARD_REPLAY_MAX_BYTES", "lots")
    assert main(["replay", str(path)]) == 2
    assert "MEDIA_GUARD_REPLAY_MAX_BYTES" in capsys.readouterr().err


def test_token_ids_are_bounded_tighter_than_bytes(tmp_path, capsys):
    ids = torch.full((1, 40_000), 1, dtype=torch.long)  # 320 KB, 40k tokens
    path = save_bundle(tmp_path, input_ids=ids, items=[], grammar=Q)
    assert main(["replay", str(path), "--max-bytes", str(1 << 20)]) == 2  # 16,384 tokens admitted
    assert "token ids" in capsys.readouterr().err
    assert main(["replay", str(path), "--max-bytes", str(4 << 20)]) == 0  # aligned: no media


# ---- MediaItem refuses what diagnostics could not carry (and bad counts) ---------------------------------
@pytest.mark.parametrize(
    "fields, refused",
    [
        ({"sample_id": "abc"}, None),
        ({"sample_id": 7}, None),
        ({"sample_id": -(2**63) + 1}, None),
        ({"sample_id": torch.tensor(5)}, "sample_id"),  # str(x) or int(x) of it
        ({"sample_id": 2**63}, "sample_id"),
        ({"sample_id": 10**5000}, "sample_id"),
        ({"sample_id": "x" * 1025}, "sample_id"),
        ({"sample_id": 1.5}, "sample_id"),
        ({"sample_id": object()}, "sample_id"),
        ({"sample_id": True}, "sample_id"),
        ({"sample_id": b"id"}, "sample_id"),
        ({"num_features": -1}, "num_features"),
        ({"num_features": 2.0}, "num_features"),
        ({"sample": -1}, "sample"),
    ],
)
def test_media_item_checks_its_fields_at_construction(fields, refused):
    fields = {"num_features": 3, **fields}
    if refused is None:
        assert type(MediaItem(**fields).sample_id) in (str, int)
    else:
        with pytest.raises(MediaInputError, match=refused):
            MediaItem(**fields)


def test_str_subclass_with_a_hostile_repr_is_stored_as_a_plain_str():
    class Evil(str):
        def __repr__(self):
            raise RuntimeError("boom")

    item = MediaItem(3, sample_id=Evil("id-1"))
    assert type(item.sample_id) is str and repr(item.sample_id) == "'id-1'"
