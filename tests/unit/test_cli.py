import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

import zinf
from zinf.cli import main


def test_info_and_consolidate(tmp_path: Path, capsys) -> None:
    assert main(["info"]) == 0
    assert "NativeInfo(" in capsys.readouterr().out
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    engine = zinf.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1))
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    out = tmp_path / "full.pt"
    result = subprocess.run([sys.executable, "-m", "zinf.cli", "consolidate", str(tmp_path / "ckpt"), str(out)],
                            capture_output=True, text=True, check=True)
    assert "wrote 4 tensors" in result.stdout
    state = torch.load(out)
    assert set(state) == set(expected) and all(torch.equal(state[k], v) for k, v in expected.items())
