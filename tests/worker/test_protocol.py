"""The written contract between the worker and the Trainer (worker/protocol.py) holds for raytrain's
Trainer: every member exists, methods take the Protocol's parameters, and the worker and driver call
nothing of the Trainer beyond it (its underscore names only where the Protocol lists HF's override points)."""

from __future__ import annotations

import ast
import inspect
import os
import typing

from raytrain import Trainer
from raytrain.worker.protocol import TrainerProtocol
from tests.tiny import TinyClassifier, args_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _members() -> tuple[set[str], set[str]]:
    attributes = set(typing.get_type_hints(TrainerProtocol, include_extras=False, localns=_types()))
    # HF's underscore override points (_evaluate ...) are members too; dunders are not
    methods = {n for n, v in vars(TrainerProtocol).items() if inspect.isfunction(v) and not n.startswith("__")}
    return attributes, methods


def _types() -> dict:
    import torch

    from raytrain.config.args import TrainingArguments
    from raytrain.callbacks import CallbackHandler
    from raytrain.callbacks.state import TrainerControl, TrainerState
    from raytrain.strategies.base import Strategy
    return dict(torch=torch, TrainingArguments=TrainingArguments, CallbackHandler=CallbackHandler,
                TrainerControl=TrainerControl, TrainerState=TrainerState, Strategy=Strategy)


def test_trainer_has_every_member_of_the_protocol(tmp_path):
    attributes, methods = _members()
    trainer = Trainer(TinyClassifier(), args_for(tmp_path, max_steps=1))
    assert {a for a in attributes if not hasattr(trainer, a)} == set()
    for name in methods:
        ours = inspect.signature(getattr(Trainer, name))
        theirs = inspect.signature(getattr(TrainerProtocol, name))
        assert list(ours.parameters) == list(theirs.parameters), name


def test_worker_and_driver_use_only_the_protocol_of_the_trainer():
    attributes, methods = _members()
    used = set()
    for folder in ("worker", "driver"):
        for name in os.listdir(os.path.join(ROOT, "raytrain", folder)):
            if name.endswith(".py") and name != "protocol.py":
                tree = ast.parse(open(os.path.join(ROOT, "raytrain", folder, name)).read())
                used |= {node.attr for node in ast.walk(tree)
                         if isinstance(node, ast.Attribute) and _is_trainer(node.value)}
    # Attributes a Ray worker sets on its unpickled Trainer (the datasets) or the driver reads back.
    assert used - attributes - methods - {"train_dataset", "eval_dataset"} == set()


def _is_trainer(node: ast.AST) -> bool:
    """`trainer` or `<x>.trainer` (run.trainer): the names the worker and driver give the Trainer."""
    return (isinstance(node, ast.Name) and node.id == "trainer") or \
        (isinstance(node, ast.Attribute) and node.attr == "trainer")


def test_an_override_of_hf_prepare_inputs_is_what_the_loop_and_evaluation_call(tmp_path):
    """HF users override _prepare_inputs; the worker calls prepare_inputs, which must reach it."""
    from tests.tiny import columns

    class Marked(Trainer):
        seen = 0

        def _prepare_inputs(self, inputs):
            Marked.seen += 1
            return super()._prepare_inputs(inputs)

    trainer = Marked(TinyClassifier(), args_for(tmp_path, max_steps=2, per_device_train_batch_size=4,
                                                gradient_accumulation_steps=2, save_strategy="no"),
                     train_dataset=columns(16), eval_dataset=columns(8))
    trainer.train()
    assert Marked.seen == 4  # 2 steps of 2 micro-batches
    trainer.evaluate()
    assert Marked.seen == 4 + 1  # one evaluation batch of 8
