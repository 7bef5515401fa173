"""transformers 5.23's names that arguments take (`optim`, `report_to`), the libraries each needs, and the
one-line refusal of an optim name that cannot be built here. Light (no torch, no transformers): argument validation and the CLI's config check
call it before any work."""

from __future__ import annotations

import importlib.util
import os
import sys

#: Built by raytrain itself (torch's classes, as HF's Trainer picks them), with or without transformers.
TORCH_NAMES = ("adamw_torch", "adamw_torch_fused", "sgd", "adagrad", "rmsprop", "adafactor")

_BNB = (("bitsandbytes", "bitsandbytes"),)
_GALORE = (("galore_torch", "galore-torch"), ("bitsandbytes", "bitsandbytes"))  # galore_torch imports bnb
_APOLLO = (("apollo_torch", "apollo-torch"),)
_SCHEDULE_FREE = (("schedulefree", "schedulefree"),)

#: Every name of transformers.training_args.OptimizerNames (5.23, its order) -> (module, pip package)
#: of the libraries its optimizer comes from, besides torch and transformers.
OPTIM_NAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "adamw_torch": (),
    "adamw_torch_fused": (),
    "adamw_torch_xla": (("torch_xla", "torch-xla"),),
    "adamw_torch_npu_fused": (("torch_npu", "torch-npu"),),
    "adafactor": (),
    "adamw_anyprecision": (("torchdistx", "torchdistx"),),
    "adamw_torch_4bit": (("torchao", "torchao"),),
    "adamw_torch_8bit": (("torchao", "torchao"),),
    "ademamix": _BNB,
    "sgd": (),
    "adagrad": (),
    "adamw_bnb_8bit": _BNB,
    "adamw_8bit": _BNB,
    "ademamix_8bit": _BNB,
    "lion_8bit": _BNB,
    "lion_32bit": _BNB,
    "paged_adamw_32bit": _BNB,
    "paged_adamw_8bit": _BNB,
    "paged_ademamix_32bit": _BNB,
    "paged_ademamix_8bit": _BNB,
    "paged_lion_32bit": _BNB,
    "paged_lion_8bit": _BNB,
    "rmsprop": (),
    "rmsprop_bnb": _BNB,
    "rmsprop_bnb_8bit": _BNB,
    "rmsprop_bnb_32bit": _BNB,
    "galore_adamw": _GALORE,
    "galore_adamw_8bit": _GALORE,
    "galore_adafactor": _GALORE,
    "galore_adamw_layerwise": _GALORE,
    "galore_adamw_8bit_layerwise": _GALORE,
    "galore_adafactor_layerwise": _GALORE,
    "lomo": (("lomo_optim", "lomo-optim"),),
    "adalomo": (("lomo_optim", "lomo-optim"),),
    "grokadamw": (("grokadamw", "grokadamw"),),
    "schedule_free_radam": _SCHEDULE_FREE,
    "schedule_free_adamw": _SCHEDULE_FREE,
    "schedule_free_sgd": _SCHEDULE_FREE,
    "apollo_adamw": _APOLLO,
    "apollo_adamw_layerwise": _APOLLO,
    "stable_adamw": (("optimi", "torch-optimi"),),
}

#: Names that project some weights to a low rank: they need optim_target_modules.
LOW_RANK = tuple(name for name in OPTIM_NAMES if name.startswith(("galore_", "apollo_")))


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent; or a module put in sys.modules without a spec
        return sys.modules.get(module) is not None


def check_optim(name: str) -> None:
    """Refuse, in one line, a name transformers does not know or whose library is not installed."""
    if name not in OPTIM_NAMES:
        raise ValueError(f"unknown optimizer {name!r} (valid: {', '.join(OPTIM_NAMES)})")
    needs = list(OPTIM_NAMES[name])
    if name not in TORCH_NAMES:  # transformers' Trainer resolves these names
        needs.append(("transformers", "transformers"))
    missing = list(dict.fromkeys(package for module, package in needs if not installed(module)))
    if missing:
        raise ValueError(f"{name} needs {' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
                         f"not installed; pip install {' '.join(missing)}")


#: report_to's names: transformers 5.23's INTEGRATION_TO_CALLBACK -> (the modules it needs, their pip packages).
#: mlflow is raytrain's own tracking; tensorboard runs without transformers too; the rest are transformers'.
INTEGRATIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "azure_ml": (("azureml.core.run",), "azureml-core"),
    "clearml": (("clearml",), "clearml"),
    "codecarbon": (("codecarbon",), "codecarbon"),
    "comet_ml": (("comet_ml",), "comet-ml"),
    "dagshub": (("dagshub",), "dagshub"),
    "dvclive": (("dvclive",), "dvclive"),
    "flyte": (("flytekit",), "flytekit"),
    "kubeflow": ((), ""),  # no package: KUBEFLOW_TRAINER_SERVER_URL, set inside a Kubeflow Trainer job
    "mlflow": (("mlflow",), "mlflow"),
    "neptune": (("neptune",), "neptune"),
    "swanlab": (("swanlab",), "swanlab"),
    "tensorboard": (("tensorboard", "tensorboardX"), "tensorboard"),  # either writer, as transformers
    "trackio": (("trackio",), "trackio"),
    "wandb": (("wandb",), "wandb"),
}
#: Integrations raytrain runs itself; the others are transformers' callbacks.
OWN_INTEGRATIONS = ("mlflow", "tensorboard")


def kubeflow_available() -> bool:
    """transformers' is_kubeflow_available (5.23): inside a Kubeflow TrainJob, report_to gains kubeflow."""
    return os.environ.get("DISABLE_KUBEFLOW_INTEGRATION", "FALSE").upper() != "TRUE" and \
        os.environ.get("KUBEFLOW_TRAINER_SERVER_URL") is not None


def available_integrations() -> list[str]:
    """report_to "all": transformers' get_available_reporting_integrations where it is installed (its
    order and rules), else those of raytrain's own (mlflow, tensorboard) whose library is installed."""
    if installed("transformers"):
        from transformers.integrations import get_available_reporting_integrations

        return list(get_available_reporting_integrations())
    return [n for n in OWN_INTEGRATIONS if any(installed(m) for m in INTEGRATIONS[n][0])]
