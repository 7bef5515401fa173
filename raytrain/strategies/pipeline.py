"""Pipeline parallelism with torch.distributed.pipelining: a model's decoder layers split into stages
(PipelineStage), run by one of torch's schedules (1F1B, GPipe, Interleaved1F1B, ...).

The split follows transformers' base_model_pp_plan where the model has one (its layer list, the modules
before it on the first stage, after it on the last; the head too), else the base model's nn.ModuleList of
blocks. Layers are divided evenly, the first stages taking one more when they do not divide. The rank's
module (the one the optimizer, checkpoints and callbacks see) is the user's model with what the rank does
not run replaced by `Absent` (no parameters), so parameter names stay the whole model's. Each stage runs
a view of it (the rank's modules shared, the other stages' absent) through the model's own forward: the
first stage from input_ids, later ones from inputs_embeds (as transformers' pipeline_parallel.py does).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from .mesh import SINGLE_STAGE, ParallelDims


class Absent(torch.nn.Identity):
    """A module this rank does not hold: passes its first input through (transformers' PipelineIdentityLayer)."""

    def forward(self, *args, **kwargs):
        return args[0] if args else next(iter(kwargs.values()))


def _view(module: torch.nn.Module, **children: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of `module` with its own child table (and hooks), some children replaced: stages
    share the rank's modules without copying their parameters."""
    new = module.__class__.__new__(module.__class__)
    new.__dict__.update({k: (v.copy() if isinstance(v, (dict, set)) else v) for k, v in module.__dict__.items()})
    new._modules.update(children)
    return new


def inner_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a PEFT wrapper (duck-typed: strategies/ imports no peft)."""
    if type(model).__module__.startswith("peft.") and hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model


class Split:
    """Where a model's pieces are: the base model (prefix), its layer list, the modules of the first
    stage and of the last (in the base model, and beside it: the head)."""

    def __init__(self, model: torch.nn.Module):
        inner = inner_model(model)
        name = type(inner).__name__
        self.prefix = getattr(inner, "base_model_prefix", "") or ""
        base = getattr(inner, self.prefix, None) if self.prefix else None
        needs = (f"parallelism_config.pp_size: {name} cannot be split into pipeline stages: raytrain needs a base "
                 "model (base_model_prefix) whose decoder layers are an nn.ModuleList (transformers' "
                 "base_model_pp_plan names it) and a forward that takes inputs_embeds")
        if not isinstance(base, torch.nn.Module) or "inputs_embeds" not in _parameters(inner):
            raise ValueError(needs)
        plan = list(getattr(getattr(inner, "config", None), "base_model_pp_plan", None) or {})
        plan = plan or [n for n, _ in base.named_children()]  # no plan: the base model's children, in order
        lists = [n for n in plan if isinstance(getattr(base, n, None), torch.nn.ModuleList) and len(getattr(base, n))]
        if len(lists) != 1:
            raise ValueError(needs)
        self.layers = lists[0]
        at = plan.index(self.layers)
        # what holds parameters before the layers goes to the first stage, after them to the last; the
        # rest (rotary embeddings) runs on every stage
        self.first = [n for n in plan[:at] if _holds(getattr(base, n, None))]
        self.last = [n for n in plan[at + 1:] if _holds(getattr(base, n, None))]
        self.head = [n for n, c in inner.named_children() if c is not base and _holds(c)]
        self.num_layers = len(getattr(base, self.layers))
        placed = set(self.first) | set(self.last) | {self.layers}
        for n, child in base.named_children():
            if n not in placed and _holds(child):
                raise ValueError(f"parallelism_config.pp_size: {name}.{self.prefix}.{n} holds parameters but is "
                                 "neither before nor after the decoder layers in the model's pipeline plan "
                                 "(base_model_pp_plan); raytrain cannot place it on a stage")
        # tied input and output embeddings (tie_word_embeddings): the last stage keeps the embedding module
        # beside the head, so both stages hold the weight under the model's own name (Megatron's shared embedding)
        embeddings = inner.get_input_embeddings() if hasattr(inner, "get_input_embeddings") else None
        out = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
        self.tied: str | None = None  # the base model's child that holds the tied embeddings
        if embeddings is not None and out is not None and out.weight is embeddings.weight:
            self.tied = next((n for n in self.first if getattr(base, n) is embeddings), None)
            if self.tied is None or not any(getattr(inner, n) is out for n in self.head):
                raise ValueError(f"parallelism_config.pp_size: {name} ties its input and output embeddings "
                                 "(tie_word_embeddings) outside the modules before and after its layers; set "
                                 "tie_word_embeddings=False in its config, or pp_size 1")
        changed = _changes_inputs_embeds(base, self)
        if changed:
            raise ValueError(f"parallelism_config.pp_size: {name}'s base model {changed}, so the stages after the "
                             "first cannot run it from the previous stage's hidden states; raytrain splits models "
                             "whose forward passes inputs_embeds to the decoder layers as they are (Llama, Mistral, "
                             "Qwen2, Gemma, ...), or use pp_size 1")

    def bounds(self, num_stages: int) -> list[tuple[int, int]]:
        """[lo, hi) of the decoder layers of each stage: even, the first stages one more when uneven."""
        q, r = divmod(self.num_layers, num_stages)
        sizes = [q + (i < r) for i in range(num_stages)]
        return [(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(num_stages)]


def _changes_inputs_embeds(base: torch.nn.Module, split: Split) -> str:
    """What the base model's forward does to inputs_embeds when it holds no layers (a stage after the first
    runs it from the previous stage's hidden states): '' when it passes them on unchanged, else a few words
    (a forward that scales them; GPT-2, whose position embeddings the first stage holds). Deterministic
    inputs on the model's device (none to probe on meta), no RNG drawn, every module's train flag put back."""
    children = {split.layers: torch.nn.ModuleList([Absent()]), **{n: Absent() for n in split.first + split.last}}
    probe = _view(base, **children)
    dim = getattr(getattr(base, "config", None), "hidden_size", None)
    device = next(iter([*base.parameters(), *base.buffers()]), torch.empty(0)).device
    if not isinstance(dim, int) or device.type == "meta":
        return ""
    flags = [(m, m.training) for m in base.modules()]
    x = torch.linspace(-1.0, 1.0, 2 * dim, device=device).reshape(1, 2, dim)
    try:
        probe.eval()
        with torch.no_grad():
            out = probe(inputs_embeds=x, use_cache=False)
        y = getattr(out, "last_hidden_state", out[0] if isinstance(out, tuple) else out)
    except Exception as e:  # a module it needs is on another stage
        return (f"does not run from inputs_embeds without the first stage's modules ({type(e).__name__}: "
                f"{e})").split("\n")[0]
    finally:
        for m, flag in flags:
            m.training = flag
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return "returns hidden states of another shape than the inputs_embeds it takes"
    if not torch.equal(y, x):
        ratio = (y.flatten()[-1] / x.flatten()[-1]).item()
        what = f"scales inputs_embeds by {ratio:.4g}" if torch.allclose(y, x * ratio) else "changes inputs_embeds"
        return what + " before its first decoder layer"
    return ""


def _holds(module: torch.nn.Module | None) -> bool:
    return module is not None and any(True for _ in module.parameters())


def _parameters(model: torch.nn.Module) -> set[str]:
    try:
        return set(inspect.signature(type(model).forward).parameters)
    except (TypeError, ValueError):
        return set()


def check(model: torch.nn.Module, dims: ParallelDims) -> Split:
    """The model splits into dims.num_stages stages; one-line ValueError naming what is missing."""
    split = Split(model)
    if split.tied and dims.tp > 1:
        raise ValueError(f"parallelism_config.pp_size: {type(inner_model(model)).__name__} ties its input and output "
                         "embeddings (tie_word_embeddings), which raytrain does not split over TP and pipeline stages "
                         "at once; use tp_size 1 (pp with dp_shard), or tie_word_embeddings=False")
    if dims.num_stages > split.num_layers:
        per = f" ({dims.stages_per_rank} per rank, {dims.pp_schedule})" if dims.stages_per_rank > 1 else ""
        raise ValueError(f"parallelism_config.pp_size: {dims.num_stages} pipeline stages{per} but "
                         f"{type(inner_model(model)).__name__} has {split.num_layers} decoder layers; every "
                         "stage needs at least one")
    return split


class Pipeline:
    """This rank's stages of the pipeline, and the schedules that run them (one per input shape)."""

    def __init__(self, model: torch.nn.Module, dims: ParallelDims, pp_rank: int, per_rank_batch: int):
        self.split, self.dims = check(model, dims), dims
        self.stage_ids = dims.stage_ids(pp_rank)
        self.has_first = 0 in self.stage_ids
        self.has_last = dims.num_stages - 1 in self.stage_ids
        self.microbatches = dims.microbatches(per_rank_batch)
        self.model = model
        self.whole_groups = _whole_groups(model)
        self.parts: list[torch.nn.Module] = []
        self.group = self.device = None
        # tied embeddings: the weight's names in the whole model (the input embedding's first), and the group
        # of this rank and its peer at the other end, whose gradients are summed before each update
        tied = inner_model(model).get_input_embeddings().weight if self.split.tied else None
        self.tied_names = [n for n, p in model.named_parameters(remove_duplicate=False) if p is tied]
        self.tied_trainable = tied is not None and tied.requires_grad
        self.tied_group: Any = None
        self._tied_weight: torch.nn.Parameter | None = None
        self.sync_group: Any = None  # set: every rank builds a schedule when any needs one (FSDP's collectives)
        self._schedules: dict[tuple, Any] = {}
        self._loss: Callable | None = None
        self._prune()

    def _prune(self) -> None:
        """Replace in the model what none of this rank's stages runs (its parameters are let go)."""
        s, inner = self.split, inner_model(self.model)
        base = getattr(inner, s.prefix)
        bounds = self.split.bounds(self.dims.num_stages)
        held = {i for sid in self.stage_ids for i in range(*bounds[sid])}
        layers = getattr(base, s.layers)
        for i in range(len(layers)):
            if i not in held:
                layers[i] = Absent()
        for n in s.first if not self.has_first else ():
            if not (n == s.tied and self.has_last):  # the last stage's head holds the tied weight through it
                setattr(base, n, Absent())
        for n in s.last if not self.has_last else ():
            setattr(base, n, Absent())
        for n in s.head if not self.has_last else ():
            setattr(inner, n, Absent())

    def make_stages(self, device: torch.device, group) -> list[torch.nn.Module]:
        """One view of the (placed, tensor-parallel) model per stage of this rank, its forward the stage's."""
        s, inner = self.split, inner_model(self.model)
        base = getattr(inner, s.prefix)
        self.device, self.group = device, group
        bounds = self.split.bounds(self.dims.num_stages)
        layers = getattr(base, s.layers)
        for sid in self.stage_ids:
            lo, hi = bounds[sid]
            own = torch.nn.ModuleList([layers[i] if lo <= i < hi else Absent() for i in range(len(layers))])
            first, last = sid == 0, sid == self.dims.num_stages - 1
            absent_first = {n: Absent() for n in s.first if not (last and n == s.tied)}  # kept: it shares the head's
            base_view = _view(base, **{s.layers: own}, **({} if first else absent_first),
                              **({} if last else {n: Absent() for n in s.last}))
            part = _view(inner, **{s.prefix: base_view}, **({} if last else {n: Absent() for n in s.head}))
            part.forward = _stage_forward(part, base_view, first, last)
            self.parts.append(part)
        return self.parts

    # -- tied embeddings
    def tied_weight(self) -> torch.nn.Parameter | None:
        """This rank's copy of the tied embedding weight when it holds the first or the last stage; looked up
        once, at the first step (FSDP2 has replaced the parameters by then)."""
        if self._tied_weight is None and self.tied_names and (self.has_first or self.has_last):
            self._tied_weight = dict(self.model.named_parameters()).get(self.tied_names[0])
        return self._tied_weight

    def sync_tied(self) -> None:
        """Sum the tied weight's gradient over its two ends (the embedding's on the first stage, the head's on
        the last), so both apply one process's update; before the norm and the optimizer step."""
        import torch.distributed as dist

        weight = self.tied_weight() if self.tied_group is not None else None
        if weight is None or weight.grad is None:
            return
        grad = weight.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        dist.all_reduce(local, group=self.tied_group)

    def uncounted(self) -> set:
        """Parameters left out of the gradient norm on this rank: the tied weight where the first stage, which
        counts it, is another rank's."""
        weight = self.tied_weight()
        return {weight} if weight is not None and not self.has_first else set()

    def tied_state(self, state: dict) -> dict:
        """A gathered state dict with the tied weight under all of its names, one tensor (saved once, as one
        process saves it)."""
        if self.tied_names and self.tied_names[0] in state:
            for alias in self.tied_names[1:]:
                state[alias] = state[self.tied_names[0]]
        return state

    # -- running
    def run(self, inputs: dict, main: str, target: torch.Tensor | None, loss: Callable | None, train: bool):
        """One pass of the pipeline over this rank's batch (split into microbatches, padded with ignored rows
        to a multiple of them): (the microbatches' losses, the outputs) on the last stage, (None, None) elsewhere."""
        x = inputs[main]
        rows = x.shape[0]
        pad = (-rows) % self.microbatches
        kwargs = {k: _pad(v, rows, pad) for k, v in inputs.items()
                  if k != main and isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == rows}
        x = _pad(x, rows, pad)
        target = _pad(target, rows, pad, fill=-100) if target is not None else None
        key = (train, loss is not None, tuple((k, tuple(v.shape), v.dtype) for k, v in [(main, x), *kwargs.items()]))
        schedule = self._schedule(key, loss is not None)
        for part in self.parts:  # train() / eval() on the rank's model reach the views' own flags too
            if part.training != self.model.training:
                part.train(self.model.training)
        self._loss = loss
        losses = [] if self.has_last and loss is not None else None
        args = (x,) if self.has_first else ()
        call = schedule.step if train else schedule.eval
        out = call(*args, target=target if self.has_last else None, losses=losses, **kwargs)
        if not train:
            self.reshard()  # an evaluation leaves no parameters gathered (the state dict reads the shards)
        if out is not None and pad:
            out = out[:rows]
        return losses, out

    def _microbatch_loss(self, output, target):
        return self._loss(output, target)

    def _schedule(self, key: tuple, with_loss: bool):
        """The schedule for inputs of this shape, built at first sight: torch's stages infer their buffers'
        shapes from the first step they run. Under FSDP every rank builds when any does, since inference
        runs a forward (with its collectives) that the other data-parallel ranks must run too."""
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import get_schedule_class

        fresh = key not in self._schedules
        if self.sync_group is not None:
            flag = torch.tensor(float(fresh), device=self.device)
            dist.all_reduce(flag, dist.ReduceOp.MAX, group=self.sync_group)
            fresh = bool(flag.item())
        if fresh:
            if len(self._schedules) >= 16:  # many shapes (padding to each batch's longest): the oldest goes
                self._schedules.pop(next(iter(self._schedules)))
            stages = [PipelineStage(part, sid, self.dims.num_stages, self.device, group=self.group)
                      for part, sid in zip(self.parts, self.stage_ids)]
            cls = get_schedule_class(self.dims.pp_schedule)
            self._schedules[key] = cls(stages[0] if self.dims.pp_schedule in SINGLE_STAGE else stages,
                                       n_microbatches=self.microbatches, scale_grads=False,
                                       loss_fn=self._microbatch_loss if with_loss else None)
        return self._schedules[key]

    def reshard(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        for part in self.parts:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()


def _whole_groups(model: torch.nn.Module) -> list[list[str]]:
    """The trainable parameters' names of the whole model in HF's two weight-decay groups (the optimizer's
    order): how a full optimizer.pt (one process, DDP) numbers them."""
    from ..optim.optimizers import decay_parameter_names

    decayed = set(decay_parameter_names(model))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return [[n for n in names if n in decayed], [n for n in names if n not in decayed]]


def stage_optimizer_state(whole: list[list[str]], own: set[str], state: dict) -> dict:
    """A full torch optimizer state_dict (indices over the whole model) -> this rank's stages' part, by
    name (the form set_optimizer_state_dict takes); a ValueError when its groups are not HF's two."""
    saved = [len(g["params"]) for g in state["param_groups"]]
    if saved != [len(g) for g in whole]:
        raise ValueError(f"optimizer.pt's parameter groups hold {saved} parameters, not the whole model's two "
                         f"weight-decay groups {[len(g) for g in whole]} that a pipeline stage can take its share of")
    to_name = {i: n for g, names in zip(state["param_groups"], whole) for i, n in zip(g["params"], names)}
    return {"state": {to_name[i]: s for i, s in state["state"].items() if to_name[i] in own},
            "param_groups": [{**g, "params": [to_name[i] for i in g["params"] if to_name[i] in own]}
                             for g in state["param_groups"]]}


def _stage_forward(part: torch.nn.Module, base: torch.nn.Module, first: bool, last: bool):
    """A stage's forward (a tensor in, a tensor out, as PipelineStage sends them): the model's own forward
    from the previous stage's hidden states, the base model's alone before the last stage."""
    original = part.forward

    def forward(x: torch.Tensor, **kwargs) -> torch.Tensor:
        source = {"input_ids" if first else "inputs_embeds": x}
        if last:
            return original(**source, use_cache=False, **kwargs).logits
        return base(**source, use_cache=False, **kwargs).last_hidden_state

    return forward


def _pad(t: torch.Tensor, rows: int, pad: int, fill: int | None = None) -> torch.Tensor:
    """`pad` more rows: copies of the first (so every value stays finite), or `fill` (labels: ignored)."""
    if not pad:
        return t
    extra = t[:1].expand(pad, *t.shape[1:]) if fill is None else torch.full((pad, *t.shape[1:]), fill,
                                                                            dtype=t.dtype, device=t.device)
    return torch.cat([t, extra])
