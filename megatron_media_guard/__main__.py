"""``python -m megatron_media_guard`` = the ``media-guard`` command."""

from .cli import main

raise SystemExit(main())
