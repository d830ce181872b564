"""adapters/energon.py on megatron-energon's real TaskEncoder pipeline (``build_batch``: its
BatchDataset and the MapDataset that runs ``encode_batch``) over a small in-memory dataset.

Each crude sample is a rollout turn: the original image and the run length the engine wrote for
it. ``encode_sample`` processes the image as a static trainer does (GLM-4V's real image
processor at its own budget) and writes the rollout's ids; ``encode_batch`` runs the guard.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from originals import picture

from megatron_media_guard import GuardConfig
from megatron_media_guard.adapters.energon import guard_batch
from megatron_media_guard.testing.families import glm4v
from megatron_media_guard.testing.families.base import Media

energon = pytest.importorskip("megatron.energon")
from megatron.energon.errors import FatalSampleError  # noqa: E402
from megatron.energon.flavors.base_dataset import SavableDataset  # noqa: E402
from megatron.energon.wrappers.map_dataset import MapDataset  # noqa: E402
from transformers.models.glm4v.image_processing_pil_glm4v import (  # noqa: E402
    Glm4vImageProcessorPil,
)

PROC = Glm4vImageProcessorPil()
MODEL = glm4v.tiny_model()
ENGINE = {"shortest_edge": 112 * 112, "longest_edge": 3 * 112 * 112}


class Turns(SavableDataset):
    """A list of samples in memory, as energon's datasets yield them (no state to save)."""

    def __init__(self, samples: list[dict], worker_config) -> None:
        super().__init__(worker_config)
        self.samples = samples

    def len_worker(self, worker_idx: int | None = None) -> int:
        return len(self.samples)

    def reset_state_own(self) -> None:
        pass

    def worker_has_samples(self) -> bool:
        return True

    def config(self) -> dict[str, Any]:
        return {"type": "Turns", "n": len(self.samples)}

    def __iter__(self):
        yield from self.samples


class RolloutEncoder(energon.TaskEncoder):
    """Static processing in ``encode_sample``; the guard in ``encode_batch``."""

    def __init__(self, guard: GuardConfig, on_drop: str = "skip") -> None:
        super().__init__()
        self.guard, self.on_drop = guard, on_drop

    def encode_sample(self, sample: dict) -> dict:
        out = PROC(images=[sample["image"]], return_tensors="pt")
        _, h, w = out["image_grid_thw"][0].tolist()
        ids = glm4v.make_batch(MODEL, [[Media("image", (h, w), tokens=sample["run"])]]).kwargs
        return {"key": sample["key"], "inputs": {**ids, **out}, "original": sample["original"]}

    def batch(self, samples: list[dict]) -> dict:
        (s,) = samples  # one turn per batch: a skip is one turn
        return {"key": s["key"], "inputs": s["inputs"], "media": [s["original"]]}

    def encode_batch(self, batch: dict) -> dict:
        checked = guard_batch(
            batch["inputs"],
            "glm4v",
            config=MODEL.config,
            guard=self.guard,
            media=batch["media"],
            processor=PROC,
            on_drop=self.on_drop,
        )
        return {"key": batch["key"], "inputs": checked.batch, "matched": checked.matched}


def engine_run(img) -> tuple[int, dict]:
    out = PROC(images=[img], size=dict(ENGINE), return_tensors="pt")
    return int(out["image_grid_thw"][0].prod()) // 4, out


def loader(encoder: RolloutEncoder, turns: list[dict]):
    wc = energon.WorkerConfig(rank=0, world_size=1, num_workers=0)
    ds = MapDataset(Turns(turns, wc), encoder.encode_sample, worker_config=wc)
    ds = encoder.build_batch(ds, batch_size=1, worker_config=wc)
    return energon.get_loader(ds, watchdog_timeout_seconds=None)


def turns():
    imgs = [picture(200, 240, 1), picture(300, 500, 2), picture(260, 300, 3)]
    runs = [None, engine_run(imgs[1])[0], engine_run(imgs[2])[0]]
    originals = [imgs[0], imgs[1], None]  # the last turn lost its original
    return imgs, [
        {"key": k, "image": im, "run": n, "original": o}
        for k, (im, n, o) in enumerate(zip(imgs, runs, originals))
    ]


def test_a_task_encoder_repairs_from_the_original_and_skips_what_it_drops():
    imgs, data = turns()
    got = list(loader(RolloutEncoder(GuardConfig(policy="repair")), data))
    assert [b["key"] for b in got] == [0, 1]  # turn 2 (no original) skipped by energon
    assert got[0]["matched"] == set() and got[1]["matched"] == {("image", 0)}
    _, engine = engine_run(imgs[1])
    repaired = got[1]["inputs"]
    assert torch.equal(repaired["pixel_values"], engine["pixel_values"])
    assert torch.equal(repaired["image_grid_thw"], engine["image_grid_thw"])
    with torch.no_grad():
        MODEL(**repaired)


def test_mask_keeps_the_batch_with_the_dropped_sample_text_only():
    _, data = turns()
    got = list(loader(RolloutEncoder(GuardConfig(policy="drop"), on_drop="mask"), data))
    assert [b["key"] for b in got] == [0, 1, 2]
    for b in got[1:]:
        assert "pixel_values" not in b["inputs"]  # dropped: media out, placeholders text
        assert (b["inputs"]["input_ids"] == MODEL.config.image_token_id).sum() == 0


def test_a_raise_is_fatal_for_energon():
    _, data = turns()
    with pytest.raises(FatalSampleError, match="media guard"):
        list(loader(RolloutEncoder(GuardConfig(policy="raise")), data))


class PackingEncoder(energon.TaskEncoder):
    """The check per sample after packing selects it (``postencode_sample``, which energon runs
    on each sample of a selected pack before ``pack_selected_samples``): a drop leaves the
    pack, the rest is packed."""

    def __init__(self) -> None:
        super().__init__()
        self.plain = RolloutEncoder(GuardConfig(policy="repair"))

    def select_samples_to_pack(self, samples: list[dict]) -> list[list[dict]]:
        return [samples]  # one pack of the whole buffer

    def postencode_sample(self, sample: dict) -> dict:
        enc = self.plain.encode_sample(sample)
        return self.plain.encode_batch(self.plain.batch([enc]))

    def pack_selected_samples(self, samples: list[dict]) -> dict:
        return {"keys": [s["key"] for s in samples], "samples": samples}

    def batch(self, packs: list[dict]) -> dict:
        (pack,) = packs
        return pack


def test_after_packing_a_dropped_sample_leaves_the_pack():
    imgs, data = turns()
    enc = PackingEncoder()
    wc = energon.WorkerConfig(rank=0, world_size=1, num_workers=0)
    ds = enc.build_encode_sample(Turns(data, wc), worker_config=wc)
    ds = enc.build_batch(ds, batch_size=1, packing_buffer_size=3, worker_config=wc)
    (pack,) = list(energon.get_loader(ds, watchdog_timeout_seconds=None))
    assert pack["keys"] == [0, 1]  # turn 2 (no original) skipped inside the pack
    _, engine = engine_run(imgs[1])
    assert torch.equal(pack["samples"][1]["inputs"]["pixel_values"], engine["pixel_values"])
    assert pack["samples"][1]["matched"] == {("image", 0)}
