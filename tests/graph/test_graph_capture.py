"""Graph mode on a plain module: one capture per input schema, every re-capture with its stated reason and the eager
output, sizes reused, nested inputs and outputs, the fallback and strict mode, the cache limit."""

from __future__ import annotations

import dataclasses
import logging
from collections import namedtuple

import pytest
import torch
from torch import nn

import shardtrain.graph as graph
from shardtrain.errors import GraphCaptureError
from shardtrain.graph import captured as captured_module


class Toy(nn.Module):
    """Every argument changes what the traced graph computes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, 3)

    def forward(self, x, mask=None, flag=True, scale=1.0, *, extra=None, **options):
        h = self.drop(torch.relu(self.proj(x))) + options.get("bias", 0.0)
        if mask is not None:
            h = h * mask.to(h.dtype).unsqueeze(-1)
        if flag:
            h = -h
        if extra is not None:
            h = h + extra
        return self.head(h) * scale


def _x(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, 8, generator=torch.Generator().manual_seed(sum(shape)))


def _same(a, b) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.fixture
def reasons(caplog):
    caplog.set_level(logging.INFO, logger="shardtrain.graph")

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "shardtrain.graph"]

    return lines


def test_each_schema_change_recaptures_with_its_reason_and_gives_the_eager_output(reasons):
    model = Toy().eval()  # dropout off, so eager and graph outputs are comparable
    run = graph.capture(model)
    x, mask = _x(2, 5), torch.ones(2, 5, dtype=torch.int64)
    _same(run(x, mask), model(x, mask))
    assert reasons() == ["capturing Toy (graph 1): first call"]
    e = _x(2, 5)
    cases = [  # (call, the reason logged), each against the call before it
        (lambda: ((x, mask.bool()), {}), "input 'mask': dtype int64 -> bool"),
        (lambda: ((x, mask.bool()), {"flag": False}), "input 'flag': value True -> False"),
        (lambda: ((x, None), {"flag": False}), "input 'mask': tensor bool, rank 2, cpu -> None"),
        (lambda: ((x, None), {"flag": False, "extra": e}), "input 'extra': None -> tensor float32, rank 3, cpu"),
        (lambda: ((x, None), {"flag": False, "extra": e, "bias": 0.5}), "input 'bias' added (float 0.5)"),
        (lambda: ((_x(2, 3, 5), None), {"flag": False, "extra": _x(3, 5), "bias": 0.5}), "input 'x': rank 3 -> 4"),
        (
            lambda: ((x.clone().requires_grad_(), None), {"flag": False, "extra": e, "bias": 0.5}),
            "input 'x': rank 4 -> 3, requires_grad False -> True",
        ),
        (lambda: ((x, None), {"flag": False, "extra": e, "scale": 2.0}), "input 'bias' removed (was float 0.5)"),
    ]
    for n, (call, reason) in enumerate(cases, start=2):
        args, kwargs = call()
        _same(run(*args, **kwargs), model(*args, **kwargs))
        assert reasons()[-1].startswith(f"capturing Toy (graph {n}): ") and reason in reasons()[-1], reasons()[-1]
    assert run(x, mask.bool()) is not None and run.graph_stats()["reuses"] == 1  # back to graph 2's schema
    model.train()
    torch.manual_seed(3)
    out = run(x.detach(), None)
    torch.manual_seed(3)
    _same(out, model(x.detach(), None))  # dropout on: the same random mask as eager
    assert reasons()[-1].endswith("module.eval() -> train()")
    model.proj.weight.requires_grad_(False)
    run(x.detach(), None)
    assert reasons()[-1].endswith("parameter 'proj.weight' requires_grad True -> False")
    stats = run.graph_stats()
    assert stats["captures"] == len(reasons()) == 11
    assert stats["reasons"]["first call"] == 1 and stats["reasons"]["module.eval() -> train()"] == 1


def test_new_batch_and_sequence_sizes_reuse_the_graph():
    model = Toy().eval()
    run = graph.capture(model)
    for batch, seq in [(2, 5), (3, 7), (4, 2), (6, 11), (2, 5)]:
        x = _x(batch, seq)
        _same(run(x), model(x))
    assert run.graph_stats()["captures"] == 1
    assert run.graph_stats()["reuses"] == 4
    assert run.graph_stats()["guard_recaptures"] == 0


def test_a_wrong_reuse_would_return_the_old_graphs_output():
    """The schema is what stops a wrong reuse: with TorchDynamo's own guards skipped (its unsafe stance, the
    equivalent of ORTModule skipping its re-export checks), a flipped bool still gets a new graph and the eager
    answer; without the schema check too, the old graph's answer comes back."""
    model = Toy().eval()
    x = _x(2, 5)
    run = graph.capture(model)
    run(x, flag=True)
    run(x, flag=False)
    blind = graph.capture(model)
    keep = captured_module.schema_of
    try:  # the mutation: a schema that ignores non-tensor inputs
        captured_module.schema_of = lambda m, a, k: keep(m, a, {})
        blind(x, flag=True)
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):  # (capturing is refused under this stance)
            wrong = blind(x, flag=False)
    finally:
        captured_module.schema_of = keep
    with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
        _same(run(x, flag=False), model(x, flag=False))
        _same(run(x, flag=True), model(x, flag=True))
    assert torch.equal(wrong, model(x, flag=True))  # the old graph's output
    assert not torch.equal(wrong, model(x, flag=False))


@dataclasses.dataclass
class Batch:
    tokens: torch.Tensor
    weights: torch.Tensor | None
    note: str


Pair = namedtuple("Pair", ["left", "right"])


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    pair: Pair
    aux: dict
    label: str
    nothing: None = None


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 4)

    def forward(self, batch: Batch, extras: dict, pairs: list):
        h = self.lin(batch.tokens)
        if batch.weights is not None:
            h = h * batch.weights
        return Out(
            logits=h,
            pair=Pair(h.sum(-1), pairs[0] * 2),
            aux={"mean": h.mean(), "count": extras["count"], "tag": batch.note},
            label=batch.note.upper(),
        )


def test_nested_inputs_and_outputs_keep_their_structure():
    model = Nested()
    run = graph.capture(model)
    batch = Batch(_x(3), torch.rand(3, 4), "a")
    extras, pairs = {"count": 7}, [torch.ones(2)]
    out, want = run(batch, extras, pairs), model(batch, extras, pairs)
    assert type(out) is Out and type(out.pair) is Pair and out.nothing is None
    assert out.label == "A" and out.aux["count"] == 7 and out.aux["tag"] == "a"
    for a, b in zip(
        torch.utils._pytree.tree_leaves((out.logits, out.pair, out.aux["mean"])),
        [want.logits, *want.pair, want.aux["mean"]],
    ):
        _same(a, b)
    out.logits.sum().backward()  # gradients flow through the captured backward
    assert model.lin.weight.grad is not None
    run(Batch(_x(5), None, "a"), extras, pairs)  # a nested leaf None -> tensor is a schema change, named by its path
    assert run.graph_stats()["reasons"] == {
        "first call": 1,
        "input 'batch.weights': tensor float32, rank 2, cpu -> None": 1,
    }
    run(Batch(_x(5), None, "b"), extras, pairs)
    assert "input 'batch.note': value 'a' -> 'b'" in run.graph_stats()["reasons"]


def test_hugging_face_model_output():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_outputs import CausalLMOutput

    class HFStyle(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, input_embeds, labels=None, return_dict=True):
            logits = self.lin(input_embeds)
            loss = None if labels is None else nn.functional.mse_loss(logits, labels)
            return CausalLMOutput(loss=loss, logits=logits) if return_dict else (loss, logits)

    assert transformers
    model = HFStyle()
    run = graph.capture(model)
    x = _x(2, 3)
    out = run(x, labels=x)
    assert isinstance(out, CausalLMOutput) and set(out.keys()) == {"loss", "logits"}
    _same(out.loss, model(x, labels=x).loss)
    out = run(x)
    assert isinstance(out, CausalLMOutput) and out.loss is None and list(out.keys()) == ["logits"]
    _, logits = run(x, labels=x, return_dict=False)
    _same(logits, model(x).logits)


class Breaks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        if h.sum().item() > 0:  # data-dependent control flow: cannot be traced into one graph
            h = h * 2
        return h


def test_what_cannot_be_captured_runs_eagerly_with_one_warning():
    model = Breaks()
    run = graph.capture(model)
    x = _x(2)
    with pytest.warns(UserWarning, match=r"graph mode: part of Breaks's forward runs eagerly: .*item"):
        _same(run(x), model(x))
    assert run.graph_stats()["fallbacks"]


def test_strict_mode_makes_it_an_error():
    run = graph.capture(Breaks(), strict=True)
    with pytest.raises(GraphCaptureError, match=r"cannot capture Breaks as one graph \(graph.strict is on\)"):
        run(_x(2))


def test_the_cache_evicts_the_least_recently_used_graph(reasons):
    model = Toy().eval()
    run = graph.capture(model, cache_size=2)
    x = _x(2, 5)
    run(x, scale=1.0)
    run(x, scale=2.0)
    run(x, scale=1.0)  # reused: now the most recent
    run(x, scale=3.0)  # evicts scale=2.0
    run(x, scale=1.0)  # still cached
    run(x, scale=2.0)  # captured again
    stats = run.graph_stats()
    assert (stats["captures"], stats["reuses"], stats["evictions"]) == (4, 2, 2)
    assert reasons()[-1].endswith("input 'scale': value 1.0 -> 2.0")


def test_bad_arguments():
    with pytest.raises(ValueError, match="graph compiler must be one of aot_eager, inductor, got 'tvm'"):
        graph.capture(Toy(), compiler="tvm")
    with pytest.raises(ValueError, match="cache_size must be at least 1"):
        graph.capture(Toy(), cache_size=0)


def test_grad_mode_and_autocast_are_part_of_the_schema(reasons):
    model = Toy().eval()
    run = graph.capture(model)
    x = _x(2, 5)
    run(x).sum().backward()
    with torch.no_grad():
        out = run(x)
    assert not out.requires_grad
    _same(out, model(x).detach())
    assert reasons()[-1].endswith("grad mode True -> False")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, want = run(x), model(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-2)  # the same bf16 ops (rounding order may differ)
    assert reasons()[-1].endswith("autocast(cpu) off -> bfloat16")


def test_module_hooks_are_part_of_the_schema(reasons):
    """TorchDynamo traces the hooks present at capture and does not guard on them (``skip_nnmodule_hook_guards``):
    without the hooks in the schema, a hook added after the capture never runs and a removed one keeps running."""
    model = Toy().eval()
    run = graph.capture(model)
    x = _x(2, 5)
    _same(run(x), model(x))
    seen: list[int] = []
    handle = model.head.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
    _same(run(x), model(x))
    assert seen == [2, 2] and reasons()[-1].endswith("module 'head': forward pre-hooks 0 -> 1")
    doubled = model.proj.register_forward_hook(lambda m, args, out: out * 2)
    _same(run(x), model(x))
    assert reasons()[-1].endswith("module 'proj': forward hooks 0 -> 1")
    doubled.remove()
    handle.remove()
    seen.clear()
    _same(run(x), model(x))  # the first graph again, recaptured (the cache still holds it: reused)
    assert seen == []
    stats = run.graph_stats()
    assert stats["captures"] == 3 and stats["reuses"] == 1, stats


def test_the_fingerprint_ranks_compare_holds_no_local_device_index():
    """At ZeRO stage 3 the ranks compare their schemas' fingerprints before every forward (the desync check). Each
    rank of a node runs on its own ``cuda:<local rank>``: tensors and a ``torch.device`` argument on ``cuda:0`` and
    ``cuda:1`` must fingerprint alike, or two GPUs of one node would never start. Fake tensors say they are on CUDA
    without a GPU; another device type or dtype still differs, and the local schema (the cache key) keeps the index."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = Toy().eval()

    def schema(device: str, dtype: torch.dtype = torch.float32) -> graph.Schema:
        with FakeTensorMode(allow_non_fake_inputs=True):
            x = torch.empty(2, 8, device=device, dtype=dtype)
        return graph.schema_of(model, (x,), {"extra": None, "where": torch.device(device)})

    on0, on1 = schema("cuda:0"), schema("cuda:1")
    assert on0 != on1  # a local cache entry is for one device
    assert on0.portable() == on1.portable()
    assert graph.differences(on0.portable(), on1.portable()) == []
    assert on0.fingerprint() == on1.fingerprint()
    assert schema("cpu").fingerprint() != on0.fingerprint()
    assert schema("cuda:1", torch.bfloat16).fingerprint() != on0.fingerprint()
