"""[Note: frozen groups read whole] in zinf/offload/whole_reads.py, on 2 gloo ranks: a bf16 Llama checkpoint
loaded under ``zinf.Init`` with the parameters on NVMe in bf16 storage (fp32 compute), most of it frozen and read in
place, groups of odd sizes (norms, an embedding of 96 rows, 48-wide projections):

- each rank reading every rank's shard (``offload.frozen_reads: whole``) trains bit for bit as all-gathering them
  (``gathered``) and as a base copied to the swap files (``frozen_in_place: false``);
- no all-gather is issued for a frozen group read whole (every collective counted by the group it gathers), and
  the bytes the ranks' transport moves are those of the trained groups' gathers alone;
- an evaluation forward reads ``world - 1`` more shards of each frozen group than the gathered path, and nothing
  else more (the NVMe bytes counted by the engine).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

import zinf
from dist_utils import run_distributed
from models import llama_config, token_batches
from training import lm_step_global

pytestmark = pytest.mark.distributed

TRAINED = ("model.layers.1.mlp.", "model.norm.")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from transformers import LlamaForCausalLM

    path = tmp_path_factory.mktemp("llama_bf16_whole")
    torch.manual_seed(11)
    LlamaForCausalLM(llama_config()).to(torch.bfloat16).save_pretrained(path, max_shard_size="60KB")
    return path


def _build(path: str, nvme: str, in_place: bool, reads: str):
    from transformers import AutoModelForCausalLM

    os.makedirs(nvme, exist_ok=True)
    config = zinf.ZeroConfig.from_dict({
        "precision": "fp32", "param_storage": "bf16",
        "offload": {"params": "nvme", "nvme_paths": [nvme], "pinned_pool_bytes": 8 << 20,
                    "frozen_in_place": in_place, "frozen_reads": reads}})
    with zinf.Init(config):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(TRAINED))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, zinf.initialize(model, opt, config)


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


def _train(rank: int, world: int, path: str, root: str) -> dict:
    counted = _Counted()
    out = {}
    for name, in_place, reads in (("whole", True, "whole"), ("gathered", True, "gathered"), ("copied", False, "whole")):
        model, engine = _build(path, os.path.join(root, name), in_place, reads)
        frozen = {id(g) for g in engine.groups if not g.trainable}
        read_whole = {id(g) for g in engine.groups if g.residence.whole}
        counted.groups.clear()
        counted.bytes = counted.gathered_bytes = 0
        model.train()
        losses = [lm_step_global(engine, x, rank, world) for x in token_batches(3, 4)]
        gathers = list(counted.groups)
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
                     "gathers": gathers, "moved": moved, "named": named, "eval_read": read,
                     "frozen_shard_bytes": sum(g.shard_nbytes for g in engine.groups if not g.trainable)}
        engine.close()
    return out


def test_frozen_groups_read_whole_train_exactly_without_collectives(checkpoint: Path, tmp_path: Path) -> None:
    results = run_distributed(_train, 2, str(checkpoint), str(tmp_path))
    for rank, r in enumerate(results):
        whole, gathered, copied = r["whole"], r["gathered"], r["copied"]
        assert whole["whole"] == whole["frozen"] and whole["frozen"], (rank, whole["whole"], whole["frozen"])
        assert not gathered["whole"] and not copied["whole"]
        assert whole["losses"] == gathered["losses"] == copied["losses"], (rank, whole["losses"], gathered["losses"])
        for k in whole["state"]:
            assert torch.equal(whole["state"][k], gathered["state"][k]), (rank, k)
            assert torch.equal(whole["state"][k], copied["state"][k]), (rank, k)
        # no collective for a frozen group read whole; the gathered path all-gathers them
        assert not whole["frozen"] & set(whole["gathers"]) and whole["gathers"]
        assert gathered["frozen"] <= set(gathered["gathers"])
        assert whole["trained_gathers"] == gathered["trained_gathers"] == len(whole["gathers"])
        assert whole["moved"] == whole["named"] < gathered["moved"], (whole["moved"], whole["named"], gathered["moved"])
        # each frozen group's other shard is read too, and nothing else
        assert whole["eval_read"] - gathered["eval_read"] == whole["frozen_shard_bytes"], \
            (whole["eval_read"], gathered["eval_read"], whole["frozen_shard_bytes"])
    assert results[0]["whole"]["losses"] == results[1]["whole"]["losses"]
