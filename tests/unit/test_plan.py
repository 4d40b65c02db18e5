"""``zinf plan``: byte accounting, fit decisions, the recommendation, the inputs and the CLI. No test measures the
machine: each passes a :class:`zinf.plan.Machine` (or a JSON file of one to the CLI)."""

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import zinf
import zinf.plan
from zinf.cli import main
from zinf.plan import Machine, PlanError, parse_placement, plan
from zinf.offload.swap import ALIGN
from zinf.plan.placements import ALL_PLACEMENTS

GiB = 2**30
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))


def machine(host_gib: float = 16.0, nvme: dict[str, float] | None = None, **kw) -> Machine:
    """A CPU machine with round figures: 100 GFLOP/s, 10 GB/s host copies, 1 GB/s disks."""
    nvme = nvme or {}
    return Machine(device="cpu", device_name="test CPU", device_bytes=int(host_gib * GiB), host_bytes=int(host_gib * GiB),
                   cores=2, flops={"fp32": 100e9, "bf16": 50e9}, host_bw=10e9, device_bw=10e9,
                   nvme_free_bytes={p: int(g * GiB) for p, g in nvme.items()},
                   disk_read_bw={p: 1e9 for p in nvme}, disk_write_bw={p: 1e9 for p in nvme}, **kw)


def tiny() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))  # groups of 15 and 8 parameters


def by_name(p: zinf.plan.Plan) -> dict[str, zinf.plan.Estimate]:
    return {f"{e.placement.name} {e.precision}" + ("" if e.storage == e.precision else f"/{e.storage}"): e
            for e in p.estimates}


# -- byte accounting ----------------------------------------------------------------------------------
def test_bytes_per_placement_by_hand(tmp_path: Path) -> None:
    nv = str(tmp_path)
    p = plan(tiny(), precision=["fp32", "bf16"], nvme_paths=[nv], machine=machine(nvme={nv: 10}), batch_tokens=8)
    est = by_name(p)
    states = lambda e, t: {k: v for k, v in e.bytes[t].items() if k not in ("gathered_peak", "activations_estimate")}  # noqa: E731
    # fp32, everything on the device: the shard is the master (4), gradient 4, Adam moments 8 = 16 x 23
    assert states(est["device/device fp32"], "device") == {"param_shards": 92, "optimizer_state": 184, "grad_shards": 92}
    # bf16: shard 2 + master 4 + gradient 4 + moments 8 = 18 x 23
    assert states(est["device/device bf16"], "device") == {"param_shards": 46, "master": 92, "optimizer_state": 184,
                                                           "grad_shards": 92}
    # CPU optimizer on a CPU machine: the fp32 shard (4, host memory) is the CPU-Adam's master; moments (8) and
    # gradients (4) on the CPU
    e = est["device/cpu fp32"]
    assert states(e, "device") == {"param_shards": 92} and e.bytes["cpu"] == {"optimizer_state": 184, "grad_shards": 92}
    # NVMe: one 4 KiB-aligned record per group (data + 64-byte trailer), states 12, gradients 4; the pool on the CPU
    e = est["nvme/nvme fp32"]
    assert e.bytes["nvme"] == {"param_shards": 2 * 4096, "optimizer_state": 276, "grad_shards": 92}
    assert e.bytes["cpu"] == {"pinned_pool": e.pinned_pool_bytes} and e.pinned_pool_bytes >= 256 << 20
    assert e.disk_bytes == 2 * 4096 + 2 * 4 * 4096  # two parameter records, four records per optimizer sub-group
    e = est["nvme/nvme/cpu bf16"]
    assert e.bytes["nvme"] == {"param_shards": 2 * 4096, "optimizer_state": 276} and e.bytes["cpu"]["grad_shards"] == 92
    # per step: parameters written once, states read and written once, gradients neither (a quarter of the pool holds
    # them for the step: [Note: gradients held for the step])
    e = est["nvme/nvme fp32"]
    assert e.io_bytes["nvme_write"] == 2 * 4096 + 23 * 12
    assert e.io_bytes["nvme_read"] == 23 * 12  # the pool keeps both parameter shards: no reads


def test_bytes_two_ranks_pad_each_group() -> None:
    p = plan(tiny(), world=2, machine=machine(), placements=["device/device", "cpu/cpu"], batch_tokens=8)
    dd, cc = p.estimates
    assert dd.tier_bytes("device", states_only=True) == (8 + 4) * 16  # ceil(15/2) + ceil(8/2) per rank
    assert cc.bytes["cpu"] == {"param_shards": 48, "optimizer_state": 96, "grad_shards": 48}  # the shard is the master
    # the whole model fits overlap.prefetch_bytes: kept from the forward for the backward, gathered once a step
    assert dd.io_bytes["allgather"] == 12 * 4 and dd.io_bytes["reduce_scatter"] == 12 * 4
    assert dd.seconds["step"] != dd.seconds["step"] and p.recommended is None  # no all-gather bandwidth given: unknown
    again = plan(tiny(), world=2, machine=machine(), placements=["device/device"], batch_tokens=8,
                 reshard_after_forward="always").estimates[0]
    assert again.io_bytes["allgather"] == 2 * 12 * 4  # gathered in the forward and again in the backward


def test_kept_for_backward_follows_the_engines_choice() -> None:
    """As zinf/schedule/keep.py: the groups the backward needs first (the last ones), while their full bytes fit
    ``prefetch_bytes`` (and the host's room), the last one whatever its size; every group with "never", none with
    "always" or with one rank and no room."""
    from zinf.plan.cost import Workload
    from zinf.plan.gathered import kept_for_backward
    from zinf.plan.model import spec_from_module

    spec = spec_from_module(tiny())  # full fp32 bytes at 2 ranks: 16 x 4 = 64 and 8 x 4 = 32
    kept = lambda room=0, **kw: kept_for_backward(  # noqa: E731
        spec, Workload(**{"world": 2, "prefetch_bytes": 40, **kw}), 4, room)
    assert kept() == [False, True]
    assert kept(prefetch_bytes=96) == [True, True]
    assert kept(prefetch_bytes=0) == [False, True]  # the output layer's group: gathered as the forward ends
    assert kept(reshard_after_forward="never", prefetch_bytes=0) == [True, True]
    assert kept(reshard_after_forward="always", prefetch_bytes=1 << 30) == [False, False]
    assert kept(world=1) == [False, False]
    # the host's room ([Note: keeping in the host's room]) beside the window: 40 + 24 holds the 64-byte group
    assert kept(room=24) == [True, True] and kept(room=23) == [False, True] and kept(world=1, room=24) == [True, True]
    with pytest.raises(PlanError, match="reshard_after_forward"):
        plan(tiny(), world=2, machine=machine(), reshard_after_forward="sometimes")
    with pytest.raises(PlanError, match="host_keep"):
        plan(tiny(), world=2, machine=machine(), host_keep="always")


def test_the_gathered_peak_counts_a_kept_group_once() -> None:
    """The largest group kept in the middle of the forward is counted once: it is gathered with what is ahead of it,
    or with the other kept groups at the forward's end, not both."""
    from zinf.plan.cost import Workload
    from zinf.plan.gathered import gathered_peak
    from zinf.plan.model import spec_from_module
    from zinf.plan.placements import PlanPlacement

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 64), nn.Linear(64, 8))  # the middle group is the largest
    spec = spec_from_module(model)
    fulls = [n * 2 * 4 for n in spec.shard_numels(2)]
    wl = Workload(world=2, prefetch_bytes=0, prefetch_modules=1)
    assert gathered_peak(spec, wl, 4, PlanPlacement("cpu", "cpu", "cpu"), [False, True, True], room=1 << 20) \
        == max(fulls[1], fulls[1] + fulls[2])


def test_the_hosts_room_keeps_groups_for_the_backward_on_a_cpu(tmp_path: Path) -> None:
    """A model over the 64 MiB window: on a CPU with room to spare, the groups the room holds are all-gathered once
    a step and counted in the gathered peak; with ``host_keep="off"``, or a budget stated, the window alone keeps."""
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(4)])  # just over 64 MiB a group in fp32
    est = {keep: plan(model, world=2, machine=machine(), placements=["cpu/cpu"], batch_tokens=8,
                      host_keep=keep).estimates[0] for keep in ("auto", "off")}
    budget = plan(model, world=2, machine=machine(), placements=["cpu/cpu"], batch_tokens=8,
                  max_cpu_bytes=8 * GiB).estimates[0]
    group = (4096 * 4096 + 4096) * 4
    assert est["auto"].io_bytes["allgather"] == 4 * group // 2  # each group once a step: half of it from the other rank
    assert est["off"].io_bytes["allgather"] == budget.io_bytes["allgather"] == 7 * group // 2  # the last group once
    peak = {k: e.bytes["device"]["gathered_peak"] for k, e in est.items()}
    assert peak["auto"] == 4 * group  # the room keeps every group: all four gathered at the forward's end
    assert peak["off"] == group + 64 * 2**20  # one group, and the window's bytes gathered ahead
    # states on NVMe are not host memory: 2 GiB leave room for every group still (a quarter of 1.9 GiB a host, after
    # the pools, split in two), and the backward reads only what nothing kept
    nvme = {keep: plan(model, world=2, machine=machine(2, nvme={str(tmp_path): 100}), placements=["nvme/nvme"],
                       nvme_paths=[str(tmp_path)], batch_tokens=8, pinned_pool_bytes=64 << 20,
                       host_keep=keep).estimates[0] for keep in ("auto", "off")}
    assert nvme["auto"].io_bytes["allgather"] == est["auto"].io_bytes["allgather"]
    assert nvme["auto"].io_bytes["nvme_read"] < nvme["off"].io_bytes["nvme_read"]


def test_cpu_only_machine_keeps_one_fp32_copy_for_cpu_params() -> None:
    e = plan(tiny(), machine=machine(), placements=["cpu/device"], batch_tokens=8).estimates[0]
    assert state_bytes_total(e) == 23 * 16


def state_bytes_total(e: zinf.plan.Estimate) -> int:
    return sum(e.tier_bytes(t, states_only=True) for t in ("device", "cpu", "nvme"))


def tiny_frozen() -> nn.Module:
    model = tiny()
    model[0].requires_grad_(False)  # a frozen first layer: its shard alone (see [Note: frozen groups])
    return model


def power_of_two() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 1024, bias=False), nn.Linear(1024, 2))  # a group of 2**12: cut in two sub-groups


@pytest.mark.parametrize("build", [tiny, tiny_frozen, power_of_two], ids=["trainable", "frozen_first_layer",
                                                                          "power_of_two_group"])
@pytest.mark.parametrize("placement", ["device/device", "device/cpu", "nvme/nvme", "cpu/cpu", "nvme/device"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_bytes_match_the_engine(tmp_path: Path, placement: str, precision: str, build) -> None:
    """The planner's bytes per tier equal what a real engine reports (peak over a backward and a step)."""
    nv = str(tmp_path)
    p = plan(build(), nvme_paths=[nv], machine=machine(nvme={nv: 10}), placements=[placement], batch_tokens=8,
             precision=[precision])
    est = p.estimates[0]
    cfg = zinf.ZeroConfig.from_dict(p.config())
    torch.manual_seed(0)
    with zinf.Init(cfg):
        model = build()
    engine = zinf.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), cfg)
    peak: dict[str, int] = {}
    for _ in range(2):
        engine.backward(engine(torch.randn(5, 4)).square().mean())
        for t, kinds in engine.resident_bytes().items():
            peak[t] = max(peak.get(t, 0), sum(kinds.values()))
        engine.step()
    swap = engine.placement.swap
    files = swap.bytes_per_path if swap is not None else {}
    engine.close()
    # without CUDA the device tier is host memory: resident_bytes reports it as "cpu"
    assert peak.get("cpu", 0) == est.tier_bytes("device", True) + est.tier_bytes("cpu", True)
    assert peak.get("nvme", 0) == est.tier_bytes("nvme", True)
    assert sum(files.values()) == (est.disk_bytes + ALIGN * len(files) if files else 0)  # each file has a header block


# -- fitting and the recommendation -------------------------------------------------------------------
def test_fits_with_given_budgets(tmp_path: Path) -> None:
    nv = str(tmp_path)
    # 1e9 parameters: 16 GB of fp32 model states, 17+ GB with the shards offloaded
    p = plan(params=1e9, layers=16, hidden=2048, nvme_paths=[nv], machine=machine(host_gib=12, nvme={nv: 100}),
             batch_tokens=256)
    est = by_name(p)
    assert not est["device/device fp32"].fits and "host memory" in est["device/device fp32"].why_not[0]
    assert not est["device/cpu fp32"].fits
    assert est["nvme/nvme fp32"].fits
    # bf16 moments take the host's states from 16 to 12 bytes a parameter: they fit in its memory, and are faster
    # than the states on NVMe
    assert est["device/cpu+bf16 fp32"].fits and not est["device/cpu fp32"].fits
    assert p.recommended is not None and p.recommended.placement.name == "device/cpu+bf16"
    assert p.config()["optimizer_storage"] == "bf16"
    zinf.ZeroConfig.from_dict(p.config())
    rest = plan(params=1e9, layers=16, hidden=2048, nvme_paths=[nv], machine=machine(host_gib=12, nvme={nv: 100}),
                batch_tokens=256, placements=[pl for pl in ALL_PLACEMENTS if pl.moments == "fp32"])
    assert rest.recommended is not None and rest.recommended.placement.optimizer == "nvme"
    # the same run with less host memory (10 GiB: not even bf16 moments fit) and a full disk: nothing fits
    p = plan(params=1e9, layers=16, hidden=2048, nvme_paths=[nv], machine=machine(host_gib=10, nvme={nv: 1}),
             batch_tokens=256)
    assert p.recommended is None and all(not e.fits for e in p.estimates)
    assert any("nvme: needs" in w for e in p.estimates for w in e.why_not)
    # an explicit host budget is honoured
    p = plan(tiny(), machine=machine(), max_cpu_bytes=100, placements=["device/device"], batch_tokens=8)
    assert not p.estimates[0].fits and "max_cpu_bytes" in p.estimates[0].why_not[0]


def test_no_nvme_path_means_nvme_does_not_fit() -> None:
    p = plan(tiny(), machine=machine(), batch_tokens=8)
    nvme = [e for e in p.estimates if "nvme" in (e.placement.params, e.placement.optimizer)]
    assert nvme and all(not e.fits and "no --nvme path" in e.why_not[0] for e in nvme)


def test_recommends_fewest_offloads_on_a_tie(tmp_path: Path) -> None:
    nv = str(tmp_path)
    even = zinf.plan.Calibration(torch_adam_bytes=zinf.plan.Calibration().cpu_adam_bytes)  # both optimizers equal
    p = plan(tiny(), nvme_paths=[nv], machine=machine(nvme={nv: 10}), batch_tokens=8, calibration=even)
    assert p.recommended is not None and p.recommended.placement.name == "device/device"
    cfg = p.config()
    assert cfg == {"precision": "fp32", "offload": {"params": "device", "optimizer": "device", "grads": "auto"}}
    assert "zinf:" in p.yaml() and "optimizer: device" in p.yaml()
    # a slower device/device (an expensive optimizer) loses to the CPU optimizer only beyond the tie tolerance
    slow = zinf.plan.Calibration(torch_adam_bytes=1e9)
    p = plan(tiny(), machine=machine(), calibration=slow, batch_tokens=8, placements=["device/device", "device/cpu"])
    assert p.recommended is not None and p.recommended.placement.name == "device/cpu"


def test_recommended_nvme_config_is_valid(tmp_path: Path) -> None:
    nv = str(tmp_path)
    p = plan(tiny(), nvme_paths=[nv], machine=machine(nvme={nv: 10}), placements=["nvme/nvme"], batch_tokens=8)
    cfg = zinf.ZeroConfig.from_dict(p.config())
    assert cfg.offload.nvme_paths == [nv] and cfg.offload.params == "nvme"
    assert cfg.offload.pinned_pool_bytes == p.recommended.pinned_pool_bytes


# -- inputs -------------------------------------------------------------------------------------------
def test_meta_device_module() -> None:
    from gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab=512, block=32, n_embd=64, n_head=4, n_layer=3)
    with torch.device("meta"):
        meta = GPT(cfg)
    real = GPT(cfg)
    spec = zinf.plan.model_spec(meta)
    assert spec.numel == sum(p.numel() for p in real.parameters())  # tied head counted once
    assert (spec.num_layers, spec.hidden, spec.vocab) == (3, 64, 512)
    assert len(spec.groups) == 2 + 3 * 6 + 1  # wte, wpe; six modules per block; ln_f; the tied head owns nothing new
    assert spec.matmul_numel == spec.numel - 32 * 64 - sum(g.numel for g in spec.groups if "ln" in g.name)


def test_transformers_config() -> None:
    transformers = pytest.importorskip("transformers")
    kwargs = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 100, "n_positions": 64}
    spec = zinf.plan.model_spec(hf_config="gpt2", hf_kwargs=kwargs)
    real = transformers.GPT2LMHeadModel(transformers.GPT2Config(**kwargs))
    assert spec.numel == sum(p.numel() for p in real.parameters())
    assert (spec.num_layers, spec.hidden, spec.seq_len, spec.vocab) == (2, 32, 64, 100)
    llama = zinf.plan.model_spec(transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                                          num_attention_heads=2, num_key_value_heads=2, vocab_size=64))
    assert llama.numel == 2 * 64 * 32 + 32 * 32 * 4 + 3 * 32 * 64 + 3 * 32  # embed + head, attention, MLP, 3 norms


def test_params_with_layer_shapes() -> None:
    spec = zinf.plan.model_spec(params=1.3e9, layers=24, hidden=2048)
    assert spec.numel == 1_300_000_000 and spec.num_layers == 24 and spec.hidden == 2048
    assert spec.largest_group_numel == spec.groups[0].numel  # the embedding takes the rest
    guessed = zinf.plan.model_spec(params=1.3e9)
    assert guessed.numel == 1_300_000_000 and guessed.notes


# -- errors -------------------------------------------------------------------------------------------
def test_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="unknown placement 'gpu/cpu'"):
        parse_placement("gpu/cpu")
    with pytest.raises(PlanError, match="unknown placement 'device/device/nvme'"):
        plan(tiny(), machine=machine(), placements=["device/device/nvme"])
    with pytest.raises(PlanError, match="exactly one model"):
        plan(machine=machine())
    with pytest.raises(PlanError, match="exactly one model"):
        plan(tiny(), params=10, machine=machine())
    missing = str(tmp_path / "nope")
    with pytest.raises(PlanError, match="does not exist"):
        plan(tiny(), nvme_paths=[missing], machine=machine())
    with pytest.raises(PlanError, match="precision 'fp8'"):
        plan(tiny(), precision="fp8", machine=machine())
    with pytest.raises(PlanError, match="not a transformers model type"):
        zinf.plan.model_spec(hf_config="no-such-model")
    with pytest.raises(PlanError, match="package.module:factory"):
        zinf.plan.model_spec(module="no_colon")
    with pytest.raises(PlanError, match="cannot import"):
        zinf.plan.model_spec(module="no_such_pkg_zinf.mod:f")
    with pytest.raises(PlanError, match="hold .* more than --params"):
        zinf.plan.model_spec(params=1000, layers=2, hidden=64)
    assert len(ALL_PLACEMENTS) == 30  # 12, and the 9 with the optimizer offloaded again with bf16 and with int8 moments


# -- the command line ---------------------------------------------------------------------------------
def _machine_file(tmp_path: Path, nvme: dict[str, float] | None = None) -> str:
    f = tmp_path / "machine.json"
    f.write_text(json.dumps(machine(nvme=nvme).to_dict()))
    return str(f)


def test_cli_json(tmp_path: Path, capsys) -> None:
    nv = tmp_path / "nvme"
    nv.mkdir()
    mf = _machine_file(tmp_path, {str(nv): 100})
    assert main(["plan", "--params", "1.3e9", "--layers", "24", "--hidden", "2048", "--nvme", str(nv),
                 "--machine", mf, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"model", "workload", "machine", "placements", "recommended", "notes", "frozen_base"}
    assert out["frozen_base"] is None
    assert out["model"]["params"] == 1_300_000_000 and len(out["placements"]) == 30
    row = out["placements"][0]
    assert {"placement", "precision", "bytes", "bytes_per_tier", "seconds", "fits", "why_not", "io_bytes"} <= set(row)
    assert {"compute", "optimizer", "step"} <= set(row["seconds"])
    rec = out["recommended"]
    assert rec["fits"] and rec["config"]["zinf"]["offload"]["params"] == rec["params"]
    zinf.ZeroConfig.from_dict(rec["config"]["zinf"])  # a valid config
    # the text form: the table and the YAML of the recommended placement
    assert main(["plan", "--params", "1e8", "--machine", mf, "--placement", "device/device", "device/cpu"]) == 0
    text = capsys.readouterr().out
    assert "recommended:" in text and "zinf:" in text and "device/cpu" in text


def test_cli_hf_config_and_errors(tmp_path: Path, capsys) -> None:
    pytest.importorskip("transformers")
    mf = _machine_file(tmp_path)
    assert main(["plan", "--hf-config", "gpt2", "--hf-kwargs", '{"n_layer": 2, "n_embd": 32, "n_head": 2}',
                 "--machine", mf, "--json", "--batch-tokens", "64"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["layers"] == 2 and out["model"]["hidden"] == 32
    assert main(["plan", "--machine", mf]) == 2
    assert "exactly one model" in capsys.readouterr().err
    assert main(["plan", "--params", "1e6", "--machine", mf, "--placement", "nvme/gpu"]) == 2
    assert "unknown placement" in capsys.readouterr().err
    assert main(["plan", "--params", "1e6", "--machine", mf, "--world", "2", "--reshard-after-forward", "x"]) == 2
    assert "overlap.reshard_after_forward" in capsys.readouterr().err
    assert main(["plan", "--params", "1e6", "--machine", mf, "--nvme", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["plan", "--params", "1e6", "--machine", str(tmp_path / "none.json")]) == 2
    assert "--machine" in capsys.readouterr().err
    assert main(["plan", "--hf-config", "gpt2", "--hf-kwargs", "{bad", "--machine", mf]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_cli_module_factory(tmp_path: Path, capsys, monkeypatch) -> None:
    pkg = tmp_path / "plan_factory_mod.py"
    pkg.write_text("from torch import nn\n\ndef build(width=8):\n    return nn.Sequential(nn.Linear(width, width), nn.Linear(width, 2))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mf = _machine_file(tmp_path)
    assert main(["plan", "--module", "plan_factory_mod:build", "--module-kwargs", '{"width": 16}', "--machine", mf,
                 "--json", "--batch-tokens", "8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["params"] == 16 * 16 + 16 + 16 * 2 + 2


# -- CPUs without native 16-bit units ------------------------------------------------------------------------
def test_slow_bf16_recommends_fp32_compute_with_bf16_storage(tmp_path: Path) -> None:
    nv = tmp_path / "nvme"
    nv.mkdir()
    slow = machine(nvme={str(nv): 100})
    slow = Machine(**{**slow.to_dict(), "flops": {"fp32": 110e9, "bf16": 0.3e9}})  # as measured on an AVX2 CPU
    p = plan(tiny(), precision="bf16", nvme_paths=[str(nv)], machine=slow, batch_tokens=8)
    rows = by_name(p)
    assert "device/device bf16" in rows and "device/device fp32/bf16" in rows  # the fp32-compute rows were added
    assert any("no native bf16 units" in n and "0.3 GFLOP/s" in n for n in p.notes), p.notes
    rec = p.recommended
    assert rec is not None and (rec.precision, rec.storage) == ("fp32", "bf16")
    cfg = p.config()
    assert cfg["precision"] == "fp32" and cfg["param_storage"] == "bf16"
    assert zinf.ZeroConfig.from_dict(cfg).storage_dtype == torch.bfloat16
    # parameters at rest and read per step: 2 bytes per parameter, as in bf16 compute, half of fp32 storage
    wide = plan(tiny(), precision="fp32", nvme_paths=[str(nv)], machine=slow, batch_tokens=8)
    fp32_nvme = by_name(wide)["nvme/nvme fp32"].bytes["nvme"]["param_shards"]
    assert rows["nvme/nvme fp32/bf16"].bytes["nvme"]["param_shards"] == rows["nvme/nvme bf16"].bytes["nvme"]["param_shards"]
    assert rows["nvme/nvme fp32/bf16"].bytes["nvme"]["param_shards"] <= fp32_nvme
    text = p.table()
    assert "fp32/bf16" in text and "param_storage: bf16" in text


def test_fast_bf16_adds_no_rows() -> None:
    p = plan(tiny(), precision="bf16", machine=machine(), batch_tokens=8)  # bf16 at half fp32's rate: native
    assert {e.storage for e in p.estimates} == {"bf16"} and not any("native" in n for n in p.notes)


@pytest.mark.parametrize("flops", [1e3, 1e18])
def test_table_stays_aligned_for_any_magnitude(flops: float) -> None:
    m = Machine(**{**machine().to_dict(), "flops": {"fp32": flops, "bf16": flops}})
    p = plan(params=7e9, layers=32, hidden=4096, precision=["fp32", "bf16"], machine=m)
    lines = p.table().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("placement"))
    head, rows = lines[start], [line for line in lines[start + 2:] if line and line[0].isalpha()]
    rows = rows[: len(p.estimates)]
    assert len(rows) == len(p.estimates)
    for name in ("device GiB", "moved GiB", "compute s", "step s"):
        end = head.index(name) + len(name)  # numbers are right-aligned under their header
        for row in rows:
            assert row[end - 1] not in " " and row[end] == " ", (name, row)
    assert all(e.seconds["step"] == e.seconds["step"] and e.seconds["step"] > 0 for e in p.estimates
               if "nvme" not in e.placement.name)  # finite and positive


def test_compute_rate_is_measured_within_its_budget() -> None:
    import time

    from zinf.plan.machine import measure_flops

    for precision in ("fp32", "bf16"):
        start = time.perf_counter()
        rate = measure_flops(torch.device("cpu"), precision, (2048, 2048, 8192), budget_seconds=1.0)
        took = time.perf_counter() - start
        assert rate > 0 and took < 5.0, f"{precision}: {rate / 1e9:.3g} GFLOP/s measured in {took:.1f} s"


@pytest.mark.parametrize("placement,bits", [("device/cpu", "4bit"), ("cpu/cpu", "4bit"), ("nvme/cpu", "4bit"),
                                            ("cpu/cpu", "8bit"), ("nvme/cpu", "8bit")])
def test_quantized_base_bytes_match_the_engine(tmp_path: Path, placement: str, bits: str) -> None:
    """``qlora``: the planner's parameter bytes per tier equal a real engine's for a Llama loaded with
    ``BitsAndBytesConfig(load_in_4bit=True)`` or ``load_in_8bit=True`` (its linear layers in 4 or 8 bits, the rest
    frozen at the precision)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("bitsandbytes")
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=96, max_position_embeddings=32)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "ckpt")
    nv = str(tmp_path)
    p = plan(config, qlora=bits, nvme_paths=[nv], machine=machine(nvme={nv: 10}), placements=[placement],
             batch_tokens=8)
    est = p.estimates[0]
    settings = p.config()
    settings["offload"]["frozen_in_place"] = False  # the planner counts frozen shards in swap, not read in place
    cfg = zinf.ZeroConfig.from_dict(settings)
    with zinf.Init(cfg):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "ckpt", dtype=torch.float32,
            quantization_config=transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
            if bits == "4bit" else transformers.BitsAndBytesConfig(load_in_8bit=True))
    model.requires_grad_(False)
    model.model.norm.weight.requires_grad_(True)  # something to train (the adapters' few parameters, not counted)
    engine = zinf.initialize(model, torch.optim.AdamW([model.model.norm.weight], lr=1e-3), cfg)
    resident = engine.resident_bytes()
    engine.close()
    shards = {t: kinds.get("param_shards", 0) for t, kinds in resident.items()}
    expected = {t: est.bytes.get(t, {}).get("param_shards", 0) for t in ("device", "cpu", "nvme")}
    # without CUDA the device tier is host memory: resident_bytes reports it as "cpu"
    assert shards.get("cpu", 0) == expected["device"] + expected["cpu"]
    assert shards.get("nvme", 0) == expected["nvme"]
    linears = [(64, 64), (32, 64), (32, 64), (64, 64), (128, 64), (128, 64), (64, 128)] * 2  # q k v o gate up down
    numel, rows = sum(o * i for o, i in linears), sum(o for o, _ in linears)
    quantized = numel // 2 + numel // 64 * 4 if bits == "4bit" else numel + rows * 4
    assert sum(expected.values()) >= quantized  # the quantized linear layers, and the embeddings, head and norms


def test_device_share_hides_the_cpu_adam_behind_the_forward() -> None:
    """``cost.device_share``: the smallest share (in 0.05 steps) that leaves the CPU-Adam no longer than the next
    forward, within the device memory left; none when the CPU-Adam is already hidden or nothing fits."""
    from zinf.plan.cost import SHARE_BYTES, device_share, share_taken

    groups = [10**7] * 100  # trained groups' shards, equal: every step of 0.05 is whole groups
    assert device_share(0.2, 0.05, groups, 10**12) == 0.75  # (1 - f) x 0.2 <= 0.05
    assert device_share(1.0, 0.4, groups, 10**12) == 0.6  # exactly on a step: not one step more
    assert device_share(0.04, 0.05, groups, 10**12) == 0.0
    assert device_share(0.2, 0.05, groups, SHARE_BYTES * 10**9 // 2) == 0.5  # room for half
    assert device_share(0.2, 0.05, groups, 0) == 0.0
    assert device_share(100.0, 0.001, groups, 10**12) == 0.95  # never the whole optimizer
    # the engine takes whole groups, the first built: a first group of 60% is the least share there is
    first = [6 * 10**7] + [10**7] * 4
    assert share_taken(first, 0.05) == 0.6
    assert device_share(0.2, 0.05, first, SHARE_BYTES * 10**8 // 2) == 0.0  # room for half: 60% does not fit
    assert device_share(0.2, 0.15, first, 10**12) == 0.05  # wanted 0.25: the first group's 0.6 covers it


def test_the_plan_keeps_a_share_of_the_optimizer_on_a_gpu() -> None:
    """On a GPU with room, device/cpu moves the chosen share's states and gradients to the device (16 bytes a
    parameter), the CPU-Adam's time shrinks with it, and the config names the share."""
    gpu = Machine(device="cuda", device_name="test GPU", device_bytes=80 * GiB, host_bytes=200 * GiB, cores=8,
                  flops={"fp32": 50e12, "bf16": 400e12}, host_bw=10e9, device_bw=2e12, h2d_bw=20e9)
    p = zinf.plan.plan(params=1.3e9, layers=24, hidden=2048, machine=gpu, precision="bf16",
                       placements=["device/cpu", "device/device"])
    est = {e.placement.name: e for e in p.estimates}
    share = est["device/cpu"]
    assert 0 < share.device_fraction < 1
    assert est["device/device"].device_fraction == 0
    assert share.bytes["device"]["optimizer_state"] > 0 and share.bytes["device"]["grad_shards"] > 0
    assert p.config(share)["offload"]["optimizer_device_fraction"] == share.device_fraction
    assert zinf.ZeroConfig.from_dict(p.config(share)).offload.optimizer_device_fraction == share.device_fraction
    assert f"({share.device_fraction:.2f} on device)" in p.table()


def test_a_share_moves_its_states_off_nvme_too(tmp_path: Path) -> None:
    """With the optimizer on NVMe, the share's states (and gradients) are neither read nor written there: the step's
    NVMe bytes and the disk's fall by the share the engine takes (whole groups)."""
    from zinf.offload.device_states import groups_in_share
    from zinf.plan.cost import share_taken
    from zinf.plan.memory import held_grad_bytes, trained_shards

    nv = str(tmp_path)
    gpu = Machine(device="cuda", device_name="test GPU", device_bytes=80 * GiB, host_bytes=200 * GiB, cores=8,
                  flops={"fp32": 50e12, "bf16": 400e12}, host_bw=10e9, device_bw=2e12, h2d_bw=20e9,
                  nvme_free_bytes={nv: 1000 * GiB}, disk_read_bw={nv: 3e9}, disk_write_bw={nv: 2e9})
    p = zinf.plan.plan(params=1.3e9, layers=24, hidden=2048, machine=gpu, precision="bf16", nvme_paths=[nv],
                       placements=["device/nvme/nvme"])
    (est,) = p.estimates
    assert 0 < est.device_fraction < 1
    trained = trained_shards(p.model, p.model.shard_numels(1))
    moved, trainable = share_taken(trained, est.device_fraction), sum(trained)
    # states 12, gradients 4, less the gradients the pool holds for the step (the CPU sweep's first: after the share)
    held = held_grad_bytes(trained[groups_in_share(trained, est.device_fraction):], est.sub_group_numel,
                           est.pinned_pool_bytes)
    assert 0 < held < trainable
    assert est.io_bytes["nvme_read"] == pytest.approx((1 - moved) * trainable * 16 - held, rel=1e-6)
    assert est.io_bytes["nvme_write"] == est.io_bytes["nvme_read"]
    assert est.bytes["nvme"]["optimizer_state"] == pytest.approx((1 - moved) * trainable * 12, rel=0.01)
