"""examples/finetune_hf.py under torchrun at world 2: trains, checkpoints, resumes where it stopped and leaves a
directory AutoModelForCausalLM.from_pretrained opens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardtrain.checkpoint import open_checkpoint

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def _run(config: Path, out: Path, steps: int) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [str(ROOT / "examples" / "finetune_hf.py"), "--config", str(config), "--tiny", "--output-dir", str(out)]
    cmd += ["--steps", str(steps), "--save-every", "2", "--seq-len", "16"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_finetune_example_trains_resumes_and_consolidates(tmp_path):
    ds_config = json.loads((ROOT / "examples" / "ds_config_zero3.json").read_text())
    ds_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # shard even this tiny model
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(ds_config))
    out = tmp_path / "run"

    first = _run(config, out, steps=2)
    assert "resumed" not in first and "step 2: loss" in first
    second = _run(config, out, steps=4)
    assert f"resumed from {out / 'checkpoints'} at step 2" in second and "step 4: loss" in second

    reader = open_checkpoint(out / "checkpoints")  # the one `latest` names
    assert reader.manifest.tag == "global_step4"
    counters = reader.objects["engine/counters"]
    assert counters["global_step"] == 4 and counters["global_samples"] == 4 * (4 * 2 * 2)  # micro x accum x ranks
    # Adam's step count continued from the checkpoint (a fresh optimizer would be at 2)
    assert reader.read("optim/model.norm.weight/step").item() == 4
    assert reader.objects["engine/scheduler"]["last_epoch"] == 4

    model = transformers.AutoModelForCausalLM.from_pretrained(out / "final")
    assert type(model).__name__ == "LlamaForCausalLM"
    for name, value in model.state_dict().items():
        assert torch.equal(value, reader.read(f"model/{name}").view(value.shape)), name
    vocab = json.loads((out / "final" / "vocab.json").read_text())
    assert model.config.vocab_size == len(vocab)
