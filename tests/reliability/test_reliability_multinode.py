"""Two torchrun agents on this machine as two nodes (``--nnodes 2 --node-rank 0/1``, static rendezvous on localhost)
train at ZeRO-3 and checkpoint; the checkpoint verifies and the losses are those of the same job on one node.
(Resuming under torchrun is tests/reliability/test_reliability_elastic.py; one launch here keeps the test short.)"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from shardtrain.checkpoint import open_checkpoint
from shardtrain.checkpoint.owner import OWNER_NAME
from shardtrain.testing import run_distributed
from test_reliability_elastic import ROOT, elastic_train, torchrun_env

STEPS, SAVE_EVERY = 4, 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(ckpt: Path, steps: int, log: Path) -> str:
    """One torchrun agent per node, one process each; returns both agents' output."""
    port = _free_port()
    agents = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}"]
        cmd += ["--nproc-per-node=1", "--rdzv-backend=static", "--master-addr=127.0.0.1", f"--master-port={port}"]
        cmd += [str(ROOT / "examples" / "elastic_train.py"), "--ckpt-dir", str(ckpt), "--steps", str(steps)]
        cmd += ["--save-every", str(SAVE_EVERY), "--stage", "3", "--loss-log", str(log)]
        env = torchrun_env()
        agents.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
    outputs = []
    try:
        for agent in agents:
            out, _ = agent.communicate(timeout=180)
            outputs.append(out)
            assert agent.returncode == 0, out[-4000:]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    return "\n".join(outputs)


def _one_node(ckpt_dir: str) -> list[tuple[int, float]]:
    return elastic_train.train(ckpt_dir, STEPS, SAVE_EVERY, stage=3)


def test_two_nodes_train_and_checkpoint(tmp_path):
    ckpt, log = tmp_path / "ck", tmp_path / "losses.jsonl"
    _two_nodes(ckpt, STEPS, log)
    reader = open_checkpoint(ckpt)
    assert reader.manifest.tag == f"global_step{STEPS}" and reader.manifest.world_size == 2
    assert reader.verify() == []
    assert sorted(p.name for p in ckpt.iterdir() if p.name != OWNER_NAME) == ["global_step2", "global_step4", "latest"]

    losses = [json.loads(line) for line in log.read_text().splitlines()]
    straight = run_distributed(_one_node, 2, str(tmp_path / "one-node"), timeout=120)[0]
    assert [(r["step"], r["loss"]) for r in losses] == straight  # bitwise
