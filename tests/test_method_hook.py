"""The adapters' one hook type (``adapters/method_hook.Hook``) and the one step end
(``adapters/step_end``), on plain objects: what every adapter's install and ``remove()`` rely on.
Each adapter's own install is tested in its file; the multi-process FSDP2 / DDP loops in
tests/test_text_only_rank.py, tests/test_dist_layouts.py and tests/test_parallel_tower.py."""

from __future__ import annotations

import copy
import functools
import inspect

import pytest
import torch

from megatron_media_guard import Grammar, GuardConfig, MediaGuard, MediaInputError
from megatron_media_guard.adapters.method_hook import Hook, guarded_by
from megatron_media_guard.adapters.step_end import StepEnd


class Net(torch.nn.Module):
    def forward(self, x, scale=1.0):
        return x * scale


def test_forward_pre_and_post_run_between_torch_hooks_and_remove_restores():
    net, order = Net(), []
    net.register_forward_pre_hook(lambda m, a: order.append("torch pre"))
    net.register_forward_hook(lambda m, a, o: order.append("torch post"))

    def pre(args, kwargs):
        order.append("pre")
        return args, {**kwargs, "scale": 2.0}

    def post(args, kwargs, out):
        order.append("post")
        return out + kwargs["scale"]

    hook = Hook(net, "forward", "owner", pre=pre, post=post).install()
    assert inspect.signature(net.forward) == inspect.signature(Net().forward)  # generate reads it
    assert net(torch.ones(1)).item() == 4.0 and net.forward(torch.ones(1)).item() == 4.0
    assert order[:4] == ["torch pre", "pre", "post", "torch post"]  # FSDP2 / DDP stay outside
    assert guarded_by(net.forward) == "owner"
    with pytest.raises(MediaInputError, match="copy the model before installing"):
        copy.deepcopy(net)  # the copy would run this instance's forward
    hook.remove()
    hook.remove()  # idempotent
    assert "forward" not in vars(net) and net(torch.ones(1)).item() == 1.0


@pytest.mark.parametrize("wrap_later", [False, True])
def test_one_double_install_check_and_removal_in_reverse_order(wrap_later):
    net = Net()
    own = lambda x: x  # noqa: E731  an instance attribute already there comes back
    object.__setattr__(net, "forward", own)
    first = Hook(net, "forward", "first", around=lambda f, a, k: f(*a, **k) + 1).install()
    if wrap_later:  # someone wraps the guarded method (functools.wraps copies the mark)
        inner = net.forward
        object.__setattr__(net, "forward", functools.wraps(inner)(lambda *a: inner(*a)))
    with pytest.raises(MediaInputError, match="already guarded"):
        Hook(net, "forward", "second").install()
    if wrap_later:
        with pytest.raises(MediaInputError, match="replaced after the media guard"):
            first.remove()
        object.__setattr__(net, "forward", inner)
    first.remove()
    assert vars(net)["forward"] is own
    with pytest.raises(MediaInputError, match="no method 'nothing'"):
        Hook(net, "nothing", None).install()


def test_step_end_ends_each_step_once_per_guard_whoever_triggers_it():
    ended = []
    guards = [MediaGuard(GuardConfig(), Grammar({"image": 9}), consensus=False) for _ in "ab"]
    for g in guards:
        g.on_step_end = lambda step, g=g: ended.append((guards.index(g), step)) or {}
    step = {"now": 1}

    class DDP:
        def zero_grad_buffer(self):
            return "zeroed"

    ddp = DDP()
    ends = StepEnd([guards[0], guards[0], guards[1]], lambda: step["now"])
    assert ends.on_method(ddp, "nothing") is None
    assert ends.on_method(ddp, "zero_grad_buffer") is ends and ddp.zero_grad_buffer() == "zeroed"
    step["now"] = 2
    ddp.zero_grad_buffer()  # a new step: the previous one ends, once per guard
    ddp.zero_grad_buffer()
    assert ended == [(0, 1), (1, 1)]
    ends.end(1)  # another trigger on an ended step: nothing
    ends.on_optimizer_step()
    p = torch.nn.Parameter(torch.ones(1))
    p.grad = torch.ones(1)
    torch.optim.SGD([p], lr=0.1).step()  # the optimizer ends the current step
    assert ended == [(0, 1), (1, 1), (0, 2), (1, 2)]
    ends.remove()
    assert "zero_grad_buffer" not in vars(ddp) and not ends.installed
