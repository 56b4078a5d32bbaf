"""Clusters described, not guessed: the GPUs the time model knows, and the profile file ``--cluster`` reads.

A :class:`Cluster` is a GPU's peaks (dense tensor-core TFLOP/s by dtype, HBM size and bandwidth), its links (within
a node, across nodes per GPU), how many GPUs a node holds and how many nodes there are, and the efficiencies the
time model applies ([Note: the roofline] in :mod:`.timing`). Built-in GPUs are data (:data:`GPUS`), each number with
the vendor page it comes from; a profile file (JSON, validated by pydantic: a wrong key or value is a
:class:`~shardtrain.errors.ConfigError` naming it) picks one by ``gpu`` and overrides what it measured, which is what
``shardtrain calibrate`` writes.

[Note: link bandwidths]
Vendors state NVLink as the sum of both directions (H100 SXM: 900 GB/s); a ring collective sends and receives at
once, each at one direction's rate, so ``intra_node_gb_s`` is half the stated figure. ``inter_node_gb_s_per_gpu`` is
one network adapter per GPU at its line rate (400 Gb/s NDR InfiniBand: 50 GB/s; 200 Gb/s HDR: 25 GB/s), as the
vendor's reference systems (DGX) are built. A collective's bytes are charged at ``link_efficiency`` of the link's
rate, with ``latency_us`` per algorithm step ([Note: the alpha-beta model] in :mod:`.timing`).
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shardtrain.errors import ConfigError


@dataclass(frozen=True)
class Gpu:
    """One accelerator's vendor figures (dense: the sparsity figures halved, as the vendor's footnotes say)."""

    name: str
    bf16_tflops: float
    fp8_tflops: float | None
    fp32_tflops: float
    """TF32 tensor-core dense peak (fp32 training's matmuls run there)."""
    hbm_gib: float
    hbm_tb_s: float
    intra_node_gb_s: float
    """One direction of NVLink ([Note: link bandwidths])."""
    inter_node_gb_s_per_gpu: float
    source: str


_A100 = (
    "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
    "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"
)
_DGX_A100 = "https://www.nvidia.com/en-us/data-center/dgx-a100/ (8x 200 Gb/s HDR)"
_H100 = "https://www.nvidia.com/en-us/data-center/h100/ (datasheet table)"
_DGX_H100 = "https://www.nvidia.com/en-us/data-center/dgx-h100/ (8x 400 Gb/s ConnectX-7)"
_H200 = "https://www.nvidia.com/en-us/data-center/h200/ (specifications table)"
_B200 = "https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200, per GPU); DGX B200 8x 400 Gb/s ConnectX-7"

GPUS: dict[str, Gpu] = {
    g.name: g
    for g in (
        Gpu("A100-40GB", 312.0, None, 156.0, 40.0, 1.555, 300.0, 25.0, f"{_A100}; {_DGX_A100}"),
        Gpu("A100-80GB", 312.0, None, 156.0, 80.0, 2.039, 300.0, 25.0, f"{_A100}; {_DGX_A100}"),
        Gpu("H100-SXM", 989.0, 1979.0, 494.5, 80.0, 3.35, 450.0, 50.0, f"{_H100}; {_DGX_H100}"),
        Gpu("H100-PCIe", 756.0, 1513.0, 378.0, 80.0, 2.0, 300.0, 50.0, f"{_H100} (NVLink bridge 600 GB/s)"),
        Gpu("H200", 989.0, 1979.0, 494.5, 141.0, 4.8, 450.0, 50.0, f"{_H200}; {_DGX_H100}"),
        Gpu("B200", 2250.0, 4500.0, 1100.0, 180.0, 7.7, 900.0, 50.0, _B200),
        # a CPU-only machine: no vendor figures; `shardtrain calibrate` measures every one of them
        Gpu("cpu", 0.0, None, 0.0, 0.0, 0.0, 0.0, 0.0, "none: measure with shardtrain calibrate"),
    )
}

STEP_MFU_H200 = 0.519
"""The H200 validation's stage-0 step at 51.9% MFU (docs/benchmarks-gpu.md, 2026-11-27, 1.3B GPT, bf16, 513 TFLOP/s
of 989, 144.5 ms a step): the only GPU step this project has measured."""

MATMUL_EFFICIENCY_H200 = 0.631
"""The matmul and attention rate (of the bf16 peak) at which the time model's own account of that step takes the
measured 144.5 ms: its memory-bound operators (at ``memory`` 0.8 of HBM) and the optimizer step take 25.6 ms of
it, so its matmuls and attention (74.1 TFLOP) take 118.9 ms. ``bench/bench_planner_time.py --h200`` gives both
predictions: 170.1 ms at :data:`STEP_MFU_H200` taken as the matmul rate (what shipped first: the whole step's rate,
with the memory-bound operators then charged a second time), 144.5 ms at this. Taken for the H100 and H200 alike
(the same dense bf16 peak); a ``calibrate`` run on such a GPU replaces it with a matmul rate measured by shape."""


@dataclass(frozen=True)
class Efficiencies:
    """Fractions of a peak the kernels reach ([Note: the roofline] in :mod:`.timing`)."""

    matmul: tuple[tuple[float, float], ...] = ((1.0, 0.5),)
    """(FLOPs of one matmul, efficiency) points, interpolated in log(FLOPs) and held flat beyond the ends."""
    attention: float = 0.4
    memory: float = 0.8
    link: float = 0.8
    overlap: float = 1.0
    """The share of overlappable communication that hides behind compute (1: all of it; 0: none, as on a CPU whose
    cores run both)."""
    latency_us: float = 5.0
    sync_skew: float = 0.0
    """How much a rank's compute stretches when the ranks meet at a collective after it ([Note: ranks that meet] in
    :mod:`.timing`): measured by ``calibrate`` on a shared CPU; 0 on a GPU cluster (stragglers are left out)."""
    op_overhead_us: float = 0.0
    """Host time per dispatched operator (eager CPU training pays it; a GPU's launches hide behind its kernels)."""
    optimizer_us_per_tensor: float = 0.0
    """Host time of the optimizer step and the gradient clipping per tensor stepped, beyond their bytes ([Note: the
    optimizer's host loop] in :mod:`.timing`); 0 on a GPU, whose step kernels run behind the host."""
    elementwise_ns: tuple[tuple[str, float], ...] = ()
    """(operator, nanoseconds per output element) of the operators whose arithmetic, not their bytes, bounds them on
    this machine ([Note: arithmetic-bound operators] in :mod:`.timing`); empty on a GPU."""
    source: str = "assumed (not measured): run shardtrain calibrate"

    def elementwise_ns_of(self, name: str) -> float:
        """Nanoseconds per output element of operator ``name`` where its arithmetic bounds it, else 0."""
        for known, ns in self.elementwise_ns:
            if known == name:
                return ns
        return 0.0

    def matmul_at(self, flops: float) -> float:
        points = sorted(self.matmul)
        if flops <= points[0][0] or len(points) == 1:
            return points[0][1]
        for (f0, e0), (f1, e1) in itertools.pairwise(points):
            if flops <= f1:
                w = (math.log(flops) - math.log(f0)) / (math.log(f1) - math.log(f0))
                return e0 + w * (e1 - e0)
        return points[-1][1]


GPU_EFFICIENCIES = Efficiencies(
    matmul=((1.0, MATMUL_EFFICIENCY_H200),),
    attention=MATMUL_EFFICIENCY_H200,
    source="matmul and attention: the rate at which the model takes docs/benchmarks-gpu.md's measured H200 stage-0 "
    "step (MATMUL_EFFICIENCY_H200); memory, link, latency: assumed, not measured",
)


@dataclass(frozen=True)
class Cluster:
    """The machines a layout is timed on."""

    gpu: Gpu
    gpus_per_node: int
    nodes: int = 1
    efficiencies: Efficiencies = field(default_factory=lambda: GPU_EFFICIENCIES)
    host_gb_s: float = 94.0
    """Host memory bandwidth a node's optimizer-offload step sees: the 94 GB/s the H200 validation's host AdamW
    reached (docs/benchmarks-gpu.md, 'The floor of a host step')."""
    pcie_gb_s: float = 25.0
    """Host-device copies of offload, one direction (PCIe Gen4/5 x16 in practice; assumed, not measured)."""
    nvme_gb_s: float = 6.0
    """NVMe offload's swap files, a node's ranks together, reads and writes alike: assumed, not measured (no run of
    this project has timed its swap files on a GPU host); a cluster file's ``nvme_gb_s`` replaces it."""

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    def peak_tflops(self, dtype: str, fp8: bool = False) -> float:
        if fp8 and self.gpu.fp8_tflops:
            return self.gpu.fp8_tflops
        return self.gpu.fp32_tflops if dtype == "fp32" else self.gpu.bf16_tflops


class _ClusterFile(BaseModel):
    """The JSON a ``--cluster`` file holds (what ``shardtrain calibrate`` writes)."""

    model_config = ConfigDict(extra="forbid")

    gpu: str
    gpus_per_node: Annotated[int, Field(ge=1)]
    nodes: Annotated[int, Field(ge=1)] = 1
    bf16_tflops: Annotated[float, Field(gt=0)] | None = None
    fp8_tflops: Annotated[float, Field(gt=0)] | None = None
    fp32_tflops: Annotated[float, Field(gt=0)] | None = None
    hbm_gib: Annotated[float, Field(gt=0)] | None = None
    hbm_tb_s: Annotated[float, Field(gt=0)] | None = None
    intra_node_gb_s: Annotated[float, Field(gt=0)] | None = None
    inter_node_gb_s_per_gpu: Annotated[float, Field(gt=0)] | None = None
    host_gb_s: Annotated[float, Field(gt=0)] | None = None
    pcie_gb_s: Annotated[float, Field(gt=0)] | None = None
    nvme_gb_s: Annotated[float, Field(gt=0)] | None = None
    matmul_efficiency: list[tuple[Annotated[float, Field(gt=0)], Annotated[float, Field(gt=0, le=1)]]] | None = None
    attention_efficiency: Annotated[float, Field(gt=0, le=1)] | None = None
    memory_efficiency: Annotated[float, Field(gt=0, le=1)] | None = None
    link_efficiency: Annotated[float, Field(gt=0, le=1)] | None = None
    overlap: Annotated[float, Field(ge=0, le=1)] | None = None
    latency_us: Annotated[float, Field(ge=0)] | None = None
    sync_skew: Annotated[float, Field(ge=0)] | None = None
    op_overhead_us: Annotated[float, Field(ge=0)] | None = None
    optimizer_us_per_tensor: Annotated[float, Field(ge=0)] | None = None
    elementwise_ns_per_element: dict[str, Annotated[float, Field(gt=0)]] | None = None
    source: str | None = None


def builtin_cluster(gpu: str, gpus_per_node: int = 8, nodes: int = 1) -> Cluster:
    """A cluster of a built-in GPU (:data:`GPUS`); an unknown name is refused with the names known."""
    if gpu not in GPUS:
        raise ConfigError(f"unknown GPU {gpu!r}: the built-in ones are {', '.join(GPUS)} (or give --cluster FILE)")
    if gpus_per_node < 1 or nodes < 1:
        raise ConfigError(f"gpus per node ({gpus_per_node}) and nodes ({nodes}) must be at least 1")
    return Cluster(GPUS[gpu], gpus_per_node, nodes)


def cluster_from_dict(data: object, where: str = "cluster") -> Cluster:
    """A :class:`Cluster` from a profile's JSON object (see :class:`_ClusterFile`), refusing what is wrong by name."""
    try:
        spec = _ClusterFile.model_validate(data)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'file'}: {e['msg']}" for e in err.errors())
        raise ConfigError(f"{where}: {problems}") from None
    base = builtin_cluster(spec.gpu, spec.gpus_per_node, spec.nodes)
    gpu_fields = ("bf16_tflops", "fp8_tflops", "fp32_tflops", "hbm_gib", "hbm_tb_s", "intra_node_gb_s")
    gpu_fields += ("inter_node_gb_s_per_gpu",)
    gpu = replace(base.gpu, **{k: getattr(spec, k) for k in gpu_fields if getattr(spec, k) is not None})
    eff = base.efficiencies
    pairs = {
        "matmul": tuple(spec.matmul_efficiency) if spec.matmul_efficiency else None,
        "attention": spec.attention_efficiency,
        "memory": spec.memory_efficiency,
        "link": spec.link_efficiency,
        "overlap": spec.overlap,
        "latency_us": spec.latency_us,
        "sync_skew": spec.sync_skew,
        "op_overhead_us": spec.op_overhead_us,
        "optimizer_us_per_tensor": spec.optimizer_us_per_tensor,
        "elementwise_ns": tuple(sorted(spec.elementwise_ns_per_element.items()))
        if spec.elementwise_ns_per_element is not None
        else None,
        "source": spec.source,
    }
    eff = replace(eff, **{k: v for k, v in pairs.items() if v is not None})
    cluster = replace(base, gpu=gpu, efficiencies=eff)
    host = {k: getattr(spec, k) for k in ("host_gb_s", "pcie_gb_s", "nvme_gb_s") if getattr(spec, k) is not None}
    cluster = replace(cluster, **host)
    missing = [k for k in ("fp32_tflops", "hbm_tb_s", "intra_node_gb_s") if not getattr(gpu, k)]
    if missing:
        raise ConfigError(f"{where}: gpu {spec.gpu!r} has no vendor figures; give {', '.join(missing)}")
    return cluster


def read_cluster(path: str | Path) -> Cluster:
    """The cluster a profile file describes (``--cluster FILE``)."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"cluster file {str(file)!r} does not exist")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"cluster file {str(file)!r} is not JSON: {err}") from None
    return cluster_from_dict(data, f"cluster file {str(file)!r}")
