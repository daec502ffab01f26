"""``AirAccelerator.load_state`` holds no second copy of the weights: the files are memory-mapped."""

from __future__ import annotations

import json
import os

from tests.conftest import REPO, run_python

MIB = 96
CODE = """
import json, sys
sys.path.insert(0, {benchmarks!r})
import torch
from accelerate_air import AirAccelerator, AirPlugin
from rss_probe import PeakRss

model = torch.nn.ParameterDict({{f"w{{i}}": torch.nn.Parameter(torch.zeros(1 << 18)) for i in range({mib})}})
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
plugin = AirPlugin({root!r}, mlflow=False, preflight=False)
accelerator = AirAccelerator(air_plugin=plugin, cpu=True)
model, optimizer = accelerator.prepare(model, optimizer)
if sys.argv[1] == "save":
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    accelerator.save_state()
    accelerator.end_training()
    print(json.dumps({{"w7": float(model["w7"][3])}}))
else:
    probe = PeakRss()  # the model exists: its 1.0x is in the baseline
    accelerator.load_state()
    print(json.dumps({{"peak": probe.stop(), "w7": float(model["w7"][3])}}))
"""


def test_load_state_holds_no_second_copy_of_the_weights(tmp_path):
    code = CODE.format(benchmarks=os.path.join(REPO, "benchmarks"), mib=MIB, root=str(tmp_path / "root"))
    runs = {}
    for what in ("save", "load"):
        proc = run_python(code, what, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[what] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert runs["load"]["w7"] == runs["save"]["w7"], "the weights were restored"
    extra = runs["load"]["peak"] / (MIB << 20)
    assert extra < 0.3, f"load_state held {extra:.2f}x the weights in memory on top of the model"
