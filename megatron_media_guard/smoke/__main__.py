"""``python -m megatron_media_guard.smoke``: the smoke job (see the package docstring)."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
