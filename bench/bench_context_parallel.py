"""Context parallelism: keys and values all-gathered or passed around a ring, and a step of Ulysses vs ring attention.

    python bench/bench_context_parallel.py [--lengths 4096 16384] [--kv-heads 2] [--head-dim 64] [--repeats 20]
        [--step-lengths 2048 4096]

1. **Gather or ring** ([Note: why not torch's context_parallel] in ``shardtrain/sequence_parallel/ring.py``): at
   world 2 and 3 (gloo), one layer's keys and values ``[1, kv, S / C, d]`` fp32 on each rank reach every rank either
   by one all-gather of each or by ``C - 1`` ring steps of ``isend``/``irecv`` to the next rank (what the engine
   does, ``Communicator.ring_step``, before any overlap with compute). Both move the same bytes per rank, ``2 * S *
   kv * d * 4 * (C - 1) / C``; the median of ``--repeats`` runs is reported.
2. **A training step** of the project's GPT (fp32, ZeRO-1, one sequence of ``S`` tokens shared by both ranks) at world
   2 under ``sequence_parallel_size 2`` (Ulysses) and ``context_parallel_size 2``: seconds per step (median of 3
   after one warm-up) and the bytes this rank's sequence group moved in one step, against the formulas: Ulysses ``8
   * L * (S / P) * d * 4 * (P - 1) / P`` (q, k, v and the output, forward and backward), context ``2 * L * (S / C)
   * d_kv * 4 * (3C - 2)`` (a rank's own keys and values sent ``C - 1`` times in forward, ``C - 1`` times in backward
   and their gradient ``C`` times: [Note: the log-sum-exp merge]), plus the engine's real-token count exchange (a few
   bytes).
3. **Activation memory per rank against cp** (``--memory-length``): a tiny Llama (4 query heads, 2 key/value heads,
   d 64, MLP 256, 2 layers) at cp 1, 2, 3 and 4 (world = cp, ZeRO-1, one sequence of ``S`` tokens): the bytes one
   forward saves for backward on each rank in the attention modules and in the MLPs ([Note: what is counted as
   activation memory] in ``bench/bench_tp.py``, whose counter this uses), the largest rank's, against ``1/cp`` of
   cp 1's (the merged ring at every cp: [Note: which context attention] in ``shardtrain/sequence_parallel/ring.py``).
4. **The longest sequence that fits a per-rank budget** (``--budget-mib``), world 4: the GQA Llama above at sp 4
   (Ulysses alone) and at sp 2 x cp 2, and a Llama with 2 heads, both key/value heads (Ulysses is capped at sp 2),
   at sp 2 x dp 2 and at sp 2 x cp 2. A length fits when the peak of one forward and backward on every rank, as
   torch's ``MemTracker`` measures it (parameters, gradients, activations and temporaries, all live storages), is
   within the budget; the length (a multiple of 8 tokens) is doubled from 256 until it does not fit, then bisected
   to 8 tokens.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

import shardtrain
from shardtrain.distributed.communicator import Communicator
from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.testing import run_distributed

FP32 = 4


def _gather(comm: Communicator, kv: torch.Tensor) -> None:
    comm.all_gather_dim(kv, -2, what="keys and values (all-gather)")


def _ring(comm: Communicator, kv: torch.Tensor) -> None:
    held = kv
    for _ in range(comm.size - 1):  # each step: what was last received goes on to the next rank
        received = torch.empty_like(held)
        comm.ring_step(received, held, what="keys and values (ring)")
        held = received


def _gather_vs_ring(lengths: list[int], kv_heads: int, head_dim: int, repeats: int) -> dict:
    comm = Communicator(dist.group.WORLD, 60.0)
    out = {}
    for length in lengths:
        kv = torch.randn(2, 1, kv_heads, length // comm.size, head_dim)  # keys and values, stacked as the engine does
        times = {}
        for name, fn in (("gather", _gather), ("ring", _ring)):
            fn(comm, kv)  # warm-up
            samples = []
            for _ in range(repeats):
                dist.barrier()
                started = time.perf_counter()
                fn(comm, kv)
                samples.append(time.perf_counter() - started)
            times[name] = statistics.median(samples)
        out[length] = times
    return out


def _step_job(lengths: list[int], d_model: int, layers: int) -> dict:
    out = {}
    for name, key in (("Ulysses sp 2", "sequence_parallel_size"), ("ring cp 2", "context_parallel_size")):
        for length in lengths:
            torch.manual_seed(0)
            model = GPT(GPTConfig(vocab_size=1024, seq_len=length, d_model=d_model, n_layer=layers, n_head=4))
            config = {
                "train_micro_batch_size_per_gpu": 1,
                "steps_per_print": 10**9,
                "zero_optimization": {"stage": 1},
                key: 2,
            }
            engine = shardtrain.initialize(model, config=config, optimizer=torch.optim.AdamW(model.parameters()))
            x = torch.randint(0, 1024, (1, length), generator=torch.Generator().manual_seed(1))
            y = torch.roll(x, -1, dims=1)
            samples, moved = [], 0
            for i in range(4):
                before = sum(s["bytes"] for s in engine._sp.comm.stats().values())
                started = time.perf_counter()
                engine.backward(engine(x, y))
                engine.step()
                if i:  # the first is a warm-up
                    samples.append(time.perf_counter() - started)
                moved = sum(s["bytes"] for s in engine._sp.comm.stats().values()) - before
            out[(name, length)] = (statistics.median(samples), moved)
            engine.close()
    return out


_MEMORY_MODEL = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "vocab_size": 64}


def _llama(heads: int, kv_heads: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        **_MEMORY_MODEL,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1 << 20,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config)


def _llama_engine(heads: int, kv_heads: int, layout: dict) -> shardtrain.Engine:
    model = _llama(heads, kv_heads)
    config = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9, "zero_optimization": {"stage": 1}}
    return shardtrain.initialize(model, config={**config, **layout}, optimizer=torch.optim.AdamW(model.parameters()))


def _saved_by_region(cp: int, length: int) -> dict:
    """Bytes one forward saves for backward on this rank, in the attention modules and in the MLPs."""
    from bench_tp import count_saved

    engine = _llama_engine(4, 2, {"context_parallel_size": cp})
    x = torch.randint(0, _MEMORY_MODEL["vocab_size"], (1, length), generator=torch.Generator().manual_seed(1))
    with count_saved(engine.module, {"self_attn": "attention", "mlp": "mlp"}) as saved:
        loss = engine(input_ids=x, labels=x, use_cache=False).loss
    engine.backward(loss)
    engine.close()
    return dict(saved)


def _peak_bytes(engine: shardtrain.Engine, length: int, document: int | None) -> int:
    """The largest rank's peak of live storages over one forward and backward of a sequence of ``length`` tokens
    (packed documents of ``document`` tokens, positions restarting, when given)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    x = torch.randint(0, _MEMORY_MODEL["vocab_size"], (1, length), generator=torch.Generator().manual_seed(1))
    packed = {} if document is None else {"position_ids": torch.arange(length)[None] % document}
    tracker = MemTracker()
    tracker.track_external(engine.module)
    with tracker:
        engine.backward(engine(input_ids=x, labels=x, use_cache=False, **packed).loss)
    engine.module.zero_grad(set_to_none=True)
    peak = torch.tensor(sum(v["Total"] for v in tracker.get_tracker_snapshot("peak").values()))
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak)


def _longest_fitting(
    heads: int, kv_heads: int, layout: dict, budget: int, document: int | None
) -> tuple[int, int, int]:
    """(the longest length that fits ``budget`` bytes on every rank, its peak, probes run): doubled from 256 tokens
    until a length does not fit, then bisected to 8 tokens."""
    engine = _llama_engine(heads, kv_heads, layout)
    peaks: dict[int, int] = {}

    def fits(length: int) -> bool:
        peaks[length] = _peak_bytes(engine, length, document)
        return peaks[length] <= budget

    fit, unfit = 0, 256
    while fits(unfit):
        fit, unfit = unfit, 2 * unfit
    while unfit - fit > 8:
        middle = (fit + unfit) // 16 * 8
        if fits(middle):
            fit = middle
        else:
            unfit = middle
    engine.close()
    return fit, peaks.get(fit, 0), len(peaks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--step-lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--memory-length", type=int, default=1536, help="a multiple of 24 (2 x cp for cp 1-4)")
    parser.add_argument("--budget-mib", type=float, default=24.0)
    parser.add_argument("--fit-document", type=int, default=None, help="tokens per packed document (default: causal)")
    parser.add_argument(
        "--sections",
        nargs="+",
        default=["transfer", "step", "memory", "fit"],
        choices=["transfer", "step", "memory", "fit"],
    )
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"# {' '.join(sys.argv)}")
    print(f"# machine: {platform.machine()}, {os.cpu_count()} cores (shared), torch {torch.__version__}, gloo")
    print(f"# load average at the start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for section in args.sections:
        globals()[f"_print_{section}"](args)


def _print_transfer(args: argparse.Namespace) -> None:
    print("\n| world | S | keys+values bytes received per rank | all-gather (ms) | ring (ms) | ring / gather |")
    print("|---|---|---|---|---|---|")
    for world in (2, 3):
        lengths = [n for n in args.lengths if n % (2 * world) == 0] or [args.lengths[0] // 6 * 6]
        got = run_distributed(_gather_vs_ring, world, lengths, args.kv_heads, args.head_dim, args.repeats)[0]
        for length, t in got.items():
            nbytes = 2 * length * args.kv_heads * args.head_dim * FP32 * (world - 1) // world
            print(
                f"| {world} | {length} | {nbytes} | {t['gather'] * 1e3:.2f} | {t['ring'] * 1e3:.2f} | "
                f"{t['ring'] / t['gather']:.2f} |"
            )


def _print_step(args: argparse.Namespace) -> None:
    print(f"\n## one step, GPT d {args.d_model}, {args.layers} layers, 4 heads (d_kv = d), world 2, ZeRO-1")
    print("| layout | S | step (s) | bytes moved by the sequence group | formula | ratio |")
    print("|---|---|---|---|---|---|")
    got = run_distributed(_step_job, 2, args.step_lengths, args.d_model, args.layers, init_process_group=False)[0]
    for (name, length), (seconds, moved) in got.items():
        if name.startswith("Ulysses"):
            formula = 8 * args.layers * (length // 2) * args.d_model * FP32 // 2
        else:
            formula = 2 * args.layers * (length // 2) * args.d_model * FP32 * (3 * 2 - 2)
        print(f"| {name} | {length} | {seconds:.3f} | {moved} | {formula} | {moved / formula:.4f} |")


def _print_memory(args: argparse.Namespace) -> None:
    length = args.memory_length
    print(f"\n## activation memory per rank against cp: Llama h 4, kv 2, d 64, MLP 256, 2 layers, S {length}")
    print("| cp | attention path | attention: saved (bytes) | x cp / cp 1's | MLP: saved (bytes) | x cp / cp 1's |")
    print("|---|---|---|---|---|---|")
    base = None
    for cp in (1, 2, 3, 4):
        ranks = run_distributed(_saved_by_region, cp, cp, length, init_process_group=False, threads=1)
        attention, mlp = (max(r[region] for r in ranks) for region in ("attention", "mlp"))
        base = base or (attention, mlp)
        path = "-" if cp == 1 else "merged ring"
        print(
            f"| {cp} | {path} | {attention:,} | {attention * cp / base[0]:.3f} | {mlp:,} | {mlp * cp / base[1]:.3f} |"
        )


def _print_fit(args: argparse.Namespace) -> None:
    budget, document = int(args.budget_mib * 2**20), args.fit_document
    what = "causal" if document is None else f"packed documents of {document} tokens"
    print(f"\n## the longest sequence within {args.budget_mib:g} MiB per rank (peak, MemTracker), world 4, {what}")
    print("| model | layout | attention path | longest S | its peak, largest rank (bytes) | probes |")
    print("|---|---|---|---|---|---|")
    ulysses, both = {"sequence_parallel_size": 4}, {"sequence_parallel_size": 2, "context_parallel_size": 2}
    cases = [
        ("Llama h 4, kv 2", 4, 2, "sp 4 (Ulysses alone)", ulysses),
        ("Llama h 4, kv 2", 4, 2, "sp 2 x cp 2", both),
        ("Llama h 2, kv 2", 2, 2, "sp 2 x dp 2", {"sequence_parallel_size": 2}),
        ("Llama h 2, kv 2", 2, 2, "sp 2 x cp 2", both),
    ]
    for model, heads, kv_heads, name, layout in cases:
        path = "-" if "context_parallel_size" not in layout else "merged ring"
        got = run_distributed(
            _longest_fitting,
            4,
            heads,
            kv_heads,
            layout,
            budget,
            document,
            init_process_group=False,
            threads=1,
        )
        longest, peak, probes = got[0]
        print(f"| {model} | {name} | {path} | {longest} | {peak:,} | {probes} |")


if __name__ == "__main__":
    main()
