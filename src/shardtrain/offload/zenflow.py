"""Stall-free optimizer offload (DeepSpeed's ZenFlow, ``zero_optimization.zenflow``): each step the most important
gradient columns update where the step runs, the rest accumulate and update on the host every ``update_interval``
steps, in a thread with ``overlap_step``. :class:`ZenFlowStep` takes the place of the offloaded optimizer's step
in :class:`~shardtrain.zero.optimizer.ShardedOptimizer` (stages 1-2, gradients in memory).

[Note: the ZenFlow rule]
Per rank, over the tensors the optimizer steps (``S``: what the model's parameters are refreshed from), with ``H``
host masters, ``A`` gradient accumulators and two twins of the user's Adam: the *host* one steps ``H``, the *device*
one steps the selected elements of ``S`` gathered into compact tensors. Step ``t`` (1-based), ``u = t - warm_up``:
1. ``t <= full_warm_up_rounds``: the host twin steps ``H`` with this step's gradients and ``S = H``.
2. A selection step (``u == 1``, then every ``select_interval`` steps, right after a host update): a host update
   in flight is finished and lands (4), ``H = S``, and each 2-D weight's columns are ranked by the sum over its rows
   of ``|gradient|`` (partial sums of each rank's fragment all-reduced in float64, so every layout picks the same
   columns); the top ``max(1, int(columns * topk_ratio))`` are selected. Parameters of fewer dimensions are selected
   whole (as DeepSpeed does). The device twin's element-wise state restarts at zero, its step count goes on
   (DeepSpeed's ``clear_selected_mv``).
3. Every step after warm-up the device twin steps the selected elements with this step's gradient, and every
   element's gradient is added to ``A``.
4. When ``u % update_interval == 0`` (``"auto"``: [Note: update_interval "auto"]) the host twin steps ``H`` with
   ``A`` divided by the steps summed in it, and ``A`` restarts, its bias correction that of step ``t`` (DeepSpeed
   hands its CPU Adam the step id, not a count of host updates). The result *lands*, ``S[unselected] =
   H[unselected]``, at once; with ``overlap_step`` the step runs in a thread and lands at the next host update (or
   selection step), one interval late: never later. The selected elements of ``H`` are the host's own (they never
   land) until the next selection copies ``S`` over them.
The gradients are those of the one step ([Note: the one step]): unscaled and clipped by the global norm.
"""

from __future__ import annotations

import collections
import copy
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from shardtrain.distributed.communicator import Communicator, Reduce
from shardtrain.errors import OptimizerError
from shardtrain.plan.policies import ZenFlowPolicy

STATE_PREFIX = "zenflow_"
"""Optimizer-state keys of this rule in checkpoints (``optim/<name>/zenflow_*``), beside the host twin's own."""


def _twin(optimizer: torch.optim.Optimizer, groups: list[list[torch.Tensor]]) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class and hyperparameters over other tensors (one list per param group),
    with a state of its own. A shallow copy keeps the class's own attributes; an LR scheduler's wrapper of
    ``step`` is the original's and stays there."""
    twin = copy.copy(optimizer)
    twin.__dict__.pop("step", None)
    twin.param_groups = [{**_hyper(g), "params": params} for g, params in zip(optimizer.param_groups, groups)]
    twin.state = collections.defaultdict(dict)
    return twin


def _hyper(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def check_zenflow_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """ZenFlow's two updates are Adam's (DeepSpeed's CPU Adam and its selective AdamW)."""
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and type(optimizer).__name__ != "DeepSpeedAdam":
        raise OptimizerError(
            f"zero_optimization.zenflow steps Adam or AdamW (its two updates are Adam's), got "
            f"{type(optimizer).__name__}; use Adam/AdamW or remove zenflow"
        )


class AutoInterval:
    """When the host update is due under ``update_interval: "auto"``.

    [Note: update_interval "auto"]
    DeepSpeed 0.19.8's adaptive interval (its default; threshold ``auto_ratio``). Per 2-D parameter, with
    ``r = topk_ratio``, ``k`` the steps summed in ``A`` this interval (this one included) and this step's gradient
    summed over the ranks: ``critic = sum |g[selected]|``, ``total = sum |g|``,
        avg_critic = (avg_critic * (k - 1) + critic) / k / (10 r)     (kept across intervals)
        non_critic += (total - critic) / (10 (1 - r))                 (restarts at 0 after each host update)
    The host update (rule 4) runs at this step when at least ``int(auto_ratio * n)`` of the ``n`` 2-D parameters
    have ``non_critic >= avg_critic``, and before every reselection. The formulas are DeepSpeed's
    (``_process_selected_fp32_groups_grad``) as written, the division by ``10 r`` inside the running mean
    included; its sums are bfloat16, ours float64. DeepSpeed carries the decision to the engine through a two-slot
    flag toggled at each backward; here it takes effect at the step it is reached. Deciding needs the sums on the
    host: with "auto" every step reads one all-reduced vector of two numbers per 2-D parameter (the one host wait
    per step this setting adds; DeepSpeed's comparison in Python reads them too).
    """

    def __init__(self, members: list[int], topk_ratio: float, auto_ratio: float) -> None:
        self.members, self.topk_ratio = members, topk_ratio
        self.needed = int(auto_ratio * len(members))
        self.avg_critic = [0.0] * len(members)
        self.non_critic = [0.0] * len(members)

    def due(self, sums: torch.Tensor, k: int) -> bool:
        """Take one step's sums (:meth:`ZenFlowStep._critic_sums`); whether the host update runs now."""
        values = sums.tolist()
        n, r = len(self.members), self.topk_ratio
        over = 0
        for j in range(n):
            total, critic = values[j], values[n + j]
            self.avg_critic[j] = (self.avg_critic[j] * (k - 1) + critic) / k / (r * 10)
            self.non_critic[j] += (total - critic) / ((1 - r) * 10)
            over += self.non_critic[j] >= self.avg_critic[j]
        due = over >= self.needed
        if due:
            self.non_critic = [0.0] * n
        return due


class ZenFlowStep:
    """The step of [Note: the ZenFlow rule] over ``stepped`` (flat fragments of parameters of ``shapes``, each
    starting at element ``starts[k]`` of its parameter flattened); ``comm``: the ranks a parameter's fragments are
    spread over (the column ranking's all-reduce)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        stepped: list[torch.Tensor],
        shapes: list[torch.Size],
        starts: list[int],
        policy: ZenFlowPolicy,
        comm: Communicator,
    ) -> None:
        check_zenflow_optimizer(optimizer)
        for shape in shapes:
            if len(shape) > 2:
                raise OptimizerError(
                    f"zero_optimization.zenflow ranks the columns of 2-D weights; a parameter of shape "
                    f"{tuple(shape)} has no columns it can rank (DeepSpeed's ZenFlow takes 1-D and 2-D ones only)"
                )
        self.policy, self.comm, self.optimizer = policy, comm, optimizer
        self.stepped, self.shapes, self.starts = stepped, shapes, starts
        self.flat = [s.view(-1) for s in stepped]
        group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.group_of = [group_of[id(s)] for s in stepped]
        self.masters = [s.detach().clone().view(-1) for s in stepped]  # H
        self.host = _twin(optimizer, self._by_group(self.masters))
        self.accum = [torch.zeros_like(f) for f in self.flat]  # A, filled by the main thread
        self.spare = [torch.zeros_like(f) for f in self.flat]  # the interval the host step reads
        self.touched = [False] * len(stepped)  # members with a gradient in this interval
        self.selected: list[torch.Tensor | None] = [None] * len(stepped)  # element indices in the fragment, sorted
        self.picked: list[torch.Tensor] = [torch.empty(0, dtype=f.dtype, device=f.device) for f in self.flat]
        self.device = _twin(optimizer, self._by_group(self.picked))
        self.steps = 0  # steps taken under this rule
        self.accumulated = 0  # steps summed in ``accum``
        self.landing = False  # a host update computed (or computing) that has not landed
        self._future: Future | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="zenflow-host") if policy.overlap_step else None
        two_d = [k for k, shape in enumerate(shapes) if len(shape) == 2]
        self._auto = AutoInterval(two_d, policy.topk_ratio, policy.auto_ratio) if not policy.update_interval else None

    def _by_group(self, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        groups: list[list[torch.Tensor]] = [[] for _ in self.optimizer.param_groups]
        for k, t in enumerate(tensors):
            groups[self.group_of[k]].append(t)
        return groups

    # -- the step --------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor | None]) -> None:
        """One step of the rule with these gradients (None: the member is frozen this step)."""
        grads = [None if g is None else g.view(-1) for g in grads]
        p = self.policy
        self.steps += 1
        u = self.steps - p.full_warm_up_rounds
        if u <= 0:
            self._sync_hyper(self.host)
            self._warm_up(grads)
            return
        if u == 1 or (p.select_interval and (u - 1) % p.select_interval == 0):
            self.settle(land=True)
            self._masters_from_stepped()
            self._select(grads)
        self._device_update(grads)
        self._accumulate(grads)
        self.accumulated += 1
        if self._update_due(u, grads):
            self.settle(land=True)
            self._sync_hyper(self.host)
            self.landing = True
            self._launch_host_update()

    # the parts of a step a device run does with copies (:mod:`shardtrain.offload.zenflow_device`)

    def _warm_up(self, grads: list[torch.Tensor | None]) -> None:
        """Rule (1): the host twin steps ``H`` with this step's gradients and ``S = H``."""
        self._host_update(grads, self.steps)
        for k, g in enumerate(grads):
            if g is not None:
                self.flat[k].copy_(self.masters[k])

    def _masters_from_stepped(self) -> None:
        """Rule (2): ``H = S``."""
        for k, f in enumerate(self.flat):
            self.masters[k].copy_(f)

    def _accumulate(self, grads: list[torch.Tensor | None]) -> None:
        """Rule (3): every element's gradient is added to ``A``."""
        for k, g in enumerate(grads):
            if g is not None:
                self.accum[k].add_(g)
                self.touched[k] = True

    def _close_interval(self) -> list[torch.Tensor | None]:
        """Rule (4)'s gradients: ``A / steps summed``; ``A`` restarts (into the other buffer)."""
        self.accum, self.spare = self.spare, self.accum
        interval = [s.div_(self.accumulated) if t else None for s, t in zip(self.spare, self.touched)]
        self.touched, self.accumulated = [False] * len(self.flat), 0
        for a in self.accum:
            a.zero_()
        return interval

    def _launch_host_update(self) -> None:
        """Rule (4): the host twin's step with the interval's gradients, in the thread with ``overlap_step``."""
        interval = self._close_interval()
        if self._pool is not None:
            self._future = self._pool.submit(self._host_update, interval, self.steps)
        else:
            self._host_update(interval, self.steps)
            self.settle(land=True)

    def _update_due(self, u: int, grads: list[torch.Tensor | None]) -> bool:
        """Whether rule (4) runs at this step: every ``update_interval`` steps, or ([Note: update_interval
        "auto"]) when the unselected columns' gradients outweigh the selected ones' (and always right before a
        reselection, so that no gradient waits in ``A`` for a column that changes side)."""
        p = self.policy
        if p.update_interval:
            return u % p.update_interval == 0
        due = self._auto.due(self._critic_sums(grads), self.accumulated)
        return due or bool(p.select_interval and u % p.select_interval == 0)

    def settle(self, land: bool) -> None:
        """Finish a host update in flight; with ``land``, its result lands on the unselected elements."""
        if self._future is not None:
            future, self._future = self._future, None
            future.result()
        if land and self.landing:
            for k, f in enumerate(self.flat):
                sel = self.selected[k]
                kept = f[sel].clone() if sel is not None else None
                f.copy_(self.masters[k])
                if sel is not None:
                    f[sel] = kept
            self.landing = False

    def _host_update(self, grads: list[torch.Tensor | None], step_id: int) -> None:
        """The host twin's step over the masters with ``grads``, as step ``step_id`` of Adam's bias correction."""
        stepped = [(k, m, g) for k, (m, g) in enumerate(zip(self.masters, grads)) if g is not None]
        for k, m, g in stepped:
            m.grad = g
            state = self.host.state[m]
            if not state:  # Adam's own initial state, made here so that its step count can be set
                state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(m), exp_avg_sq=torch.zeros_like(m))
                if self.host.param_groups[self.group_of[k]].get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(m)
            state["step"] = torch.tensor(float(step_id - 1))  # Adam adds one before it corrects
        try:
            self.host.step()
        finally:
            for _, m, _ in stepped:
                m.grad = None

    def _device_update(self, grads: list[torch.Tensor | None]) -> None:
        self._sync_hyper(self.device)
        live = []
        for k, g in enumerate(grads):
            sel = self.selected[k]
            if g is None or sel is None or not sel.numel():
                continue
            self.picked[k].copy_(self.flat[k][sel])
            self.picked[k].grad = g[sel]
            live.append(k)
        self.device.step()
        for k in live:
            self.flat[k][self.selected[k]] = self.picked[k]
            self.picked[k].grad = None

    def _sync_hyper(self, twin: torch.optim.Optimizer) -> None:
        """The twin takes the user's hyperparameters (an LR scheduler changes those of the user's optimizer)."""
        for mine, theirs in zip(twin.param_groups, self.optimizer.param_groups):
            mine.update(_hyper(theirs))

    # -- selection -------------------------------------------------------------------------------------------------

    def _column_sums(self, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Per 2-D member: the sum over all rows of |gradient| per column (float64, summed over the ranks)."""
        local = []
        for k, shape in enumerate(self.shapes):
            if len(shape) != 2:
                local.append(None)
                continue
            sums = torch.zeros(shape[1], dtype=torch.float64, device=self.flat[k].device)
            g = grads[k]
            if g is not None and g.numel():
                sums.index_add_(0, self._columns(k), g.abs().to(torch.float64))
            local.append(sums)
        present = [s for s in local if s is not None]
        if present:
            flat = torch.cat(present)
            self.comm.all_reduce(flat, Reduce.SUM, what="zenflow column importance")
            out, offset = [], 0
            for s in local:
                if s is None:
                    out.append(None)
                else:
                    out.append(flat[offset : offset + s.numel()])
                    offset += s.numel()
            return out
        return local

    def _critic_sums(self, grads: list[torch.Tensor | None]) -> torch.Tensor:
        """Per 2-D member (in order): the sum of |gradient| over the whole parameter, then over its selected
        columns; float64, summed over the ranks (every rank holds a member of each parameter, maybe empty)."""
        device = self.flat[0].device if self.flat else torch.device("cpu")
        members = self._auto.members
        sums = torch.zeros(2 * len(members), dtype=torch.float64, device=device)
        for j, k in enumerate(members):
            g, sel = grads[k], self.selected[k]
            if g is None or not g.numel():
                continue
            sums[j] = g.abs().to(torch.float64).sum()
            if sel is not None and sel.numel():
                sums[len(members) + j] = g[sel].abs().to(torch.float64).sum()
        if members:
            self.comm.all_reduce(sums, Reduce.SUM, what="zenflow update_interval auto")
        return sums

    def _columns(self, k: int) -> torch.Tensor:
        """The column of each element of member ``k``'s fragment (row-major)."""
        n = self.flat[k].numel()
        columns = torch.arange(self.starts[k], self.starts[k] + n, device=self.flat[k].device)
        return (columns % self.shapes[k][1]).long()

    def _select(self, grads: list[torch.Tensor | None]) -> None:
        sums = self._column_sums(grads)
        selected = []
        for k, shape in enumerate(self.shapes):
            if sums[k] is None:
                selected.append(torch.arange(self.flat[k].numel(), device=self.flat[k].device))
                continue
            count = max(1, int(shape[1] * self.policy.topk_ratio))
            chosen = torch.zeros(shape[1], dtype=torch.bool, device=self.flat[k].device)
            chosen[torch.topk(sums[k], count).indices] = True
            selected.append(torch.nonzero(chosen[self._columns(k)]).view(-1))
        self._take_selection(selected)

    def _take_selection(self, selected: list[torch.Tensor]) -> None:
        """New compact tensors for ``selected``; their device-twin state restarts at zero, the step count kept."""
        for k, sel in enumerate(selected):
            old = self.device.state.get(self.picked[k], {})
            zeros = torch.zeros(sel.numel(), dtype=self.flat[k].dtype, device=self.flat[k].device)
            fresh = {key: zeros.clone() if torch.is_tensor(v) and v.dim() else v for key, v in old.items()}
            self._set_member(k, sel, fresh)

    def _set_member(self, k: int, selected: torch.Tensor, state: dict) -> None:
        """Member ``k``'s selected elements and its device-twin state (``state``: compact, or empty)."""
        old = self.picked[k]
        self.device.state.pop(old, None)
        here = self.flat[k].device  # a checkpoint's tensors are read on the host
        selected = selected.to(here)
        state = {key: v.to(here) if torch.is_tensor(v) and v.dim() else v for key, v in state.items()}
        self.selected[k] = selected
        self.picked[k] = self.flat[k][selected].clone()
        params = self.device.param_groups[self.group_of[k]]["params"]
        params[next(i for i, p in enumerate(params) if p is old)] = self.picked[k]
        if state:
            self.device.state[self.picked[k]] = state

    # -- checkpoints -----------------------------------------------------------------------------------------------

    def state_of(self, stepped: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state of one stepped tensor, element-wise tensors shaped like it: the host twin's own, and the rule's
        (``zenflow_*``): host master, accumulator, selection mask, the device twin's state spread over the
        fragment, and the counters. A host update in flight is finished first and recorded as not landed."""
        self.settle(land=False)
        k = self._index(stepped)
        shape = stepped.shape
        out = {key: v for key, v in self.host.state.get(self.masters[k], {}).items()}
        out[STATE_PREFIX + "master"] = self.masters[k].view(shape)
        out[STATE_PREFIX + "accum"] = self.accum[k].view(shape)
        mask = torch.zeros_like(self.flat[k])
        sel = self.selected[k]
        if sel is not None:
            mask[sel] = 1.0
        out[STATE_PREFIX + "selected"] = mask.view(shape)
        for key, v in self.device.state.get(self.picked[k], {}).items():
            if torch.is_tensor(v) and v.dim():
                full = torch.zeros_like(self.flat[k])
                full[sel] = v
                out[STATE_PREFIX + "device_" + key] = full.view(shape)
            else:
                out[STATE_PREFIX + "device_" + key] = torch.as_tensor(v)
        out[STATE_PREFIX + "steps"] = torch.tensor(float(self.steps))
        out[STATE_PREFIX + "accumulated"] = torch.tensor(float(self.accumulated))
        out[STATE_PREFIX + "landing"] = torch.tensor(float(self.landing))
        out[STATE_PREFIX + "touched"] = torch.tensor(float(self.touched[k]))
        if self._auto is not None and k in self._auto.members:
            j = self._auto.members.index(k)
            out[STATE_PREFIX + "auto_avg_critic"] = torch.tensor(self._auto.avg_critic[j], dtype=torch.float64)
            out[STATE_PREFIX + "auto_non_critic"] = torch.tensor(self._auto.non_critic[j], dtype=torch.float64)
        return out

    def set_state(self, stepped: torch.Tensor, state: dict) -> None:
        """Replace the state of one stepped tensor with what :meth:`state_of` gave (a checkpoint's)."""
        self.settle(land=False)
        k = self._index(stepped)
        mine = {key.removeprefix(STATE_PREFIX): v for key, v in state.items() if key.startswith(STATE_PREFIX)}
        host = {key: v for key, v in state.items() if not key.startswith(STATE_PREFIX)}
        self.host.state.pop(self.masters[k], None)
        if host:
            self.host.state[self.masters[k]] = host
        if "master" in mine:
            self.masters[k].copy_(mine["master"].reshape(-1))
        if "accum" in mine:
            self.accum[k].copy_(mine["accum"].reshape(-1))
        self.steps = int(mine["steps"]) if "steps" in mine else 0
        self.accumulated = int(mine["accumulated"]) if "accumulated" in mine else 0
        self.landing = bool(mine["landing"]) if "landing" in mine else False
        self.touched[k] = bool(mine["touched"]) if "touched" in mine else False
        if self._auto is not None and k in self._auto.members:
            j = self._auto.members.index(k)
            self._auto.avg_critic[j] = float(mine["auto_avg_critic"]) if "auto_avg_critic" in mine else 0.0
            self._auto.non_critic[j] = float(mine["auto_non_critic"]) if "auto_non_critic" in mine else 0.0
        mask = mine.get("selected")
        if mask is None or not self.steps > self.policy.full_warm_up_rounds:
            return
        sel = torch.nonzero(mask.reshape(-1)).view(-1)
        moments = {
            key.removeprefix("device_"): v.reshape(-1)[sel].clone() if v.dim() else v
            for key, v in mine.items()
            if key.startswith("device_")
        }
        self._set_member(k, sel, moments)

    def _index(self, stepped: torch.Tensor) -> int:
        for k, s in enumerate(self.stepped):
            if s is stepped:
                return k
        raise KeyError("not a tensor this step updates")

    def close(self) -> None:
        """Finish a host update in flight and stop the thread."""
        self.settle(land=False)
        if self._pool is not None:
            self._pool.shutdown()
