"""Driver of test_checkpoint_commit.py's kill test: saves on 2 gloo ranks killed (SIGKILL) at random moments.

Started once with ``subprocess``; it imports torch and zinf once, runs no torch work of its own before
forking, and per iteration forks two fresh ranks that (1) load the checkpoint (a fresh load in new
processes, except on the first iteration, which saves step 1 instead), check that it is one save, and
report its step; (2) save steps loaded+1, loaded+2, ... in a loop, logging each save that returned, until
the driver kills them both after a random delay. Between iterations the driver itself (no process group)
checks the directory with ``consolidate`` and ``read_client_state``. It writes a JSON report to --out and
fails (exit 1) on the first violation.

Every saved value is the save's step (all masters and the client state), so a checkpoint mixing two saves
cannot look whole: it fails its commit check, or shows two steps.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import zinf
from zinf.checkpoint import consolidate, read_client_state

WORLD = 2


def _engine() -> zinf.ZeroInfinityEngine:
    model = nn.Sequential(*(nn.Linear(256, 256) for _ in range(4)))
    return zinf.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _set_all(engine: zinf.ZeroInfinityEngine, step: int) -> None:
    for g in engine.groups:
        engine.set_master(g, torch.full_like(engine.master_of(g), float(step)))
    engine.global_step = step


def _rank(rank: int, work: Path, ckpt: Path, iteration: int, driver: int) -> None:
    log = open(work / f"log{iteration}.rank{rank}", "a", buffering=1)  # line-buffered: a killed rank keeps its lines
    ready = False  # set once both ranks loaded and the driver may kill them
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{work / f'rendezvous{iteration}'}", rank=rank,
                                world_size=WORLD)
        engine = _engine()
        if iteration == 0:
            step = 1
            _set_all(engine, step)
            engine.save_checkpoint(str(ckpt), client_state={"step": step})
        else:
            client = engine.load_checkpoint(str(ckpt))
            step = engine.global_step
            values = {float(v) for g in engine.groups for v in engine.master_of(g).unique()}
            steps = engine.comm.all_gather_object(step)
            if values != {float(step)} or client != {"step": step} or len(set(steps)) != 1:
                log.write(f"MIXED step={step} values={sorted(values)} client={client} ranks={steps}\n")
                os._exit(3)
            dist.barrier()  # every rank has removed its leftovers
            if rank == 0:
                names = sorted(n for n in os.listdir(ckpt) if n != "commit.lock")
                log.write(f"files {json.dumps(names)}\n")
        log.write(f"loaded {step}\n")
        dist.barrier()
        if rank == 0:
            (work / f"ready{iteration}").touch()
        ready = True
        while os.getppid() == driver:  # until killed (or orphaned)
            step += 1
            _set_all(engine, step)
            engine.save_checkpoint(str(ckpt), client_state={"step": step})
            log.write(f"saved {step}\n")
    except BaseException as exc:  # noqa: BLE001
        text = traceback.format_exc().replace("\n", " | ")
        if ready and isinstance(exc, RuntimeError) and ("Connection reset by peer" in str(exc)
                                                        or "Connection closed by peer" in str(exc)):
            # the driver kills the ranks one after the other: the survivor's collective may see its peer gone
            log.write("PEERGONE " + text + "\n")  # (what that leaves on disk is checked like any kill)
        else:
            log.write("ERROR " + text + "\n")
        os._exit(2)
    os._exit(0)


def _lines(work: Path, iteration: int, rank: int) -> list[str]:
    path = work / f"log{iteration}.rank{rank}"
    return path.read_text().splitlines() if path.exists() else []


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--iterations", type=int, required=True)
    parser.add_argument("--max-delay", type=float, default=0.15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    # import now, once, what the ranks would otherwise each import lazily (torch.optim pulls in torch._dynamo)
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    torch.save({}, io.BytesIO())
    rng = random.Random(args.seed)
    work, ckpt = args.work, args.work / "ckpt"
    report: dict = {"iterations": [], "error": None}
    known = 0  # the newest step known to be committed: a save of it returned, or it was loaded
    try:
        for it in range(args.iterations):
            pids = []
            for rank in range(WORLD):
                pid = os.fork()
                if pid == 0:
                    _rank(rank, work, ckpt, it, os.getppid())
                pids.append(pid)
            deadline = time.monotonic() + 60
            while not (work / f"ready{it}").exists():
                done = [p for p in pids if os.waitpid(p, os.WNOHANG)[0]]
                if done or time.monotonic() > deadline:
                    raise AssertionError(f"iteration {it}: a rank ended before it was ready:\n"
                                         + "\n".join(_lines(work, it, 0) + _lines(work, it, 1)))
                time.sleep(0.005)
            time.sleep(rng.uniform(0, args.max_delay))
            order = pids if rng.random() < 0.5 else pids[::-1]
            os.kill(order[0], signal.SIGKILL)
            if rng.random() < 0.3:  # now and then one rank dies a moment before the other
                time.sleep(rng.uniform(0, 0.01))
            os.kill(order[1], signal.SIGKILL)
            for p in pids:
                os.waitpid(p, 0)

            logs = [_lines(work, it, r) for r in range(WORLD)]
            errors = [line for lines in logs for line in lines if line.startswith(("ERROR", "MIXED"))]
            if errors:
                raise AssertionError(f"iteration {it}: {errors}")
            loaded = int(next(line for line in logs[0] if line.startswith("loaded")).split()[1])
            if it > 0 and loaded not in (known, known + 1):
                raise AssertionError(f"iteration {it}: loaded step {loaded}, but step {known} was the newest "
                                     "known to be committed (only it or the save in flight may be current)")
            files = next((json.loads(line[6:]) for line in logs[0] if line.startswith("files ")), None)
            if files is not None and len(files) != 1 + WORLD:
                raise AssertionError(f"iteration {it}: after the load the directory holds {files}")
            outcome = "first" if it == 0 else ("old" if loaded == known else "new")
            saved = [int(line.split()[1]) for lines in logs for line in lines if line.startswith("saved")]
            known = max([loaded, *saved])
            # the driver's own offline check of what the kill left: one save, its step known or in flight
            state, client = consolidate(ckpt), read_client_state(ckpt)
            values = {float(v) for t in state.values() for v in t.unique()}
            if values != {float(client["step"])} or client["step"] not in (known, known + 1):
                raise AssertionError(f"iteration {it}: consolidate found values {sorted(values)[:4]} with client "
                                     f"state {client}; newest known commit {known}")
            report["iterations"].append({"loaded": loaded, "outcome": outcome, "saves_returned": len(saved) // WORLD,
                                         "leftover_files": len([n for n in os.listdir(ckpt) if n != "commit.lock"]) - 1 - WORLD})
    except BaseException as exc:  # noqa: BLE001
        report["error"] = f"{type(exc).__name__}: {exc}"
    args.out.write_text(json.dumps(report, indent=1))
    return 1 if report["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
