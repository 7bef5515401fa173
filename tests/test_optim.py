"""raytrain.optim.optimizers: parameter groups, optimizers, and every LR schedule against its closed form."""

import io
import math
import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from raytrain.hf.optim import create_scheduler
from raytrain.optim.optimizers import create_optimizer, decay_parameter_names, get_lr, get_parameter_groups
from raytrain.optim.schedules import scheduler_needs_metric

LR = 0.1
T = 20  # training steps
W = 4  # warmup steps
# inside warmup, the warmup boundary, mid-way, around the end and past it
STEPS = [0, 1, W - 1, W, W + 1, 9, 12, T - 1, T, T + 3]


def make_args(**overrides):
    warmup = overrides.pop("warmup", W)
    args = SimpleNamespace(
        learning_rate=LR, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        optim="sgd", optim_args=None, lr_scheduler_type="linear", lr_scheduler_kwargs={},
        get_warmup_steps=lambda num_training_steps: warmup,
    )
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def lr_trace(schedule, kwargs=None, warmup=W, total=T, upto=T + 3):
    """Learning rate at steps 0..upto from a real scheduler driving a real optimizer."""
    torch.manual_seed(0)
    args = make_args(lr_scheduler_type=schedule, lr_scheduler_kwargs=kwargs or {}, warmup=warmup)
    optimizer = create_optimizer(nn.Linear(3, 2), args)
    scheduler = create_scheduler(optimizer, args, total)
    trace = []
    for _ in range(upto + 1):
        trace.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return trace


def assert_matches(trace, closed_form, steps=STEPS):
    for s in steps:
        assert trace[s] == pytest.approx(LR * closed_form(s), rel=1e-9, abs=1e-15), f"step {s}"


# ---- schedules: each closed form written out here, independently of the module ----


def test_linear():
    def f(s):
        return s / W if s < W else max(0.0, (T - s) / (T - W))

    trace = lr_trace("linear")
    assert_matches(trace, f)
    assert trace[12] == pytest.approx(LR * 0.5)  # (20 - 12) / 16, by hand


def test_linear_without_warmup_starts_at_full_lr():
    trace = lr_trace("linear", warmup=0)
    assert_matches(trace, lambda s: max(0.0, (T - s) / T))
    assert trace[0] == pytest.approx(LR)


@pytest.mark.parametrize("num_cycles", [None, 1.0])
def test_cosine(num_cycles):
    cycles = 0.5 if num_cycles is None else num_cycles

    def f(s):
        if s < W:
            return s / W
        p = (s - W) / (T - W)
        return max(0.0, 0.5 * (1 + math.cos(math.pi * cycles * 2 * p)))

    kwargs = {} if num_cycles is None else {"num_cycles": num_cycles}
    trace = lr_trace("cosine", kwargs)
    assert_matches(trace, f)
    if num_cycles is None:
        assert trace[12] == pytest.approx(LR * 0.5)  # half-way through the half cosine


@pytest.mark.parametrize("num_cycles", [None, 2])
def test_cosine_with_restarts(num_cycles):
    cycles = 1 if num_cycles is None else num_cycles

    def f(s):
        if s < W:
            return s / W
        p = (s - W) / (T - W)
        if p >= 1:
            return 0.0
        return max(0.0, 0.5 * (1 + math.cos(math.pi * ((cycles * p) % 1.0))))

    kwargs = {} if num_cycles is None else {"num_cycles": num_cycles}
    trace = lr_trace("cosine_with_restarts", kwargs)
    assert_matches(trace, f, STEPS + [11, 13])
    if num_cycles == 2:
        assert trace[12] == pytest.approx(LR)  # the restart: (2 * 0.5) % 1 == 0


@pytest.mark.parametrize("kwargs", [{}, {"lr_end": 1e-3, "power": 2.0}])
def test_polynomial(kwargs):
    lr_end, power = kwargs.get("lr_end", 1e-7), kwargs.get("power", 1.0)

    def f(s):
        if s < W:
            return s / W
        if s > T:
            return lr_end / LR
        return ((LR - lr_end) * (1 - (s - W) / (T - W)) ** power + lr_end) / LR

    trace = lr_trace("polynomial", kwargs)
    assert_matches(trace, f)
    assert trace[T] == pytest.approx(lr_end)
    assert trace[T + 3] == pytest.approx(lr_end)


def test_polynomial_rejects_lr_end_above_lr():
    with pytest.raises(ValueError, match="lr_end"):
        lr_trace("polynomial", {"lr_end": 1.0})


@pytest.mark.parametrize("kwargs, rate", [({"min_lr": LR / 10}, 0.1), ({"min_lr_rate": 0.25, "num_cycles": 0.7}, 0.25)])
def test_cosine_with_min_lr(kwargs, rate):
    cycles = kwargs.get("num_cycles", 0.5)

    def f(s):
        if s < W:
            return s / W
        factor = 0.5 * (1 + math.cos(math.pi * cycles * 2 * (s - W) / (T - W)))
        return max(0.0, factor * (1 - rate) + rate)
    assert_matches(lr_trace("cosine_with_min_lr", kwargs), f)


@pytest.mark.parametrize("warmup_lr_rate", [None, 0.05])
def test_cosine_warmup_with_min_lr(warmup_lr_rate):
    rate = 0.2

    def f(s):
        if s < W:
            return (s + 1) / W if warmup_lr_rate is None else warmup_lr_rate + (1 - warmup_lr_rate) * s / (W - 1)
        factor = 0.5 * (1 + math.cos(math.pi * 0.5 * 2 * (s - W + 1) / (T - W)))
        return max(0.0, factor * (1 - rate) + rate)
    kwargs = {"min_lr_rate": rate, "warmup_lr_rate": warmup_lr_rate}
    assert_matches(lr_trace("cosine_warmup_with_min_lr", kwargs), f)


def test_min_lr_schedules_need_exactly_one_of_min_lr_and_rate():
    for kwargs in ({}, {"min_lr": 0.01, "min_lr_rate": 0.1}):
        with pytest.raises(ValueError, match=r"^lr_scheduler_kwargs: set exactly one of min_lr or min_lr_rate"):
            lr_trace("cosine_with_min_lr", kwargs)


def test_constant_ignores_warmup():
    assert_matches(lr_trace("constant"), lambda s: 1.0)


def test_constant_with_warmup():
    assert_matches(lr_trace("constant_with_warmup"), lambda s: s / W if s < W else 1.0)


@pytest.mark.parametrize(
    "warmup, kwargs, timescale",
    [(W, {}, W), (0, {}, 10_000), (W, {"timescale": 8}, 8)],
)
def test_inverse_sqrt(warmup, kwargs, timescale):
    def f(s):
        if s < warmup:
            return s / warmup
        return 1 / math.sqrt((s + timescale - warmup) / timescale)

    trace = lr_trace("inverse_sqrt", kwargs, warmup=warmup)
    assert_matches(trace, f)
    assert trace[warmup] == pytest.approx(LR)  # continuous at the end of warmup


def wsd_closed_form(warmup, stable, decay, decay_type="cosine", warmup_type="linear", min_ratio=0.0, cycles=0.5):
    def f(s):
        if s < warmup:
            p = s / warmup
            shape = {"linear": p, "cosine": 0.5 * (1 - math.cos(math.pi * p)), "1-sqrt": 1 - math.sqrt(1 - p)}
            return max(0.0, shape[warmup_type] * (1 - min_ratio) + min_ratio)
        if s < warmup + stable:
            return 1.0
        if s < warmup + stable + decay:
            p = (s - warmup - stable) / decay
            shape = {"linear": 1 - p, "cosine": 0.5 * (1 + math.cos(math.pi * cycles * 2 * p)),
                     "1-sqrt": 1 - math.sqrt(p)}
            return max(0.0, shape[decay_type] * (1 - min_ratio) + min_ratio)
        return min_ratio

    return f


def test_warmup_stable_decay_defaults_decay_over_last_ten_percent():
    # T=20, W=4: decay 2 steps (10% of T), stable 14, cosine decay
    trace = lr_trace("warmup_stable_decay")
    assert_matches(trace, wsd_closed_form(W, 14, 2), STEPS + [17, 18])
    assert trace[17] == pytest.approx(LR)
    assert trace[19] == pytest.approx(LR * 0.5)


@pytest.mark.parametrize("decay_type", ["linear", "cosine", "1-sqrt"])
def test_warmup_stable_decay_shapes(decay_type):
    kwargs = {"num_decay_steps": 8, "decay_type": decay_type, "warmup_type": "cosine", "min_lr_ratio": 0.1}
    trace = lr_trace("warmup_stable_decay", kwargs)
    f = wsd_closed_form(W, T - W - 8, 8, decay_type, "cosine", 0.1)
    assert_matches(trace, f, STEPS + [8, 10, 14, 16])
    assert trace[T + 3] == pytest.approx(LR * 0.1)


def test_warmup_stable_decay_decay_fills_the_rest_after_a_given_stable_phase():
    trace = lr_trace("warmup_stable_decay", {"num_stable_steps": 6, "decay_type": "linear"})
    assert_matches(trace, wsd_closed_form(W, 6, T - W - 6, "linear"), STEPS + [10, 15])


@pytest.mark.parametrize(
    "kwargs, match",
    [({"num_decay_steps": 30}, "do not fit"), ({"decay_type": "exp"}, "decay_type 'exp' is not one of")],
)
def test_warmup_stable_decay_rejects_bad_kwargs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lr_trace("warmup_stable_decay", kwargs)


def test_unknown_schedule_kwarg_names_the_valid_ones():
    message = "lr_scheduler_kwargs: unknown key 'foo' for cosine (valid: num_cycles)"
    with pytest.raises(ValueError, match=re.escape(message)):
        lr_trace("cosine", {"foo": 1})
    with pytest.raises(ValueError, match=re.escape("for linear (valid: none)")):
        lr_trace("linear", {"num_cycles": 1})


def test_unknown_schedule_type():
    with pytest.raises(ValueError, match="lr_scheduler_type: unknown schedule 'cosine_fancy'"):
        lr_trace("cosine_fancy")


def test_scheduler_state_dict_round_trip():
    args = make_args(lr_scheduler_type="cosine", lr_scheduler_kwargs={"num_cycles": 1.0})
    optimizer = create_optimizer(nn.Linear(3, 2), args)
    scheduler = create_scheduler(optimizer, args, T)
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    buffer = io.BytesIO()
    torch.save(scheduler.state_dict(), buffer)  # what a checkpoint does
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)

    fresh_optimizer = create_optimizer(nn.Linear(3, 2), args)
    fresh = create_scheduler(fresh_optimizer, args, T)
    fresh.load_state_dict(state)
    for opt, sched in ((optimizer, scheduler), (fresh_optimizer, fresh)):
        opt.step()
        sched.step()
    assert fresh.last_epoch == scheduler.last_epoch == 6
    assert get_lr(fresh_optimizer) == pytest.approx(get_lr(optimizer))
    assert get_lr(optimizer) == pytest.approx(LR * 0.5 * (1 + math.cos(2 * math.pi * (6 - W) / (T - W))))


def test_reduce_lr_on_plateau_reduces_after_patience():
    args = make_args(lr_scheduler_type="reduce_lr_on_plateau", lr_scheduler_kwargs={"patience": 2, "factor": 0.5})
    optimizer = create_optimizer(nn.Linear(3, 2), args)
    scheduler = create_scheduler(optimizer, args, T)
    assert scheduler_needs_metric(scheduler)
    for _ in range(3):  # the first sets the best; two bad epochs are within patience
        scheduler.step(1.0)
    assert get_lr(optimizer) == pytest.approx(LR)
    scheduler.step(1.0)  # third bad epoch > patience
    assert get_lr(optimizer) == pytest.approx(LR * 0.5)


def test_reduce_lr_on_plateau_rejects_unknown_kwarg():
    with pytest.raises(ValueError, match="unknown key 'num_cycles' for reduce_lr_on_plateau"):
        lr_trace("reduce_lr_on_plateau", {"num_cycles": 1})


def test_lambda_schedules_do_not_need_a_metric():
    args = make_args()
    optimizer = create_optimizer(nn.Linear(3, 2), args)
    assert not scheduler_needs_metric(create_scheduler(optimizer, args, T))


# ---- parameter groups and optimizers ----


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.norm2d = nn.LayerNorm([2, 4])  # 2-D weight, still not decayed
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 2, bias=False)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        h = self.norm(self.proj(x))
        h = self.norm2d(h.view(-1, 2, 4)).view(-1, 8)
        return self.head(self.bn(h))


def test_parameter_groups_are_hfs_decayed_and_not_by_module_type_and_name():
    """HF's rule (get_decay_parameter_names): a LayerNorm's parameters and any named like a bias are not
    decayed; a BatchNorm's weight is (HF matches norms by LayerNorm type or by a name containing "norm")."""
    model = Net()
    groups = get_parameter_groups(model, 0.05)
    assert [g["weight_decay"] for g in groups] == [0.05, 0.0]
    decay, no_decay = ({id(p) for p in g["params"]} for g in groups)
    assert decay == {id(model.proj.weight), id(model.head.weight), id(model.bn.weight)}
    assert no_decay == {id(p) for p in (model.proj.bias, model.norm.weight, model.norm.bias, model.norm2d.weight,
                                        model.norm2d.bias, model.bn.bias)}
    assert id(model.frozen.weight) not in decay | no_decay
    assert decay_parameter_names(nn.Sequential(nn.Linear(2, 2), nn.ModuleDict({"final_norm": nn.Linear(2, 2)}))) \
        == ["0.weight"]  # "_norm" in the name


def test_parameter_groups_are_two_even_when_empty_or_without_decay_and_hold_tied_weights_once():
    assert [(g["weight_decay"], len(g["params"])) for g in get_parameter_groups(nn.LayerNorm(4), 0.1)] == \
        [(0.1, 0), (0.0, 2)]
    assert [(g["weight_decay"], len(g["params"])) for g in get_parameter_groups(nn.Linear(4, 4), 0.0)] == \
        [(0.0, 1), (0.0, 1)]
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    model[1].weight = model[0].weight  # tied
    groups = get_parameter_groups(model, 0.1)
    assert [len(g["params"]) for g in groups] == [1, 0]


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused", "sgd", "adagrad", "rmsprop", "adafactor"])
def test_each_optimizer_steps_and_changes_weights(optim):
    torch.manual_seed(0)
    model = Net()
    optimizer = create_optimizer(model, make_args(optim=optim, weight_decay=0.05))
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.05, 0.0]
    assert get_lr(optimizer) == pytest.approx(LR)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(6, 4)).pow(2).mean().backward()
    optimizer.step()
    for b, p in zip(before, model.parameters()):
        assert torch.equal(b, p) != p.requires_grad  # trainable ones moved, frozen ones did not


def test_adamw_kinds_take_betas_eps_and_fused_flag():
    fused = create_optimizer(nn.Linear(3, 2), make_args(optim="adamw_torch_fused", adam_beta2=0.95))
    assert fused.defaults["fused"] is True
    assert fused.defaults["betas"] == (0.9, 0.95) and fused.defaults["eps"] == 1e-8
    plain = create_optimizer(nn.Linear(3, 2), make_args(optim="adamw_torch"))
    assert not plain.defaults["fused"]


def test_fused_adamw_falls_back_with_a_warning():
    # torch refuses fused together with foreach; we keep foreach and drop fused
    args = make_args(optim="adamw_torch_fused", optim_args={"foreach": True})
    with pytest.warns(UserWarning, match="falling back"):
        optimizer = create_optimizer(nn.Linear(3, 2), args)
    assert optimizer.defaults["foreach"] is True and not optimizer.defaults["fused"]


def test_optim_args_are_merged():
    sgd = create_optimizer(nn.Linear(3, 2), make_args(optim="sgd", optim_args={"momentum": 0.9, "nesterov": True}))
    assert sgd.defaults["momentum"] == 0.9 and sgd.defaults["nesterov"] is True
    assert create_optimizer(nn.Linear(3, 2), make_args(optim="sgd")).defaults["momentum"] == 0.0
    ada = create_optimizer(nn.Linear(3, 2), make_args(optim="adafactor", optim_args={"beta2_decay": -0.5}))
    assert ada.defaults["beta2_decay"] == -0.5 and ada.defaults["lr"] == LR


def test_unknown_optimizer_and_optim_args_key():
    from raytrain.hf.optim import create_optimizer as create_any

    with pytest.raises(ValueError, match=r"optim: unknown optimizer 'lion' \(valid: adamw_torch, adamw_torch_fused, "):
        create_any(nn.Linear(3, 2), make_args(optim="lion"))
    with pytest.raises(ValueError, match=re.escape("optim_args: unknown key 'betas' for sgd")):
        create_optimizer(nn.Linear(3, 2), make_args(optim="sgd", optim_args={"betas": (0.9, 0.9)}))


def test_get_lr_is_a_float_of_the_first_group():
    optimizer = create_optimizer(nn.Linear(3, 2), make_args(optim="adamw_torch"))
    optimizer.param_groups[0]["lr"] = 0.25
    assert get_lr(optimizer) == 0.25 and isinstance(get_lr(optimizer), float)


def test_greedy_schedule_is_transformers_greedy_lr_stepped_as_hf_steps_it(tmp_path):
    """lr_scheduler_type="greedy": the learning rates and evaluation losses of a full-batch run (no data
    order in play) equal transformers 5.23's Trainer's, step for step."""
    import transformers

    from raytrain import Trainer
    from tests.tiny import TinyClassifier, args_for, columns, rows

    kw = dict(max_steps=12, per_device_train_batch_size=16, logging_steps=1, eval_strategy="steps", eval_steps=1,
              save_strategy="no", report_to="none", disable_tqdm=True, seed=0, learning_rate=0.5,
              lr_scheduler_type="greedy", metric_for_best_model="loss",
              lr_scheduler_kwargs={"patience": 1, "factor": 0.5, "min_lr": 1e-3})
    torch.manual_seed(0)
    hf = transformers.Trainer(TinyClassifier(), transformers.TrainingArguments(str(tmp_path / "hf"), **kw),
                              train_dataset=rows(16), eval_dataset=rows(6, seed=1))
    hf.train()
    torch.manual_seed(0)
    ours = Trainer(TinyClassifier(), args_for(tmp_path, **kw), train_dataset=columns(16),
                   eval_dataset=columns(6, seed=1))
    ours.train()

    def series(trainer, key):
        return [h[key] for h in trainer.state.log_history if key in h]

    assert type(ours.lr_scheduler) is transformers.optimization.GreedyLR
    lrs = series(ours, "learning_rate")
    assert lrs == series(hf, "learning_rate") and len(set(lrs)) >= 3  # it raised and lowered the rate
    assert series(ours, "eval_loss") == pytest.approx(series(hf, "eval_loss"), rel=1e-5)
