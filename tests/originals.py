"""Original images for the data-side repair tests (families/reprocess.py, adapters/energon.py)."""

from __future__ import annotations

import numpy as np
from PIL import Image


def picture(h: int, w: int, seed: int) -> Image.Image:
    """A smooth RGB picture with edges (random noise would make every resampler agree less)."""
    rs = np.random.RandomState(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([np.sin(x / (7 + c) + y / (11 + c) + rs.rand() * 6) for c in range(3)], -1)
    img = (base * 100 + 128 + rs.randint(-20, 20, (h, w, 3))).clip(0, 255)
    return Image.fromarray(img.astype(np.uint8))
