"""WORKER side: what the worker (loop, evaluation, resume, ray_worker) and the driver's launch use of
a Trainer, written down once. raytrain.Trainer is one; a subclass overrides HF's methods as in HF.

Nothing here is called: it is a typing.Protocol (structural), checked by tests/worker/test_protocol.py
against Trainer, so a hook renamed on one side fails there rather than in a worker on the cluster.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    import torch

    from ..config.args import TrainingArguments
    from ..callbacks import CallbackHandler
    from ..callbacks.state import TrainerControl, TrainerState
    from ..strategies.base import Strategy


class TrainerProtocol(Protocol):
    """The Trainer as the worker sees it: HF's attributes and overridable methods, plus named hooks."""

    # -- what the loop reads and replaces
    args: TrainingArguments
    state: TrainerState
    control: TrainerControl
    callback_handler: CallbackHandler
    model: torch.nn.Module
    model_wrapped: torch.nn.Module | None       # as the strategy placed it (DDP, FSDP ...), None before
    optimizer: torch.optim.Optimizer | None
    lr_scheduler: Any
    optimizers: tuple[Any, Any]                 # the (optimizer, scheduler) given to Trainer(...)
    train_dataset: Any
    eval_dataset: Any
    processing_class: Any
    compute_metrics: Callable | None
    preprocess_logits_for_metrics: Callable | None
    ignore_keys_for_eval: list[str] | None      # train()'s, passed to the loop's evaluations
    trial_name: str | None                      # set by a sweep: the TrainerState names the trial
    trial_params: dict | None
    model_preparation_time: float | None        # HF's: set by the first evaluation of an unprepared model
    accelerator: Any                            # hf/accelerator.py: accelerate's names (gradient_state's flags)
    current_gradient_accumulation_steps: int    # HF's: the micro-batches of the step being trained
    is_in_train: bool                           # HF's: True while train() runs (full_eval casts only outside it)
    _train_batch_size: int                      # HF's: training's per-device batch (auto_find_batch_size
                                                # lowers it; a resume of such a run takes the checkpoint's)

    # -- HF's overridable methods, called as HF's Trainer calls them
    def get_train_dataloader(self) -> Any: ...

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any: ...

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer: ...

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any: ...

    def compute_loss(self, model: torch.nn.Module, inputs: dict, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any: ...

    def training_step(self, model: torch.nn.Module, inputs: dict, num_items_in_batch: Any = None) -> torch.Tensor: ...

    def prediction_step(self, model: torch.nn.Module, inputs: dict, prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple: ...

    def floating_point_ops(self, inputs: dict) -> float: ...

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]: ...

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None: ...

    def add_callback(self, callback: Any) -> None: ...

    def remove_callback(self, callback: Any) -> None: ...

    def is_world_process_zero(self) -> bool: ...

    # -- HF's underscore override points (its subclasses and tests patch them; raytrain/hf/trainer_api.py)
    def _evaluate(self, trial: Any, ignore_keys_for_eval: list[str] | None, skip_scheduler: bool = False) -> dict:
        """An evaluation during training: evaluate(), then a metric-driven schedule steps on it."""

    def _load_callback_state(self) -> None:
        """Callbacks and TrainerControl back from state.stateful_callbacks (a resume)."""

    def compare_trainer_and_checkpoint_args(self, training_args: Any, trainer_state: TrainerState) -> None:
        """HF's warning naming the steps and batch size a resumed checkpoint had otherwise."""

    # -- named hooks
    def get_strategy(self) -> Strategy:
        """This process's backend, created from args on first use."""

    def set_strategy(self, strategy: Strategy | None) -> None:
        """Use `strategy`; None: create one on next use (a Trainer pickled for other processes)."""

    def prepare_inputs(self, inputs: dict) -> dict:
        """The batch on this rank's device, by HF's overridable _prepare_inputs."""

    def rank_state(self) -> dict | None:
        """What the Trainer keeps on this rank between steps (plain data and tensors; None: nothing), saved
        with each checkpoint."""

    def load_rank_state(self, state: dict | None) -> None:
        """rank_state()'s value back when resuming (None: the checkpoint holds none for this rank)."""

    def optimizer_factory(self, num_training_steps: int) -> Callable[[torch.nn.Module], torch.optim.Optimizer]:
        """What the strategy calls with the placed model: create_optimizer (or an overridden
        create_optimizer_and_scheduler)."""

    def loss_needs_num_items(self) -> bool:
        """Whether compute_loss needs num_items_in_batch even for one micro-batch on one rank."""

    def count_loss_items(self, inputs: dict) -> Any:
        """A batch's loss items as HF counts them (a tensor; None without labels): summed into
        num_items_in_batch."""

    def current_learning_rate(self) -> float:
        """The rate the last optimizer step used (logged as learning_rate): HF's _get_learning_rate."""

    def report_to_trial(self, trial: Any, metrics: dict, checkpoint_dir: str | None = None) -> None:
        """An evaluation's metrics, and the checkpoint saved with them, to a sweep's trial."""

    def start_memory_tracking(self, stage: str = "train") -> None:
        """HF's memory metrics from here (skip_memory_metrics permitting)."""

    def stop_memory_tracking(self, stage: str) -> dict[str, int]:
        """The stage's {stage}_mem_* metrics since start_memory_tracking."""

    def log_training_start(self, dataloader: Any, num_update_steps_per_epoch: int) -> None:
        """HF's "***** Running training *****" info lines for the planned run (state.max_steps set)."""
