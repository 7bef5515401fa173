"""The fields transformers 5.23 added to TrainingArguments, without transformers: which work (DDP's flags,
activation checkpointing and its alias, main_process_first across processes) and which warn once."""

from __future__ import annotations

import logging
import types
import multiprocessing
import os
import socket
import time

import pytest
import torch

import raytrain.config.validation
from raytrain.config.args import TrainingArguments
from raytrain.strategies.base import enable_gradient_checkpointing
from raytrain.strategies.ddp import DDPStrategy, ddp_kwargs
from raytrain.strategies.single import SingleProcessStrategy

WARNED = {  # a non-default value -> the start of its warning
    "trackio_bucket_id": ("me/bucket", "trackio_bucket_id is not supported"),
    "trackio_space_id": ("me/space", "trackio_space_id is not supported"),
    "trackio_static_space_id": (False, "trackio_static_space_id is not supported"),
}
WORKS = dict(activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": False},
             ddp_broadcast_buffers=False, ddp_bucket_cap_mb=10, ddp_static_graph=True, enable_jit_checkpoint=True,
             eval_use_gather_object=True, use_cache=True, dataloader_multiprocessing_context="spawn",
             optim_target_modules=["attn"])  # read by GaLore / APOLLO, ignored by other names (as HF)


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(raytrain.config.validation, "_warned", set())  # the warnings are once per process


def _messages(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("name", sorted(WARNED))
def test_unsupported_field_warns_once_when_set(name, tmp_path, caplog, fresh_warnings):
    value, message = WARNED[name]
    with caplog.at_level(logging.WARNING):
        TrainingArguments(str(tmp_path), use_cpu=True)  # its default: silent
        assert not [m for m in _messages(caplog) if name in m]
        args = TrainingArguments(str(tmp_path), use_cpu=True, **{name: value})
        TrainingArguments(str(tmp_path), use_cpu=True, **{name: value})
    assert getattr(args, name) == value
    hits = [m for m in _messages(caplog) if name in m]
    assert len(hits) == 1 and hits[0].startswith(message) and ";" in hits[0]  # says what happens instead


def test_supported_fields_are_silent(tmp_path, caplog, fresh_warnings):
    with caplog.at_level(logging.WARNING):
        args = TrainingArguments(str(tmp_path), use_cpu=True, **WORKS)
    assert not _messages(caplog)
    assert all(getattr(args, k) == v for k, v in WORKS.items())


def test_assigning_either_checkpointing_name_sets_both(tmp_path):
    args = TrainingArguments(str(tmp_path))
    assert (args.activation_checkpointing, args.gradient_checkpointing) == (False, False)
    args.gradient_checkpointing = True
    assert (args.activation_checkpointing, args.gradient_checkpointing) == (True, True)
    args.activation_checkpointing = False
    assert (args.activation_checkpointing, args.gradient_checkpointing) == (False, False)
    args.activation_checkpointing_kwargs = '{"every_n_layers": 2}'
    assert args.gradient_checkpointing_kwargs == args.activation_checkpointing_kwargs == {"every_n_layers": 2}
    assert TrainingArguments.from_dict(args.to_dict()) == args
    with pytest.warns(FutureWarning, match="`gradient_checkpointing` is deprecated"):
        assert TrainingArguments(str(tmp_path), gradient_checkpointing=True).activation_checkpointing is True


class _Recorder(torch.nn.Linear):
    def __init__(self):
        super().__init__(2, 2)
        self.calls = []


class NewModel(_Recorder):  # transformers >= 5.23
    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, every_n_layers=1, offload=False):
        self.calls.append((activation_checkpointing_kwargs, every_n_layers, offload))


class OldModel(_Recorder):  # transformers 4.x, or a user's module
    def gradient_checkpointing_enable(self, **kwargs):
        self.calls.append(kwargs)


def test_activation_checkpointing_reaches_the_model_as_hf_calls_it(tmp_path):
    new, old = NewModel(), OldModel()
    enable_gradient_checkpointing(new, {"every_n_layers": 2, "offload": True, "use_reentrant": False})
    enable_gradient_checkpointing(old, None)
    enable_gradient_checkpointing(old, {"use_reentrant": False})
    assert new.calls == [({"use_reentrant": False}, 2, True)]
    assert old.calls == [{}, {"gradient_checkpointing_kwargs": {"use_reentrant": False}}]
    with pytest.raises(ValueError, match="activation_checkpointing: the model has no activation_checkpointing_enable"):
        enable_gradient_checkpointing(torch.nn.Linear(2, 2))
    args = TrainingArguments(str(tmp_path), use_cpu=True, activation_checkpointing=True,
                             activation_checkpointing_kwargs={"every_n_layers": 3})
    model = NewModel()
    SingleProcessStrategy(args).setup(model, lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    assert model.calls == [(None, 3, False)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.filterwarnings("ignore:`broadcast_buffers` is deprecated", "ignore:You passed find_unused_parameters")
def test_ddp_arguments_reach_distributed_data_parallel(tmp_path):
    assert ddp_kwargs(TrainingArguments(str(tmp_path))) == {}
    args = TrainingArguments(str(tmp_path), use_cpu=True, ddp_find_unused_parameters=True, ddp_bucket_cap_mb=10,
                             ddp_broadcast_buffers=False, ddp_static_graph=True, scaling={"num_workers": 2})
    assert ddp_kwargs(args) == {"find_unused_parameters": True, "bucket_cap_mb": 10, "broadcast_buffers": False,
                                "static_graph": True}
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        model, _ = DDPStrategy(args).setup(torch.nn.Linear(2, 2), lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
        assert (model.find_unused_parameters, model.broadcast_buffers, model.static_graph) == (True, False, True)
        assert model.bucket_bytes_cap == 10 * 1024 * 1024
    finally:
        dist.destroy_process_group()


def _rank(rank: int, init: str, local: bool, events) -> None:
    import torch.distributed as dist

    os.environ["LOCAL_RANK"] = str(rank)  # one node
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    args = TrainingArguments("unused", use_cpu=True, log_level="info", log_level_replica="error")
    with args.main_process_first(local=local, desc="map"):
        events.put(("enter", rank, time.monotonic()))
        if rank == 0:
            time.sleep(0.5)  # the replica must not enter meanwhile
        events.put(("leave", rank, time.monotonic()))
    events.put(("level", rank, args.get_process_log_level()))
    events.put(("mode", rank, args.parallel_mode.value))
    dist.destroy_process_group()


@pytest.mark.parametrize("local", [True, False])
def test_main_process_first_makes_replicas_wait(local):
    ctx = multiprocessing.get_context("fork")
    events = ctx.Queue()
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, init, local, events)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    seen = {(kind, rank): value for kind, rank, value in (events.get(timeout=5) for _ in range(8))}
    assert seen[("enter", 1)] >= seen[("leave", 0)]
    assert (seen[("level", 0)], seen[("level", 1)]) == (logging.INFO, logging.ERROR)
    assert seen[("mode", 0)] == seen[("mode", 1)] == "distributed"


def test_use_cache_and_the_workers_start_method_are_applied(tmp_path):
    from raytrain import Trainer
    from raytrain.data.loaders import WorkerPool
    from tests.tiny import TinyClassifier, args_for, columns

    model = TinyClassifier()
    model.config = types.SimpleNamespace(use_cache=True)  # a transformers model's config, as HF sets it
    trainer = Trainer(model, args_for(tmp_path, use_cache=False, dataloader_num_workers=1,
                                      dataloader_multiprocessing_context="spawn"), train_dataset=columns(8))
    assert model.config.use_cache is False
    loader = trainer.get_train_dataloader()
    assert isinstance(loader.source, WorkerPool) and loader.loader_kwargs["multiprocessing_context"] == "spawn"
    assert loader.multiprocessing_context.get_start_method() == "spawn" and loader.num_workers == 1  # torch's
