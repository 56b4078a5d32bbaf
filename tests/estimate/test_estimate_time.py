"""The time model's pieces (``estimate/timing.py``, ``estimate/cluster.py``): FLOPs against torch's counter on a real
module, ZeRO's and tensor parallelism's bytes against the engine's communicators, the 1F1B bubble against its
formula, the alpha-beta and roofline arithmetic, and the cluster profile's refusals. Timed comparisons against
measured steps live in ``bench/bench_planner_time.py``, not here."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

import shardtrain
from shardtrain.errors import ConfigError
from shardtrain.estimate import estimate_memory
from shardtrain.estimate.cluster import Cluster, Efficiencies, builtin_cluster, cluster_from_dict, read_cluster
from shardtrain.estimate.source import resolve_source
from shardtrain.estimate.timing import (
    MicroBatchWork,
    Op,
    StepInputs,
    ZeroTraffic,
    _WorkCounter,
    collective_time,
    is_metadata_only,
    measure_work,
    op_time,
    step_time,
    sum_kinds,
)
from shardtrain.models.gpt import GPT, GPTConfig
from shardtrain.testing import run_distributed

VOCAB, SEQ, MICRO, GAS, D, LAYERS, HEADS = 64, 16, 2, 2, 32, 3, 4


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, d_model=D, n_layer=LAYERS, n_head=HEADS))


def tiny_llama() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(cfg)


def _attention_flops(batch: int, layers: int) -> int:
    shape = (batch, HEADS, SEQ, D // HEADS)
    return layers * (sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(shape, shape, shape, shape))


def test_flops_are_torch_flop_counters_on_a_real_module_and_on_the_fake_run():
    """The matmul FLOPs of a forward and backward equal ``FlopCounterMode``'s, counted on the real module and on the
    planner's fake run alike; CPU's fused attention (which the registry does not list, so the counter gives it 0)
    is the registry's own ``sdpa_flop_count`` per layer."""
    model = tiny_gpt()
    idx = torch.randint(0, VOCAB, (MICRO, SEQ))
    counter = FlopCounterMode(display=False)
    with counter:
        model(idx, idx).backward()
    want = counter.get_total_flops()
    assert want > 0

    work = MicroBatchWork()
    mode = _WorkCounter(work)
    with mode:
        loss = model(idx, idx)
        mode.backward = True
        loss.backward()
    assert work.flops("matmul") == want
    assert work.flops("attention") == _attention_flops(MICRO, LAYERS)
    forward = FlopCounterMode(display=False)
    with forward, torch.no_grad():
        model(idx, idx)
    shape = (MICRO, HEADS, SEQ, D // HEADS)
    assert work.forward_flops == forward.get_total_flops() + LAYERS * sdpa_flop_count(shape, shape, shape)

    fake = measure_work(resolve_source(tiny_gpt), tp=1, compute=torch.float32, micro_batch=MICRO, seq_len=SEQ)
    assert fake.flops("matmul") == want
    assert fake.flops("attention") == _attention_flops(MICRO, LAYERS)


def test_recompute_is_counted_once_more_under_checkpointing():
    """Activation checkpointing runs each block's forward again in backward: the fake run sees it (torch's
    non-reentrant checkpoint stops recomputing once it has what backward needs, so a block's last matmul, whose
    output nothing saves, is not run again: less than the blocks' forward)."""
    source = resolve_source(tiny_gpt)
    plain = measure_work(source, tp=1, compute=torch.float32, micro_batch=MICRO, seq_len=SEQ)
    full = measure_work(source, tp=1, compute=torch.float32, micro_batch=MICRO, seq_len=SEQ, checkpointing=True)
    assert full.forward_flops == plain.forward_flops
    recomputed = full.flops() - plain.flops()
    head = 2 * MICRO * SEQ * D * VOCAB  # the output head is outside the blocks: not recomputed
    assert 0.5 * (plain.forward_flops - head) < recomputed < plain.forward_flops - head


def _engine_bytes(stage: int, tp: int) -> dict:
    import torch.distributed as dist

    model = tiny_llama() if tp > 1 else tiny_gpt()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000, "stage3_param_persistence_threshold": 0},
        "tensor_parallel": {"size": tp},
    }
    engine = shardtrain.initialize(model, config=config, optimizer=torch.optim.AdamW(model.parameters()))
    torch.manual_seed(dist.get_rank() // tp)
    totals = []
    for _ in range(3):
        for _ in range(GAS):
            idx = torch.randint(0, VOCAB, (MICRO, SEQ))
            out = engine(input_ids=idx, labels=idx) if tp > 1 else engine(idx, idx)
            engine.backward(out.loss if tp > 1 else out)
            engine.step()  # DeepSpeed's protocol: every micro-batch; it steps at the boundary
        totals.append({"zero": engine.comm_stats(reset=True), "tp": engine.tp_comm.stats() if tp > 1 else {}})
        if tp > 1:
            engine.tp_comm.reset_stats()
    return totals


def _per_step(totals: list[dict], group: str) -> dict[str, int]:
    """The third step's bytes (counted from a reset after the second; the gradient norm's few-byte all-reduce is not
    ZeRO's and is dropped)."""
    return {k: v["bytes"] for k, v in totals[2][group].items() if v["bytes"] > 8}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_bytes_per_step_equal_the_engines_counts(stage):
    """Each stage's gathers and reductions of one step (2 micro-batches, world 2, every parameter in a unit at stage
    3) as the time model counts them from the layout, against ZeRO's communicator's bytes."""
    totals = run_distributed(_engine_bytes, 2, stage, 1)[0]
    est = estimate_memory(
        tiny_gpt,
        {"zero_optimization": {"reduce_bucket_size": 2000, "stage3_param_persistence_threshold": 0}},
        world_size=2,
        stage=stage,
        micro_batch=MICRO,
        micro_batches=GAS,
        seq_len=SEQ,
        device_type="cpu",
        cluster=builtin_cluster("H100-SXM", 8),
    )
    from shardtrain.estimate.timing import zero_traffic

    predicted = zero_traffic(est.state, stage).per_step(GAS)
    assert predicted == _per_step(totals, "zero")
    assert est.time is not None and est.time.step_time_s > 0


def test_tensor_parallel_bytes_equal_the_engines_counts():
    """The fake run's recorded tensor-parallel collectives of one micro-batch (Llama, tp 2) against the engine's
    tensor-parallel communicator, per step of 2 micro-batches."""
    totals = run_distributed(_engine_bytes, 2, 1, 2)[0]
    work = measure_work(resolve_source(tiny_llama), tp=2, compute=torch.float32, micro_batch=MICRO, seq_len=SEQ)
    recorded = {kind: GAS * n for (axis, kind), n in sum_kinds(work.collectives).items() if axis == "tp"}
    assert recorded and recorded == _per_step(totals, "tp")


def _replica_bytes(stage: int) -> int:
    """The engine's all-reduce bytes across replicas in one step (hybrid sharding, shard groups of 2)."""
    model = tiny_gpt()
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2000, "mics_shard_size": 2},
    }
    engine = shardtrain.initialize(model, config=config, optimizer=torch.optim.AdamW(model.parameters()))
    engine.comm_stats(reset=True)
    for _ in range(GAS):
        idx = torch.randint(0, VOCAB, (MICRO, SEQ))
        engine.backward(engine(idx, idx))
        engine.step()
    return engine.comm_stats(by_group=True)["replicate"]["all_reduce"]["bytes"]


@pytest.mark.soak  # four ranks of the engine: 25-29 s on the shared 2-core machine
def test_hybrid_sharding_replica_all_reduce_equals_the_engines_bytes():
    """World 4 as 2 shard groups of 2 (stage 2): each rank's gradient shards all-reduced over the 2 replicas once a
    step, as the time model counts them from the layout, against the engine's replicate communicator; the step
    carries their time (a layout without replicas has none)."""
    measured = run_distributed(_replica_bytes, 4, 2)[0]
    config = {"zero_optimization": {"reduce_bucket_size": 2000, "mics_shard_size": 2}}
    kw = dict(world_size=4, stage=2, micro_batch=MICRO, micro_batches=GAS, seq_len=SEQ, device_type="cpu")
    est = estimate_memory(tiny_gpt, config, cluster=builtin_cluster("H100-SXM", 2, 2), **kw)
    from shardtrain.estimate.timing import zero_traffic

    traffic = zero_traffic(est.state, 2, replicas=est.layout.zero // est.layout.shard_group)
    assert traffic.replicas == 2 and traffic.replica_all_reduce == measured > 0
    assert zero_traffic(est.state, 2).replica_all_reduce == 0


def _inputs(**kw) -> StepInputs:
    base = dict(world=8, dp=8, micro_batch=1, seq_len=SEQ, micro_batches=8, dtype="bf16")
    return StepInputs(**{**base, **kw})


def test_the_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1():
    """With pipeline stages of equal cost, the bubble's share of the step is ``(p-1)/(m+p-1)``."""
    work = MicroBatchWork()
    work.ops[Op("matmul", 10**12, 0, False)] = 1
    work.ops[Op("matmul", 2 * 10**12, 0, True)] = 1
    cluster = builtin_cluster("H100-SXM", 8)
    p, m = 4, 8
    est = step_time(work, ZeroTraffic({}, {}, {}), _inputs(pp=p, dp=2, micro_batches=m, bubble=3 / 11), cluster)
    assert est.parts["pipeline bubble"] / est.step_time_s == pytest.approx((p - 1) / (m + p - 1))


def test_alpha_beta_and_roofline_arithmetic():
    """An all-reduce of S bytes over n ranks costs a tree's ``2 log2 n`` latencies (fewer than a ring's ``2(n-1)``)
    plus ``2 S (n-1)/n`` bytes at the link's rate, within a node NVLink's, across nodes (one rank a node) one network
    adapter's; an
    all-gather a ring's ``n - 1`` latencies. A matmul takes its FLOPs at the matmul rate,
    a memory-bound operator its bytes at HBM's."""
    eff = Efficiencies(matmul=((1.0, 0.5),), memory=0.5, link=0.5, latency_us=10.0)
    h100 = Cluster(builtin_cluster("H100-SXM", 8).gpu, 8, 2, eff)
    s = 10**9
    intra = collective_time("all_reduce", 2 * s * 7 // 8, 8, 8, h100)
    assert intra == pytest.approx(6 * 10e-6 + 2 * s * 7 / 8 / (450e9 * 0.5))
    inter = collective_time("all_reduce", 2 * s // 2, 2, 16, h100)  # one rank a node: one adapter ([Note: rings...])
    assert inter == pytest.approx(2 * 10e-6 + 2 * s / 2 / (50e9 * 0.5))
    gather = collective_time("all_gather", s * 3 // 4, 4, 4, h100)
    assert gather == pytest.approx(3 * 10e-6 + s * 3 / 4 / (450e9 * 0.5))
    assert op_time(Op("matmul", 989 * 10**12, 0, False), h100, "bf16") == pytest.approx(2.0)
    assert op_time(Op("memory", 0, 3_350 * 10**9, False), h100, "bf16") == pytest.approx(2.0)
    assert op_time(Op("matmul", 1979 * 10**12, 0, False), h100, "bf16", fp8=True) == pytest.approx(2.0)


def test_views_are_charged_no_bytes_and_no_host_overhead():
    """[Note: metadata-only operators]: by the schema's alias rule, views are metadata-only and in-place or copying
    operators are not; a view costs nothing on a host that pays 10 us per operator, a kernel does; and a real model's
    fake run holds views (so the first slice overcharged it)."""
    aten = torch.ops.aten
    views = (aten.view.default, aten.t.default, aten.transpose.int, aten.expand.default, aten.as_strided.default)
    views += (aten.detach.default, aten.split.Tensor, aten._unsafe_view.default)
    assert all(is_metadata_only(f) for f in views)
    kernels = (aten.add_.Tensor, aten.copy_.default, aten.mm.default, aten.clone.default, aten.add.Tensor)
    assert not any(is_metadata_only(f) for f in kernels)
    cpu = Cluster(builtin_cluster("H100-SXM", 1).gpu, 1, 1, Efficiencies(op_overhead_us=10.0))
    assert op_time(Op("memory", 0, 0, False, metadata_only=True), cpu, "fp32") == 0.0
    assert op_time(Op("memory", 0, 0, False), cpu, "fp32") == pytest.approx(10e-6)
    work = measure_work(resolve_source(tiny_gpt), tp=1, compute=torch.float32, micro_batch=MICRO, seq_len=SEQ)
    counted = {flag: sum(n for op, n in work.ops.items() if op.metadata_only == flag) for flag in (True, False)}
    assert counted[True] > 0 and counted[False] > 0
    assert all(op.nbytes == 0 and op.flops == 0 for op in work.ops if op.metadata_only)


def test_the_offloaded_host_steps_bytes_are_the_one_pass_steps_own_figure():
    """The time model reads the host step's bytes per element from ``offload/one_pass.py`` (no copy of the docs'
    34): the figure there, plus the bf16 fragment, is what a host step is charged."""
    from shardtrain.estimate import timing
    from shardtrain.offload import one_pass

    assert timing.HOST_STEP_BYTES_PER_ELEMENT is one_pass.HOST_STEP_BYTES_PER_ELEMENT == 32
    cluster = cluster_from_dict({"gpu": "H200", "gpus_per_node": 1, "host_gb_s": 10})
    inputs = _inputs(world=1, dp=1, stepped_elements=10**9, offload_optimizer="cpu")
    step = step_time(MicroBatchWork(), ZeroTraffic({}, {}, {}), inputs, cluster).parts["optimizer step"]
    assert step == pytest.approx(10**9 * (one_pass.HOST_STEP_BYTES_PER_ELEMENT + 2) / 10e9)


def test_the_offloaded_host_step_is_its_bytes_over_the_host_bandwidth_and_nvme_adds_its_swaps():
    """Optimizer offload: the host step moves 34 bytes per stepped element (bf16: one pass, docs/offload.md) at the
    profile's ``host_gb_s``, shared by a node's ranks; NVMe offload adds its swap bytes at ``nvme_gb_s``."""
    cluster = cluster_from_dict({"gpu": "H200", "gpus_per_node": 4, "host_gb_s": 50, "nvme_gb_s": 2})
    n, swapped = 10**9, 3 * 10**9
    on_host = step_time(MicroBatchWork(), ZeroTraffic({}, {}, {}), _inputs(world=4, dp=4, stepped_elements=n,
                        offload_optimizer="cpu"), cluster)  # fmt: skip
    assert on_host.parts["optimizer step"] == pytest.approx(n * 34 * 4 / 50e9)
    assert on_host.parts["nvme swaps"] == 0
    on_disk = step_time(MicroBatchWork(), ZeroTraffic({}, {}, {}), _inputs(world=4, dp=4, stepped_elements=n,
                        offload_optimizer="nvme", nvme_bytes=swapped), cluster)  # fmt: skip
    assert on_disk.parts["nvme swaps"] == pytest.approx(swapped * 4 / 2e9)
    assert on_disk.step_time_s > on_host.step_time_s
    kw = dict(world_size=2, stage=3, micro_batch=MICRO, seq_len=SEQ, cluster=builtin_cluster("H200", 8))
    cpu = estimate_memory(tiny_gpt, offload_optimizer="cpu", **kw).time
    nvme = estimate_memory(tiny_gpt, offload_optimizer="nvme", **kw).time
    assert cpu is not None and nvme is not None
    assert cpu.parts["optimizer step"] > 0 and cpu.parts["nvme swaps"] == 0 < nvme.parts["nvme swaps"]


def test_a_cluster_file_overrides_a_gpu_and_bad_ones_are_refused_by_name(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"gpu": "H100-SXM", "gpus_per_node": 4, "nodes": 2, "inter_node_gb_s_per_gpu": 25}))
    cluster = read_cluster(path)
    assert (cluster.world, cluster.gpu.inter_node_gb_s_per_gpu, cluster.gpu.bf16_tflops) == (8, 25, 989.0)
    with pytest.raises(ConfigError, match=r"unknown GPU 'V100'.*H100-SXM"):
        cluster_from_dict({"gpu": "V100", "gpus_per_node": 8})
    with pytest.raises(ConfigError, match="bf16_tflop"):
        cluster_from_dict({"gpu": "H200", "gpus_per_node": 8, "bf16_tflop": 900})
    with pytest.raises(ConfigError, match="gpus_per_node"):
        cluster_from_dict({"gpu": "H200", "gpus_per_node": 0})
    with pytest.raises(ConfigError, match="fp32_tflops"):
        cluster_from_dict({"gpu": "cpu", "gpus_per_node": 2})
    with pytest.raises(ConfigError, match=r"elementwise_ns_per_element\.gelu"):
        cluster_from_dict({"gpu": "H200", "gpus_per_node": 8, "elementwise_ns_per_element": {"gelu": -1.0}})
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not JSON"):
        read_cluster(path)


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    from shardtrain.cli import main as cli_main

    code = cli_main(["estimate", "test_estimate_time:tiny_gpt", "--seq-len", str(SEQ), *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_command_prints_and_carries_the_time_fields(capsys):
    code, out, _ = _cli(capsys, "--world", "2", "--stage", "3", "--time", "--gpu", "H200", "--json")
    data = json.loads(out)
    assert code == 0
    assert {"step_time_s", "tokens_per_s_per_gpu", "mfu", "exposed_comm_s", "peak"} <= set(data)
    assert data["step_time_s"] == pytest.approx(sum(data["parts_s"].values()))
    assert data["tokens_per_s_per_gpu"] == pytest.approx(SEQ / data["step_time_s"])  # micro-batch 1 x SEQ a rank
    code, out, _ = _cli(capsys, "--world", "2", "--time", "--gpu", "H200")
    assert code == 0 and "tokens/s per GPU" in out and "MFU" in out
    code, _, err = _cli(capsys, "--world", "2", "--time")
    assert code == 2 and "--time needs a cluster" in err
    code, _, err = _cli(capsys, "--world", "2", "--time", "--gpu", "H200", "--cluster", "x.json")
    assert code == 2 and "not both" in err


def test_a_search_at_1024_gpus_ranks_by_speed_with_the_fake_runs_of_one_node(capsys, monkeypatch):
    """``--budget`` on 128 nodes of 8 GPUs: every layout that fits, ranked by predicted tokens/s, each after the
    first with why it is slower. What bounds its time (measured by ``bench/bench_search_time.py``, not here: a
    wall clock under load says nothing): the fake runs, seconds each, are one per distinct (tp, sp, ep, batch,
    checkpointing), as many at 1,024 GPUs as at 8, and the fake model of each (tp, ep) is built once, whether it is
    refused or not; only the model-state arithmetic grows with the layouts."""
    from shardtrain.estimate import planner

    runs: list[int] = []
    real_runs, real_work, real_build = planner.measure_runs, planner.measure_work, planner.build_fake
    built: list[tuple[int, int]] = []

    def counted_build(source, tp, dtype, tp_plan, ep, split=False):  # type: ignore[no-untyped-def]
        built.append((tp, ep))
        return real_build(source, tp, dtype, tp_plan, ep, split=split)

    def counted_runs(keyed, workers=1):  # type: ignore[no-untyped-def]
        runs.append(len(keyed))
        yield from real_runs(keyed, workers)

    def counted_work(**kwargs):  # type: ignore[no-untyped-def]
        runs.append(-1)  # a time model's fake run
        return real_work(**kwargs)

    monkeypatch.setattr(planner, "measure_runs", counted_runs)
    monkeypatch.setattr(planner, "measure_work", counted_work)
    monkeypatch.setattr(planner, "build_fake", counted_build)
    per_search = []
    for nodes in ("1", "128"):
        runs.clear()
        built.clear()
        code, out, _ = _cli(capsys, "--budget", "80GiB", "--gpu", "H100-SXM", "--nodes", nodes, "--jobs", "1")
        assert code == 0
        per_search.append((sum(n for n in runs if n > 0), runs.count(-1)))
        assert len(built) == len(set(built)), sorted(built)  # a refused size is not built again per layout
    assert per_search[0] == per_search[1], per_search
    memory_runs, work_runs = per_search[1]
    assert 0 < work_runs <= memory_runs <= 64, per_search
    lines = out.splitlines()
    assert "by predicted tokens/s per GPU" in lines[0] and "world 1024" in out
    speeds = [float(line.split()[1].replace(",", "")) for line in lines if line.strip()[:2] in ("1.", "2.", "3.")]
    assert len(speeds) == 3 and speeds == sorted(speeds, reverse=True)
    assert "slower than 1." in out


def test_calibrate_writes_a_profile_the_cluster_option_reads(tmp_path, capsys, monkeypatch):
    """``shardtrain calibrate`` at world 1 (the collectives are measured by the benchmark at worlds 2-4): every
    figure the time model needs is measured and positive, and ``--cluster`` reads the file back (short windows and
    operand pools here: the figures' accuracy is the benchmark's)."""
    from shardtrain.cli import main as cli_main
    from shardtrain.estimate import calibrate

    monkeypatch.setattr(calibrate, "WINDOW_S", 0.02)
    monkeypatch.setattr(calibrate, "COLD_BYTES", 8 * 2**20)

    path = tmp_path / "profile.json"
    assert cli_main(["calibrate", "--out", str(path), "--world", "1", "--threads", "1"]) == 0
    capsys.readouterr()
    cluster = read_cluster(path)
    assert cluster.gpu.fp32_tflops > 0 and cluster.gpu.hbm_tb_s > 0 and cluster.efficiencies.op_overhead_us > 0
    assert cluster.host_gb_s == pytest.approx(cluster.gpu.hbm_tb_s * 1e3)  # a CPU's host memory is its memory
    assert max(e for _, e in cluster.efficiencies.matmul) == pytest.approx(1.0)
    assert cluster.efficiencies.optimizer_us_per_tensor > 0
    from shardtrain.estimate.calibrate import ELEMENTWISE_OPERATORS

    assert [name for name, ns in cluster.efficiencies.elementwise_ns if ns > 0] == sorted(ELEMENTWISE_OPERATORS)
    code, out, _ = _cli(capsys, "--world", "1", "--time", "--cluster", str(path), "--json")
    assert code == 0 and json.loads(out)["step_time_s"] > 0
    assert cli_main(["calibrate", "--out", str(path), "--world", "0"]) == 2


def test_expert_parallel_work_counts_grouped_matmuls_and_the_token_exchange():
    """A Mixtral at ep 2: the experts' grouped matmuls (not in torch's registry) are matmul FLOPs, and the token
    exchange is recorded on the expert axis, forward and backward, at a balanced routing's bytes."""
    from helpers.moe_cases import tiny_moe

    def mixtral() -> torch.nn.Module:
        return tiny_moe("mixtral", 4, router_logits=False)

    source = resolve_source(mixtral)
    whole = measure_work(source, tp=1, compute=torch.float32, micro_batch=MICRO, seq_len=SEQ)
    split = measure_work(source, tp=1, compute=torch.float32, micro_batch=MICRO, seq_len=SEQ, ep=2)
    assert split.flops("matmul") > 0
    exchanges = [c for c in split.collectives if c.axis == "ep"]
    assert {c.backward for c in exchanges} == {False, True} and not whole.collectives
    rows = MICRO * SEQ * 2  # top-2: each token's row goes to two experts
    hidden_bytes = rows * 16 * 4  # hidden 16, fp32
    assert max(c.nbytes for c in exchanges) == hidden_bytes // 2  # S (n-1)/n at n = 2


def wide_gpt() -> GPT:
    """Wide enough that its matmuls, not latencies, decide an H200's step (the speed flags' tests)."""
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=512, d_model=1024, n_layer=4, n_head=8))


def _step(capsys, *argv: str, model: str = "test_estimate_time:wide_gpt") -> dict:
    """One layout of ``model`` on 2 H200s (stage 3, bf16, micro-batch 2 x 512) with ``argv`` added, as JSON."""
    from shardtrain.cli import main as cli_main

    base = ["estimate", model, "--seq-len", "512", "--gpu", "H200", "--time", "--world", "2", "--stage", "3"]
    code = cli_main([*base, "--dtype", "bf16", "--micro-batch", "2", "--json", *argv])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def _refused(capsys, *argv: str) -> str:
    code, _, err = _cli(capsys, "--world", "4", "--time", "--gpu", "H200", *argv)
    assert code == 2
    return err


def test_ac_recomputes_more_as_it_keeps_less_and_checkpointing_is_full(capsys):
    """``--ac``: full recomputes each block's forward in backward, selective only what it does not keep, none
    nothing: the backward and the step grow in that order; ``--checkpointing`` is ``--ac full``; both at once with
    another choice is refused by name."""
    steps = {ac: _step(capsys, "--ac", ac) for ac in ("none", "selective", "full")}
    backward = [steps[ac]["parts_s"]["backward"] for ac in ("none", "selective", "full")]
    assert backward[0] < backward[1] < backward[2]
    assert steps["none"]["step_time_s"] < steps["selective"]["step_time_s"] < steps["full"]["step_time_s"]
    assert _step(capsys, "--checkpointing")["step_time_s"] == steps["full"]["step_time_s"]
    assert "--checkpointing is --ac full" in _refused(capsys, "--ac", "selective", "--checkpointing")


def test_compile_fuses_pointwise_operators_and_fp8_speeds_up_the_matmuls(capsys):
    """``--compile`` and ``--fp8`` each shorten the step of the same layout; the memory is the same under
    ``--compile`` (it changes the time model only)."""
    plain = _step(capsys)
    compiled = _step(capsys, "--compile")
    fp8 = _step(capsys, "--fp8")
    assert compiled["parts_s"]["forward"] < plain["parts_s"]["forward"]
    assert compiled["step_time_s"] < plain["step_time_s"] and compiled["peak"] == plain["peak"]
    assert fp8["parts_s"]["forward"] < plain["parts_s"]["forward"] and fp8["layout"]["fp8"]


def test_only_converted_linears_matmuls_run_at_the_fp8_peak():
    """[Note: fp8 matmuls]: a matmul whose operand is a converted weight's shape (or its transpose) runs at the fp8
    peak, one of an unconverted shape (an output head) at bf16's; the pointwise operator fused under compile is
    charged its output's bytes only."""
    h200 = builtin_cluster("H200", 8)
    converted = Op("matmul", 10**12, 0, False, shapes=((32, 128), (512, 32)))  # x (512 x 128) @ W^T (128 x 32)
    head = Op("matmul", 10**12, 0, False, shapes=((64, 32), (512, 64)))
    work = MicroBatchWork()
    work.ops[converted] = work.ops[head] = 1
    est = step_time(
        work,
        ZeroTraffic({}, {}, {}),
        _inputs(world=1, dp=1, micro_batches=1, fp8=True, float8_linears={(128, 32)}),
        h200,
    )
    want = op_time(converted, h200, "bf16", fp8=True) + op_time(head, h200, "bf16")
    assert est.parts["forward"] == pytest.approx(want)
    assert op_time(converted, h200, "bf16", fp8=True) < op_time(head, h200, "bf16")
    add = Op("memory", 0, 3 * 10**9, False, pointwise=True, out_bytes=10**9)
    assert op_time(add, h200, "bf16", compiled=True) == pytest.approx(op_time(add, h200, "bf16") / 3)


def test_schedule_sets_the_pipeline_bubble_and_unknown_ones_are_refused(capsys):
    """``--schedule``: 1F1B and GPipe idle ``(p-1)/(m+p-1)``, Interleaved1F1B with 2 stages a rank
    ``(p-1)/(2m+p-1)``, a shorter step, ZBVZeroBubble ``(p-1)/(6m+p-1)``; a name the pipeline section does not
    build, a schedule without ``--pp`` and a multi-stage schedule with one stage a rank are refused by name."""
    pipe = ("--world", "4", "--stage", "1", "--pp", "2", "--global-batch", "16")
    one_f_one_b = _step(capsys, *pipe)
    gpipe = _step(capsys, *pipe, "--schedule", "GPipe")
    interleaved = _step(capsys, *pipe, "--schedule", "interleaved1f1b", "--stages-per-rank", "2")
    m = 16 // (2 * 2)
    assert one_f_one_b["pipeline_bubble"] == gpipe["pipeline_bubble"] == pytest.approx(1 / (m + 1))
    assert interleaved["pipeline_bubble"] == pytest.approx(1 / (2 * m + 1))
    assert interleaved["layout"]["schedule"] == "Interleaved1F1B"
    assert interleaved["step_time_s"] < one_f_one_b["step_time_s"]
    zbv = _step(capsys, *pipe, "--schedule", "zbvzerobubble", "--stages-per-rank", "2")
    assert zbv["pipeline_bubble"] == pytest.approx(1 / (3 * 2 * m + 1))  # forward = input pass = weight pass
    assert "'Zero' is not built; use one of GPipe" in _refused(capsys, "--pp", "2", "--schedule", "Zero")
    assert "give --pp 2 or more" in _refused(capsys, "--schedule", "GPipe")
    assert "needs stages_per_rank of 2" in _refused(capsys, "--pp", "2", "--schedule", "Interleaved1F1B")


def test_the_schedule_is_honoured_where_the_config_sets_the_pipeline(capsys, tmp_path):
    """A config's ``pipeline_parallel_size`` is a pipeline as ``--pp`` is: its ``pipeline.schedule`` sets the
    bubble, and ``--schedule`` (refused before unless ``--pp`` was given) overrides it."""
    path = tmp_path / "ds.json"
    pipe = ("--world", "4", "--stage", "1", "--global-batch", "16", "--config", str(path))
    m = 16 // (2 * 2)
    path.write_text(json.dumps({"pipeline_parallel_size": 2, "pipeline": {"schedule": "Interleaved1F1B",
                                                                          "stages_per_rank": 2}}))  # fmt: skip
    from_config = _step(capsys, *pipe)
    assert from_config["layout"]["schedule"] == "Interleaved1F1B"
    assert from_config["pipeline_bubble"] == pytest.approx(1 / (2 * m + 1))
    path.write_text(json.dumps({"pipeline_parallel_size": 2}))
    flagged = _step(capsys, *pipe, "--schedule", "interleaved1f1b", "--stages-per-rank", "2")
    assert flagged["layout"]["schedule"] == "Interleaved1F1B" and flagged["layout"]["pp"] == 2
    assert flagged["pipeline_bubble"] == pytest.approx(1 / (2 * m + 1))


def test_global_batch_sets_the_accumulation_and_refuses_a_batch_it_cannot_make_up(capsys):
    """``--global-batch``: micro-batch x accumulation x dp equals it; a batch no accumulation makes up is refused
    with its numbers."""
    one = _step(capsys, "--global-batch", "16")
    assert one["layout"]["micro_batches"] == 16 // (2 * 2)
    assert "global batch 6 is not a multiple of micro-batch 2 x data-parallel size 4 = 8" in _refused(
        capsys, "--micro-batch", "2", "--global-batch", "6"
    )


@pytest.mark.soak  # 72 layouts, 9-42 s on the shared 2-core machine
def test_the_budget_search_tries_micro_batches_and_checkpointing_within_the_global_batch(capsys):
    """A ``--budget`` search with a cluster tries micro-batch sizes and every checkpointing choice, and every layout
    it lists makes up ``--global-batch``, fastest first."""
    code, out, _ = _cli(capsys, "--budget", "1GiB", "--gpu", "H200", "--gpus-per-node", "2", "--global-batch", "8",
                        "--no-offload", "--jobs", "1", "--json")  # fmt: skip
    fits = json.loads(out)
    assert code == 0 and fits
    for e in fits:
        lay = e["layout"]
        assert lay["micro_batch"] * lay["micro_batches"] * lay["world"] // (lay["tp"] * lay["sp"]) == 8
    assert {e["layout"]["micro_batch"] for e in fits} == {1, 2, 4}
    assert {str(e["layout"]["checkpointing"]) for e in fits} == {"False", "selective", "True"}
    speeds = [e["tokens_per_s_per_gpu"] for e in fits]
    assert speeds == sorted(speeds, reverse=True)


def test_offloads_copies_hide_behind_backward_and_the_host_step():
    """[Note: overlapped offload]: the fp32 gradients' copy down hides behind the last backward, the fp32 masters'
    copy up behind the host step; only what each cannot cover is exposed (charged in series before)."""
    cluster = cluster_from_dict({"gpu": "H200", "gpus_per_node": 1, "host_gb_s": 10, "pcie_gb_s": 20})
    n = 10**9
    down = up = n * 4 / 20e9  # 0.2 s each way
    host = n * 34 / 10e9  # 3.4 s: covers the copy up
    work = MicroBatchWork()
    work.ops[Op("memory", 0, 10**11, True)] += 1  # a backward of 10**11 bytes
    backward = op_time(Op("memory", 0, 10**11, True), cluster, "bf16")
    assert 0 < backward < down  # the case the test is built for: the copy down sticks out of backward
    inputs = _inputs(world=1, dp=1, micro_batches=1, stepped_elements=n, offload_optimizer="cpu")
    parts = step_time(work, ZeroTraffic({}, {}, {}), inputs, cluster).parts
    assert parts["optimizer step"] == pytest.approx(host)
    assert parts["offload copies"] == pytest.approx(down - backward)
    assert up < host


@pytest.mark.soak  # fake runs of a 1.3B-parameter GPT: minutes on the shared 2-core machine
def test_the_h200_validation_runs_are_predicted_within_15_percent_from_the_shipped_profile():
    """docs/benchmarks-gpu.md's measured H200 steps (the 1.3B GPT, world 1: plain and stages 0-3, and optimizer
    offload with overlapped copies), predicted from the shipped H200 profile (``bench/bench_planner_time.py
    --h200``), each within 15%."""
    import importlib.util
    import re
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("bench_planner_time", root / "bench" / "bench_planner_time.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    doc = (root / "docs" / "benchmarks-gpu.md").read_text()
    assert re.search(r"\| 4 \(overlapped copies\) \| stage2:offload \| 772 \|", doc)  # the figure the bench copies
    table = bench.h200_check()
    ratios = {cells[0]: float(cells[3]) for cells in (line.strip("| ").split(" | ") for line in table.splitlines()[2:])}
    assert len(ratios) == 5
    assert all(0.85 <= r <= 1.15 for r in ratios.values()), ratios


def test_arithmetic_bound_operators_take_their_calibrated_time_per_element():
    """[Note: arithmetic-bound operators]: the fake run names a memory-bound operator (``gelu`` by its form) and
    counts its output's elements; an operator the profile lists takes ``max(bytes / bandwidth, elements x ns)``,
    one it does not list its bytes only; a GPU profile lists none."""
    x = torch.randn(8, 16)
    work = MicroBatchWork()
    with _WorkCounter(work):
        torch.nn.functional.gelu(x, approximate="tanh")
        torch.nn.functional.gelu(x)
        x + x
    named = {op.name: op for op in work.ops}
    assert set(named) == {"gelu:tanh", "gelu", "add"} and all(op.elements == 128 for op in work.ops)
    eff = Efficiencies(memory=1.0, elementwise_ns=(("gelu:tanh", 1e6),))  # 1 ms per element
    cpu = Cluster(builtin_cluster("H100-SXM", 1).gpu, 1, 1, eff)
    assert op_time(named["gelu:tanh"], cpu, "fp32") == pytest.approx(128 * 1e-3)
    bytes_only = named["gelu"].nbytes / (cpu.gpu.hbm_tb_s * 1e12)
    assert op_time(named["gelu"], cpu, "fp32") == pytest.approx(bytes_only)
    assert builtin_cluster("H100-SXM", 8).efficiencies.elementwise_ns == ()


def test_the_optimizer_step_charges_its_host_loop_per_tensor_stepped():
    """[Note: the optimizer's host loop]: the step is its bytes plus ``optimizer_us_per_tensor`` per tensor this rank
    steps: every parameter at stage 0, each fragment of its shard at stages 1-3 (at world 2 the buckets' fragments:
    a parameter cut by the shard boundary counts on both ranks)."""
    profile = {"gpu": "cpu", "gpus_per_node": 2, "fp32_tflops": 1.0, "hbm_tb_s": 1.0, "intra_node_gb_s": 1.0}
    cluster = cluster_from_dict({**profile, "optimizer_us_per_tensor": 1000.0})  # 1 ms a tensor
    without = cluster_from_dict(profile)
    tensors = len(list(tiny_gpt().parameters()))
    kw = dict(micro_batch=MICRO, seq_len=SEQ, device_type="cpu")
    for stage, world in ((0, 1), (2, 2)):
        with_loop = estimate_memory(tiny_gpt, world_size=world, stage=stage, cluster=cluster, **kw).time
        bytes_only = estimate_memory(tiny_gpt, world_size=world, stage=stage, cluster=without, **kw).time
        assert with_loop is not None and bytes_only is not None
        loop = with_loop.parts["optimizer step"] - bytes_only.parts["optimizer step"]
        if stage == 0:
            assert loop == pytest.approx(tensors * 1e-3)
        else:  # each rank steps a fragment of most parameters: more than half of them, at most all and one cut
            assert tensors / 2 * 1e-3 < loop <= (tensors + 1) * 1e-3


def test_the_last_buckets_reduction_and_the_first_gather_after_the_step_are_exposed():
    """[Note: what overlaps]: the boundary's last bucket is reduced after backward's last gradient and the next
    forward first reads the last bucket's after-step gather: neither hides, even at overlap 1; a model in one bucket
    hides none of its reduction, one in two equal buckets half of it."""
    eff = Efficiencies(memory=1.0, link=1.0, latency_us=0.0, overlap=1.0)
    cluster = Cluster(builtin_cluster("H100-SXM", 2).gpu, 2, 1, eff)
    work = MicroBatchWork()
    work.ops[Op("memory", 0, 10**13, True)] += 1  # a backward far longer than the reductions
    work.ops[Op("memory", 0, 10**13, False)] += 1
    s = 10**11
    full = collective_time("all_reduce", s, 2, 2, cluster)

    def exposed(traffic: ZeroTraffic, stage: int) -> float:
        inputs = _inputs(world=2, dp=2, micro_batches=1, stage=stage)
        return step_time(work, traffic, inputs, cluster).parts["zero collectives (exposed)"]

    one_bucket = ZeroTraffic({}, {"all_reduce": s}, {}, last_reduce=s // 2, group=2)
    assert exposed(one_bucket, 0) == pytest.approx(full)
    assert exposed(replace(one_bucket, last_reduce=s // 4), 0) == pytest.approx(full / 2)
    gather = collective_time("all_gather", s, 2, 2, cluster)
    one_bucket = ZeroTraffic({}, {}, {"all_gather": s}, first_after_gather=s, group=2)
    assert exposed(one_bucket, 1) == pytest.approx(gather)
    assert exposed(replace(one_bucket, first_after_gather=s // 4), 1) == pytest.approx(gather / 4)


def test_each_collective_pays_its_latencies_and_the_sharded_step_adds_the_norms_all_reduce():
    """[Note: the alpha-beta model]: ZeRO's collectives are one per bucket and one per unit gathered, each paying its
    ring steps' latencies; stages 1-3 add the squared norm's all-reduce. With no bytes to move, the exposed time is
    latencies only: stage 2 over 3 buckets at world 2 pays 3 reduce-scatters, 3 gathers and the norm's 2 steps."""
    eff = Efficiencies(latency_us=1000.0, overlap=0.0)
    cluster = Cluster(builtin_cluster("H100-SXM", 2).gpu, 2, 1, eff)
    calls = {"per_micro_batch": {"reduce_scatter": 3}, "after_step": {"all_gather": 3}}
    traffic = ZeroTraffic({"reduce_scatter": 1}, {}, {"all_gather": 1}, group=2, calls=calls)
    inputs = _inputs(world=2, dp=2, micro_batches=1, stage=2)
    exposed = step_time(MicroBatchWork(), traffic, inputs, cluster).parts["zero collectives (exposed)"]
    assert exposed == pytest.approx((3 + 3 + 2) * 1e-3, rel=1e-3)
    kw = dict(world_size=2, micro_batch=MICRO, seq_len=SEQ, device_type="cpu")
    config = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 2000}, "train_micro_batch_size_per_gpu": MICRO}
    est = estimate_memory(tiny_gpt, config, cluster=cluster, **kw)
    assert est.time is not None
    traffic_calls = est.time.parts["zero collectives (exposed)"]
    assert traffic_calls > (2 * LAYERS + 2) * 1e-3  # every unit's gathers and every bucket's reduce-scatter


def test_calibrate_times_kernels_over_operands_larger_than_the_caches():
    """[Note: cold operands]: a calibrated kernel turns through operand sets adding up to ``COLD_BYTES``; the
    elementwise cases are the operators the timing model looks up."""
    from shardtrain.estimate import calibrate

    sets = []
    turn = calibrate._rotating(lambda: sets.append(torch.empty(2**20, dtype=torch.uint8)) or sets[-1], 2**20)
    seen = {id(turn()) for _ in range(3 * len(sets))}
    assert len(seen) == len(sets) == calibrate.COLD_BYTES // 2**20
    assert tuple(calibrate._elementwise_cases()) == calibrate.ELEMENTWISE_OPERATORS


def test_a_multi_rank_steps_compute_is_stretched_by_the_calibrated_sync_skew():
    """[Note: ranks that meet]: with ``sync_skew`` 0.5, a world-2 step's forward, backward and optimizer step take
    1.5x what they take at world 1 on the same profile; a GPU profile has no skew, and a negative one is refused."""
    cluster = Cluster(builtin_cluster("H100-SXM", 2).gpu, 2, 1, Efficiencies(sync_skew=0.5, memory=1.0))
    work = MicroBatchWork()
    work.ops[Op("memory", 0, 10**12, False)] += 1
    work.ops[Op("memory", 0, 2 * 10**12, True)] += 1

    def parts(world: int) -> dict[str, float]:
        inputs = _inputs(world=world, dp=world, micro_batches=1, stepped_elements=10**9)
        return step_time(work, ZeroTraffic({}, {}, {}), inputs, cluster).parts

    one, two = parts(1), parts(2)
    for part in ("forward", "backward", "optimizer step"):
        assert two[part] == pytest.approx(1.5 * one[part]) and one[part] > 0
    assert builtin_cluster("H100-SXM", 8).efficiencies.sync_skew == 0.0
    with pytest.raises(ConfigError, match="sync_skew"):
        cluster_from_dict({"gpu": "H200", "gpus_per_node": 8, "sync_skew": -0.1})
