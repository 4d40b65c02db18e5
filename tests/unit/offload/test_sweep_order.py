"""The optimizer's sweep over NVMe sub-groups reads ahead counted in sub-groups ([Note: the sweep's reads] in
zinf/offload/nvme_state_store.py): with sub-groups whose reads exceed READ_AHEAD_BYTES, sub-group i+1's first read
is submitted before sub-group i's CPU-Adam starts; a corrupted state record is refused (by the CPU-Adam pass that
checksums what it reads, [Note: checks in the Adam pass]) before anything of its sub-group is written back or
reaches the parameters. One process, real files; the swap space and the step are wrapped only to record the
order of their calls."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import zinf
from zinf.offload.swap import OffloadFileError
from zinf.offload.nvme_state_store import READ_AHEAD_BYTES

SUB_GROUP = 6 << 20  # 24 MiB per state record: master, exp_avg and exp_avg_sq read 72 MiB a sub-group


class _Calls:
    """The swap space's submits and waits and the optimizer's per-sub-group step, in order, as (what, record id or
    sub-group index)."""

    def __init__(self, engine: zinf.ZeroInfinityEngine) -> None:
        self.log: list[tuple[str, int]] = []
        swap, opt = engine.placement.swap, engine.placement.optimizer
        self.subgroups = opt.states.subgroups
        self.owner = {rec.record_id: i for i, sg in enumerate(self.subgroups)
                      for rec in opt.states.records[id(sg)].values()}
        for name in ("submit_read", "submit_write", "wait"):
            setattr(swap, name, self._logged(name, getattr(swap, name), lambda args: args[0].record_id))
        opt._step = self._logged("step", opt._step, lambda args: self.subgroups.index(args[0]))

    def _logged(self, what: str, fn, key):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            self.log.append((what, key(args if what == "step" else args[1:] if what == "wait" else args)))
            return fn(*args, **kwargs)
        return call

    def clear(self) -> None:
        self.log.clear()

    def first(self, what: str, subgroup: int) -> int:
        """The index in the log of the first ``what`` of ``subgroup``'s state records (or of its step)."""
        for i, (w, k) in enumerate(self.log):
            if w == what and (k == subgroup if what == "step" else self.owner.get(k) == subgroup):
                return i
        raise AssertionError(f"no {what} of sub-group {subgroup} in {self.log}")


def _engine(tmp: Path) -> zinf.ZeroInfinityEngine:
    torch.manual_seed(0)
    config = zinf.ZeroConfig.from_dict({"offload": {
        "params": "cpu", "optimizer": "nvme", "grads": "cpu", "nvme_paths": [str(tmp)], "sub_group_numel": SUB_GROUP,
        "pinned_pool_bytes": 640 << 20, "overlap_optimizer": False}})
    with zinf.Init(config):
        model = nn.Sequential(nn.Linear(4096, 4096), nn.Tanh(), nn.Linear(4096, 8))  # 16.8M: 3 + 1 sub-groups
    return zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)


def _step(engine: zinf.ZeroInfinityEngine, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    loss = nn.functional.cross_entropy(engine(torch.randn(4, 4096, generator=g)), torch.randint(0, 8, (4,), generator=g))
    engine.backward(loss)
    engine.step()


def test_the_next_subgroup_is_read_while_one_is_stepped(tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    calls = _Calls(engine)
    big = [i for i, sg in enumerate(calls.subgroups) if 3 * (sg.hi - sg.lo) * 4 > READ_AHEAD_BYTES]
    assert big[:2] == [0, 1], [sg.hi - sg.lo for sg in calls.subgroups]
    try:
        for seed in range(2):
            calls.clear()
            _step(engine, seed)
            engine.synchronize()
            for i in range(len(calls.subgroups) - 1):
                assert calls.first("submit_read", i + 1) < calls.first("step", i), (i, calls.log)
    finally:
        engine.close()


def test_a_corrupted_state_record_is_refused_before_any_write_of_its_subgroup(tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    calls = _Calls(engine)
    try:
        _step(engine, 0)
        engine.synchronize()
        bad = 1
        rec = engine.placement.optimizer.states.records[id(calls.subgroups[bad])]["exp_avg"]
        with open(rec.path, "r+b") as f:  # one byte of the record's data, its trailer's checksum unchanged
            f.seek(rec.offset + 4096)
            byte = f.read(1)
            f.seek(rec.offset + 4096)
            f.write(bytes([byte[0] ^ 0xFF]))
        sg = calls.subgroups[bad]
        before = sg.group.store.read(sg.group)[sg.lo : sg.hi].clone()
        calls.clear()
        with pytest.raises(OffloadFileError, match="is corrupted"):
            _step(engine, 1)
            engine.synchronize()
        written = {calls.owner.get(k) for w, k in calls.log if w == "submit_write"}
        assert bad not in written, calls.log
        assert ("step", bad) in calls.log  # the pass that stepped it found the corruption
        assert torch.equal(sg.group.store.read(sg.group)[sg.lo : sg.hi], before)  # and wrote no parameter
    finally:
        engine.close()
