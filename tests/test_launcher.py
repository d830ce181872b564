"""Megatron-LM launcher integration: arguments, environment overrides, install/remove."""

from __future__ import annotations

import argparse

import pytest
import torch

from megatron_media_guard import DropBudgetExceeded, GuardConfig, MediaInputError
from megatron_media_guard.adapters import guarded_by
from megatron_media_guard.adapters.launcher import (
    add_media_guard_args,
    budget_from_args,
    config_from_args,
    disabled,
    find_vlm,
    install_from_args,
)

llava_mod = pytest.importorskip("megatron.core.models.multimodal.llava_model")
mimo_mod = pytest.importorskip("megatron.core.models.mimo.model.base")

TOK, L, H = -200, 2, 4


def parse(argv):
    parser = add_media_guard_args(argparse.ArgumentParser())
    return parser.parse_args(argv)


FULL = [
    "--media-guard-policy", "drop",
    "--media-guard-fallback", "raise",
    "--media-guard-log-dir", "/tmp/mg",
    "--media-guard-nonfinite", "off",
    "--media-guard-allowed-fidelity", "engine-replay,unique", "closest-aspect",
    "--media-guard-drop-budget-step", "0.25",
    "--media-guard-drop-budget-window", "0.1",
    "--media-guard-window-steps", "20",
    "--media-guard-dump-dir", "/tmp/bundles",
    "--media-guard-generated", "raise",
    "--media-guard-keep-tower", "never",
]  # fmt: skip


def test_argparse_round_trip():
    args = parse(FULL)
    assert config_from_args(args, environ={}) == GuardConfig(
        policy="drop",
        fallback="raise",
        log_dir="/tmp/mg",
        nonfinite="off",
        allowed_fidelity=("engine-replay", "unique", "closest-aspect"),
        dump_dir="/tmp/bundles",
        generated="raise",
        keep_tower="never",
    )
    b = budget_from_args(args, environ={})
    assert (b.max_fraction_per_step, b.max_fraction_window, b.window_steps) == (0.25, 0.1, 20)
    assert not disabled(args, environ={})


def test_defaults_are_the_config_defaults():
    args = parse([])
    assert config_from_args(args, environ={}) == GuardConfig()
    assert budget_from_args(args, environ={}) is None
    assert parse(["--media-guard-disable"]).media_guard_disable
    parser = add_media_guard_args(argparse.ArgumentParser())
    assert "media guard" in [g.title for g in parser._action_groups]  # Megatron's --help


@pytest.mark.parametrize(
    "env, field, value",
    [
        ({"MEDIA_GUARD_POLICY": "raise"}, "policy", "raise"),
        ({"MEDIA_GUARD_LOG_DIR": "/elsewhere"}, "log_dir", "/elsewhere"),
        ({"MEDIA_GUARD_ALLOWED_FIDELITY": "unique"}, "allowed_fidelity", ("unique",)),
        ({"MEDIA_GUARD_DUMP_DIR": "/d"}, "dump_dir", "/d"),  # where the merge reads it
        ({"MEDIA_GUARD_GENERATED": "drop"}, "generated", "drop"),
        ({"MEDIA_GUARD_KEEP_TOWER": "on_drop"}, "keep_tower", "on_drop"),
    ],
)
def test_environment_overrides_arguments(env, field, value):
    assert getattr(config_from_args(parse(FULL), environ=env), field) == value


def test_environment_overrides_the_budget():
    env = {"MEDIA_GUARD_DROP_BUDGET_STEP": "0.5", "MEDIA_GUARD_WINDOW_STEPS": "3"}
    b = budget_from_args(parse(FULL), environ=env)
    assert (b.max_fraction_per_step, b.max_fraction_window, b.window_steps) == (0.5, 0.1, 3)


@pytest.mark.parametrize("flag", ["policy", "generated", "keep-tower"])
def test_argparse_refuses_a_choice_the_config_lacks(flag):
    with pytest.raises(SystemExit):
        parse([f"--media-guard-{flag}", "sometimes"])


@pytest.mark.parametrize(
    "raw, flag, want",
    [
        ("on", False, True),
        ("YES", False, True),
        ("true", False, True),
        ("off", True, False),
        ("no", True, False),
        ("0", True, False),
        ("", True, True),  # empty: the argument decides
        ("auto", False, False),
    ],
)
def test_disable_parses_like_the_config(raw, flag, want):
    args = parse(["--media-guard-disable"] if flag else [])
    assert disabled(args, environ={"MEDIA_GUARD_DISABLE": raw}) is want


@pytest.mark.parametrize(
    "fn, env, match",
    [
        (config_from_args, {"MEDIA_GUARD_POLICY": "ignore"}, "policy"),
        (budget_from_args, {"MEDIA_GUARD_WINDOW_STEPS": "2.5"}, "WINDOW_STEPS must be an integer"),
        (
            budget_from_args,
            {"MEDIA_GUARD_DROP_BUDGET_STEP": "lots"},
            "BUDGET_STEP must be a number",
        ),
        (budget_from_args, {"MEDIA_GUARD_DROP_BUDGET_STEP": "1.5"}, "fraction"),
        (disabled, {"MEDIA_GUARD_DISABLE": "maybe"}, "MEDIA_GUARD_DISABLE must be true/false"),
    ],
)
def test_bad_environment_values_name_themselves(fn, env, match):
    with pytest.raises(MediaInputError, match=match):
        fn(parse([]), environ=env)


# ---- install on a stand-in Megatron model ---------------------------------------------


class TinyLLaVA(torch.nn.Module):
    """An ``nn.Module`` with the attributes the release's ``_preprocess_data`` reads
    (copied from ``llava_standins``) and the real method."""

    _preprocess_data = llava_mod.LLaVAModel._preprocess_data

    def __init__(self, pre=True, post=True):
        from llava_standins import LLaVAStandIn

        super().__init__()
        for k, v in vars(LLaVAStandIn(7, pre, post, img_seq_len=L, image_token=TOK)).items():
            setattr(self, k, v)


class Wrapper(torch.nn.Module):
    """DistributedDataParallel / Float16Module stand-in: the model under ``.module``."""

    def __init__(self, module, ddp=False):
        super().__init__()
        self.module = module
        self.zeroed = 0
        if ddp:
            self.zero_grad_buffer = self._zero  # only the DDP wrapper has it

    def _zero(self):
        self.zeroed += 1


def chunks():
    inner = [TinyLLaVA(post=False), TinyLLaVA(pre=False)]
    return [Wrapper(Wrapper(m), ddp=True) for m in inner], inner


def call(m, ids, nit):
    b, s = ids.shape
    emb = torch.randn(L, int(nit.sum()), H)
    lang = torch.randn(b, s, H)
    return m._preprocess_data(
        emb, lang, ids, torch.ones(b, s), torch.zeros(b, s, dtype=torch.long), False, None, TOK, nit
    )


class TinyMimo(torch.nn.Module):
    align_embeddings_by_token_positions = mimo_mod.MimoModel.align_embeddings_by_token_positions

    def __init__(self):
        super().__init__()
        self.special_token_ids = {"images": 50}


def test_find_vlm_through_wrappers_and_submodules():
    model, inner = chunks()
    assert find_vlm(model[0]) == ("llava", inner[0])

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mimo = TinyMimo()

    h = Holder()
    assert find_vlm(Wrapper(h)) == ("mimo", h.mimo)
    assert find_vlm(torch.nn.Linear(2, 2)) is None


def test_install_from_args_on_virtual_pipeline_chunks_and_remove():
    model, inner = chunks()
    args = parse(["--media-guard-policy", "drop"])
    group = install_from_args(model, args, environ={})
    assert [h.kind for h in group] == ["llava", "llava", "step_end"]
    assert all(guarded_by(m._preprocess_data) is h for m, h in zip(inner, group))
    assert group[0].guard is group[1].guard
    assert type(group[0].guard.consensus).__name__ == "StageConsensus"
    ids = torch.tensor([[1, TOK, 2, 3], [4, 5, 6, 7]])
    out = call(inner[0], ids, torch.tensor([1], dtype=torch.int))
    assert out[0].shape == (5, 2, H)
    group.remove()
    assert all("_preprocess_data" not in vars(m) for m in inner)
    assert "zero_grad_buffer" in vars(model[0]) and model[0].zero_grad_buffer() is None
    assert model[0].zeroed == 1  # the DDP method is back and still works


def test_drop_budget_trips_at_the_next_train_step():
    model, inner = chunks()
    args = parse(["--media-guard-policy", "drop", "--media-guard-drop-budget-step", "0.4"])
    group = install_from_args(model, args, environ={})
    ids = torch.tensor([[1, 2, 3, TOK], [4, 5, 6, 7]])  # sample 0's image crosses length 7
    nit = torch.tensor([3], dtype=torch.int)  # [3, 9) after expansion
    args.curr_iteration = 1
    model[0].zero_grad_buffer()
    call(inner[0], ids, nit)
    assert group[0].last_result.dropped == (0,) and group[0].last_result.step == 1
    args.curr_iteration = 2
    with pytest.raises(DropBudgetExceeded, match="step 1: 1 of 2 samples"):
        model[0].zero_grad_buffer()
    group.remove()


def test_disabled_installs_nothing():
    model, inner = chunks()
    group = install_from_args(model, parse(["--media-guard-disable"]), environ={})
    assert len(group) == 0 and all("_preprocess_data" not in vars(m) for m in inner)


def test_no_vlm_is_a_clear_error():
    with pytest.raises(MediaInputError, match=r"no family knows(.|\n)*llava, mimo, qwen_vl"):
        install_from_args([torch.nn.Linear(2, 2)], parse([]), environ={})


def test_without_ddp_the_optimizer_step_closes_the_step():
    llava = TinyLLaVA()
    args = parse(["--media-guard-policy", "drop", "--media-guard-drop-budget-step", "0.4"])
    group = install_from_args([llava], args, environ={})
    assert repr(group[-1]) == "StepEnd(optimizer)"
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    p.grad = torch.ones(2)
    args.curr_iteration = 4
    call(llava, torch.tensor([[1, 2, 3, TOK], [4, 5, 6, 7]]), torch.tensor([3], dtype=torch.int))
    with pytest.raises(DropBudgetExceeded, match="step 4"):
        opt.step()
    group.remove()
    opt.step()  # the hook is gone


def test_manual_step_end_and_bad_choice():
    llava = TinyLLaVA()
    group = install_from_args([llava], parse([]), step_end="manual", environ={})
    assert [h.kind for h in group] == ["llava"]
    group.remove()
    with pytest.raises(MediaInputError, match="step_end must be one of"):
        install_from_args([llava], parse([]), step_end="sometimes", environ={})
    assert "_preprocess_data" not in vars(llava)


def test_dump_dir_reaches_the_guard_and_a_mismatch_writes_a_bundle(tmp_path):
    from megatron_media_guard import MediaItem
    from megatron_media_guard.replay.bundle import load_bundle

    mimo = TinyMimo()
    argv = ["--media-guard-policy", "drop", "--media-guard-dump-dir", str(tmp_path)]
    group = install_from_args([mimo], parse(argv), step_end="manual", environ={})
    handle = group[0]
    assert handle.guard.config.dump_dir == str(tmp_path)
    assert not hasattr(handle, "dump_dir")
    ids = torch.tensor([[1, 50, 50, 2], [3, 50, 4, 5]])
    embs = {"text": torch.randn(5, H), "images": torch.randn(3, H)}
    handle.set_items(
        [MediaItem(1, sample=0, modality="images"), MediaItem(2, sample=1, modality="images")]
    )
    mimo.align_embeddings_by_token_positions(embs, ids, mimo.special_token_ids)
    assert handle.last_result.report.dropped == (0, 1)
    (path,) = tmp_path.glob("*.bundle")
    assert load_bundle(path).input_ids.tolist() == ids.tolist()
    group.remove()


def test_dump_dir_reaches_the_llava_guard_without_a_warning(tmp_path, caplog):
    # the LLaVA adapter saves the bundles a replay can re-run (tests/test_llava_replay.py)
    import logging

    from megatron_media_guard.diagnostics import get_logger

    logger = get_logger()
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger=logger.name):
            group = install_from_args(
                [TinyLLaVA()], parse(["--media-guard-dump-dir", str(tmp_path)]), environ={}
            )
    finally:
        logger.removeHandler(caplog.handler)
    assert group[0].guard.config.dump_dir == str(tmp_path)
    assert "bundle" not in caplog.text
    group.remove()
