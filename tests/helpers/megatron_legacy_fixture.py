"""Write legacy Megatron-LM checkpoints (``--ckpt-format torch``: ``iter_N/mp_rank_XX[_YYY]/model_optim_rng.pt``)
with Megatron-LM's own ``megatron.training.checkpointing.save_checkpoint`` (test-only;
``tests/checkpoint/test_migrate_megatron_legacy.py``).

Megatron-LM's training package is not in the megatron-core wheel: the generator needs a Megatron-LM source tree
(``MEGATRON_LM=<checkout of core_v0.16.1>``), appended to ``sys.path`` *after* site-packages so that ``megatron`` (a
namespace package) takes ``megatron.training`` from the source and ``megatron.core`` from the installed wheel, plus
the two modules ``megatron.training`` imports and our venv lacks (``six``, ``triton``: ``MEGATRON_LM_DEPS=<dir>``,
``pip install --target <dir> six triton``). Nothing of it is needed to read the committed fixtures.

``save OUT TP PP SCRATCH [KIND EP]``, under torchrun (world 4): the tiny Llama-style GPT of ``megatron_fixture.py``
(KIND ``moe``: its MoE version, sequential experts, at expert parallelism EP),
Megatron-LM's real ``args`` (``parse_args`` + ``validate_args`` of the command line below), saved by
``save_checkpoint`` at iteration 1; the same model also saved as ``torch_dist`` into SCRATCH so that
``megatron_fixture.logits`` (Megatron loading it at tp 1 x pp 1, its own resharding) gives the reference logits.

``train OUT REF``, one process: Megatron trains the dense model 4 steps with its (non-distributed) fp32 Adam, saving
with ``save_checkpoint`` after step 2 (model and ``optimizer.state_dict()``); REF gets the losses of every step.

[Note: Megatron-LM's legacy save on CPU]
What ran beyond [Note: megatron-core on CPU] (``megatron_fixture.py``), each given its CPU meaning:
- ``validate_args`` asks the CUDA device's architecture (to warn about ``CUDA_DEVICE_MAX_CONNECTIONS``): 10;
- ``get_rng_state`` saves ``torch.cuda.get_rng_state()``: an empty byte tensor (there is no CUDA generator).
The rest of ``save_checkpoint`` (checkpoint names, ``generate_state_dict``, ``torch.save``, the tracker file) is
Megatron-LM's code as released. Not written: the distributed optimizer's state (``DistributedOptimizer`` refuses
parameters whose ``type()`` is not ``torch.cuda.*Tensor``; docs/migration-megatron.md says what a probe found).
"""

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from helpers import megatron_fixture as mf

DATA = Path(__file__).parents[1] / "data" / "megatron_legacy"
SAVE_TP, SAVE_PP = 2, 2
MOE_TP, MOE_PP, MOE_EP = 1, 2, 2  # the layout of megatron_core/moe: iter_N/mp_rank_00_<pp:03d>_<ep:03d>/


def megatron_lm_path() -> str | None:
    """The Megatron-LM source tree the generator runs (``MEGATRON_LM``), or None."""
    path = os.environ.get("MEGATRON_LM")
    return path if path and (Path(path) / "megatron" / "training" / "checkpointing.py").is_file() else None


def _import_megatron_lm() -> None:
    for path in (megatron_lm_path(), os.environ.get("MEGATRON_LM_DEPS")):
        if path and path not in sys.path:
            sys.path.append(path)  # after site-packages: megatron.core stays the installed wheel


def _megatron_lm_args(tp: int, pp: int, save: str, iteration_interval: int, kind: str = "dense", ep: int = 1):
    """Megatron-LM's full ``args`` for the command line a user would give this model."""
    import megatron.training.arguments as arguments
    from megatron.training.global_vars import set_args

    arguments.get_device_arch_version = lambda: 10  # [Note: Megatron-LM's legacy save on CPU]
    argv = f"""--num-layers {mf.LAYERS} --hidden-size {mf.HIDDEN} --ffn-hidden-size {mf.FFN}
        --num-attention-heads {mf.HEADS} --group-query-attention --num-query-groups {mf.GROUPS}
        --seq-length {mf.SEQ} --max-position-embeddings {mf.SEQ} --position-embedding-type rope
        --normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
        --tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp} --ckpt-format torch --save {save}
        --save-interval {iteration_interval} --train-iters {mf.TRAIN_STEPS} --micro-batch-size {mf.ROWS}
        --lr {mf.LR} --weight-decay 0 --clip-grad 0 --adam-eps 1e-8 --hidden-dropout 0 --attention-dropout 0
        --init-method-std 0.05 --use-cpu-initialization --no-gradient-accumulation-fusion""".split()
    if kind == "moe":  # megatron_fixture's MoE: sequential experts, allgather dispatcher, no aux loss
        argv += f"""--num-experts {mf.EXPERTS} --moe-router-topk 2 --moe-ffn-hidden-size {mf.FFN}
            --moe-aux-loss-coeff 0 --moe-token-dispatcher-type allgather --moe-router-load-balancing-type none
            --expert-model-parallel-size {ep}""".split()
    old = sys.argv
    sys.argv = ["pretrain_gpt.py", *argv]
    try:
        args = arguments.parse_args()
    finally:
        sys.argv = old
    args.world_size = dist.get_world_size()
    arguments.validate_args(args, {})
    args.padded_vocab_size = mf.VOCAB  # what Megatron-LM's tokenizer setup computes
    set_args(args)
    return args


def _cpu_rng() -> None:
    torch.cuda.get_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)  # [Note: Megatron-LM's legacy ...]


def save(out: str, tp: int, pp: int, scratch: str, kind: str = "dense", ep: int = 1) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.training.checkpointing import save_checkpoint

    dist.init_process_group("gloo")
    mf._cpu_only()
    _cpu_rng()
    _megatron_lm_args(tp, pp, out, 1, kind, ep)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
    )
    torch.manual_seed(1234)
    model = mf._model(kind, tp, pp, ep)
    save_checkpoint(1, [model], None, None, 0)
    ckpt = os.path.join(scratch, "iter_0000001")  # the same weights as torch_dist: Megatron computes their logits
    if dist.get_rank() == 0:
        os.makedirs(ckpt, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict()}, ckpt)
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def train(out: str, ref: str) -> None:
    """``megatron_fixture.megatron_train`` with Megatron-LM's legacy save (its optimizer runs on CPU at tp 1 x pp 1
    only: [Note: megatron-core on CPU])."""
    import contextlib

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.training.checkpointing import save_checkpoint

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{ref}.rendezvous")
    mf._cpu_only()
    mf._cuda_allocations_on_cpu()
    _cpu_rng()
    _megatron_lm_args(1, 1, out, mf.TRAIN_SAVE_AT)
    ps.initialize_model_parallel()
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    torch.manual_seed(1234)
    model = mf._model("dense", 1, 1, 1)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    config = OptimizerConfig(optimizer="adam", lr=mf.LR, weight_decay=0.0, clip_grad=0.0, adam_eps=1e-8)
    opt = get_megatron_optimizer(config, [ddp])
    causal = torch.triu(torch.ones(mf.SEQ, mf.SEQ, dtype=torch.bool), diagonal=1)[None, None]
    position_ids = torch.arange(mf.SEQ).expand(mf.ROWS, mf.SEQ)
    losses = []
    for step, tokens in enumerate(mf._train_batches(mf.TRAIN_STEPS)):
        if step == mf.TRAIN_SAVE_AT:
            save_checkpoint(step, [model], opt, None, 0)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        labels = torch.roll(tokens, -1, dims=1)
        per_token = ddp(tokens, position_ids, attention_mask=causal, labels=labels)
        loss = per_token[:, :-1].float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        opt.step()
        losses.append(loss.item())
    torch.save({"losses": losses}, ref)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def regenerate(out: Path) -> dict:
    """Write ``out/dense`` (tp 2 x pp 2), ``out/moe`` (pp 2 x ep 2) and ``out/trained`` (tp 1 x pp 1, with Adam)
    with Megatron-LM's legacy save, and ``out/expected.json``; returns the expected values."""
    import megatron.core

    expected: dict = {"megatron_core": megatron.core.__version__}
    with tempfile.TemporaryDirectory() as scratch:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        world = SAVE_TP * SAVE_PP
        torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", f"--master-port={port}"]
        dist_copy = os.path.join(scratch, "dense_torch_dist")
        _run(*torchrun, __file__, "save", str(out / "dense"), str(SAVE_TP), str(SAVE_PP), dist_copy)
        ref = os.path.join(scratch, "dense.pt")
        _run(sys.executable, mf.__file__, "logits", dist_copy, "dense", ref)
        values = torch.load(ref)
        expected["dense"] = {"tokens": values["tokens"].tolist(), "logits": values["logits"].tolist()}
        dist_copy = os.path.join(scratch, "moe_torch_dist")
        moe = (str(MOE_TP), str(MOE_PP), dist_copy, "moe", str(MOE_EP))
        _run(*torchrun, __file__, "save", str(out / "moe"), *moe)
        ref = os.path.join(scratch, "moe.pt")
        _run(sys.executable, mf.__file__, "logits", dist_copy, "moe", ref)
        values = torch.load(ref)
        expected["moe"] = {"tokens": values["tokens"].tolist(), "logits": values["logits"].tolist()}
        ref = os.path.join(scratch, "trained.pt")
        _run(sys.executable, __file__, "train", str(out / "trained"), ref)
        expected["trained"] = {"losses": torch.load(ref)["losses"]}
    mf._write_expected(out / "expected.json", expected)
    return expected


def _run(*argv: str) -> None:
    own = {megatron_lm_path(), os.environ.get("MEGATRON_LM_DEPS")}  # each process appends them after site-packages
    path = os.pathsep.join(p for p in sys.path if p not in own)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{argv[-5:]} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")


def expected_values(out: Path = DATA) -> dict:
    import json

    raw = json.loads((out / "expected.json").read_text())
    for kind in ("dense", "moe"):
        raw[kind] = {k: torch.tensor(v) for k, v in raw[kind].items()}
    return raw


if __name__ == "__main__":
    _import_megatron_lm()
    if sys.argv[1] == "save":
        save(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], *sys.argv[6:7], *map(int, sys.argv[7:8]))
    elif sys.argv[1] == "train":
        train(sys.argv[2], sys.argv[3])
    else:
        regenerate(Path(sys.argv[2]) if len(sys.argv) > 2 else DATA)
