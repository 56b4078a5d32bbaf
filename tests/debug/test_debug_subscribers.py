"""SubscriberManager and Subscriber: callbacks, names, steps, replacement values, nested outputs, hooks."""

from __future__ import annotations

import json

import pytest
import torch

from shardtrain.debug import StatisticsSubscriber, Subscriber, SubscriberManager, inspect_activation
from shardtrain.tree import iter_tensors, map_tensors

from helpers.debug_models import FakeModelOutput, Net, Pair, Point, Wrapper


class Recorder(Subscriber):
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def pre_forward(self, step, name, module, args, kwargs):
        self.events.append(("pre", step, name))

    def post_forward(self, step, name, module, outputs):
        self.events.append(("post", step, name))

    def output_grad(self, step, name, path, grad):
        self.events.append(("grad", step, name))

    def inspect(self, step, name, tensor):
        self.events.append(("inspect", step, name))

    def post_root_forward(self, step, name, module, outputs):
        self.events.append(("root", step, name))


def _train(model, steps, batch=3, width=4):
    torch.manual_seed(5)
    for _ in range(steps):
        model(torch.randn(batch, width)).backward()


def _hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _records(run_dir, step, rank=0):
    path = run_dir / f"rank_{rank}" / f"step_{step:06d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_callbacks_names_order_and_steps():
    model, rec = Net(), Recorder()
    SubscriberManager().subscribe(model, rec)
    _train(model, 2)
    forward0 = [e for e in rec.events if e[1] == 0 and e[0] in ("pre", "post", "inspect", "root")]
    assert forward0 == [
        ("pre", 0, ""),
        ("pre", 0, "blocks.0"),
        ("pre", 0, "blocks.0.fc1"),
        ("post", 0, "blocks.0.fc1"),
        ("pre", 0, "blocks.0.act"),
        ("post", 0, "blocks.0.act"),
        ("post", 0, "blocks.0"),
        ("pre", 0, "blocks.1"),
        ("pre", 0, "blocks.1.fc1"),
        ("post", 0, "blocks.1.fc1"),
        ("pre", 0, "blocks.1.act"),
        ("post", 0, "blocks.1.act"),
        ("post", 0, "blocks.1"),
        ("inspect", 0, "net.hidden"),
        ("pre", 0, "head"),
        ("post", 0, "head"),
        ("post", 0, ""),
        ("root", 0, ""),
    ]
    # backward of step 0 (reverse order of outputs) happens before the forward of step 1, with step 0
    grads0 = [e[2] for e in rec.events if e[0] == "grad" and e[1] == 0]
    assert grads0[:3] == ["", "head", "net.hidden"] and grads0[-1] == "blocks.0.fc1"
    assert rec.events.index(("pre", 1, "")) > max(i for i, e in enumerate(rec.events) if e[0] == "grad" and e[1] == 0)
    assert {e[1] for e in rec.events} == {0, 1}


def test_resubscribe_does_not_stack_and_unsubscribe_removes_everything():
    model = Net()
    manager = SubscriberManager()
    manager.subscribe(model, Recorder())
    rec = Recorder()
    manager.subscribe(model, [rec])  # replaces the first subscription
    _train(model, 1)
    posts = [e[2] for e in rec.events if e[0] == "post"]
    assert len(posts) == len(set(posts)) == 8  # every called module once: no stacked hooks
    assert _hook_count(model) == 3 + 2 * 8  # root: pre, post, cleanup; 8 submodules (ModuleList too): pre, post
    manager.unsubscribe(model)
    assert _hook_count(model) == 0 and not manager.is_subscribed(model)
    before = len(rec.events)
    _train(model, 1)
    assert len(rec.events) == before
    with pytest.raises(ValueError, match="not subscribed"):
        manager.unsubscribe(model)


def test_start_and_end_step_are_exact_and_hooks_leave_outside(tmp_path):
    model = Net()
    manager = SubscriberManager()
    stats = StatisticsSubscriber(tmp_path / "run", start_step=2, end_step=4)
    manager.subscribe(model, stats)
    counts = []
    for _ in range(6):
        _train(model, 1)
        counts.append(_hook_count(model))
    manager.unsubscribe(model)
    files = sorted(p.name for p in (tmp_path / "run" / "rank_0").iterdir())
    assert files == ["step_000002.jsonl", "step_000003.jsonl"]
    for step in (2, 3):
        dirs = [r["dir"] for r in _records(tmp_path / "run", step)]
        assert dirs.count("forward") == 9 and dirs.count("backward") == 9  # 8 called modules + 1 inspected
        assert dirs.index("backward") == 9  # all forward records first, in execution order
    # outside the window only the 3 root hooks stay; inside, every module is hooked
    assert counts == [3, 3, 19, 19, 3, 3]


def test_replacement_values():
    class Edit(Subscriber):
        def pre_forward(self, step, name, module, args, kwargs):
            return ((args[0] * 0,), kwargs) if name == "blocks.0.fc1" else None

        def post_forward(self, step, name, module, outputs):
            return outputs + 1 if name == "blocks.1.act" else None

        def output_grad(self, step, name, path, grad):
            return torch.zeros_like(grad) if name == "head" else None

        def post_root_forward(self, step, name, module, outputs):
            return outputs * 10

    model = Net()
    x = torch.randn(2, 4)
    with torch.no_grad():
        b0 = model.blocks[0].act(model.blocks[0].fc1.bias.expand(2, 4))  # input zeroed: only the bias
        b1 = model.blocks[1].act(model.blocks[1].fc1(b0)) + 1
        want = model.head(b1 * 2).sum() * 10
    SubscriberManager().subscribe(model, Edit())
    out = model(x)
    assert torch.allclose(out, want)
    out.backward()
    assert all(p.grad is None or not p.grad.any() for p in model.blocks.parameters())  # head's grad was zeroed


def test_nested_outputs_are_walked_and_rebuilt(tmp_path):
    out = Wrapper()(torch.ones(2, 3))
    paths = [p for p, _ in iter_tensors(out)]
    assert paths == [
        "[0]",
        "[1]['a']",
        "[1]['b'][0]",
        "[2].first",
        "[2].second",
        "[3]['loss']",
        "[3]['logits']",
        "[4].x",
    ]
    doubled = map_tensors(out, lambda path, t: t * 2)
    assert type(doubled[2]) is Pair and type(doubled[3]) is FakeModelOutput and type(doubled[4]) is Point
    assert torch.equal(doubled[3].logits, out[3].logits * 2) and torch.equal(doubled[3]["logits"], out[3]["logits"] * 2)
    assert doubled[1]["b"][1:] == ["text", None] and doubled[4].y == 7
    assert map_tensors(out, lambda path, t: t) is out  # nothing replaced: the very same objects

    model = Wrapper()
    manager = SubscriberManager()
    manager.subscribe(model, StatisticsSubscriber(tmp_path / "run"))
    result = model(torch.ones(2, 3, requires_grad=True))
    result[3].loss.backward()
    manager.unsubscribe(model)
    records = _records(tmp_path / "run", 0)
    forward = [(r["name"], r["output"]) for r in records if r["dir"] == "forward"]
    assert forward[0] == ("inner.lin", "")
    assert [o for n, o in forward if n == "inner"] == paths and [o for n, o in forward if n == ""] == paths
    loss_grads = [r for r in records if r["dir"] == "backward" and r["output"] == "[3]['loss']"]
    # one tensor, output of both modules: its hooks fire in registration order (inner first)
    assert [r["name"] for r in loss_grads] == ["inner", ""] and loss_grads[0]["mean"] == 1.0


class Probe(torch.nn.Module):
    """Notes whether inspect_activation handed back the very tensor it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.same: list[bool] = []

    def forward(self, x):
        y = self.lin(x) * 2
        out = inspect_activation("probe", y)
        self.same.append(out is y)
        return out.sum()


def test_inspect_activation_is_transparent_without_active_statistics(tmp_path):
    t = torch.randn(3)
    assert inspect_activation("x", t) is t  # no manager at all

    class Inactive(Subscriber):
        def is_active(self, step):
            return False

        def inspect(self, step, name, tensor):
            raise AssertionError("an inactive subscriber must not be called")

    model = Probe()
    manager = SubscriberManager()
    manager.subscribe(model, [Inactive(), StatisticsSubscriber(tmp_path / "run", start_step=1, end_step=2)])
    for _ in range(3):
        model(torch.randn(2, 4)).backward()
    manager.unsubscribe(model)
    assert model.same == [True, True, True]  # outside the window and while recording: the tensor itself
    assert sorted(p.name for p in (tmp_path / "run" / "rank_0").iterdir()) == ["step_000001.jsonl"]
    records = _records(tmp_path / "run", 1)
    probe = [r for r in records if r["name"] == "probe"]
    assert [r["dir"] for r in probe] == ["forward", "backward"]
    assert probe[1]["min"] == probe[1]["max"] == 1.0  # d(sum)/d(probe) is all ones


def test_inspect_activation_rejects_bad_names_inside_a_forward():
    class Bad(torch.nn.Module):
        def forward(self, x):
            return inspect_activation("", x)

    model = Bad()
    SubscriberManager().subscribe(model, Recorder())
    with pytest.raises(ValueError, match="non-empty string"):
        model(torch.ones(1))
    assert inspect_activation("", torch.ones(1)) is not None  # the raised forward left nothing behind


def test_engine_like_steps_follow_global_step_with_accumulation(tmp_path):
    class FakeEngine:  # duck-typed: .module and .global_step
        def __init__(self, module):
            self.module, self.global_step = module, 0

    engine = FakeEngine(Net())
    manager = SubscriberManager()
    manager.subscribe(engine, StatisticsSubscriber(tmp_path / "run", end_step=2))
    torch.manual_seed(0)
    for _ in range(3):
        for _micro in range(2):
            engine.module(torch.randn(2, 4)).backward()
        engine.global_step += 1
    manager.unsubscribe(engine)
    assert sorted(p.name for p in (tmp_path / "run" / "rank_0").iterdir()) == [
        "step_000000.jsonl",
        "step_000001.jsonl",
    ]
    records = _records(tmp_path / "run", 1)
    head = [(r["dir"], r["call"]) for r in records if r["name"] == "head"]
    assert head == [("forward", 0), ("backward", 0), ("forward", 1), ("backward", 1)]  # micro-steps in order
    assert [r["seq"] for r in records] == list(range(len(records)))


def test_parameters_and_gradients_untouched(tmp_path):
    torch.manual_seed(0)
    plain, watched = Net(), Net()
    watched.load_state_dict(plain.state_dict())
    manager = SubscriberManager()
    manager.subscribe(watched, [StatisticsSubscriber(tmp_path / "run"), Recorder()])
    x = torch.randn(5, 4)
    plain(x).backward()
    watched(x).backward()
    for (name, p), q in zip(plain.named_parameters(), watched.parameters()):
        assert torch.equal(p.grad, q.grad), name
        assert not q._backward_hooks and not getattr(q, "_post_accumulate_grad_hooks", None), name


def test_bad_arguments(tmp_path):
    manager = SubscriberManager()
    with pytest.raises(TypeError, match="Subscriber instances"):
        manager.subscribe(Net(), [object()])
    with pytest.raises(TypeError, match=r"nn\.Module or an engine"):
        manager.subscribe(object(), Recorder())
    for kwargs in ({"start_step": -1}, {"end_step": 1.5}, {"start_step": 3, "end_step": 3}):
        with pytest.raises(ValueError):
            StatisticsSubscriber(tmp_path / "never", **kwargs)
    assert not (tmp_path / "never").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        StatisticsSubscriber(tmp_path / "file")


def test_existing_output_dir_is_an_error_unless_overridden(tmp_path):
    run = tmp_path / "run"
    model = Net()
    manager = SubscriberManager()
    manager.subscribe(model, StatisticsSubscriber(run))
    _train(model, 3)
    manager.unsubscribe(model)
    with pytest.raises(FileExistsError, match="override_output_dir=True"):
        StatisticsSubscriber(run)
    manager.subscribe(model, StatisticsSubscriber(run, override_output_dir=True))
    _train(model, 1)
    manager.unsubscribe(model)
    assert sorted(p.name for p in (run / "rank_0").iterdir()) == ["step_000000.jsonl"]  # old steps are gone
    # override removes rank_<r> directories only, never other content of the directory
    (run / "notes.txt").write_text("keep me")
    (run / "rank_7").mkdir()
    StatisticsSubscriber(run, override_output_dir=True).close()
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt", "rank_0"]
    assert not any((run / "rank_0").iterdir())
