"""ALST's tiled loss and tiled MLP (``tiled_logits_loss``, ``tiled_mlp_compute``; docs/sequence-parallel.md).

The tiled computations against the untiled ones: the Functions alone (loss and every gradient, fp32 tight, bf16 at
its rounding), whole models through the engine on one process (the project's GPT with tied embeddings, a GQA Llama
under activation checkpointing), and under sequence parallelism with ZeRO-3 at world 2 and 3 against one untiled
process; the memory the tiled loss saves, measured as the peak RSS of a fresh process; what is refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from functools import partial

import pytest
import torch
import torch.nn.functional as F

import shardtrain
from shardtrain.errors import ConfigError
from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.sequence_parallel.tiling import (
    enable_tiled_logits_loss,
    enable_tiled_mlp_compute,
    logits_loss_shards,
    mlp_shards,
    tiled_fused_logits_loss,
    tiled_mlp,
)
from shardtrain.testing import run_distributed
from shardtrain.testing.parity import Recipe, assert_params_near, reference_run

VOCAB, SEQ, ROWS, STEPS = 64, 12, 2, 2


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


# -- the Functions ---------------------------------------------------------------------------------------------------
def _loss_inputs(dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 13, 16, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(50, 16, generator=g) * 0.3).to(dtype).requires_grad_()
    b = (torch.randn(50, generator=g) * 0.1).to(dtype).requires_grad_()
    t = torch.randint(0, 50, (2, 13), generator=g)
    t[0, :6] = -100  # a tile (3 tiles of 9 tokens) with no real target, and tiles with different counts
    t[1, 5] = -100
    return h, w, b, t


@pytest.mark.parametrize("shards", [1, 3, 26])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_loss_is_cross_entropy_of_the_logits(shards, dtype):
    h, w, b, t = _loss_inputs(dtype)
    want = F.cross_entropy(F.linear(h, w, b).float().reshape(-1, 50), t.reshape(-1))
    want_grads = torch.autograd.grad(want * 1.7, (h, w, b))  # an incoming gradient other than 1
    got = tiled_fused_logits_loss(h, w, t, b, shards=shards)
    got_grads = torch.autograd.grad(got * 1.7, (h, w, b))
    assert got.dtype == torch.float32
    loss_tol, grad_tol = (1e-6, 1e-5) if dtype == torch.float32 else (1e-3, 1e-2)
    assert abs(got.item() - want.item()) <= loss_tol * abs(want.item())
    for name, g, r in zip(("hidden", "weight", "bias"), got_grads, want_grads):
        assert g.dtype == dtype and g.shape == r.shape
        assert _rel(g, r) <= grad_tol, (name, _rel(g, r))


def test_tiled_loss_reductions_and_shapes():
    h, w, b, t = _loss_inputs(torch.float32)
    real = int((t != -100).sum())
    mean = tiled_fused_logits_loss(h, w, t, b, shards=4)
    total = tiled_fused_logits_loss(h, w, t, b, shards=4, reduction="sum")
    over_items = tiled_fused_logits_loss(h, w, t, b, shards=4, num_items_in_batch=2 * real)
    assert torch.allclose(total, mean * real, rtol=1e-6) and torch.allclose(over_items, mean / 2, rtol=1e-6)
    assert torch.isnan(tiled_fused_logits_loss(h, w, torch.full_like(t, -100)))  # as F.cross_entropy's mean
    assert logits_loss_shards(8192, 128_256) == 4 and logits_loss_shards(16, 64) == 1  # tiles of <= 1 GiB of fp32
    assert mlp_shards(10_000, 4096) == 3
    with pytest.raises(ValueError, match="do not match"):
        tiled_fused_logits_loss(h, w, t[:, :-1])
    with pytest.raises(ValueError, match="reduction"):
        tiled_fused_logits_loss(h, w, t, reduction="none")


def test_tiled_mlp_matches_the_mlp():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    x = torch.randn(2, 13, 16, requires_grad=True)
    want = mlp(x)
    want_grads = torch.autograd.grad(want.square().sum(), [x, *mlp.parameters()])
    got = tiled_mlp(mlp, x, shards=4)  # 4 tiles of 4 tokens, the last 1
    got_grads = torch.autograd.grad(got.square().sum(), [x, *mlp.parameters()])
    assert _rel(got, want) <= 1e-6
    for g, r in zip(got_grads, want_grads):
        assert _rel(g, r) <= 1e-5


# -- memory ----------------------------------------------------------------------------------------------------------
_PEAK = textwrap.dedent(
    """
    import json
    import torch, torch.nn.functional as F
    from shardtrain.sequence_parallel.tiling import tiled_fused_logits_loss
    torch.manual_seed(0)
    n, d, v = {n}, 64, {v}
    h = torch.randn(n, d, requires_grad=True)
    w = (torch.randn(v, d) * 0.05).requires_grad_()
    t = torch.randint(0, v, (n,))
    def kib():  # VmHWM: this process's own high-water mark (ru_maxrss keeps the forking parent's across exec)
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    # the first backward's one-time process costs (autograd's engine, kernels' first use: 13.6-25 MiB measured)
    # are paid here, on 64 rows, before the high-water mark is read: the rises below are the losses' own
    for loss in (tiled_fused_logits_loss(h[:64], w, t[:64], shards=16), F.cross_entropy(F.linear(h[:64], w), t[:64])):
        loss.backward()
    h.grad = w.grad = None
    del loss
    peaks = [kib()]
    for variant in ("tiled", "untiled"):  # the process's high-water mark only rises: the smaller one first
        if variant == "tiled":
            loss = tiled_fused_logits_loss(h, w, t, shards=16)
        else:
            loss = F.cross_entropy(F.linear(h, w), t)
        loss.backward()
        h.grad = w.grad = None
        del loss
        peaks.append(kib())
    print(json.dumps(peaks))
    """
)


def test_the_tiled_loss_peak_is_below_the_untiled_by_the_logits():
    """Peak RSS (VmHWM) of a fresh process through forward and backward of the loss alone, tiled then untiled:
    the untiled loss holds the fp32 logits, their log-softmax and their gradient; the tiled one a sixteenth of the
    logits and of their gradient."""
    n, v = 2048, 4096
    logits_kib = n * v * 4 // 1024  # 32 MiB
    out = subprocess.run(
        [sys.executable, "-c", _PEAK.format(n=n, v=v)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    start, tiled, untiled = json.loads(out.stdout.strip().splitlines()[-1])
    assert tiled - start <= logits_kib * 3 / 4, (start, tiled, untiled, logits_kib)
    assert untiled - tiled >= logits_kib, (start, tiled, untiled, logits_kib)


# -- whole models through the engine, one process --------------------------------------------------------------------
def _gpt(tied: bool = True) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=48, n_layer=2, n_head=6, tie_embeddings=tied))


def _llama(checkpointing: bool = False):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(cfg)
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def _batches(rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens, targets aligned with the tokens), a fifth -100, a real target in every sixth of a row."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
        y = torch.where(torch.rand(x.shape, generator=g) < 0.2, -100, torch.roll(x, -1, dims=1))
        y[:, :: SEQ // 6] = torch.roll(x, -1, dims=1)[:, :: SEQ // 6]
        out.append((x, y))
    return out


def _loss(case: str, model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if case == "gpt":
        return model(x, y)
    labels = torch.cat([torch.full_like(x[:, :1], -100), torch.where(y[:, :-1] == -100, -100, x[:, 1:])], 1)
    return model(input_ids=x, labels=labels).loss


_TILED = {"tiled_logits_loss": True, "tiled_logits_loss_shards": 3, "tiled_mlp_compute": True, "tiled_mlp_shards": 5}


def _untiled(case: str):
    return _gpt() if case == "gpt" else _llama()


def _adamw(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def _batch_loss(case: str, model, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return _loss(case, model, *batch)


def _reference(case: str) -> dict:
    """One process, untiled, plain torch (the parity harness's reference): the whole batch's mean loss, one
    micro-step per step, no clipping; the float64 run's parameters as ``exact``."""
    recipe = Recipe(partial(_untiled, case), _adamw, partial(_batches, ROWS), partial(_batch_loss, case))
    return reference_run(recipe)


def _engine_run(case: str, config: dict, checkpointing: bool = False) -> dict:
    model = _gpt() if case == "gpt" else _llama(checkpointing)
    opt = _adamw(model)
    engine = shardtrain.initialize(
        model,
        # the one-process reference does not clip
        config={"train_micro_batch_size_per_gpu": ROWS, "steps_per_print": 10**6, "gradient_clipping": 0, **config},
        optimizer=opt,
    )
    head = model.head if case == "gpt" else model.lm_head
    head_calls = []  # the head module is not called when the loss is tiled: its weight is used tile by tile
    head.register_forward_hook(lambda *_: head_calls.append(1))
    mlps = [m for n, m in model.named_modules() if n.endswith(".mlp")]
    losses = []
    for x, y in _batches(ROWS * engine.topology.dp):
        rows = slice(engine.topology.dp_rank * ROWS, (engine.topology.dp_rank + 1) * ROWS)
        out = engine(input_ids=x[rows], labels=_hf_labels(x[rows], y[rows])) if case != "gpt" else None
        loss = engine(x[rows], y[rows]) if case == "gpt" else out.loss
        if case != "gpt":
            assert out.logits is None  # the logits were never made whole
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert bool(head_calls) != bool(config.get("tiled_logits_loss"))
    assert all(getattr(m.forward, "__shardtrain_tiled__", False) == bool(config.get("tiled_mlp_compute")) for m in mlps)
    return {"losses": losses, "params": engine.full_state_dict()}


def _hf_labels(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.full_like(x[:, :1], -100), torch.where(y[:, :-1] == -100, -100, x[:, 1:])], 1)


@pytest.mark.parametrize(("case", "checkpointing"), [("gpt", False), ("llama", True)])
def test_tiled_training_matches_untiled_on_one_process(case, checkpointing):
    """Tied embeddings (the head's weight is the embedding's: both gradients add up), 3 loss tiles and 5 MLP tiles
    of 12 tokens, the Llama under transformers' activation checkpointing."""
    ref = _reference(case)
    got = _engine_run(case, _TILED, checkpointing)
    for s, (g, w) in enumerate(zip(got["losses"], ref["losses"])):
        assert abs(g - w) <= 1e-6 * abs(w), f"step {s}: tiled {g} vs untiled {w}"
    assert_params_near(
        got["params"], ref["params"], ref["init"], exact=ref["exact"], what=f"{case} tiled: ", require_moved=True
    )


def test_bf16_tiled_training_is_near_untiled():
    """bf16 compute (fp32 masters): the tiled loss and MLP round differently from the untiled ones (the weight's
    gradient is summed in fp32 over the tiles); the losses stay within bf16's rounding of each other."""
    ref = _engine_run("gpt", {"bf16": {"enabled": True}})
    got = _engine_run("gpt", {"bf16": {"enabled": True}, **_TILED})
    for g, w in zip(got["losses"], ref["losses"]):
        assert abs(g - w) <= 1e-2 * abs(w), (got["losses"], ref["losses"])


# -- sequence parallelism and ZeRO-3 ---------------------------------------------------------------------------------
def _sp_run(case: str, sp: int) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 2000}
    # the Llama under activation checkpointing: the tiled MLP re-run inside a checkpointed block at ZeRO-3
    return _engine_run(case, {"sequence_parallel_size": sp, "zero_optimization": zero, **_TILED}, case == "llama")


@pytest.mark.parametrize(("case", "world"), [("gpt", 2), ("gpt", 3), pytest.param("llama", 2, marks=pytest.mark.soak)])
def test_tiled_under_sequence_parallelism_and_zero3_matches_one_untiled_process(case, world):
    """Each rank tiles its slice of the sequence; the loss is the whole sequence's mean over its real tokens (the
    slices hold different counts); ZeRO-3 gathers the head (tied to the embedding) and the MLPs for the recompute;
    the Llama (soak) under activation checkpointing."""
    results = run_distributed(_sp_run, world, case, world, init_process_group=False)
    ref = _reference(case)
    for r in results:
        for s, (g, w) in enumerate(zip(r["losses"], ref["losses"])):
            assert abs(g - w) <= 1e-5 * abs(w), f"step {s}: {g} vs one process {w}"
    assert_params_near(results[0]["params"], ref["params"], ref["init"], exact=ref["exact"], what=f"sp {world}: ")


# -- what is refused -------------------------------------------------------------------------------------------------
def test_refusals():
    model = _gpt()
    with pytest.raises(ConfigError, match="graph"):
        shardtrain.initialize(
            model,
            config={"train_micro_batch_size_per_gpu": 1, "tiled_logits_loss": True, "graph": {"enabled": True}},
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        )
    with pytest.raises(ConfigError, match="neither a transformers causal LM nor"):
        enable_tiled_logits_loss(torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="no submodule named 'mlp'"):
        enable_tiled_mlp_compute(torch.nn.Linear(2, 2))
    dropped = torch.nn.Module()
    dropped.mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1))
    with pytest.raises(ConfigError, match="dropout"):
        enable_tiled_mlp_compute(dropped)
    replaced = _gpt()
    replaced.loss = torch.nn.Identity()  # as tensor parallelism's vocabulary-parallel loss replaces it
    with pytest.raises(ConfigError, match="head or loss was replaced"):
        enable_tiled_logits_loss(replaced)
    enable_tiled_logits_loss(model)
    with pytest.raises(ConfigError, match="tiled already"):
        enable_tiled_logits_loss(model)
    enable_tiled_mlp_compute(model)
    with pytest.raises(ConfigError, match="tiled already"):
        enable_tiled_mlp_compute(model)
    with pytest.raises(ConfigError, match="tiled_logits_loss_shards"):
        shardtrain.load_config({"tiled_logits_loss_shards": 0})


def test_transformers_loss_tiled_in_training_whole_in_evaluation():
    """In training mode with labels the forward returns the tiled loss and no logits; in evaluation it is the
    model's own forward (logits included), with the same loss; a model that transforms its logits is refused."""
    model = _llama()
    x, y = _batches(ROWS)[0]
    labels = _hf_labels(x, y)
    want = model(input_ids=x, labels=labels)
    enable_tiled_logits_loss(model, shards=5)
    got = model(input_ids=x, labels=labels)
    assert got.logits is None and abs(got.loss.item() - want.loss.item()) <= 1e-6 * want.loss.item()
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)  # ALST's shift_labels
    assert abs(model(input_ids=x, shift_labels=shifted).loss.item() - want.loss.item()) <= 1e-6 * want.loss.item()
    model.eval()
    evaluated = model(input_ids=x, labels=labels)
    assert evaluated.logits is not None and torch.allclose(evaluated.loss, want.loss)
    capped = _llama()
    capped.config.final_logit_softcapping = 30.0
    with pytest.raises(ConfigError, match="final_logit_softcapping"):
        enable_tiled_logits_loss(capped)
