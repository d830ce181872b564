"""Clip-to-sample assignment by walking sound token counts against clip rows (host only)."""

from __future__ import annotations

import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_media_guard.adapters.llava.sound import clip_owners


def facts(tokens, rows):
    return types.SimpleNamespace(batch=len(tokens), sound=tuple(tokens), clip_rows=tuple(rows))


@pytest.mark.parametrize(
    ("tokens", "rows", "clips", "matched"),
    [
        ([3, 2, 4], [3, 2, 4], ((0,), (1,), (2,)), (True, True, True)),
        ([3, 0, 4], [3, 4], ((0,), (), (1,)), (True, True, True)),
        ([3, 5], [3, 2, 3], ((0,), (1, 2)), (True, True)),  # two clips in one sample
        ([3, 2, 4], [3, 1, 4], ((0,), (1,), (2,)), (True, False, True)),  # short middle clip
        ([3, 3, 4], [3, 2, 4], ((0,), (1,), (2,)), (True, False, True)),  # extra token
        # which one lacks its clip: ambiguous, all three are candidates
        ([3, 3, 3], [3, 3], ((0, 1), (), ()), (False, False, False)),
        ([3, 4], [3, 4, 2], ((0,), (1, 2)), (True, False)),  # a clip left over: the last
        ([0, 1], [2, 1], ((0, 1), ()), (False, False)),  # sample 0 lost its tokens
    ],
)
def test_walk_table(tokens, rows, clips, matched):
    own = clip_owners(facts(tokens, rows), None)
    assert own.clips == clips and own.matched == matched


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(st.integers(1, 9), min_size=1, max_size=6),
    data=st.data(),
)
def test_one_wrong_sample_is_never_misplaced(rows, data):
    """One sample's token count off: it is always unmatched, and when exactly one sample is
    unmatched it is that one."""
    bad = data.draw(st.integers(0, len(rows) - 1))
    delta = data.draw(st.integers(-rows[bad], 5).filter(lambda d: d != 0))
    tokens = list(rows)
    tokens[bad] += delta
    own = clip_owners(facts(tokens, rows), None)
    assert not own.matched[bad]
    unmatched = [i for i, ok in enumerate(own.matched) if not ok]
    if len(unmatched) == 1:
        assert unmatched == [bad]
