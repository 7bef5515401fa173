"""benchmarks/hf_trainer_tests.py changes only the imports of HF's test files: the Trainer's names come from
raytrain, a name the installed transformers lacks is dropped (in both copies), every other line stays."""

from __future__ import annotations

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _harness():
    spec = importlib.util.spec_from_file_location("hf_trainer_tests", os.path.join(ROOT, "benchmarks",
                                                                                   "hf_trainer_tests.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SOURCE = '''import numpy as np
from transformers import (
    AutoTokenizer,
    NoSuchNameInTransformers,
    TrainingArguments,
)
from transformers.testing_utils import TestCasePlus

if True:
    from transformers.trainer_callback import DefaultFlowCallback, TrainerState
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint


def test_x():
    return "from transformers import Trainer"
'''


def test_only_the_trainers_imports_change():
    harness = _harness()
    names = harness.raytrain_names()
    assert {"Trainer", "TrainingArguments", "TrainerState", "EarlyStoppingCallback"} <= names
    assert "set_seed" not in names  # the tests seed their models with HF's
    assert harness.rewrite(SOURCE, names) == '''import numpy as np
from transformers import AutoTokenizer
from raytrain import TrainingArguments
from transformers.testing_utils import TestCasePlus

if True:
    from raytrain import DefaultFlowCallback, TrainerState
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
    from raytrain import get_last_checkpoint


def test_x():
    return "from transformers import Trainer"
'''
    # transformers' own copy: only the missing name goes
    assert harness.rewrite(SOURCE, set()).splitlines()[1] == "from transformers import AutoTokenizer, TrainingArguments"
