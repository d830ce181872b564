"""Every wrong call of an installer (``install_vlm``, ``install_from_args``) is answered with a
:class:`MediaInputError` that names the function called and what to pass, in a few short
lines: a tokenizer given as a string, a tokenizer that does not know the family's markers, a
model no family knows (each family named once), bad launcher arguments."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_media_guard import GuardConfig, MediaInputError
from megatron_media_guard.adapters.launcher import install_from_args
from megatron_media_guard.adapters.vlm_install import install_vlm
from megatron_media_guard.families import FAMILIES, family_names


def _omni():
    """A stand-in of transformers' Nemotron Omni class (the registry matches by class name):
    its config has the placeholder ids, its ``<img>`` / ``<so_start>`` markers come from the
    tokenizer."""
    cls = type("NemotronH_Omni_Reasoning_V3", (), {"__module__": "transformers.models.x"})
    model = cls()
    model.config = SimpleNamespace(image_token_id=5, audio_token_id=8, pad_token_id=0)
    return model


MARKERS = {"<img>": 1, "</img>": 2, "<so_start>": 6, "<so_end>": 7}


class _UnkTokenizer:
    """A tokenizer that maps every marker to its unk id (the wrong model's tokenizer)."""

    unk_token_id = 3

    def convert_tokens_to_ids(self, text):
        return 3


class _Plain:
    pass


@pytest.mark.parametrize(
    "call, needles, absent",
    [
        (  # a model name given where the tokenizer object belongs
            lambda: install_vlm(_omni(), GuardConfig(), tokenizer="my-tokenizer"),
            ["install_vlm", "'my-tokenizer'", "tokenizer object", "{token text: id} mapping"],
            [],
        ),
        (  # a real tokenizer whose markers map to unk: no "pass tokenizer=" advice
            lambda: install_vlm(_omni(), GuardConfig(), tokenizer=_UnkTokenizer()),
            ["install_vlm", "'<img>'", "_UnkTokenizer", "does not know", "model's own tokenizer"],
            ["pass tokenizer="],
        ),
        (  # no tokenizer at all: the advice is to pass one
            lambda: install_vlm(_omni(), GuardConfig()),
            ["install_vlm", "'<img>'", "pass tokenizer="],
            [],
        ),
        (  # a mapping that lacks the markers
            lambda: install_vlm(_omni(), GuardConfig(), tokenizer={"<img>": 3}),
            ["install_vlm", "'<so_start>'", "mapping given has none"],
            ["pass tokenizer="],
        ),
        (
            lambda: install_from_args(_omni(), SimpleNamespace(), tokenizer="my-tokenizer"),
            ["install_from_args", "'my-tokenizer'", "tokenizer object"],
            [],
        ),
        (
            lambda: install_from_args(_omni(), SimpleNamespace(), tokenizer=_UnkTokenizer()),
            ["install_from_args", "'<img>'", "does not know"],
            ["pass tokenizer="],
        ),
        (
            lambda: install_from_args(_omni(), None, step_end="sometimes"),
            ["install_from_args", "step_end must be one of", "'sometimes'"],
            [],
        ),
        (
            lambda: install_from_args(_omni(), SimpleNamespace(media_guard_policy="skip")),
            ["install_from_args", "policy", "'skip'"],
            [],
        ),
    ],
)
def test_wrong_installer_calls_name_the_function_and_what_to_pass(call, needles, absent):
    with pytest.raises(MediaInputError) as info:
        call()
    msg = str(info.value)
    for n in needles:
        assert n in msg, (n, msg)
    for n in absent:
        assert n not in msg, (n, msg)
    assert "AttributeError" not in msg


@pytest.mark.parametrize(
    "call, caller",
    [
        (lambda: install_vlm(_Plain(), GuardConfig()), "install_vlm"),
        (lambda: install_from_args([_Plain(), _Plain()], None), "install_from_args"),
    ],
)
def test_an_unknown_model_is_refused_in_short_lines_naming_each_family_once(call, caller):
    with pytest.raises(MediaInputError) as info:
        call()
    msg = str(info.value)
    assert msg.startswith(f"{caller}: no family knows")
    assert max(len(line) for line in msg.splitlines()) <= 100, msg
    names = family_names()
    assert set(names) == {f.name for f in FAMILIES} and len(names) < len(FAMILIES)
    for name in names:  # each once (a family's transformers and Bridge specs share a name)
        assert msg.count(f" {name},") + msg.count(f" {name}\n") == 1, (name, msg)
    assert "install_generic" in msg
