"""Kept for launchers that import ``megatron_media_guard.launcher``: the launcher lives in
``megatron_media_guard.adapters.launcher`` (see CHANGELOG.md)."""

from .adapters.launcher import *  # noqa: F403
