"""A long run that survives crashes: torchrun restarts the job and it resumes from the last complete checkpoint.

    torchrun --standalone --nproc-per-node=2 --max-restarts=3 examples/elastic_train.py \\
        --ckpt-dir runs/elastic --steps 300 --save-every 25

When any rank dies (the OOM killer, a node reboot, a bug), the others stop within a second with an error naming it,
torchrun stops the job and starts it again (up to ``--max-restarts`` times), and this script loads what
``<ckpt-dir>/latest`` names: weights, optimizer, scheduler, loss scale, step counters and each rank's RNG states.
Training then continues exactly as if the crash had not happened, from that checkpoint on; only the steps after it
are done again. What this takes from a training script:

* resume at start: ``if (ckpt_dir / "latest").exists(): engine.load_checkpoint(ckpt_dir)``;
* data that is a function of the step (here: the batch is drawn from a generator seeded with (seed, step, rank)),
  or a data loader whose position is saved in ``client_state`` and restored from what ``load_checkpoint`` returns;
* a checkpoint every N steps (``save_checkpoint`` is crash-safe: ``latest`` only ever names a complete one).

The command line above is all a restart needs: no environment variable (shardtrain starts each attempt's process
group on a store of its own, so a restarted attempt never reads the addresses of the one that died; see [Note:
restarts under torchrun] in ``src/shardtrain/mesh.py``).

``--kill-rank R --kill-at-step S`` shows it: rank R kills itself with SIGKILL after step S on the first attempt only
(``TORCHELASTIC_RESTART_COUNT`` is 0), as the OOM killer would; with ``--kill-at-save POINT`` it dies inside the
save of step S instead, at that point of the save protocol (one of ``CRASH_POINTS`` in
``src/shardtrain/checkpoint/durable.py``, e.g. ``renamed``: the checkpoint directory is in place, ``latest`` not
moved yet). ``--async-save`` writes the checkpoints in the background (``save_checkpoint(async_save=True)``).
``--hold-rank R --hold-at-step S --pid-file F`` lets
something outside kill it instead: on the first attempt rank R writes its pid to F after step S and waits there (its
peers wait for it in the next step's collectives) until it is killed, e.g. ``kill -9 $(cat F)``. ``--loss-log FILE``
appends one JSON line per step (rank 0): attempt, step, loss, time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch

import shardtrain
from shardtrain.checkpoint.durable import CRASH_POINTS, KILL_ENV
from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.models.markov import MarkovCorpus

MODEL = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=2, n_head=2)


def build_engine(stage: int, seed: int) -> shardtrain.Engine:
    torch.manual_seed(seed)  # every rank builds the same initial weights (rank 0's are broadcast anyway)
    model = GPT(MODEL)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-3, "warmup_num_steps": 5}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10**9,
    }
    return shardtrain.initialize(model, config=config)


def batch(corpus: MarkovCorpus, seed: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of optimizer step ``step``: a resumed run reads exactly what the first attempt read."""
    g = torch.Generator().manual_seed(hash((seed, step, rank)) % 2**63)
    return corpus.batch(4, MODEL.seq_len, g)


def train(
    ckpt_dir: str,
    steps: int,
    save_every: int,
    stage: int = 2,
    seed: int = 0,
    kill_rank: int | None = None,
    kill_at_step: int | None = None,
    log: str | None = None,
    hold_rank: int | None = None,
    hold_at_step: int | None = None,
    pid_file: str | None = None,
    kill_at_save: str | None = None,
    async_save: bool = False,
) -> list[tuple[int, float]]:
    """Train until ``steps`` optimizer steps in total, resuming from ``ckpt_dir/latest`` when it exists. Returns
    (step, loss) of the steps this call trained."""
    engine = build_engine(stage, seed)
    rank = engine.topology.rank
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if (Path(ckpt_dir) / "latest").exists():
        engine.load_checkpoint(ckpt_dir)
        if rank == 0:
            print(f"attempt {attempt}: resumed from {ckpt_dir} at step {engine.global_step}", flush=True)
    if attempt == 0 and rank == kill_rank and kill_at_save:  # the save protocol's test hook: die in the n-th save
        saves = sum(1 for s in range(engine.global_step + 1, kill_at_step + 1) if s % save_every == 0)
        os.environ[KILL_ENV] = f"{kill_at_save}:{saves}"
    corpus = MarkovCorpus(MODEL.vocab_size, seed=seed)
    losses = []
    while engine.global_step < steps:
        if attempt == 0 and rank == kill_rank and engine.global_step == kill_at_step and kill_at_save is None:
            os.kill(os.getpid(), signal.SIGKILL)
        if attempt == 0 and rank == hold_rank and engine.global_step == hold_at_step:
            hold(pid_file)
        x, y = batch(corpus, seed, engine.global_step, rank)
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append((engine.global_step, loss.item()))
        if rank == 0 and log:
            with open(log, "a") as f:
                line = {"attempt": attempt, "step": engine.global_step, "loss": loss.item(), "time": time.time()}
                f.write(json.dumps(line) + "\n")
        if engine.global_step % save_every == 0:
            engine.save_checkpoint(ckpt_dir, async_save=async_save)
    return losses


def hold(pid_file: str) -> None:
    """Publish this process's pid (whole: written aside, then renamed) and wait to be killed from outside."""
    tmp = f"{pid_file}.tmp"
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, pid_file)
    while True:
        time.sleep(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--steps", type=int, default=300, help="train until this many optimizer steps in total")
    parser.add_argument("--save-every", type=int, default=25)
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kill-rank", type=int, help="this rank kills itself with SIGKILL on the first attempt")
    parser.add_argument("--kill-at-step", type=int, help="... after this many optimizer steps")
    parser.add_argument("--hold-rank", type=int, help="this rank waits to be killed from outside, first attempt")
    parser.add_argument("--hold-at-step", type=int, help="... after this many optimizer steps")
    parser.add_argument("--pid-file", help="... having written its pid here")
    parser.add_argument("--kill-at-save", choices=CRASH_POINTS, help="... inside the save of that step, there")
    parser.add_argument("--async-save", action="store_true", help="save_checkpoint(async_save=True)")
    parser.add_argument("--loss-log", help="rank 0 appends one JSON line per step here")
    args = parser.parse_args()
    if args.hold_rank is not None and (args.hold_at_step is None or args.pid_file is None):
        parser.error("--hold-rank needs --hold-at-step and --pid-file")
    losses = train(
        args.ckpt_dir,
        args.steps,
        args.save_every,
        stage=args.stage,
        seed=args.seed,
        kill_rank=args.kill_rank,
        kill_at_step=args.kill_at_step,
        log=args.loss_log,
        hold_rank=args.hold_rank,
        hold_at_step=args.hold_at_step,
        pid_file=args.pid_file,
        kill_at_save=args.kill_at_save,
        async_save=args.async_save,
    )
    if losses and int(os.environ.get("RANK", "0")) == 0:
        print(f"step {losses[-1][0]}: loss {losses[-1][1]:.4f}", flush=True)


if __name__ == "__main__":
    main()
