"""``zinf plan``'s checks of what it is given: numeric flags, a --machine file's fields, --hf-kwargs' keys, and
--allgather-gbps with a given machine."""

import json
from pathlib import Path

import pytest

from zinf.cli import main
from zinf.plan import Machine, PlanError, plan

GiB = 2**30


def machine(**kw) -> Machine:
    return Machine(device="cpu", device_name="test CPU", device_bytes=16 * GiB, host_bytes=16 * GiB, cores=2,
                   flops={"fp32": 100e9}, host_bw=10e9, device_bw=10e9, **kw)


def _file(tmp_path: Path, data: dict, name: str = "machine.json") -> str:
    f = tmp_path / name
    f.write_text(json.dumps(data))
    return str(f)


def test_allgather_gbps_applies_to_a_given_machine(tmp_path: Path, capsys) -> None:
    p = plan(params=1e7, world=2, machine=machine(), allgather_gbps=5, placements=["device/device"])
    assert p.machine.allgather_bw == 5e9 and "given" in p.machine.allgather_source
    assert p.recommended is not None and p.recommended.seconds["step"] > 0
    mf = _file(tmp_path, machine().to_dict())
    assert main(["plan", "--params", "1e7", "--world", "2", "--machine", mf, "--allgather-gbps", "5"]) == 0
    out = capsys.readouterr().out
    assert "recommended:" in out and "no placement fits" not in out


def test_unknown_step_time_names_allgather_gbps(tmp_path: Path, capsys) -> None:
    mf = _file(tmp_path, machine().to_dict())  # world 1's machine: no all-gather figure
    assert main(["plan", "--params", "1e7", "--world", "2", "--machine", mf]) == 0
    out = capsys.readouterr().out
    assert "no placement fits" not in out and "--allgather-gbps" in out.splitlines()[-1]
    p = plan(params=1e7, world=2, machine=machine(), placements=["device/device"])
    with pytest.raises(PlanError, match="--allgather-gbps"):
        p.config()


@pytest.mark.parametrize("args, flag", [
    (["--params", "1e7", "--layers", "0"], "--layers"),
    (["--params", "1e7", "--layers", "-3"], "--layers"),
    (["--params", "1e7", "--hidden", "0"], "--hidden"),
    (["--params", "nan"], "--params"),
    (["--params", "inf"], "--params"),
    (["--params", "1e7", "--seq", "-5"], "--seq"),
    (["--params", "1e7", "--vocab", "0"], "--vocab"),
    (["--params", "1e7", "--ranks-per-node", "0"], "--ranks-per-node"),
    (["--params", "1e7", "--pinned-pool-bytes", "-1"], "--pinned-pool-bytes"),
    (["--params", "1e7", "--max-cpu-bytes", "-1"], "--max-cpu-bytes"),
    (["--params", "1e7", "--allgather-gbps", "0"], "--allgather-gbps"),
    (["--params", "1e7", "--allgather-gbps", "-1"], "--allgather-gbps"),
    (["--params", "1e7", "--allgather-gbps", "nan"], "--allgather-gbps"),
])
def test_numeric_flags_are_checked(tmp_path: Path, capsys, args: list, flag: str) -> None:
    mf = _file(tmp_path, machine().to_dict())
    assert main(["plan", *args, "--machine", mf]) == 2
    err = capsys.readouterr().err
    assert flag in err and "expected" in err


@pytest.mark.parametrize("field, value, expect", [
    ("flops", {"fp32": "fast"}, "flops"),
    ("flops", {}, "flops"),
    ("host_bw", -1, "host_bw"),
    ("host_bw", "10", "host_bw"),
    ("device_bytes", 1.5, "device_bytes"),
    ("cores", True, "cores"),
    ("device", "tpu", "device"),
    ("disk_read_bw", {"/x": None}, "disk_read_bw"),
    ("allgather_bw", 0, "allgather_bw"),
    ("notes", "text", "notes"),
])
def test_machine_file_fields_are_checked(tmp_path: Path, capsys, field: str, value, expect: str) -> None:
    mf = _file(tmp_path, {**machine().to_dict(), field: value})
    with pytest.raises(PlanError, match=rf"machine\.json.*{expect}"):
        Machine.load(mf)
    assert main(["plan", "--params", "1e7", "--machine", mf]) == 2
    assert expect in capsys.readouterr().err


def test_machine_file_as_written_loads(tmp_path: Path) -> None:
    m = machine(allgather_bw=2e9, h2d_bw=None, disk_read_bw={"/x": 1e9})
    assert Machine.load(_file(tmp_path, {"machine": m.to_dict()})) == m
    assert Machine.load(_file(tmp_path, {**m.to_dict(), "device_bytes": 8e9})).device_bytes == 8_000_000_000
    with pytest.raises(PlanError, match="JSON object"):
        Machine.load(_file(tmp_path, [1, 2]))


def test_unknown_hf_kwargs_are_refused(tmp_path: Path, capsys) -> None:
    pytest.importorskip("transformers")
    mf = _file(tmp_path, machine().to_dict())
    assert main(["plan", "--hf-config", "gpt2", "--hf-kwargs", '{"n_layerz": 3}', "--machine", mf]) == 2
    err = capsys.readouterr().err
    assert "n_layerz" in err and "'n_layer'" in err
    import zinf.plan

    with pytest.raises(PlanError, match="n_layerz"):
        zinf.plan.model_spec(hf_config="gpt2", hf_kwargs={"n_layer": 1, "n_layerz": 3})
    # aliases (attribute_map) and the config's own attributes stay accepted
    spec = zinf.plan.model_spec(hf_config="gpt2", hf_kwargs={"num_hidden_layers": 1, "n_embd": 32, "n_head": 2})
    assert spec.num_layers == 1 and spec.hidden == 32
    small = {"num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128}
    # keys the config's __init__ consumes rather than keeps (rope_theta, attn_implementation) are settings too
    assert zinf.plan.model_spec(hf_config="llama", hf_kwargs={**small, "rope_theta": 1e4,
                                                               "attn_implementation": "eager"}).num_layers == 1
    from transformers import GPT2Config

    with pytest.raises(PlanError, match="'n_layer'"):
        zinf.plan.model_spec(hf_config=GPT2Config(n_layer=1, n_embd=32, n_head=2), hf_kwargs={"n_layerz": 3})
