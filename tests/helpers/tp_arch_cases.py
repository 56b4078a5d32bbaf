"""Every ``transformers`` architecture that ships a tensor-parallel plan, built tiny and random, trained with its own
plan against one process: the cases of ``tests/tensor_parallel/test_tp_architectures.py``.

:func:`planned_architectures` enumerates the config classes whose ``base_model_tp_plan`` is not empty. One tiny
config fits them all where it can (:data:`TINY`: every size divisible by 2 and 3, 6 query and 6 key/value heads);
the model is the architecture's causal LM, else its masked LM, else its base model. An architecture whose config
refuses these sizes is *unbuildable here*, which says nothing about tensor parallelism.

:func:`run_architectures` runs on every rank of a ``run_distributed`` job: the reference trains a copy of the model
in this process on the whole batch (the parity harness's ``train_one_process``); the tensor-parallel model
(``parallelize`` with no plan argument: the model's own) trains on the same batch over the group. SGD without
clipping, so a gradient off by any factor shows in the parameters ([helpers/tp_cases.py] explains why AdamW would not
see it). Each architecture comes back as
``("match" | "refused" | "failed" | "unbuildable", detail)``; "match" means losses and final parameters were compared
and agreed (``assert_arch_parity`` checks the numbers again on the test's side).
"""

from __future__ import annotations

import copy
import traceback
import warnings

import torch
import torch.distributed as dist
from torch import nn

from shardtrain.testing.parity import train_one_process

VOCAB, SEQ, BATCH, STEPS, LR = 96, 8, 2, 3, 0.1
MAX_PARAMS = 5_000_000  # "the cheap ones": larger tiny models are not run

TINY = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=6,
    head_dim=8,
    max_position_embeddings=64,
    moe_intermediate_size=48,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    shared_expert_intermediate_size=48,
    first_k_dense_replace=1,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

# The default run's slice: Gemma 2 and 3 (scaled embeddings), MuseGlimmer (an embedding that normalizes its rows),
# Llama, and Mixtral (fused experts, moe_tp_experts).
DEFAULT_SLICE = ("gemma2", "gemma3_text", "llama", "muse_glimmer_text", "mixtral")


def planned_architectures() -> list[str]:
    """Model types (``config.model_type``) whose config class declares a ``base_model_tp_plan``, in registry order."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    out = []
    for model_type, class_name in CONFIG_MAPPING_NAMES.items():
        cls = getattr(transformers, class_name, None)
        if cls is not None and getattr(cls, "base_model_tp_plan", None):
            out.append(model_type)
    return out


def build(model_type: str) -> nn.Module:
    """The tiny random model of ``model_type`` (the same on every call: seeded)."""
    import transformers
    from transformers.models.auto import modeling_auto as auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    config = getattr(transformers, CONFIG_MAPPING_NAMES[model_type])(**TINY)
    for mapping in (
        auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        auto.MODEL_MAPPING_NAMES,
    ):
        if model_type in mapping:
            model_class = getattr(transformers, mapping[model_type])
            break
    else:
        raise LookupError(f"{model_type}: no causal LM, masked LM or base model class is registered")
    torch.manual_seed(0)
    model = model_class._from_config(config, attn_implementation="eager")
    return model.eval()  # no dropout: the two runs see the same function (dropout under TP is tested elsewhere)


def batch() -> torch.Tensor:
    return torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model's own loss when it has a head (Gemma's logit soft-capping included); a fixed projection of the
    last hidden state for a base model."""
    try:
        out = model(input_ids=ids, labels=ids, use_cache=False)
    except TypeError:  # a base model takes no labels
        out = model(input_ids=ids, use_cache=False)
    if getattr(out, "loss", None) is not None:
        return out.loss
    hidden = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
    hidden = hidden.float()
    direction = torch.randn(hidden.shape[-1], generator=torch.Generator().manual_seed(3))
    return (hidden @ direction).square().mean()


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)


def _reference(model: nn.Module, ids: torch.Tensor, steps: int) -> list[float]:
    """The parity harness's one-process recipe on the whole batch: SGD, one micro-step, no clipping."""
    return train_one_process(model, _sgd(model), lambda m, i: loss_of(m, ids), steps, 1, 0.0)["losses"]


def _train(model: nn.Module, ids: torch.Tensor, steps: int, after_backward) -> list[float]:
    """The tensor-parallel model's side of :func:`_reference`: ``after_backward`` sums the partial gradients of its
    replicated parameters over the group before each step."""
    opt = _sgd(model)
    losses = []
    for _ in range(steps):
        loss = loss_of(model, ids)
        loss.backward()
        after_backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def run_architectures(model_types: list[str], steps: int = STEPS) -> dict[str, tuple[str, object]]:
    """On each rank of the job: every architecture's outcome (module docstring)."""
    from shardtrain.distributed.communicator import Communicator
    from shardtrain.errors import LayoutError
    from shardtrain.tensor_parallel import assemble_blocks, parallelize, sum_partial_gradients

    comm = Communicator(dist.group.WORLD, 120)
    ids = batch()
    out: dict[str, tuple[str, object]] = {}
    for model_type in model_types:
        warnings.simplefilter("ignore")
        try:
            with torch.device("meta"):  # counted before any memory is spent on it
                size = sum(p.numel() for p in build(model_type).parameters())
            if size > MAX_PARAMS:  # sub-configs (vision towers, audio) keep their full sizes
                out[model_type] = ("unbuildable", f"the tiny config still builds {size / 1e6:.0f}M parameters")
                continue
            ref = build(model_type)
            model = copy.deepcopy(ref)
            init = {n: p.detach().clone() for n, p in ref.named_parameters()}
        except Exception as err:  # the tiny config, not tensor parallelism
            out[model_type] = ("unbuildable", f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
            continue
        try:
            placements = parallelize(model, None, comm)
        except LayoutError as err:
            out[model_type] = ("refused", str(err))
            continue
        try:
            ref_losses = _reference(ref, ids, steps)
        except Exception as err:  # the tiny model does not train in one process either
            out[model_type] = ("unbuildable", f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
            continue
        exact = build(model_type).double()  # the same seed: the same initial values
        try:
            exact_losses = _reference(exact, ids, steps)
        except Exception:  # some kernels have no float64 (grouped matmul): the fp32 bounds alone
            exact_losses, exact = ref_losses, ref
        try:
            losses = _train(model, ids, steps, lambda: sum_partial_gradients(model, placements, comm))  # noqa: B023
            params = {}
            for name, p in model.named_parameters():
                blocks = comm.all_gather_object(p.detach(), what="test blocks")
                params[name] = assemble_blocks(blocks, placements[name])
        except LayoutError as err:  # the replicated-gradient check at the first backward: a refusal too
            out[model_type] = ("refused", str(err))
            continue
        except Exception as err:  # reported as a failure of the architecture
            out[model_type] = ("failed", "".join(traceback.format_exception_only(err)).strip()[-600:])
            continue
        result = {
            "losses": losses,
            "ref_losses": ref_losses,
            "params": params,
            "ref_params": {n: p.detach().clone() for n, p in ref.named_parameters()},
            "exact_losses": exact_losses,
            "exact_params": {n: p.detach().float().clone() for n, p in exact.named_parameters()},
            "init": init,
            "split": sorted(n for n, pl in placements.items() if pl.is_split),
        }
        problems = arch_mismatches(result)
        out[model_type] = ("mismatch", problems) if problems else ("match", result)
    return out


def arch_mismatches(result: dict) -> list[str]:
    """What separates the tensor-parallel run from one process by more than rounding.

    Rounding is measured, not assumed: the same training in float64 (``exact``) gives each quantity's true value,
    and the fp32 reference's own distance from it is what fp32 rounding does to this model in these steps (a few
    steps of SGD on a tiny random model can amplify it well above 1e-5 where the loss climbs). The tensor-parallel
    run may be 4 times as far from the true value as the reference is, and always 1e-5 (losses, relative) or 1e-4
    of the distance moved (each parameter tensor, L2), plus two units in the last place of the tensor's largest
    element: one element stored one rounding step away (the fp32 reference can land on the float64 value exactly,
    a tensor of values near 7 moving 1e-6 per element in 4096 elements: Kimi-Linear's dt_bias)."""
    problems = []
    for step, (a, b, x) in enumerate(zip(result["losses"], result["ref_losses"], result["exact_losses"])):
        if abs(a - x) > max(4 * abs(b - x), 1e-5 * abs(x)):
            problems.append(f"step {step}: loss {a} vs one process {b} (float64: {x})")
    for name, want in result["ref_params"].items():
        got, exact = result["params"][name], result["exact_params"][name]
        if got.shape != want.shape:
            problems.append(f"{name}: shape {tuple(got.shape)} vs {tuple(want.shape)}")
            continue
        moved = (exact - result["init"][name]).norm().item()
        err, ref_err = (got - exact).norm().item(), (want - exact).norm().item()
        ulps = 2 * torch.finfo(torch.float32).eps * exact.abs().max().item()  # one element rounded otherwise
        if err > max(4 * ref_err, 1e-4 * moved) + max(1e-7, ulps):
            problems.append(
                f"{name}: error {err:.3g} vs the reference's {ref_err:.3g}, distance moved {moved:.3g} (L2)"
            )
    return problems
