"""Write Megatron-Core checkpoints with real megatron-core (test-only; ``tests/checkpoint/test_migrate_megatron.py``).

``save OUT TP PP EP KIND``, under torchrun (world = TP x PP x DP): builds a tiny GPT (Llama-style: RMSNorm, rotary,
SwiGLU, grouped-query attention, untied output layer; KIND ``moe`` adds 4 experts, top-2, sequential experts) with
the local (no TransformerEngine, no apex) layer spec on CPU/gloo and saves it as Megatron-LM does: a ``torch_dist``
distributed checkpoint in ``OUT/iter_0000001`` with ``args``, ``iteration`` and ``checkpoint_version`` in its common
state, and ``OUT/latest_checkpointed_iteration.txt``.

``logits OUT KIND REF``, one process: Megatron loads that checkpoint at tp 1 x pp 1 (its own resharding) and writes
the logits of one batch to REF (``{"tokens", "logits"}``): the reference the consolidated model must reproduce.

[Note: megatron-core on CPU]
What megatron-core 0.16 needs to run here, each given its CPU meaning below and nothing else changed:
- saving calls ``torch.cuda.synchronize`` before copying tensors and puts its save-status flags on
  ``torch.cuda.current_device()``: a no-op, and the CPU;
- its CUDA RNG tracker cannot be seeded on CPU; dropout is 0, so nothing draws from it and its fork is a no-op;
- the MoE router's forward names ``te_general_gemm``, left undefined without TransformerEngine: None (TE absent);
- the MoE layers use the "allgather" token dispatcher ("alltoall" makes a CUDA stream);
- the default causal mask is made on "cuda": the logits pass it explicitly.
- the (non-distributed) optimizer makes its loss-scale and overflow tensors on "cuda": made on the CPU; gradient
  clipping asserts CUDA gradients: the training fixture does not clip.
What cannot run: the distributed optimizer (``DistributedOptimizer`` requires ``torch.cuda.*Tensor`` parameters),
so the training fixture uses megatron's plain fp32 optimizer, at tp 1 x pp 1.

``regenerate [OUT]`` writes all three fixtures (dense tp 2 x pp 2, MoE pp 2 x ep 2, the tp 1 x pp 1 training run)
and their ``expected.json`` into OUT (default ``tests/data/megatron_core``, what the default tests read): the same
function the soak test runs to check that the committed data is still what megatron-core writes.

``engine_load_body`` and ``engine_default_load_body`` are shardtrain's side (run by ``run_distributed``).
"""

import argparse
import contextlib
import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

VOCAB, SEQ, HIDDEN, FFN, HEADS, GROUPS, LAYERS, EXPERTS = 64, 16, 32, 48, 4, 2, 2, 4  # ~1 MB of fixtures


def _cpu_only() -> None:
    torch.cuda.synchronize = lambda *a, **k: None  # [Note: megatron-core on CPU]
    torch.cuda.current_device = lambda: "cpu"
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # megatron 0.16 forgets to define it when TE is absent
        moe_utils.te_general_gemm = None


def _config(kind: str, tp: int, pp: int, ep: int):
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = {}
    if kind == "moe":
        moe = dict(num_moe_experts=EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=FFN, moe_aux_loss_coeff=0.0)
        moe |= dict(moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none")
    return TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        use_cpu_initialization=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        init_method_std=0.05,  # large enough that the logits differ clearly between tokens
        **moe,
    )


def _model(kind: str, tp: int, pp: int, ep: int):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = _config(kind, tp, pp, ep)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, normalization="RMSNorm")
    return GPTModel(
        config,
        spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=10000,
    )


def _args(kind: str, tp: int, pp: int, ep: int) -> argparse.Namespace:
    """The part of Megatron-LM's ``args`` that describes the model (Megatron-LM saves the whole namespace), and one
    of megatron's enums, as Megatron-LM's args hold them."""
    from megatron.core.transformer.enums import AttnBackend

    args = argparse.Namespace(
        attention_backend=AttnBackend.auto,
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        ffn_hidden_size=FFN,
        num_attention_heads=HEADS,
        group_query_attention=True,
        num_query_groups=GROUPS,
        kv_channels=HIDDEN // HEADS,
        padded_vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        position_embedding_type="rope",
        rotary_base=10000,
        rotary_interleaved=False,
        normalization="RMSNorm",
        norm_epsilon=1e-5,
        swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=False,
        untie_embeddings_and_output_weights=True,
        qk_layernorm=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        params_dtype=torch.float32,
        num_experts=None,
    )
    if kind == "moe":
        args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size = EXPERTS, 2, FFN
        args.moe_grouped_gemm = False
    return args


def save(out: str, tp: int, pp: int, ep: int, kind: str) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    own_group = not dist.is_initialized()  # under torchrun; run_distributed makes the group itself
    if own_group:
        dist.init_process_group("gloo")
    _cpu_only()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep
    )
    torch.manual_seed(1234)  # use_cpu_initialization: the master weights are drawn on every rank alike, then split
    model = _model(kind, tp, pp, ep)
    state = {
        "args": _args(kind, tp, pp, ep),
        "checkpoint_version": 3.0,
        "iteration": 1,
        "model": model.sharded_state_dict(),
    }
    ckpt = os.path.join(out, "iter_0000001")
    if dist.get_rank() == 0:
        os.makedirs(ckpt, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, ckpt)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("1")
    ps.destroy_model_parallel()
    if own_group:
        dist.destroy_process_group()


def logits(out: str, kind: str, ref: str) -> None:
    from megatron.core import dist_checkpointing, tensor_parallel
    from megatron.core import parallel_state as ps

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{ref}.rendezvous")
    _cpu_only()
    ps.initialize_model_parallel()
    # [Note: megatron-core on CPU]: the attention's dropout region forks the CUDA RNG tracker; dropout is 0
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    model = _model(kind, 1, 1, 1)
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, os.path.join(out, "iter_0000001"))
    model.load_state_dict(state["model"])
    model.eval()
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))
    position_ids = torch.arange(SEQ).expand(2, SEQ)
    with torch.no_grad():
        # megatron's default causal mask is made on "cuda": pass it (True = masked), as its data loaders do
        causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
        out_logits = model(tokens, position_ids, attention_mask=causal)
    torch.save({"tokens": tokens, "logits": out_logits.float()}, ref)
    ps.destroy_model_parallel()
    if own_group:
        dist.destroy_process_group()


TRAIN_SAVE_AT, TRAIN_STEPS = 2, 4  # Megatron trains 2 steps, saves (iteration 2), goes on for 2 more


def _train_batches(count: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen) for _ in range(count)]


def _cuda_allocations_on_cpu() -> None:
    """[Note: megatron-core on CPU]: megatron's optimizer makes its loss-scale and overflow tensors with
    ``device='cuda'``; here they are made on the CPU."""

    def on_cpu(factory):
        @functools.wraps(factory)
        def make(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)

        return make

    for name in ("tensor", "zeros", "empty", "ones", "full"):
        setattr(torch, name, on_cpu(getattr(torch, name)))


def megatron_train(out: str, ref: str) -> None:
    """One process (tp 1 x pp 1: megatron's optimizer runs on CPU only there, see the note): Megatron trains the
    dense model with its (non-distributed) Adam, saves model and optimizer state at ``TRAIN_SAVE_AT`` as Megatron-LM
    does, and goes on; REF gets the losses of every step (the continuation is what a resume must reproduce)."""
    from megatron.core import dist_checkpointing, tensor_parallel
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{ref}.rendezvous")
    _cpu_only()
    _cuda_allocations_on_cpu()
    ps.initialize_model_parallel()
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    torch.manual_seed(1234)
    model = _model("dense", 1, 1, 1)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    # clip_grad 0: megatron's clipping asserts CUDA tensors; weight decay 0: one set of hyperparameters
    config = OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.0, clip_grad=0.0, adam_eps=1e-8)
    opt = get_megatron_optimizer(config, [ddp])
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    position_ids = torch.arange(SEQ).expand(ROWS, SEQ)
    losses = []
    for step, tokens in enumerate(_train_batches(TRAIN_STEPS)):
        if step == TRAIN_SAVE_AT:
            model_sd = model.sharded_state_dict()
            state = {
                "args": _args("dense", 1, 1, 1),
                "checkpoint_version": 3.0,
                "iteration": step,
                "model": model_sd,
                "optimizer": opt.sharded_state_dict(model.sharded_state_dict()),
            }
            ckpt = os.path.join(out, f"iter_{step:07d}")
            os.makedirs(ckpt, exist_ok=True)
            dist_checkpointing.save(state, ckpt)
            with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(step))
        ddp.zero_grad_buffer()
        opt.zero_grad()
        labels = torch.roll(tokens, -1, dims=1)  # the next token; the last position has none and is left out
        per_token = ddp(tokens, position_ids, attention_mask=causal, labels=labels)
        loss = per_token[:, :-1].float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        opt.step()
        losses.append(loss.item())
    torch.save({"losses": losses}, ref)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


# -- shardtrain's side ----------------------------------------------------------------------------------------------
ROWS, STEPS, LR = 6, 2, 1e-2  # 6 rows: every data-parallel size of worlds 1-3 divides them


def train_batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen) for _ in range(STEPS)]


def hf_model(config_json: str, seed: int):
    """The transformers model the consolidated config describes, with weights from ``seed`` (then overwritten)."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads(config_json)
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)


def train(model, batches: list[torch.Tensor], dp: int = 1, dp_rank: int = 0, opt=None) -> list[float]:
    """``STEPS`` steps on this rank's rows of each batch (an engine, or a plain model and its ``opt``); the losses."""
    per = ROWS // dp
    losses = []
    for x in batches:
        mine = x[dp_rank * per : (dp_rank + 1) * per]
        loss = model(input_ids=mine, labels=mine).loss
        if opt is None:
            model.backward(loss)
            model.step()
        else:
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses


def engine_load_body(
    save_dir: str, config_json: str, stage: int, tp: int, ref_tokens: torch.Tensor, ep: int = 1
) -> dict:
    """An engine at (world, ``stage``, ``tp``, ``ep``) over a model from another seed loads the Megatron checkpoint;
    returns the full state dict (rank 0), the logits of ``ref_tokens`` and the losses of ``STEPS`` steps after it."""
    import shardtrain

    model = hf_model(config_json, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    config = {
        "train_micro_batch_size_per_gpu": ROWS // (dist.get_world_size() // tp),
        "gradient_clipping": 0.0,  # the single-process reference does not clip
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "tensor_parallel": {"size": tp},
    }
    if ep > 1:
        config["expert_parallel_size"] = ep
    engine = shardtrain.initialize(model, config=config, optimizer=opt)
    engine.load_checkpoint(save_dir, load_optimizer_states=False)
    loaded_step = engine.global_step
    state = engine.full_state_dict()
    with torch.no_grad():
        logits = engine(input_ids=ref_tokens).logits
    losses = train(engine, train_batches(), engine.topology.dp, engine.topology.dp_rank)
    return {"state": state, "logits": logits, "losses": losses, "step": loaded_step}


def engine_resume_body(save_dir: str, config_json: str, stage: int, tp: int, with_optimizer: bool) -> dict:
    """An engine at (world, ``stage``, ``tp``) resumes Megatron's training checkpoint (its Adam in megatron's two
    groups: weights, then norms) and trains the steps Megatron trained after it; this rank's losses."""
    import shardtrain

    model = hf_model(config_json, seed=1)
    groups = [
        {"params": [p for p in model.parameters() if p.dim() > 1]},
        {"params": [p for p in model.parameters() if p.dim() == 1]},
    ]
    opt = torch.optim.AdamW(groups, lr=LR, weight_decay=0.0, eps=1e-8)
    dp = dist.get_world_size() // tp
    config = {
        "train_micro_batch_size_per_gpu": ROWS // dp,
        "gradient_clipping": 0.0,  # Megatron's run does not clip (clip_grad 0); DeepSpeed's default would clip at 1.0
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "tensor_parallel": {"size": tp},
    }
    engine = shardtrain.initialize(model, config=config, optimizer=opt)
    engine.load_checkpoint(save_dir, load_optimizer_states=with_optimizer)
    batches = _train_batches(TRAIN_STEPS)[TRAIN_SAVE_AT:]
    losses = train(engine, batches, engine.topology.dp, engine.topology.dp_rank)
    return {"losses": losses, "tp_rank": engine.topology.tp_rank, "step": engine.global_step}


def engine_default_load_body(save_dir: str, config_json: str) -> str:
    """What ``load_checkpoint`` with the optimizer state (the default) says of a Megatron checkpoint."""
    import shardtrain
    from shardtrain.errors import CheckpointError

    model = hf_model(config_json, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    engine = shardtrain.initialize(model, config={"train_micro_batch_size_per_gpu": 1}, optimizer=opt)
    try:
        engine.load_checkpoint(save_dir)
    except CheckpointError as err:
        return str(err)
    return "loaded"


# -- the committed fixtures ------------------------------------------------------------------------------------------
DATA = Path(__file__).parents[1] / "data" / "megatron_core"
FIXTURES = {"dense": (2, 2, 1), "moe": (1, 2, 2)}  # kind -> (tp, pp, ep), world 4


def _run(*argv: str) -> None:
    """A megatron-core process (its save starts worker processes, which run_distributed's daemons may not)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{argv[-5:]} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")


def regenerate(out: Path) -> dict:
    """Write the three fixtures into ``out`` with real megatron-core, and ``out/expected.json`` (the tokens and
    Megatron's logits of each saved model, the losses of Megatron's training run); returns the expected values."""
    import megatron.core

    expected: dict = {"megatron_core": megatron.core.__version__}
    with tempfile.TemporaryDirectory() as scratch:
        for kind, (tp, pp, ep) in FIXTURES.items():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", f"--master-port={port}"]
            _run(*torchrun, __file__, "save", str(out / kind), str(tp), str(pp), str(ep), kind)
            ref = os.path.join(scratch, f"{kind}.pt")
            _run(sys.executable, __file__, "logits", str(out / kind), kind, ref)
            values = torch.load(ref)
            expected[kind] = {"tokens": values["tokens"].tolist(), "logits": values["logits"].tolist()}
        (out / "trained").mkdir(parents=True, exist_ok=True)
        ref = os.path.join(scratch, "trained.pt")
        _run(sys.executable, __file__, "train", str(out / "trained"), ref)
        expected["trained"] = {"losses": torch.load(ref)["losses"]}
    _write_expected(out / "expected.json", expected)
    return expected


def _write_expected(path: Path, expected: dict) -> None:
    """One line per value: small, and a regenerated file diffs by value."""
    lines = [f"  {json.dumps(kind)}: {json.dumps(value)}" for kind, value in expected.items()]
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n")


def expected_values(out: Path = DATA) -> dict:
    """``expected.json`` with the tokens and logits as tensors."""
    raw = json.loads((out / "expected.json").read_text())
    for kind in FIXTURES:
        raw[kind] = {"tokens": torch.tensor(raw[kind]["tokens"]), "logits": torch.tensor(raw[kind]["logits"])}
    return raw


if __name__ == "__main__":
    if sys.argv[1] == "save":
        save(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    elif sys.argv[1] == "train":
        megatron_train(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "regenerate":
        regenerate(Path(sys.argv[2]) if len(sys.argv) > 2 else DATA)
    else:
        logits(sys.argv[2], sys.argv[3], sys.argv[4])
