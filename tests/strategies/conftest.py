"""The TP and pipeline tests' references (one process) and their one shared 4-process gloo launch: both modules
are in the xdist group "worker_group", so one pytest process launches it once (tests/conftest.py: MULTIPROCESS)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tp_one_process(tmp_path_factory):
    """test_tp's reference: one process, the same global batch; and LoRA's and the MLP's (tp_plan by name)."""
    from raytrain import Trainer
    from tests.strategies.test_tp import lm_args, mlp_run, tiny_llama, tiny_lora, token_rows

    root = tmp_path_factory.mktemp("tp1")
    trainer = Trainer(tiny_llama(), lm_args(str(root / "single")), train_dataset=token_rows())
    trainer.train()
    lora = Trainer(tiny_lora(), lm_args(str(root / "lora")), train_dataset=token_rows())
    lora.train()
    trainer.lora = lora
    trainer.mlp = mlp_run(str(root / "mlp"))
    trainer.mlp.train()
    return root, trainer


@pytest.fixture(scope="session")
def pp_one_process(tmp_path_factory):
    """test_pp's reference: one process, the same global batch (and its checkpoint-SAVE_AT, for pp2 x tp2)."""
    from raytrain import Trainer
    from tests.strategies.test_pp import padded_rows, predict, tiny_gemma, tiny_llama, tiny_lora, token_accuracy, trim
    from tests.strategies.test_tp import lm_args, token_rows

    root = tmp_path_factory.mktemp("pp1")
    out = {}
    for name, model in (("single", tiny_llama()), ("lora", tiny_lora()), ("gemma", tiny_gemma()),
                        ("single-tied", tiny_llama(tied=True))):
        trainer = Trainer(model, lm_args(str(root / name)), train_dataset=token_rows(), compute_metrics=token_accuracy)
        trainer.train()
        out[name] = trainer
    out["pad"] = Trainer(tiny_llama(), lm_args(str(root / "pad")), train_dataset=padded_rows(), data_collator=trim)
    out["pad"].train()
    out["eval"] = out["single"].evaluate(eval_dataset=token_rows(16))
    out["predict"] = predict(out["single"])
    return root, out


@pytest.fixture(scope="session")
def gloo4(tmp_path_factory, tp_one_process, pp_one_process):
    """test_tp's layouts, then test_pp's pipelines, on one launch of 4 gloo processes: (root, per rank {"tp": ...,
    "pp": ...}); each module's runs write under root / "tp" and root / "pp"."""
    from tests.strategies._gloo import launch
    from tests.strategies.test_pp import PIPELINE_RUNS

    root = tmp_path_factory.mktemp("gloo4")
    jobs = {"tp": ("tests.strategies.test_tp:rank_runs", {"root": str(root / "tp"),
                                                           "single": str(tp_one_process[0] / "single")}),
            "pp": ("tests.strategies.test_pp:rank_runs", {"root": str(root / "pp"), "single": str(pp_one_process[0]),
                                                           "runs": PIPELINE_RUNS})}
    return root, launch(root, 4, jobs)
