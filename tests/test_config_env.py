"""``GuardConfig(...)`` as the README builds it reads ``MEDIA_GUARD_<FIELD>``: an argument wins
over the environment, which wins over the default; ``environ={}`` reads none; ``with_env``
still lets the environment win over every field. A repair guard that cannot repair says so
when it is built."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from family_checks import records

from megatron_media_guard import Grammar, GuardConfig, MediaGuard, MediaInputError
from megatron_media_guard.testing import TEST_GRAMMARS, inject

ENV = {
    "MEDIA_GUARD_POLICY": "drop",
    "MEDIA_GUARD_LOG_DIR": "/from/env",
    "MEDIA_GUARD_ALLOWED_FIDELITY": "unique",
    "MEDIA_GUARD_DUMP_MAX": "none",
    "MEDIA_GUARD_FP8": "true",
}


@pytest.mark.parametrize(
    "kwargs, field, want",
    [
        ({}, "policy", "drop"),  # environment over default
        ({}, "log_dir", "/from/env"),
        ({}, "allowed_fidelity", ("unique",)),
        ({}, "dump_max", None),
        ({}, "fp8", True),
        ({}, "fallback", "drop"),  # not in the environment: the default
        ({}, "generated", "text"),
        ({"environ": {"MEDIA_GUARD_GENERATED": "drop"}}, "generated", "drop"),
        ({"policy": "raise"}, "policy", "raise"),  # argument over environment
        ({"log_dir": None}, "log_dir", None),  # an explicit None is an argument too
        ({"dump_max": 3}, "dump_max", 3),
        ({"environ": {}}, "policy", "raise"),  # no environment: defaults
        ({"environ": {"MEDIA_GUARD_POLICY": "repair"}}, "policy", "repair"),
        ({"environ": {}}, "keep_tower", "always"),
        ({"environ": {"MEDIA_GUARD_KEEP_TOWER": "on_drop"}}, "keep_tower", "on_drop"),
    ],
)
def test_argument_then_environment_then_default(monkeypatch, kwargs, field, want):
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    assert getattr(GuardConfig(**kwargs), field) == want


def test_positional_arguments_count_as_given(monkeypatch):
    monkeypatch.setenv("MEDIA_GUARD_POLICY", "drop")
    monkeypatch.setenv("MEDIA_GUARD_FALLBACK", "raise")
    cfg = GuardConfig("repair")
    assert (cfg.policy, cfg.fallback) == ("repair", "raise")


def test_replace_and_with_env_keep_their_meaning(monkeypatch):
    monkeypatch.setenv("MEDIA_GUARD_POLICY", "drop")
    cfg = GuardConfig(policy="raise", fallback="raise", log_dir="x", dump_dir="y")
    assert dataclasses.replace(cfg, nonfinite="off").policy == "raise"  # replace: no env
    assert cfg.with_env().policy == "drop"  # with_env: the environment wins
    assert cfg.with_env({}).policy == "raise"
    off = cfg.with_env({"MEDIA_GUARD_LOG_DIR": "", "MEDIA_GUARD_DUMP_DIR": ""})
    assert off.log_dir is None and off.dump_dir is None  # set but empty: logging, dumps off


@pytest.mark.parametrize(
    "env, needle",
    [
        ({"MEDIA_GUARD_DUMP_MAX": "many"}, "MEDIA_GUARD_DUMP_MAX must be an integer"),
        ({"MEDIA_GUARD_POLICY": "ignore"}, "MEDIA_GUARD_POLICY='ignore'"),
        ({"MEDIA_GUARD_FP8": "maybe"}, "MEDIA_GUARD_FP8 must be true/false"),
        ({"MEDIA_GUARD_DUMP_PIXELS": "maybe"}, "MEDIA_GUARD_DUMP_PIXELS must be true/false"),
        ({"MEDIA_GUARD_GENERATED": "no"}, "MEDIA_GUARD_GENERATED='no'"),
        ({"MEDIA_GUARD_KEEP_TOWER": "yes"}, "MEDIA_GUARD_KEEP_TOWER='yes'"),
    ],
)
def test_a_bad_variable_is_named(env, needle):
    with pytest.raises(MediaInputError, match=needle.replace("(", r"\(")):
        GuardConfig(environ=env)
    with pytest.raises(MediaInputError, match=needle.replace("(", r"\(")):
        GuardConfig(environ={}).with_env(env)  # the environment over every field
    given = dict(policy="raise", dump_max=1, fp8=None, dump_pixels=True, generated="text")
    given["keep_tower"] = "always"
    GuardConfig(**given, environ=env)  # every field given: no variable read


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"policy": "ignore"}, "policy must be one of"),
        ({"generated": "keep"}, "GuardConfig.generated must be one of"),
        ({"keep_tower": "sometimes"}, "keep_tower must be one of"),
        ({"ignore_index": "x"}, "ignore_index must be an int"),
        ({"allowed_fidelity": "unique"}, r"write \('unique',\)"),
    ],
)
def test_config_rejects_values_that_would_fail_later(kwargs, match):
    with pytest.raises(MediaInputError, match=match):
        GuardConfig(environ={}, **kwargs)


def test_the_readme_way_writes_where_the_variable_says(monkeypatch, tmp_path):
    """README: `MEDIA_GUARD_LOG_DIR` sets the log directory of `GuardConfig(policy="drop")`."""
    monkeypatch.setenv("MEDIA_GUARD_LOG_DIR", str(tmp_path / "logs"))
    monkeypatch.delenv("RANK", raising=False)
    q = TEST_GRAMMARS["qwen"]
    batch = inject(q, [[("image", 4)]], "surplus_feature")
    guard = MediaGuard(GuardConfig(policy="drop"), grammar=q)
    emb = torch.zeros(*batch.input_ids.shape, 8)
    guard.merge(emb, batch.input_ids, batch.features(8), batch.items)
    guard.close()
    assert records(tmp_path / "logs")[-1]["action"] == "drop"


@pytest.mark.parametrize(
    "policy, kwargs, missing",
    [
        ("repair", {}, "without geometry and encoder"),
        ("repair", {"encoder": object()}, "without geometry:"),
        ("repair", {"geometry": object(), "encoder": object()}, None),
        ("repair", {"geometry": object()}, None),  # the encoder may come with each merge
        ("drop", {}, None),  # other policies never warn
    ],
)
def test_repair_without_geometry_warns_at_construction(policy, kwargs, missing):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        MediaGuard(GuardConfig(policy=policy, environ={}), Grammar.qwen2_vl(), **kwargs)
    msgs = [str(w.message) for w in seen if "repair" in str(w.message)]
    if missing is None:
        assert msgs == []
    else:
        assert len(msgs) == 1 and missing in msgs[0] and "fallback ('drop')" in msgs[0], msgs
        assert seen[0].filename == __file__  # points at the caller's line
