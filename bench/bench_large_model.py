"""A model whose fp32 training state is larger than this machine's memory, trained at world 2 with ZeRO-3 and NVMe
offload of parameters and optimizer state.

    python bench/bench_large_model.py --nvme-path /mnt/nvme                      # ~2.48B parameters (d 4096, 12 layers)
    python bench/bench_large_model.py --nvme-path /mnt/nvme --d-model 1024 --layers 4 --parity   # ~55M, the check

Runs, each in fresh processes:

1. raw disk: both ranks at once write a file of ``--raw-gib`` GiB each with ``O_DIRECT`` (page cache bypassed)
   and ``fsync``, then read it back with ``O_DIRECT``: the bandwidth the disk gives two writers, then two
   readers, measured in this run;
2. the model built under ``shardtrain.zero.Init()`` (each rank builds only its shard of each parameter: no rank
   ever holds the whole model), ZeRO-3, ``offload_param`` and ``offload_optimizer`` to ``nvme`` in
   ``--nvme-path``, fp32 AdamW, one fixed batch trained for ``--steps`` steps (the loss must go down). Per rank:
   peak RSS (``ru_maxrss``: anonymous memory plus the pages of mapped files the process touched), and on rank 0
   the total RSS of both ranks sampled every 0.1 s; per step and phase (forward+backward, optimizer step): wall
   time, the main thread's CPU time (compute), the rest (waiting: on the disk, and on the other rank), and the
   bytes the process read and wrote to storage (``/proc/self/io``: page faults on mapped shards, the swapper's
   reads and writes, dirtied mapped pages) against what the raw disk needs for those bytes;
3. with ``--parity``: the same model and batches without any offload; losses and final weights must be equal
   bitwise (the correctness argument for the large run, which runs the same code at a larger size).

Prints the training state (16 bytes per parameter: fp32 parameters, gradients, two Adam moments) against the
machine's memory, every number above, and the machine's load.
"""

from __future__ import annotations

import argparse
import mmap
import os
import platform
import resource
import shutil
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

import shardtrain
from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.testing import run_distributed

GiB = 1 << 30


def mem_total() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))


def proc_io() -> tuple[int, int]:
    """Bytes this process made the storage read and write (page faults and writeback of mapped files included)."""
    with open("/proc/self/io") as f:
        v = dict(line.split(": ") for line in f.read().splitlines())
    return int(v["read_bytes"]), int(v["write_bytes"])


def rss_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


def model_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(
        vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model, n_layer=args.layers, n_head=args.heads
    )


def count_params(cfg: GPTConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


# -- 1. raw disk -------------------------------------------------------------------------------------


def raw_disk(path: str, gib: float) -> dict:
    """Both ranks at once: write then read ``gib`` GiB with O_DIRECT (no page cache), synced."""
    chunk = 64 << 20
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(1 << 20) * (chunk >> 20))
    count = max(1, int(gib * GiB) // chunk)
    name = Path(path) / f"raw-disk-rank{dist.get_rank()}.bin"
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(count):
        os.write(fd, buf)
    os.fsync(fd)
    os.close(fd)
    wrote = time.perf_counter() - start
    dist.barrier()
    fd = os.open(name, os.O_RDONLY | os.O_DIRECT)
    start = time.perf_counter()
    for _ in range(count):
        os.readv(fd, [buf])
    os.close(fd)
    read = time.perf_counter() - start
    dist.barrier()
    name.unlink()
    return {"bytes": count * chunk, "write_s": wrote, "read_s": read}


# -- 2./3. training ----------------------------------------------------------------------------------


class Phase:
    """Wall time, main-thread CPU time and storage bytes of one phase of a step."""

    def __enter__(self):
        self.t0, self.c0, self.io0 = time.perf_counter(), time.thread_time(), proc_io()
        self.f0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
        return self

    def __exit__(self, *exc):
        io = proc_io()
        self.wall = time.perf_counter() - self.t0
        self.cpu = time.thread_time() - self.c0
        self.read, self.written = io[0] - self.io0[0], io[1] - self.io0[1]
        self.faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - self.f0

    def row(self) -> dict:
        return {"wall": self.wall, "cpu": self.cpu, "read": self.read, "written": self.written, "faults": self.faults}


def train(args: argparse.Namespace, offload: bool) -> dict:
    rank = dist.get_rank()
    pids = [0, 0]
    dist.all_gather_object(pids, os.getpid())
    total_peak, sampling = [0], [True]

    def sample() -> None:  # the RSS of both ranks at the same moment
        while sampling[0]:
            total_peak[0] = max(total_peak[0], sum(rss_of(p) for p in pids))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True) if rank == 0 else None
    if sampler is not None:
        sampler.start()
    zero: dict = {"stage": 3, "stage3_prefetch_bucket_size": 0, "reduce_bucket_size": args.bucket}
    if offload:
        zero["sub_group_size"] = args.sub_group_size
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": args.nvme_path, "buffer_count": args.buffer_count}
        zero["offload_param"] = {"device": "nvme", "nvme_path": args.nvme_path, "max_in_cpu": 0}
    config = {"train_micro_batch_size_per_gpu": args.micro, "zero_optimization": zero}
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with shardtrain.zero.Init():  # each rank allocates only its shard of each parameter
        model = GPT(model_config(args))
    built = time.perf_counter() - t0
    rss_built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if rank == 0:
        print(f"  built in {built:.0f} s", flush=True)
    engine = shardtrain.initialize(model, config, torch.optim.AdamW(model.parameters(), lr=args.lr))
    init_s = time.perf_counter() - t0
    rss_init = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if rank == 0:
        print(f"  initialized at {init_s:.0f} s", flush=True)
    g = torch.Generator().manual_seed(1 + rank)  # one fixed batch per rank, trained on at every step
    x = torch.randint(0, args.vocab, (args.micro, args.seq), generator=g)
    y = torch.roll(x, -1, 1)
    steps, losses = [], []
    for _ in range(args.steps):
        dist.barrier()
        with Phase() as fb:
            loss = engine(x, y)
            engine.backward(loss)
        with Phase() as st:
            engine.step()
        losses.append(loss.item())
        steps.append({"fwd_bwd": fb.row(), "step": st.row()})
        if rank == 0:
            line = f"  step {len(steps)}: loss {losses[-1]:.4f}, fwd+bwd {fb.wall:.1f} s, step {st.wall:.1f} s"
            print(line, flush=True)
    out = {
        "losses": losses,
        "steps": steps,
        "build_s": built,
        "init_s": init_s,
        "rss_built": rss_built,
        "rss_init": rss_init,
        "params_on_disk": engine._param_offload.mapped_bytes() if engine._param_offload is not None else 0,
    }
    opt = engine._optimizer.offload
    if opt is not None and opt.files is not None:
        out["swap_buffers_peak"] = opt.peak_held_bytes
    if opt is not None and opt.grads is not None:  # gradient shards in swap files (see [Note: gradient offload])
        out["grad_in_flight_peak"] = opt.grads.peak_bytes
    out["grad_bytes_in_memory"] = engine._reducer.grad_bytes()
    if engine._param_offload is not None:  # parameter shards read into buffers for their gathers, one call each
        out["param_reads"] = (engine._param_offload.reads, engine._param_offload.bytes_read)
    # bytes in the swap directories: parameter shards (param-*.bin), gradient shards (*.grad.bin), optimizer state
    files = [f for s in engine._scratch.values() for f in s.path.iterdir() if f.suffix == ".bin"]
    grads = [f for f in files if f.name.endswith(".grad.bin")]
    out["grads_on_disk"] = sum(f.stat().st_size for f in grads)
    out["optimizer_on_disk"] = sum(
        f.stat().st_size for f in files if not f.name.startswith("param-") and f not in grads
    )
    if args.parity:
        out["weights"] = engine.full_state_dict()
    engine.close()
    out["max_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if sampler is not None:
        sampling[0] = False
        sampler.join()
    out["total_rss_peak"] = total_peak[0]
    return out


# -- 4. DeepSpeed ZeRO-Infinity ----------------------------------------------------------------------


def deepspeed_infinity(args: argparse.Namespace) -> str:
    """DeepSpeed's NVMe offload on the same model: what happened (where it stopped and its error, or its losses)."""
    import traceback

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    phase = "import deepspeed"
    config = {
        "train_micro_batch_size_per_gpu": args.micro,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr}},
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": args.sub_group_size,
            "offload_optimizer": {"device": "nvme", "nvme_path": args.nvme_path},
            "offload_param": {"device": "nvme", "nvme_path": args.nvme_path, "max_in_cpu": 0},
        },
    }
    try:
        import deepspeed

        phase = "deepspeed.zero.Init(remote_device='nvme') + model construction"
        with deepspeed.zero.Init(config_dict_or_path=config, remote_device="nvme"):
            model = GPT(model_config(args))
        phase = "deepspeed.initialize"
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        g = torch.Generator().manual_seed(1 + dist.get_rank())
        x = torch.randint(0, args.vocab, (args.micro, args.seq), generator=g)
        losses = []
        for step in range(args.steps):
            phase = f"training step {step + 1}"
            loss = engine(x, torch.roll(x, -1, 1))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return "trained, losses " + ", ".join(f"{v:.4f}" for v in losses)
    except Exception as err:
        frame = traceback.extract_tb(err.__traceback__)[-1]
        where = f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno} ({frame.name})"
        text = " ".join(f"{type(err).__name__}: {err}".split())
        return f"failed in {phase}, raised at {where}: {text[:500]}"


def ds_entry(args: argparse.Namespace) -> str:
    return deepspeed_infinity(args)


# -- report ------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--micro", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--nvme-path", required=True, help="directory for the swap files (and the raw-disk file)")
    parser.add_argument("--raw-gib", type=float, default=2.0, help="per rank, for the raw disk bandwidth")
    parser.add_argument("--sub-group-size", type=int, default=25_000_000)
    parser.add_argument("--buffer-count", type=int, default=2)
    parser.add_argument("--bucket", type=int, default=50_000_000, help="reduce_bucket_size (elements)")
    parser.add_argument("--parity", action="store_true", help="also train without offload; compare bitwise")
    parser.add_argument("--deepspeed", action="store_true", help="also try DeepSpeed ZeRO-Infinity (nvme)")
    parser.add_argument("--min-ratio", type=float, default=0.0, help="refuse unless state >= this x RAM")
    args = parser.parse_args()
    # glibc keeps freed blocks below its dynamic mmap threshold in the heap, so RSS would count memory already
    # freed; with this the ranks (fresh processes, which read it at start) return every block of 64 KiB or more
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    Path(args.nvme_path).mkdir(parents=True, exist_ok=True)
    ram = mem_total()
    n = count_params(model_config(args))
    state = 16 * n
    print(
        f"machine: {platform.node()}, {os.cpu_count()} cores, RAM {ram / GiB:.2f} GiB, torch {torch.__version__}, "
        f"load average {os.getloadavg()[0]:.1f}; swap dir {Path(args.nvme_path).resolve()} "
        f"({shutil.disk_usage(args.nvme_path).free / 1e9:.0f} GB free)"
    )
    print(
        f"model: GPT d_model {args.d_model}, {args.layers} layers, vocab {args.vocab}, {n / 1e9:.3f}B parameters; "
        f"fp32 training state (params + grads + Adam m, v) {state / GiB:.1f} GiB = {state / ram:.2f} x RAM; "
        f"world 2, ZeRO-3, offload_param + offload_optimizer nvme, sub_group_size {args.sub_group_size:,}, "
        f"buffer_count {args.buffer_count}; batch {args.micro} x {args.seq} tokens per rank, {args.steps} steps"
    )
    if state < args.min_ratio * ram:
        raise SystemExit(f"state {state / GiB:.1f} GiB < {args.min_ratio} x RAM: pick a larger --d-model/--layers")
    timeout = 4 * 3600
    raw = run_distributed(raw_disk, 2, args.nvme_path, args.raw_gib, timeout=timeout, threads=1)
    nbytes = sum(r["bytes"] for r in raw)
    raw_w = nbytes / max(r["write_s"] for r in raw)
    raw_r = nbytes / max(r["read_s"] for r in raw)
    print(
        f"raw disk (O_DIRECT, 2 ranks at once, {nbytes / GiB:.1f} GiB in all, synced): "
        f"write {raw_w / 1e6:.0f} MB/s, read {raw_r / 1e6:.0f} MB/s"
    )
    off = run_distributed(train, 2, args, True, timeout=timeout, threads=1)
    r0 = off[0]
    per_rank = [r["max_rss"] for r in off]
    print(
        f"built under zero.Init in {r0['build_s']:.0f} s, initialize done at {r0['init_s']:.0f} s; peak RSS after "
        f"construction {max(r['rss_built'] for r in off) / GiB:.2f} GiB/rank, after initialize "
        f"{max(r['rss_init'] for r in off) / GiB:.2f} GiB/rank"
    )
    print(
        f"on disk per rank: parameters {r0['params_on_disk'] / GiB:.2f} GiB, optimizer state "
        f"{r0.get('optimizer_on_disk', 0) / GiB:.2f} GiB, fp32 gradients {r0['grads_on_disk'] / GiB:.2f} GiB; "
        f"swap buffers (state + gradients of the sub-groups in flight) held at most "
        f"{r0.get('swap_buffers_peak', 0) / GiB:.2f} GiB; gradients on their way to their files at most "
        f"{r0.get('grad_in_flight_peak', 0) / GiB:.2f} GiB; gradient shards in memory after training "
        f"{r0['grad_bytes_in_memory'] / GiB:.2f} GiB"
    )
    if "param_reads" in r0:
        reads, nread = r0["param_reads"]
        print(f"parameter shards read for gathers (rank 0): {reads} reads, {nread / GiB:.2f} GiB, one call each")
    print(
        f"peak RSS per rank: {', '.join(f'{b / GiB:.2f}' for b in per_rank)} GiB; sum {sum(per_rank) / GiB:.2f} GiB "
        f"= {sum(per_rank) / ram:.1%} of RAM (limit 75%); both ranks at the same moment (sampled) "
        f"{r0['total_rss_peak'] / GiB:.2f} GiB"
    )
    print(f"losses (rank 0): {', '.join(f'{v:.4f}' for v in r0['losses'])}")
    print(f"losses (rank 1): {', '.join(f'{v:.4f}' for v in off[1]['losses'])}")
    print(
        f"{'step':>4} {'phase':<8} {'wall s':>8} {'compute s':>10} {'wait s':>8} {'read GB':>8} {'written GB':>10} "
        f"{'I/O at raw speed s':>19}"
    )
    for s in range(args.steps):
        for phase in ("fwd_bwd", "step"):
            rows = [r["steps"][s][phase] for r in off]
            wall = max(x["wall"] for x in rows)
            cpu = max(x["cpu"] for x in rows)
            rd, wr = sum(x["read"] for x in rows), sum(x["written"] for x in rows)
            print(
                f"{s + 1:>4} {phase:<8} {wall:>8.1f} {cpu:>10.1f} {wall - cpu:>8.1f} {rd / 1e9:>8.2f} "
                f"{wr / 1e9:>10.2f} {rd / raw_r + wr / raw_w:>19.1f}"
            )
    if args.parity:
        mem = run_distributed(train, 2, args, False, timeout=timeout, threads=1)
        same_losses = all(a["losses"] == b["losses"] for a, b in zip(off, mem))
        wa, wb = off[0]["weights"], mem[0]["weights"]
        same_weights = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
        print(
            f"parity with the same model without offload: losses {'equal' if same_losses else 'DIFFER'}, "
            f"final weights {'bitwise equal' if same_weights else 'DIFFER'}; peak RSS per rank without offload "
            f"{max(r['max_rss'] for r in mem) / GiB:.2f} GiB"
        )
        if not (same_losses and same_weights):
            raise SystemExit("offloaded training differs from training in memory")
    if args.deepspeed:
        print("DeepSpeed ZeRO-Infinity (offload_param + offload_optimizer nvme), same model, world 2:")
        for rank, outcome in enumerate(run_distributed(ds_entry, 2, args, timeout=timeout, threads=1)):
            print(f"  rank {rank}: {outcome}")
    decreasing = all(b < a for a, b in zip(r0["losses"], r0["losses"][1:]))
    print(f"loss decreasing at every step: {decreasing}")


if __name__ == "__main__":
    main()
