"""[Note: frozen shards in place] in zinf/offload/in_place.py, on real gloo processes: a bf16 Llama checkpoint
loaded under ``zinf.Init`` with parameters on NVMe in bf16 storage, most of it frozen (LoRA's shape):

- on 2 ranks, reading the frozen shards from the checkpoint's files trains exactly as copying them to the swap files
  (``offload.frozen_in_place: false``): the same losses and final values bit for bit; the swap holds only the
  trained groups, the report counts the frozen bytes as read from the checkpoint, and the files are not written;
- a checkpoint file changed under a run (rewritten, rewritten with its old modification time restored, truncated) is
  refused at the next read, naming the file;
- new values loaded into a built engine give a frozen group a swap record of its own (the files stay as they were);
- [Note: frozen groups read whole] in zinf/offload/whole_reads.py: each rank reading every rank's shard
  (``offload.frozen_reads: whole``) trains bit for bit as all-gathering them and as a copied base; no all-gather is
  issued for a frozen group read whole (each collective counted by the group it gathers), the ranks' transport moves
  the trained groups' gathers alone, and an evaluation forward reads one more shard of each frozen group than the
  gathered path and nothing else (the engine's NVMe bytes);
- [Note: one pass per byte] in zinf/offload/in_place.py: read whole or by one rank, a frozen shard's checksum is
  taken in the gather's widening copy, never in a pass of its own (all-gathered, at the read); a shard refused on one
  rank stops the others at once, and with one rank a shard read again once its file is back trains as before.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest
import torch

import zinf
from dist_utils import run_distributed
from models import llama_config, token_batches
from training import lm_step_global
from zinf.errors import ZinfError
from zinf.offload.in_place import CheckpointChangedError

pytestmark = pytest.mark.distributed

STEPS = 3
TRAINED = ("model.layers.1.mlp.", "model.norm.")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from transformers import LlamaForCausalLM

    path = tmp_path_factory.mktemp("llama_bf16")
    torch.manual_seed(5)
    LlamaForCausalLM(llama_config()).to(torch.bfloat16).save_pretrained(path, max_shard_size="60KB")
    return path


def _files(path: Path) -> dict[str, tuple[str, int]]:
    return {f.name: (hashlib.sha256(f.read_bytes()).hexdigest(), f.stat().st_mtime_ns)
            for f in sorted(path.glob("*.safetensors"))}


def _build(path: str, nvme: str, in_place: bool, reads: str = "gathered", shared: str = "auto"):
    from transformers import AutoModelForCausalLM

    os.makedirs(nvme, exist_ok=True)
    config = zinf.ZeroConfig.from_dict({
        "precision": "fp32", "param_storage": "bf16",
        "offload": {"params": "nvme", "nvme_paths": [nvme], "pinned_pool_bytes": 8 << 20,
                    "frozen_in_place": in_place, "frozen_reads": reads},
        "overlap": {"shared_memory": shared}})
    with zinf.Init(config):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(TRAINED))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, zinf.initialize(model, opt, config)


def _train(rank: int, world: int, path: str, nvme: str, in_place: bool) -> dict:
    model, engine = _build(path, nvme, in_place)
    nvme_bytes = engine.resident_bytes()["nvme"]
    model.train()
    losses = []
    for x in token_batches(STEPS, 4):
        losses.append(lm_step_global(engine, x, rank, world))
    state = engine.full_state_dict()
    engine.close()
    return {"losses": losses, "state": state, "nvme": nvme_bytes}


def _both(rank: int, world: int, path: str, root: str) -> list[dict]:
    return [_train(rank, world, path, os.path.join(root, f"nvme_{flag}"), flag) for flag in (True, False)]


def test_frozen_shards_read_in_place_train_exactly_as_copied(checkpoint: Path, tmp_path: Path) -> None:
    before = _files(checkpoint)
    in_place, copied = zip(*run_distributed(_both, 2, str(checkpoint), str(tmp_path)))
    assert _files(checkpoint) == before, "a checkpoint file was written"
    for rank, (a, b) in enumerate(zip(in_place, copied)):
        assert a["losses"] == b["losses"], (rank, a["losses"], b["losses"])
        assert set(a["state"]) == set(b["state"])
        for k in a["state"]:
            assert torch.equal(a["state"][k], b["state"][k]), (rank, k)
        # the swap holds the trained groups only; the frozen bytes are counted as read from the checkpoint
        assert "frozen_in_checkpoint" not in b["nvme"], b["nvme"]
        frozen = a["nvme"]["frozen_in_checkpoint"]
        assert frozen > 0 and a["nvme"]["param_shards"] + frozen <= b["nvme"]["param_shards"], (a["nvme"], b["nvme"])
        assert a["nvme"]["param_shards"] < b["nvme"]["param_shards"] / 4, (a["nvme"], b["nvme"])
    assert in_place[0]["losses"] == in_place[1]["losses"]


def _first_file(path: Path) -> Path:
    return sorted(path.glob("*.safetensors"))[0]


def _step(engine, x: torch.Tensor) -> None:
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()


def _changed(rank: int, world: int, path: str, nvme: str, how: str, reads: str = "gathered") -> str:
    _, engine = _build(path, os.path.join(nvme, str(rank)), True, reads)
    target = _first_file(Path(path))
    raw = bytearray(target.read_bytes())
    seen = target.stat()
    if rank == 0 and how == "truncated":
        target.write_bytes(raw[: len(raw) - 4096])
    elif rank == 0:
        raw[-64] ^= 0xFF  # inside the last tensor's bytes
        target.write_bytes(raw)
        if how == "same_mtime":  # only the checksum can tell
            os.utime(target, ns=(seen.st_atime_ns, seen.st_mtime_ns))
    torch.distributed.barrier()
    try:
        _step(engine, token_batches(1, 2)[0])
    except CheckpointChangedError as exc:
        return str(exc)
    finally:
        engine.placement.store.flush()
    return "no error"


@pytest.mark.parametrize("how", ["rewritten", "same_mtime", "truncated"])
def test_a_checkpoint_changed_under_a_run_is_refused(checkpoint: Path, tmp_path: Path, how: str) -> None:
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(checkpoint, copy)
    (message,) = run_distributed(_changed, 1, str(copy), str(tmp_path / "nvme"), how)
    assert _first_file(copy).name in message and "Refusing to train" in message, message
    if how == "same_mtime":
        assert "CRC32C" in message, message


def test_a_checkpoint_changed_under_ranks_reading_it_whole_is_refused(checkpoint: Path, tmp_path: Path) -> None:
    """Read whole, every rank reads the changed bytes: each refuses them, by their checksum alone."""
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(checkpoint, copy)
    for message in run_distributed(_changed, 2, str(copy), str(tmp_path / "nvme"), "same_mtime", "whole"):
        assert _first_file(copy).name in message and "CRC32C" in message, message


def _refused_on_one_rank(rank: int, world: int, path: str, nvme: str, reads: str) -> dict:
    """One rank's checksum of one frozen group made wrong after step 1 (as if that rank read the file while it was
    being changed); step 2 on every rank, then the checksum put back and step 2 again."""
    import time

    model, engine = _build(path, os.path.join(nvme, str(rank)), True, reads)
    model.train()
    batches = token_batches(2, 4)
    losses = [lm_step_global(engine, batches[0], rank, world)]
    engine.synchronize()
    engine.placement.store.flush()  # the next gathers read the files again
    store = engine.placement.store
    from zinf.offload.in_place import InPlaceRecord

    read_in_place = [g for g in engine.groups if isinstance(store.records[id(g)], InPlaceRecord)]
    group = read_in_place[len(read_in_place) // 2]  # one the forward reaches after others have been gathered
    record = store.records[id(group)]
    good = record.crc
    if rank == 0:
        record.crc = good ^ 1
    began, error = time.monotonic(), ""
    try:
        lm_step_global(engine, batches[1], rank, world)
    except ZinfError as exc:
        error = f"{type(exc).__name__}: {exc}"
    waited = time.monotonic() - began
    record.crc = good
    out = {"losses": losses, "error": error, "waited": waited, "state": group.state.name}
    if world == 1:  # the refused slot was dropped: the shard is read again from the files, and trains as before
        out["again"] = lm_step_global(engine, batches[1], rank, world)
    engine.close()
    return out


@pytest.mark.parametrize("world,reads", [(1, "gathered"), (2, "whole")])
def test_a_shard_refused_in_the_widening_copy_unwinds_cleanly(checkpoint: Path, tmp_path: Path, world: int,
                                                              reads: str) -> None:
    """The checksum taken in the widening copy ([Note: one pass per byte]) is verified before the group leaves
    SHARDED: the refusing rank's pass unwinds as after a failed read, the other rank stops at the next round at once
    (not after the collective timeout), and with one rank the same step run again, once the file is as it was,
    gives the loss of an undisturbed run."""
    results = run_distributed(_refused_on_one_rank, world, str(checkpoint), str(tmp_path / "nvme"), reads)
    assert "CheckpointChangedError" in results[0]["error"] and "CRC32C" in results[0]["error"], results[0]
    assert results[0]["state"] == "SHARDED", results[0]
    if world == 2:
        assert "the pass raised on rank(s) [0]" in results[1]["error"], results[1]
        assert results[1]["waited"] < 60, results[1]
        return
    (clean,) = run_distributed(_train, 1, str(checkpoint), str(tmp_path / "clean"), True)
    assert results[0]["again"] == clean["losses"][1], (results[0]["again"], clean["losses"])


def _load_into(rank: int, world: int, path: str, nvme: str) -> dict:
    model, engine = _build(path, nvme, True)
    state = engine.full_state_dict()
    new = {k: v + 1 if v.is_floating_point() else v for k, v in state.items()}
    engine.load_full_state_dict(new)
    got = engine.full_state_dict()
    bytes_after = engine.resident_bytes()["nvme"]
    engine.close()
    return {"new": new, "got": got, "nvme": bytes_after}


def test_new_values_for_a_frozen_group_go_to_swap(checkpoint: Path, tmp_path: Path) -> None:
    before = _files(checkpoint)
    (res,) = run_distributed(_load_into, 1, str(checkpoint), str(tmp_path / "nvme"))
    assert _files(checkpoint) == before
    for k, v in res["new"].items():  # a frozen group's values are its bf16 shard's
        expect = v if k.startswith(TRAINED) or not v.is_floating_point() else v.to(torch.bfloat16).float()
        assert torch.equal(res["got"][k], expect), k
    assert "frozen_in_checkpoint" not in res["nvme"], res["nvme"]


class _Counted:
    """Every all-gather a group issues (``collectives.all_gather``, called by the group's ``start_gather``: the group
    is its caller) and every byte the ranks' collectives gather (``Comm.all_gather_into`` / ``all_gather_coalesced``),
    the real calls made as they are."""

    def __init__(self) -> None:
        from zinf.runtime import collectives
        from zinf.runtime.comm import Comm

        self.groups: list[int] = []  # id() of the group of each gather
        self.bytes = 0
        self.gathered_bytes = 0  # the outputs of the named gathers
        gather, into, coalesced = collectives.all_gather, Comm.all_gather_into, Comm.all_gather_coalesced

        def counted_gather(ctx, out, shard, name, batch=None):
            if out is not shard:  # ``out is shard`` orders the streams as a gather does and moves nothing
                self.groups.append(id(sys._getframe(1).f_locals["self"]))
                self.gathered_bytes += out.numel() * out.element_size()
            return gather(ctx, out, shard, name, batch)

        def counted_into(comm, out, shard, async_op):
            self.bytes += out.numel() * out.element_size()
            return into(comm, out, shard, async_op)

        def counted_coalesced(comm, outs, shards):
            self.bytes += sum(o.numel() * o.element_size() for o in outs)
            return coalesced(comm, outs, shards)

        collectives.all_gather = counted_gather
        Comm.all_gather_into, Comm.all_gather_coalesced = counted_into, counted_coalesced

        # [Note: one pass per byte]: where a frozen shard's checksum is taken, at the read or in the gather's copy
        from zinf.offload.in_place import InPlaceRecord
        from zinf.native.checksum import ContentCheck

        self.checked_at_read = self.checked_in_copy = 0
        check, verify = InPlaceRecord.check, ContentCheck.verify

        def counted_check(record, buf, content=True):
            self.checked_at_read += content
            return check(record, buf, content)

        def counted_verify(pending, actual):
            self.checked_in_copy += 1
            return verify(pending, actual)

        InPlaceRecord.check, ContentCheck.verify = counted_check, counted_verify


def _three_ways(rank: int, world: int, path: str, root: str) -> dict:
    from zinf.runtime import same_host

    same_host.POOL_GATHER_MIN_BYTES = 0  # this model's gathers are all within one chunk: from the pools all the same
    counted = _Counted()
    out = {}
    for name, in_place, reads, shared in (("whole", True, "whole", "auto"), ("gathered", True, "gathered", "auto"),
                                          ("chunks", True, "gathered", "chunks"), ("copied", False, "whole", "auto")):
        model, engine = _build(path, os.path.join(root, name), in_place, reads, shared)
        frozen = {id(g) for g in engine.groups if not g.trainable}
        read_whole = {id(g) for g in engine.groups if g.residence.whole}
        counted.groups.clear()
        counted.bytes = counted.gathered_bytes = counted.checked_at_read = counted.checked_in_copy = 0
        model.train()
        losses, transport = [], dict.fromkeys(("transport_copied_bytes", "pool_gathered_bytes"), 0)
        for x in token_batches(3, 4):
            losses.append(lm_step_global(engine, x, rank, world))
            for k in transport:  # each step's report counts the step's bytes
                transport[k] += engine.report().counts[k]
        gathers = list(counted.groups)
        checks = {"at_read": counted.checked_at_read, "in_copy": counted.checked_in_copy}
        moved, named = counted.bytes, counted.gathered_bytes
        # an evaluation forward: each group gathered once, read once (the pool holds the tiny model)
        model.eval()
        engine.synchronize()  # the step's writes done, the slots the store keeps given back: the files alone hold them
        engine.placement.io_counts()
        with torch.no_grad():
            engine(input_ids=token_batches(1, 2)[0])
        read = engine.placement.io_counts()["nvme_read_bytes"]
        out[name] = {"losses": losses, "state": engine.full_state_dict(), "frozen": frozen, "whole": read_whole,
                     "trained_gathers": sum(1 for g in gathers if g not in frozen),
                     "gathers": gathers, "moved": moved, "named": named, "eval_read": read, "checks": checks,
                     "transport": transport,
                     "frozen_shard_bytes": sum(g.shard_nbytes for g in engine.groups if not g.trainable)}
        engine.close()
    return out


def test_frozen_groups_read_whole_train_exactly_without_collectives(checkpoint: Path, tmp_path: Path) -> None:
    results = run_distributed(_three_ways, 2, str(checkpoint), str(tmp_path))
    for rank, r in enumerate(results):
        whole, gathered, chunks, copied = r["whole"], r["gathered"], r["chunks"], r["copied"]
        assert whole["whole"] == whole["frozen"] and whole["frozen"], (rank, whole["whole"], whole["frozen"])
        assert not gathered["whole"] and not copied["whole"]
        assert whole["losses"] == gathered["losses"] == chunks["losses"] == copied["losses"], \
            (rank, whole["losses"], gathered["losses"], chunks["losses"])
        for k in whole["state"]:
            assert torch.equal(whole["state"][k], gathered["state"][k]), (rank, k)
            assert torch.equal(whole["state"][k], chunks["state"][k]), (rank, k)
            assert torch.equal(whole["state"][k], copied["state"][k]), (rank, k)
        # no collective for a frozen group read whole; the gathered path all-gathers them
        assert not whole["frozen"] & set(whole["gathers"]) and whole["gathers"]
        assert gathered["frozen"] <= set(gathered["gathers"])
        assert whole["trained_gathers"] == gathered["trained_gathers"] == len(whole["gathers"])
        assert whole["moved"] == whole["named"] < gathered["moved"], (whole["moved"], whole["named"], gathered["moved"])
        # each frozen group's other shard is read too, and nothing else
        assert whole["eval_read"] - gathered["eval_read"] == whole["frozen_shard_bytes"], \
            (whole["eval_read"], gathered["eval_read"], whole["frozen_shard_bytes"])
        # read whole, each frozen shard's checksum is taken in the widening copy, never in a pass of its own; gathered
        # through the ranks' transport, at the read
        assert whole["checks"]["at_read"] == 0 and whole["checks"]["in_copy"] >= len(whole["frozen"]), whole["checks"]
        assert gathered["checks"]["in_copy"] == 0 and gathered["checks"]["at_read"] > 0, gathered["checks"]
        # gathered, every shard (each read into the pool) is taken from the ranks' shared pools, none copied into the
        # chunk buffers ([Note: gathering from the ranks' pools]); with the pool private, all of them are copied
        assert gathered["transport"]["transport_copied_bytes"] == 0, gathered["transport"]
        assert gathered["transport"]["pool_gathered_bytes"] == chunks["transport"]["transport_copied_bytes"] > 0, \
            (gathered["transport"], chunks["transport"])
        assert chunks["transport"]["pool_gathered_bytes"] == 0, chunks["transport"]
    assert results[0]["whole"]["losses"] == results[1]["whole"]["losses"]


def _one_rank_checks(rank: int, world: int, path: str, nvme: str) -> dict:
    counted = _Counted()
    model, engine = _build(path, nvme, True)
    counted.checked_at_read = counted.checked_in_copy = 0  # the trained groups' shards, copied to swap at the placement
    model.train()
    losses = [lm_step_global(engine, x, rank, world) for x in token_batches(2, 4)]
    engine.close()
    return {"losses": losses, "at_read": counted.checked_at_read, "in_copy": counted.checked_in_copy}


def test_one_rank_takes_the_checksum_in_the_widening_copy(checkpoint: Path, tmp_path: Path) -> None:
    """One rank widens each frozen bf16 shard where it was read: that copy takes the checksum, and the steps are those
    of a base copied to the swap files (the checksum's refusal: ``test_a_checkpoint_changed_under_a_run_is_refused``)."""
    (r,) = run_distributed(_one_rank_checks, 1, str(checkpoint), str(tmp_path / "nvme"))
    assert r["at_read"] == 0 and r["in_copy"] > 0, r
    (copied,) = run_distributed(_train, 1, str(checkpoint), str(tmp_path / "copied"), False)
    assert r["losses"] == copied["losses"][:2], (r["losses"], copied["losses"])


def _refused_at_the_read(rank: int, world: int, path: str, nvme: str) -> dict:
    """After step 1, one frozen group's checksum made wrong: its shard read ahead and read back twice, then read ahead
    again and thrown away (the cache flushed); then the checksum put back and read once more."""
    from zinf.offload.in_place import InPlaceRecord

    model, engine = _build(path, nvme, True)
    model.train()
    lm_step_global(engine, token_batches(1, 4)[0], rank, world)
    engine.synchronize()
    store = engine.placement.store
    store.flush()
    in_pool = store.pool.bytes_in_use
    group = next(g for g in engine.groups if isinstance(store.records[id(g)], InPlaceRecord))
    record = store.records[id(group)]
    good = record.crc
    record.crc = good ^ 1
    outcomes = []
    store.prefetch(group)
    for _ in range(2):
        try:
            store.read(group)
            outcomes.append("returned")
        except CheckpointChangedError:
            outcomes.append("refused")
    store.prefetch(group)
    store.flush()  # a read thrown away is not checked: nothing it read is used
    leaked = store.pool.bytes_in_use - in_pool
    record.crc = good
    again = store.read(group)
    engine.close()
    return {"outcomes": outcomes, "leaked": leaked, "again": again.numel()}


def test_a_shard_refused_at_the_read_is_never_handed_out_later(checkpoint: Path, tmp_path: Path) -> None:
    """A frozen shard whose checksum fails at the read leaves the store's cache and the pool: read again it is
    refused again (not handed out from the cache), a read dropped unused is not refused, and once its checksum is
    as at loading the shard is read from the files again."""
    (r,) = run_distributed(_refused_at_the_read, 1, str(checkpoint), str(tmp_path / "nvme"))
    assert r["outcomes"] == ["refused", "refused"], r
    assert r["leaked"] == 0 and r["again"] > 0, r
