"""Memory of sharded construction under expert parallelism: a Mixtral built three ways, then ``initialize``d at ZeRO-3.

    PYTHONPATH=src python bench/bench_moe_construction.py [--world 4] [--ep 2] [--hidden 128] [--ffn 512] [--experts 8]

Ways: ``deferred`` (``zero.Init(config)`` with ``expert_parallel_size`` > 1: each rank makes only its chunk of its
experts' rows), ``sharded`` (``zero.Init()``: each parameter chunked over the world as it is built, each expert
weight gathered once at ``initialize`` to cut its rows) and ``normal`` (built whole, then ``initialize``).

Printed per way and rank, in MB: the tensor bytes alive after construction, the peak through construction and
``initialize``, and what is kept after ``initialize`` (parameter and gradient shards). Measured by the ``LiveBytes``
dispatch mode of ``tests/tensor_parallel/test_tp_construction.py``: every storage an operator returns, tracked by a
weak reference, summed before and after every operator (temporaries included; gloo's own buffers and the Python heap
are not seen).
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import shardtrain  # noqa: E402
from shardtrain.testing import run_distributed  # noqa: E402


def build(args: argparse.Namespace):
    import transformers

    cfg = transformers.MixtralConfig(
        vocab_size=64, hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=args.experts, num_experts_per_tok=2,
        max_position_embeddings=32, attn_implementation="eager", tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(cfg)


def measure(how: str, args: argparse.Namespace) -> tuple[float, float, float]:
    import transformers

    from shardtrain.testing.live_bytes import LiveBytes

    assert transformers.MixtralForCausalLM  # defined before Init wraps the module classes
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "expert_parallel_size": args.ep,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    torch.manual_seed(0)
    context = {
        "deferred": lambda: shardtrain.zero.Init(config),
        "sharded": shardtrain.zero.Init,
        "normal": contextlib.nullcontext,
    }[how]()
    live = LiveBytes()
    with live:
        with context:
            model = build(args)
        built = live._sample()
        engine = shardtrain.initialize(model, config=config, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
        kept = live._sample()
    engine.close()
    return built / 1e6, live.peak / 1e6, kept / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    args = parser.parse_args()
    model = build(args)
    whole = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n) / 1e6
    one = model.model.layers[0].mlp.experts.gate_up_proj
    print(f"command: PYTHONPATH=src python {' '.join(sys.argv)}")
    print(f"machine: {platform.platform()}, {platform.processor() or platform.machine()}, torch {torch.__version__}")
    print(f"model {whole:.2f} MB (experts {experts:.2f} MB, one gate_up_proj {one.numel() * 4 / 1e6:.2f} MB)")
    print(f"world {args.world}, ep {args.ep}, ZeRO-3; per rank, MB: built / peak through initialize / kept")
    for how in ("deferred", "sharded", "normal"):
        ranks = run_distributed(measure, args.world, how, args, timeout=600)
        print(f"{how:9s}", "  ".join(f"{b:.2f} / {p:.2f} / {k:.2f}" for b, p, k in ranks))


if __name__ == "__main__":
    main()
