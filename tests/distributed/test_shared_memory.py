"""Collectives through shared memory between the ranks of one host (zinf/runtime/same_host.py), against gloo's on the
same tensors, and a training run with them against the same run through gloo (2 and 4 gloo ranks)."""

from __future__ import annotations

import glob
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import zinf
from dist_utils import run_distributed
from zinf.runtime import same_host
from zinf.runtime.comm import Comm
from zinf.runtime.same_host import SameHostTransport

pytestmark = pytest.mark.distributed

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _collectives(rank: int, world: int) -> dict:
    comm = Comm.current()
    shared = comm.with_same_host(SameHostTransport.connect(comm))
    assert shared.same_host is not None, "every rank is on this host: the transport must be set up"
    g = torch.Generator().manual_seed(100 + rank)
    dist.barrier()  # every rank has unlinked its file
    out: dict = {"files": glob.glob(os.path.join(same_host.SHM_DIR, f"zinf-shm-{shared.same_host.token}-*"))}
    # sizes below, at and above a chunk (split over several), several tensors of mixed dtypes in one call
    chunk = same_host.CHUNK_BYTES
    sizes = [7, 1000, chunk // 4 // world, chunk // 4 + 13, 3 * chunk // 4 + 5]
    for n in sizes:
        shard = torch.randn(n, generator=g)
        mine, theirs = torch.empty(world * n), torch.empty(world * n)
        shared.all_gather_into(mine, shard, async_op=False)
        _all_gather(theirs, shard)
        out[f"gather {n}"] = torch.equal(mine, theirs)
        full = torch.randn(world * n, generator=g)
        mine, theirs = torch.empty(n), torch.empty(n)
        shared.reduce_scatter_sum(mine, full, async_op=False)
        _reduce_scatter(theirs, full.clone())
        out[f"scatter {n} gloo"] = torch.equal(mine, theirs)
        whole = torch.empty(world * n)  # every rank's slice, to compare with the sum in rank order
        _all_gather(whole, mine)
        out[f"scatter {n} rank order"] = whole
        out[f"scatter {n} input"] = full
    shards = [torch.randn(5, generator=g), torch.randn(chunk // 8, generator=g).to(torch.bfloat16),
              torch.randint(0, 100, (chunk // 16 + 3,), generator=g), torch.randn(3, generator=g).double()]
    outs = [torch.empty(world * s.numel(), dtype=s.dtype) for s in shards]
    shared.all_gather_coalesced(outs, shards).wait()
    for i, (o, s) in enumerate(zip(outs, shards)):
        ref = torch.empty_like(o)
        _all_gather(ref, s)
        out[f"coalesced {i}"] = torch.equal(o, ref)
    # widening gathers ([Note: a widening gather]): bf16 and fp16 shards into fp32, across chunks, coalesced with a
    # plain one, equal to gloo's gather of the narrow values, widened
    narrow = [torch.randn(chunk // 2 + 7, generator=g).to(torch.bfloat16), torch.randn(9, generator=g),
              torch.randn(3 * chunk // 4 + 1, generator=g).half()]
    wide = [torch.empty(world * s.numel(), dtype=torch.float32) for s in narrow]
    assert shared.gathers_widening(wide[0])
    shared.all_gather_coalesced(wide, narrow).wait()
    single = torch.empty(world * narrow[0].numel())
    shared.all_gather_into(single, narrow[0], async_op=False)
    for i, (o, s) in enumerate(zip(wide, narrow)):
        ref = torch.empty(world * s.numel(), dtype=s.dtype)
        _all_gather(ref, s)
        out[f"gather widened {i}"] = torch.equal(o, ref.float())
    out["gather widened alone"] = torch.equal(single, wide[0])
    out["ops"] = shared.same_host.ops
    shared.close()
    out["closed gathers as it is"] = not shared.gathers_widening(wide[0])
    out["closed falls back"] = shared._shared(torch.empty(1)) is None
    return out


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_collectives_equal_gloos(world: int) -> None:
    results = run_distributed(_collectives, world)
    for rank, res in enumerate(results):
        assert res["files"] == [], f"rank {rank}: segments left in /dev/shm after set-up: {res['files']}"
        for key, value in res.items():
            if key.startswith(("gather", "coalesced")) or key.endswith("gloo") and world == 2:
                assert value is True, f"rank {rank}, world {world}: {key} differs from gloo's"
        assert res["ops"] > 0 and res["closed falls back"] and res["closed gathers as it is"]
    for key in [k for k in results[0] if k.endswith("rank order")]:
        n = int(key.split()[1])
        full = torch.stack([res[key.replace("rank order", "input")] for res in results]).view(world, world, n)
        expect = full[0].clone()
        for r in range(1, world):
            expect += full[r]  # rank r's input, every slice: summed in rank order
        assert torch.equal(results[0][key], expect.reshape(-1)), f"world {world}: {key}"


def _train(rank: int, world: int, shared_memory: str) -> dict:
    torch.manual_seed(0)
    config = {"overlap": {"shared_memory": shared_memory}, "gradient_clipping": 1.0}
    with zinf.Init(config):
        model = nn.Sequential(nn.Embedding(300, 64), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64),
                              nn.Linear(64, 300))
    engine = zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(3):
        idx = torch.randint(0, 300, (4, 16), generator=g)
        loss = nn.functional.cross_entropy(engine(idx).flatten(0, 1), idx.flatten())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    transport = engine.comm.same_host
    ops = None if transport is None else transport.ops
    # without shared memory and without the launcher's LOCAL_WORLD_SIZE, the ranks count who runs on this host
    assert "LOCAL_WORLD_SIZE" not in os.environ and engine.comm.ranks_on_host() == world
    state = {k: v.clone() for k, v in engine.full_state_dict(rank0_only=False).items()}
    engine.close()
    return {"losses": losses, "ops": ops, "state": state}


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_training_through_shared_memory_equals_gloo(world: int) -> None:
    shm = run_distributed(_train, world, "auto")
    gloo = run_distributed(_train, world, "off")
    assert all(r["ops"] for r in shm) and all(r["ops"] is None for r in gloo)
    for a, b in zip(shm, gloo):
        assert a["losses"] == b["losses"]
        if world == 2:  # x0 + x1 either way; with 4 ranks gloo's order of summation is its own
            for k in a["state"]:
                assert torch.equal(a["state"][k], b["state"][k]), k


def _pool_gathers(rank: int, world: int) -> dict:
    """Gathers of shards lying in the ranks' shared staging pools ([Note: gathering from the ranks' pools]), alone,
    widened, and mixed in one call with shards that lie elsewhere, against gloo's gathers of the same shards."""
    from zinf.native.pool import PinnedBufferPool

    comm = Comm.current()
    shared = comm.with_same_host(SameHostTransport.connect(comm))
    transport = shared.same_host
    pool = PinnedBufferPool(128 << 20, memory=transport.share_pool(comm, (128 + rank) << 20))  # sizes may differ
    dist.barrier()
    out: dict = {"files": glob.glob(os.path.join(same_host.SHM_DIR, f"zinf-pool-{transport.token}-*"))}
    g = torch.Generator().manual_seed(7 + rank)

    def in_pool(t: torch.Tensor) -> torch.Tensor:
        buf = pool.acquire(t.numel() * t.element_size()).view(t.dtype)
        buf.copy_(t)
        return buf

    chunk = same_host.CHUNK_BYTES
    shards = [in_pool(torch.randn(3 * chunk // 8 + 5, generator=g)), torch.randn(1000, generator=g),
              in_pool(torch.randn(17, generator=g).to(torch.bfloat16)), in_pool(torch.randn(9, generator=g))]
    outs = [torch.empty(world * shards[0].numel()), torch.empty(world * 1000), torch.empty(world * 17),
            torch.empty(world * 9, dtype=torch.float32)]
    ops, copied = transport.ops, transport.copied_bytes
    shared.all_gather_coalesced(outs, shards).wait()
    out["ops mixed"], out["copied mixed"] = transport.ops - ops, transport.copied_bytes - copied
    for i, (o, s) in enumerate(zip(outs, shards)):
        ref = torch.empty(world * s.numel(), dtype=s.dtype)
        _all_gather(ref, s)
        out[f"gather {i}"] = torch.equal(o, ref.to(o.dtype))
    # 4 chunks' worth: from the pools in two meetings; within one chunk: its one meeting, copied
    for name, numel in (("big", chunk), ("small", chunk // 8)):
        shard = in_pool(torch.randn(numel, generator=g))
        ops, copied, direct = transport.ops, transport.copied_bytes, transport.direct_bytes
        whole, ref = torch.empty(world * numel), torch.empty(world * numel)
        shared.all_gather_into(whole, shard, async_op=False)
        _all_gather(ref, shard)
        out[f"gather {name}"] = torch.equal(whole, ref)
        out[f"ops {name}"], out[f"copied {name}"] = transport.ops - ops, transport.copied_bytes - copied
        out[f"direct {name}"] = transport.direct_bytes - direct
    shared.close()
    out["closed falls back"] = shared._shared(torch.empty(1)) is None and transport.pools is None
    pool.close()
    return out


def test_gathers_from_the_ranks_pools_equal_gloos() -> None:
    for rank, res in enumerate(run_distributed(_pool_gathers, 2)):
        assert res["files"] == [], f"rank {rank}: pool segments left in /dev/shm: {res['files']}"
        for key in [k for k in res if k.startswith("gather")]:
            assert res[key] is True, f"rank {rank}: {key} differs from gloo's"
        # the shard lying outside the pool goes through one chunk; the pools' shards meet twice and copy nothing in
        assert (res["ops mixed"], res["copied mixed"]) == (3, 1000 * 4), res
        assert (res["ops big"], res["copied big"], res["direct big"]) == (2, 0, 4 * same_host.CHUNK_BYTES), res
        assert (res["ops small"], res["copied small"], res["direct small"]) == (1, same_host.CHUNK_BYTES // 2, 0), res
        assert res["closed falls back"]


def _pools_not_shared(rank: int, world: int, where: str) -> dict:
    from zinf.runtime import shm_files

    comm = Comm.current()
    transport = SameHostTransport.connect(comm)
    shm_files.SHM_DIR = where if rank == 1 else shm_files.SHM_DIR  # one rank cannot make its segment
    memory = transport.share_pool(comm, 1 << 20)
    out = torch.empty(world * 5)
    transport.all_gather([out], [torch.full((5,), float(rank))])  # the transport goes on, through its chunks
    transport.close()
    return {"memory": memory, "pools": transport.pools, "out": out.tolist(), "left": os.listdir(same_host.SHM_DIR)}


def test_pools_that_cannot_be_shared_stay_private_on_every_rank(tmp_path) -> None:
    for res in run_distributed(_pools_not_shared, 2, str(tmp_path / "missing")):
        assert res["memory"] is None and res["pools"] is None, res
        assert res["out"] == [0.0] * 5 + [1.0] * 5
        assert not [f for f in res["left"] if f.startswith("zinf-pool-")], res["left"]


def _late_peer(rank: int, world: int) -> str:
    comm = Comm.current()
    transport = SameHostTransport.connect(comm, timeout_s=1.0)
    assert transport is not None
    if rank == 1:
        time.sleep(3.0)  # never joins the collective
        return "slept"
    start = time.monotonic()
    try:
        transport.all_gather([torch.empty(world * 4)], [torch.ones(4)])
    except zinf.errors.SharedMemoryTimeout as exc:
        return f"{time.monotonic() - start:.1f}|{exc}"
    return "no error"


def test_a_peer_that_never_posts_is_named_after_the_timeout() -> None:
    result = run_distributed(_late_peer, 2)[0]
    waited, _, message = result.partition("|")
    assert 0.9 <= float(waited) < 2.5, result
    assert "rank 1" in message and "collective_timeout_s" in message and "shared_memory: off" in message


def _dead_peer(rank: int, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdv", rank=rank, world_size=world)
    comm = Comm.current()
    transport = SameHostTransport.connect(comm, timeout_s=60.0)  # without the exit noticed: a timeout after 60 s
    assert transport is not None
    if rank == 1:
        os._exit(0)  # gone without a word, as a SIGKILLed rank (0: the launcher waits for rank 0's answer)
    start = time.monotonic()
    try:
        transport.all_gather([torch.empty(world * 4)], [torch.ones(4)])
        result = "no error"
    except zinf.ZinfError as exc:
        result = f"{time.monotonic() - start:.1f}|{exc}"
    with open(f"{tmp}/result0", "w") as f:
        f.write(result)
    os._exit(0)


def test_a_peer_that_exits_is_named_at_once(tmp_path) -> None:
    mp.start_processes(_dead_peer, args=(2, str(tmp_path)), nprocs=2, start_method="spawn")
    waited, _, message = (tmp_path / "result0").read_text().partition("|")
    assert float(waited) < 5.0 and "rank 1 (pid " in message and "exited" in message, message


def _closed_peer(rank: int, world: int) -> str:
    comm = Comm.current()
    transport = SameHostTransport.connect(comm, timeout_s=5.0)  # without the close noticed: a timeout after 5 s
    assert transport is not None
    out = torch.empty(world * 4)
    transport.all_gather([out], [torch.full((4,), float(rank))])  # rank 1 closes right after its last post
    assert torch.equal(out, torch.tensor([0.0] * 4 + [1.0] * 4))
    if rank == 1:
        transport.close()  # as engine.close() does; the process stays, in the barrier below
        result = "closed"
    else:
        start = time.monotonic()
        try:
            transport.all_gather([out], [torch.ones(4)])
            result = "no error"
        except zinf.ZinfError as exc:
            result = f"{time.monotonic() - start:.1f}|{type(exc).__name__}: {exc}"
    dist.barrier()
    return result


def test_a_peer_that_closed_its_transport_is_named_at_once() -> None:
    waited, _, message = run_distributed(_closed_peer, 2)[0].partition("|")
    assert float(waited) < 1.0 and "rank 1 closed its shared-memory transport" in message, message
    assert "every rank at the same point" in message and "shared_memory: off" in message, message


def _group_timeout(rank: int, world: int, rendezvous: str) -> dict:
    dist.destroy_process_group()  # run_distributed's group has torch's default timeout; this one 1 s
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=1))
    comm = Comm.current()
    explicit = SameHostTransport.connect(comm, timeout_s=2.5)  # collective_timeout_s goes first
    assert explicit is not None
    explicit.close()
    group = dist.new_group([0, 1], timeout=timedelta(seconds=7))
    out = {"explicit": explicit.timeout_s, "new_group": same_host._group_timeout_s(group)}
    transport = SameHostTransport.connect(comm)
    assert transport is not None
    out["default"] = transport.timeout_s
    if rank == 1:
        time.sleep(3.0)  # never joins the collective
        return out
    start = time.monotonic()
    try:
        transport.all_gather([torch.empty(world * 4)], [torch.ones(4)])
        out["error"] = "no error"
    except zinf.ZinfError as exc:
        out["waited"], out["error"] = time.monotonic() - start, f"{type(exc).__name__}: {exc}"
    return out


def test_the_default_timeout_is_the_process_groups(tmp_path) -> None:
    results = run_distributed(_group_timeout, 2, str(tmp_path / "rendezvous"))
    for res in results:
        assert (res["explicit"], res["new_group"], res["default"]) == (2.5, 7.0, 1.0), res
    res = results[0]
    assert res["error"].startswith("SharedMemoryTimeout") and "rank 1" in res["error"], res
    assert 0.9 <= res["waited"] < 2.5, res
