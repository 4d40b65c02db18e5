"""Pinned per-step losses: every offload placement and training option, on 1 and 2 gloo ranks, must give
the same losses as the engine did at the recorded commit.

The numbers in data/step_baselines.json were recorded from commit
42f93fd614579c785022990584105a58817876b9 (the code before the offload-engine refactor; the JSON names
the commit, torch version and CPU-Adam SIMD level it was recorded with). A refactor must not change
them: each recipe's losses must stay within 1e-6 relative of the stored ones at every step (in practice
they are bit-identical on the machine that recorded them), and the same steps must be skipped.

Recipes (6 steps each, the small GPT of tests/models.py, ``sub_group_numel`` 4096 so that the NVMe
optimizer pipeline sees several sub-groups): parameters device/CPU/NVMe x optimizer states
device/CPU/NVMe; gradients on NVMe and on CPU with the NVMe optimizer; ``overlap_optimizer`` on and
off; gradient clipping; gradient accumulation 2; fp16 with dynamic loss scaling (near the overflow
edge, so steps are both skipped with the scale backed off and taken with the scale grown) and clipping;
bf16. All recipes of one world size run in one spawned group of processes.

To re-record (only for a deliberate numerical change, saying why in the commit): run
``ZINF_RECORD_BASELINES=1 python -m pytest tests/distributed/test_step_baselines.py``; it rewrites the
JSON with the current code's losses and commit instead of comparing.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

import zinf
from dist_utils import run_distributed
from training import Recipe, zinf_worker

pytestmark = pytest.mark.distributed

DATA = Path(__file__).parent / "data" / "step_baselines.json"
RECORD = os.environ.get("ZINF_RECORD_BASELINES", "0") not in ("", "0")
RTOL = 1e-6
STEPS = 6
TIERS = ("device", "cpu", "nvme")
# fp16 with a scale near the overflow edge that doubles after every 2 good steps: in 6 steps some steps
# overflow (skipped, scale halved) and some grow the scale (recorded: 1 skipped step on one rank, 2 on two)
FP16 = {"precision": "fp16", "loss_scale": {"initial_scale": 2.0**18, "growth_interval": 2}}


def _offload(params: str, optimizer: str, nvme: str, **extra: Any) -> dict[str, Any]:
    return {"offload": {"params": params, "optimizer": optimizer, "nvme_paths": [nvme + "/a", nvme + "/b"],
                        "sub_group_numel": 4096, "pinned_pool_bytes": 4 << 20, **extra}}


def _recipes(nvme: str) -> dict[str, Recipe]:
    def recipe(params: str, optimizer: str, clip: float = 0.0, accum: int = 1, extra: dict | None = None,
               **offload: Any) -> Recipe:
        return Recipe(kind="gpt", steps=STEPS, clip=clip, accum=accum,
                      zinf={**_offload(params, optimizer, nvme, **offload), **(extra or {})})

    out = {f"{p}/{o}": recipe(p, o) for p, o in itertools.product(TIERS, TIERS)}
    out.update({
        "cpu/nvme grads=nvme": recipe("cpu", "nvme", grads="nvme"),
        "cpu/nvme grads=cpu": recipe("cpu", "nvme", grads="cpu"),
        "nvme/nvme grads=cpu": recipe("nvme", "nvme", grads="cpu"),
        "cpu/cpu overlap=on": recipe("cpu", "cpu", overlap_optimizer=True),
        "cpu/cpu overlap=off": recipe("cpu", "cpu", overlap_optimizer=False),
        "nvme/nvme overlap=on": recipe("nvme", "nvme", overlap_optimizer=True),
        "nvme/nvme overlap=off": recipe("nvme", "nvme", overlap_optimizer=False),
        "device/device clip": recipe("device", "device", clip=0.5),
        "cpu/cpu clip": recipe("cpu", "cpu", clip=0.5),
        "nvme/nvme clip": recipe("nvme", "nvme", clip=0.5),
        "device/device accum=2": recipe("device", "device", accum=2),
        "cpu/cpu accum=2 clip": recipe("cpu", "cpu", clip=0.5, accum=2),
        "nvme/nvme accum=2": recipe("nvme", "nvme", accum=2),
        "device/device fp16 clip": recipe("device", "device", clip=0.5, extra=FP16),
        "cpu/cpu fp16 clip": recipe("cpu", "cpu", clip=0.5, extra=FP16),
        "nvme/nvme fp16 clip accum=2": recipe("nvme", "nvme", clip=0.5, accum=2, extra=FP16),
        "device/device bf16": recipe("device", "device", extra={"precision": "bf16"}),
        "cpu/cpu bf16": recipe("cpu", "cpu", extra={"precision": "bf16"}),
        "nvme/nvme bf16 clip": recipe("nvme", "nvme", clip=0.5, extra={"precision": "bf16"}),
    })
    return out


def _run(rank: int, world: int, recipes: dict[str, Recipe]) -> dict[str, dict[str, Any]]:
    out = {}
    for name, r in recipes.items():
        result = zinf_worker(rank, world, r)
        out[name] = {"losses": result["losses"], "skipped": result["skipped"]}
    return out


def _commit() -> str:
    """The commit of the zinf being run (``+dirty`` when its core/ or cpp/ differ from it)."""
    here = os.path.dirname(zinf.__file__)
    try:
        sha = subprocess.check_output(["git", "-C", here, "rev-parse", "HEAD"], text=True).strip()
        top = subprocess.check_output(["git", "-C", here, "rev-parse", "--show-toplevel"], text=True).strip()
        dirty = subprocess.check_output(["git", "-C", top, "status", "--porcelain", "--", "core", "cpp"], text=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("+dirty" if dirty.strip() else "")


def _record(world: int, got: dict[str, dict[str, Any]]) -> None:
    from zinf import native

    data = json.loads(DATA.read_text()) if DATA.exists() else {}
    commit = _commit()
    data.update({
        "recorded_from_commit": commit,
        "note": "per-step global losses (JSON floats: Python's repr, exact round trip); see test_step_baselines.py",
        "steps": STEPS,
        "environment": {"torch": torch.__version__, "python": platform.python_version(),
                        "simd_level": native.info().simd_level, "zinf_path": os.path.dirname(zinf.__file__)},
    })
    data.setdefault("worlds", {})[str(world)] = {"commit": commit, "recipes": got}
    DATA.parent.mkdir(parents=True, exist_ok=True)
    DATA.write_text(_dumps(data) + "\n")


def _dumps(value: Any, indent: str = "") -> str:
    """JSON with one line per recipe (its losses and skipped count), nested mappings above it indented."""
    if isinstance(value, dict) and not ("losses" in value and "skipped" in value):
        inner = indent + " "
        items = [f"{inner}{json.dumps(k)}: {_dumps(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    return json.dumps(value)


def _max_rel(stored: list[float], new: list[float]) -> float:
    if len(stored) != len(new):
        return math.inf
    rel = 0.0
    for a, b in zip(stored, new):
        if not (math.isfinite(a) and math.isfinite(b)):
            if not (a == b or (math.isnan(a) and math.isnan(b))):
                return math.inf
            continue
        rel = max(rel, abs(a - b) / max(abs(a), 1e-30))
    return rel


@pytest.mark.parametrize("world", [1, 2])
def test_step_losses_match_recorded_baseline(world: int, tmp_path: Path) -> None:
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
    recipes = _recipes(str(tmp_path))
    got = run_distributed(_run, world, recipes)[0]
    if RECORD:
        _record(world, got)
        return
    stored = json.loads(DATA.read_text())
    base = stored["worlds"][str(world)]["recipes"]
    missing = sorted(set(recipes) - set(base))
    assert not missing, f"no stored baseline for {missing}: record them (ZINF_RECORD_BASELINES=1, see the docstring)"
    rels = {name: _max_rel(base[name]["losses"], got[name]["losses"]) for name in recipes}
    failures = [f"{name}: max relative loss difference {rel:.3e} > {RTOL:g} (stored {base[name]['losses']}, "
                f"now {got[name]['losses']})" for name, rel in rels.items() if not rel <= RTOL]
    failures += [f"{name}: {got[name]['skipped']} skipped steps, stored {base[name]['skipped']}"
                 for name in recipes if got[name]["skipped"] != base[name]["skipped"]]
    worst = max(rels, key=lambda n: rels[n])
    print(f"{world} rank(s): {len(recipes)} recipes, largest relative loss difference {rels[worst]:.3e} ({worst})")
    assert not failures, (f"{world} rank(s): {len(failures)} difference(s) from the losses recorded at "
                          f"{stored['worlds'][str(world)]['commit']} (largest: {worst} {rels[worst]:.3e}):\n"
                          + "\n".join(failures))
