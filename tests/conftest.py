"""Puts ``tests/`` on ``sys.path`` for the suites in its subfolders (``tests/families/``),
which import the shared helpers and tables of ``tests/`` (``family_checks``,
``test_check_batch``) as the files at the top level do."""

import logging

import pytest


@pytest.fixture
def quiet_logger():
    """The guard's logger at ERROR for the test (the records go to files; no console noise)."""
    from megatron_media_guard.diagnostics import get_logger

    get_logger().setLevel(logging.ERROR)
    yield
    get_logger().setLevel(logging.INFO)
