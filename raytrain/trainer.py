"""The user's facade, with HF Trainer's names: runs worker/loop.py in-process, or hands itself to driver/launch.py."""

from __future__ import annotations

import inspect
import logging
import warnings
from typing import Any, Callable

import torch

from .callbacks import CallbackHandler, DefaultFlowCallback, PrinterCallback, ProgressCallback
from .callbacks.state import PredictionOutput, TrainerControl, TrainerState, TrainOutput
from .config.args import ConfigError, TrainingArguments
from .config.seq2seq import Seq2SeqTrainingArguments
from .data.columns import is_named_datasets
from .hf import adapters, objects as hf
from .hf.metrics import MemoryTracker
from .hf.optim import create_optimizer, create_scheduler
from .hf.instrument import check_liger
from .hf.loss import LossMethods
from .hf.pipeline import PipelineMethods
from .hf.seq2seq import Seq2SeqMethods
from .hf.sequence import SequenceMethods
from .hf.skeleton import ExampleScriptMethods
from .hf.trackers import integration_callbacks
from .hf.trainer_api import HFOverridePoints
from .optim.optimizers import build_optimizer
from .runtime.seeding import set_seed
from .strategies.base import unwrap_model
from .worker import loop
from .worker.evaluation import EvalLoopOutput, evaluation_loop

logger = logging.getLogger(__name__)

__all__ = ["Seq2SeqTrainer", "Trainer", "set_seed", "trainer_class"]


class Trainer(LossMethods, HFOverridePoints, ExampleScriptMethods, PipelineMethods, SequenceMethods):
    """Train, evaluate and predict with a PyTorch model, as HF's Trainer does (same arguments, same
    overridable methods, same events).

    The model is any nn.Module taking a batch (a dict of tensors) as keyword arguments; its loss is
    the output's `loss` (dict key, attribute, or the first element of a tuple), or
    `compute_loss_func(outputs, labels, num_items_in_batch)` when given.
    """

    def __init__(self, model: torch.nn.Module | None = None, args: TrainingArguments | None = None,
                 data_collator: Callable | None = None, train_dataset=None, eval_dataset=None,
                 processing_class: Any = None, model_init: Callable | None = None,
                 compute_loss_func: Callable | None = None, compute_metrics: Callable | None = None,
                 callbacks: list | None = None, optimizers=(None, None),
                 optimizer_cls_and_kwargs: tuple[type, dict] | None = None,
                 preprocess_logits_for_metrics: Callable | None = None):
        self._memory = MemoryTracker()
        self.args = args if args is not None else TrainingArguments(output_dir="trainer_output")
        self.start_memory_tracking("init")
        if self.args.log_level != "passive":
            logging.getLogger("raytrain").setLevel(self.args.log_level.upper())
            # HF's lines are on transformers' loggers: their level set as HF's Trainer sets it (set_verbosity)
            logging.getLogger("transformers").setLevel(self.args.log_level.upper())
        set_seed(self.args.seed, self.args.full_determinism)
        if model is None and model_init is None:
            raise ValueError("Trainer needs a model or a model_init function")
        if optimizers[0] is not None and optimizer_cls_and_kwargs is not None:
            raise ValueError("Trainer: pass either optimizers or optimizer_cls_and_kwargs, not both")
        self.model_init = model_init
        self.create_accelerator_and_postprocess()  # HF's: accelerator_config's num_steps may set the accumulation
        self.model = model if model is not None else self.call_model_init()
        self.model_wrapped = None
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.processing_class = processing_class
        self.data_collator = data_collator if data_collator is not None else hf.default_collator(processing_class)
        self.compute_metrics = compute_metrics
        self.compute_loss_func = compute_loss_func
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        self.optimizers = optimizers
        self.optimizer, self.lr_scheduler = optimizers
        self.label_names = self.args.label_keys if self.args.label_names else hf.default_label_names(self.model)
        self.model_accepts_loss_kwargs = hf.accepts_loss_kwargs(self.model)  # HF's; a script may change it
        self.label_smoother = (hf.LabelSmoother(self.args.label_smoothing_factor)
                               if self.args.label_smoothing_factor else None)
        if self.label_smoother is not None and \
                getattr(getattr(self.model, "config", None), "problem_type", None) == "multi_label_classification":
            warnings.warn("Label smoothing is not compatible with multi-label classification. "
                          "Disabling label smoothing for this training run.", UserWarning, stacklevel=2)
            self.label_smoother = None
        self._strategy = None
        self.ignore_keys_for_eval: list[str] | None = None  # train()'s, for the loop's evaluations
        self.trial_name: str | None = None  # set by a sweep: its TrainerState says which trial it is
        self.trial_params: dict | None = None
        self.model_preparation_time: float | None = None  # HF's eval_model_preparation_time
        defaults = [DefaultFlowCallback, PrinterCallback if self.args.disable_tqdm else ProgressCallback]
        self.callback_handler = CallbackHandler(defaults + integration_callbacks(self.args) + list(callbacks or []),
                                                self.model, self.processing_class, self.optimizer,
                                                self.lr_scheduler)
        self.state = TrainerState()
        self.control = TrainerControl()
        self.control = self.callback_handler.on_init_end(self.args, self.state, self.control)
        if getattr(self.model, "config", None) is not None and hasattr(self.model.config, "use_cache"):
            self.model.config.use_cache = self.args.use_cache  # as HF: no generation cache while training
        self.stop_memory_tracking("init")

    # ------------------------------------------------------------ public API
    def _run_loop(self, resume_from_checkpoint, trial) -> TrainOutput:
        """One training run of worker/loop.py in this process (the bridge's batch-size finder repeats it)."""
        return loop.train(self, resume_from_checkpoint, trial)

    @staticmethod
    def _plan_steps(args, dataloader):
        """The loop's plan of a run over `dataloader`: (batches per epoch, updates per epoch, max_steps, epochs)."""
        return loop.plan_steps(args, dataloader)

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs) -> TrainOutput:
        """Train from scratch, or continue a checkpoint (True: the newest valid one in output_dir)."""
        if kwargs:
            raise TypeError(f"train() got unexpected arguments {sorted(kwargs)}")
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        self.ignore_keys_for_eval = ignore_keys_for_eval
        try:  # Liger's kernels without a GPU, a model that cannot be split into the layout: before any worker
            check_liger(self.args)  # starts, in one line (CLI: exit 2)
            if self.args.should_use_distributed:
                self._check_layout()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.args.should_use_distributed:
            from .driver.launch import run_distributed
            return run_distributed(self, resume_from_checkpoint)
        if self.model_init is not None:  # as HF: every train() starts from a fresh, seeded model
            set_seed(self.args.seed, self.args.full_determinism)
            self.model = self.call_model_init(trial)
            self.optimizer = self.lr_scheduler = None
            self.__dict__.pop("_model_flops", None)
        self.start_memory_tracking("train")
        from .worker.signals import python_interrupts

        self.is_in_train = True
        try:
            with python_interrupts(self):  # Ctrl-C: save at the next step, then KeyboardInterrupt
                if not self.args.auto_find_batch_size:
                    return self._run_loop(resume_from_checkpoint, trial)
                return self._train_finding_batch_size(resume_from_checkpoint, trial)
        finally:
            self.is_in_train = False

    def evaluate(self, eval_dataset=None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Evaluate on `eval_dataset` (or the Trainer's); a dict of datasets is evaluated one by one with
        metrics prefixed `{metric_key_prefix}_{name}_`, as HF."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if is_named_datasets(dataset):
            metrics: dict[str, float] = {}
            for name, data in dataset.items():
                metrics.update(self.evaluate(data if eval_dataset is not None else name, ignore_keys,
                                             f"{metric_key_prefix}_{name}"))
            return metrics
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset (given to Trainer or to evaluate)")
        self.start_memory_tracking("eval")
        source = self.get_eval_dataloader(dataset)
        out = self.evaluation_loop(source, "Evaluation", ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        metrics = {**out.metrics, **self.stop_memory_tracking("eval")}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def predict(self, test_dataset, ignore_keys: list[str] | None = None,
                metric_key_prefix: str = "test") -> PredictionOutput:
        """Every non-loss output of the model on `test_dataset` (a tuple when there are several), the
        labels if present, and metrics; sequences are padded with -100 across batches, as HF."""
        self.start_memory_tracking("test")
        out = self.evaluation_loop(self.get_test_dataloader(test_dataset), "predict", ignore_keys=ignore_keys,
                                   metric_key_prefix=metric_key_prefix)
        metrics = {**out.metrics, **self.stop_memory_tracking("test")}
        self.control = self.callback_handler.on_predict(self.args, self.state, self.control, metrics)
        return PredictionOutput(out.predictions, out.label_ids, metrics)

    def evaluation_loop(self, dataloader, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval") -> EvalLoopOutput:
        """Run prediction_step over `dataloader` (what get_eval_dataloader returns) and gather."""
        self.log_evaluation_start(dataloader, description)
        return evaluation_loop(self, dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> str:
        """Write the model (rank 0) as from_pretrained loads it: model.safetensors, and for a transformers
        model config.json; a PEFT model's adapter as PEFT writes it (save_merged_model: also merged/);
        the processing class's files, training_args.json and .bin."""
        output_dir = output_dir or self.args.output_dir
        strategy = self.get_strategy()
        # a PEFT model's adapter alone, unless merged/ needs its base too
        trainable_only = adapters.peft_of(self.model) is not None and not self.args.save_merged_model
        state = strategy.model_state_dict(trainable_only=trainable_only) if strategy.model is not None else \
            {k: v.detach().cpu() for k, v in unwrap_model(self.model).state_dict().items()}
        if strategy.is_main:
            adapters.save_model_dir(self.model, state, self.processing_class, self.args, output_dir)
        strategy.barrier()
        return output_dir

    def hyperparameter_search(self, hp_space=None, compute_objective=None, n_trials: int = 20,
                              direction: str | list[str] | None = None, backend: str | None = None, hp_name=None,
                              **kwargs):
        """Search hyperparameters as HF does (needs model_init); returns a BestRun (a list for several directions).
        The objective: compute_objective, else `hp_objective` (GRPO / RLOO: the evaluation's mean reward, maximized),
        else HF's default_compute_objective; minimized unless `direction` or hp_objective says otherwise.
        backend "optuna" (None: HF's default when installed): trials one after another in this process
        (raytrain.sweep.optuna_backend); "ray": Ray Tune trials (raytrain.sweep.search.hyperparameter_search)."""
        from .sweep.optuna_backend import run_hp_search
        return run_hp_search(self, hp_space, compute_objective, n_trials, direction, backend, hp_name, **kwargs)

    def add_callback(self, callback) -> None:
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback):
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback) -> None:
        self.callback_handler.remove_callback(callback)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Append to log_history (with epoch and step, as HF) and fire on_log. As HF, `logs` itself gets
        the epoch (so evaluate()'s metrics carry it)."""
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch
        if self.args.include_num_input_tokens_seen != "no":
            logs["num_input_tokens_seen"] = self.state.num_input_tokens_seen
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)

    # ------------------------------------------------------------ overridable: data
    def get_train_dataloader(self):
        """This rank's training batches: a data source (deterministic, sharded, resumable) over the
        prepared train_dataset. An override may return any iterable of batches (e.g. a DataLoader);
        resuming then replays it up to the saved position."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        return self._build_source(self.train_dataset, self._train_batch_size, "train_dataset",
                                  shuffle=True, training=True)

    def get_eval_dataloader(self, eval_dataset=None):
        """Evaluation batches of `eval_dataset` (a dataset, or the name of one in a dict eval_dataset),
        built once per dataset and reused."""
        named = self.eval_dataset if is_named_datasets(self.eval_dataset) else {}
        if isinstance(eval_dataset, str) and eval_dataset in named:
            eval_dataset = named[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        name = "eval_dataset" if dataset is self.eval_dataset or any(dataset is d for d in named.values()) \
            else "dataset"
        return self._build_source(dataset, self.args.per_device_eval_batch_size, name, shuffle=False, training=False)

    def get_test_dataloader(self, test_dataset):
        return self._build_source(test_dataset, self.args.per_device_eval_batch_size, "test_dataset",
                                  shuffle=False, training=False)

    def _build_source(self, dataset, batch_size: int, name: str, shuffle: bool, training: bool, sampler=None):
        """A torch DataLoader (data/loaders.RankLoader) over a source for `dataset` as HF prepares it;
        evaluation sources are built (and checked) once per dataset and batch size, and reused. As HF, a
        new loader each call, but one kept per dataset with dataloader_persistent_workers. `sampler`: a
        subclass's own (HF's _get_train_sampler), whose order the rows keep, handed over as they are."""
        from .data.build import model_inputs
        from .data.loaders import RankLoader, build_loader, prepare_dataset
        args, strategy = self.args, self.get_strategy()
        cache = self.__dict__.setdefault("_data_sources", {})
        key = (id(dataset), batch_size, training, *(shard := strategy.data_shard(training)).values())  # which rows
        hit = cache.get(key)
        if hit is not None and hit[0] is dataset and not training:
            if args.dataloader_persistent_workers and args.dataloader_num_workers:
                return hit[1]
            return RankLoader(hit[1].source, hit[1].dataset, args.dataloader_num_workers)
        input_name = (getattr(self.processing_class, "model_input_names", None) or ["input_ids"])[0]
        own = getattr(self, "_signature_columns", None)  # HF's: a trainer that names its columns builds its inputs
        prepared = prepare_dataset(dataset, self.model, args, name, own, rename_labels=sampler is None)
        source = build_loader(prepared, batch_size, args, sampler=sampler,
                              seed=args.data_seed if args.data_seed is not None else args.seed,
                              drop_last=args.dataloader_drop_last, shuffle=shuffle,  # evaluation's too, as HF
                              **shard, collate_fn=self.data_collator,
                              columns=None if own else model_inputs(self.model, training=training), name=name,
                              input_name=input_name)
        loader = RankLoader(source, prepared, args.dataloader_num_workers, args.dataloader_persistent_workers)
        cache[key] = (dataset, loader)  # holds the dataset, so its id is not reused while cached
        return loader

    # ------------------------------------------------------------ overridable: optimizer and schedule
    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """The optimizer over `model`'s parameters (as the backend placed them): optimizer_cls_and_kwargs
        if given, else args.optim; weight decay skips biases and norms."""
        if model is None:
            model = self.__dict__.get("_placed_model") or self.model_wrapped or self.model
        if self.optimizer is None:
            if self.optimizer_cls_and_kwargs is not None:
                cls, kwargs = self.optimizer_cls_and_kwargs
                self.optimizer = build_optimizer(cls, kwargs, model, self.args.weight_decay)
            else:
                self.optimizer = create_optimizer(model, self.args)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        """The learning-rate schedule (args.lr_scheduler_type) over num_training_steps."""
        if self.lr_scheduler is None:
            self.lr_scheduler = create_scheduler(optimizer if optimizer is not None else self.optimizer,
                                                 self.args, num_training_steps)
        return self.lr_scheduler

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        self.create_optimizer()
        self.create_scheduler(num_training_steps, self.optimizer)

    def optimizer_factory(self, num_training_steps: int) -> Callable[[torch.nn.Module], torch.optim.Optimizer]:
        """What the strategy calls once it placed the model: create_optimizer, or an overridden
        create_optimizer_and_scheduler (whose create_optimizer() then sees the placed model)."""
        overridden = type(self).create_optimizer_and_scheduler is not Trainer.create_optimizer_and_scheduler

        def build(model: torch.nn.Module) -> torch.optim.Optimizer:
            if not overridden:
                return self.create_optimizer(model)
            self._placed_model = model
            try:
                self.create_optimizer_and_scheduler(num_training_steps)
            finally:
                del self._placed_model
            return self.optimizer
        return build

    # ------------------------------------------------------------ overridable maths
    def _prepare_inputs(self, inputs: dict) -> dict:
        """The batch on this rank's device (HF's name: override this one)."""
        device = self.get_strategy().device
        if device.type == "cpu":
            return inputs
        non_blocking = self.accelerator.non_blocking  # accelerator_config's (accelerate's default: a blocking copy)
        return {k: v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v
                for k, v in inputs.items()}

    def prediction_step(self, model, inputs: dict, prediction_loss_only: bool, ignore_keys: list[str] | None = None):
        """(loss, predictions, labels) for one evaluation batch; loss is the batch's mean; predictions are
        every non-loss output (a tuple when there are several), as HF."""
        if self.get_strategy().pipeline is not None:
            return self._pipeline_prediction_step(model, inputs, prediction_loss_only)
        has_labels = bool(self.label_names) and all(inputs.get(k) is not None for k in self.label_names)
        labels = None
        if has_labels:
            labels = tuple(inputs[k].detach() for k in self.label_names)
            labels = labels[0] if len(labels) == 1 else labels
        if ignore_keys is None:
            ignore_keys = hf.ignore_keys_for(unwrap_model(model))
        with torch.no_grad(), self.get_strategy().autocast():
            if has_labels:  # HF's num_items_in_batch: this batch's items, a tensor
                if self.args.use_liger_kernel and prediction_loss_only:  # HF: Liger's loss without the logits
                    inputs = {**inputs, "skip_logits": True}
                loss, outputs = self.compute_loss(model, inputs, return_outputs=True,
                                                  num_items_in_batch=self._eval_num_items(inputs))
            else:
                outputs = model(**inputs)
                loss = None
        if loss is not None:
            loss = loss.detach().mean()
        if prediction_loss_only:
            return loss, None, None
        return loss, hf.predictions_of(outputs, loss is not None, ignore_keys), labels

    def floating_point_ops(self, inputs: dict) -> float:
        """HF's count: 6 x the main input's elements x the parameters less embeddings, for models that
        say how many they have (PreTrainedModel.num_parameters); 0 for others, as HF."""
        model = self.model
        if "_flops_per_item" not in self.__dict__:  # looked up once: a failed Module attribute lookup is slow
            main = getattr(model, "main_input_name", "input_ids")
            count = getattr(model, "num_parameters", None)
            self._flops_per_item = (main, 6.0 * count(exclude_embeddings=True)) if callable(count) else None
        if self._flops_per_item is None or self._flops_per_item[0] not in inputs:
            return 0.0
        main, per_item = self._flops_per_item
        return per_item * inputs[main].numel()

    def call_model_init(self, trial=None) -> torch.nn.Module:
        positional = [p for p in inspect.signature(self.model_init).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        model = self.model_init(trial) if len(positional) == 1 else self.model_init()
        if model is None:
            raise ValueError("model_init returned None; it must return an nn.Module")
        return model

    def hp_search_setup(self, args: TrainingArguments, model: torch.nn.Module, callbacks: list | None = None,
                        trial_name: str | None = None, trial_params: dict | None = None) -> None:
        """Make this Trainer (a sweep's copy of the user's, subclass and all) one trial's, as if built with
        the trial's args, model and callbacks (HF's _hp_search_setup). The other arguments stay, but for
        model_init (the sweep made `model`) and optimizers (the driver's model's); caches, state are new."""
        self.forget_caches()
        accepts = self.model_accepts_loss_kwargs  # HF decides it once, at the Trainer's construction
        Trainer.__init__(self, model=model, args=args, data_collator=self.data_collator,
                         train_dataset=self.train_dataset, eval_dataset=self.eval_dataset,
                         processing_class=self.processing_class, compute_loss_func=self.compute_loss_func,
                         compute_metrics=self.compute_metrics, callbacks=callbacks,
                         optimizer_cls_and_kwargs=self.optimizer_cls_and_kwargs,
                         preprocess_logits_for_metrics=self.preprocess_logits_for_metrics)
        self.trial_name, self.trial_params, self.model_accepts_loss_kwargs = trial_name, trial_params, accepts

    def forget_caches(self) -> None:
        """What this Trainer derived from its model, data and arguments (data sources, FLOPs, batch size found)."""
        for cache in ("_data_sources", "_model_flops", "_num_params", "_loss_shifts", "_found_batch_size"):
            self.__dict__.pop(cache, None)

    #: The metric a sweep optimises when given no compute_objective and no metric, and its direction when given
    #: none; None: HF's default_compute_objective, minimized. TRL's GRPO / RLOO: the evaluation's mean reward.
    hp_objective: tuple[str, str] | None = None

    # ------------------------------------------------------------ hooks the worker calls (worker/protocol.py)
    def get_strategy(self):
        """This process's Strategy (the backend), created from args on first use."""
        if self._strategy is None:
            from .strategies import create_strategy
            self._strategy = create_strategy(self.args)
        return self._strategy

    def set_strategy(self, strategy) -> None:
        """Use `strategy` from now on; None: create one from args on next use (a fresh process)."""
        self._strategy = strategy

    def prepare_inputs(self, inputs: dict) -> dict:
        """The batch on this rank's device, by HF's overridable _prepare_inputs."""
        return self._prepare_inputs(inputs)

    def rank_state(self) -> dict | None:
        """What a subclass keeps on this rank between steps (GRPO's rollout buffer): saved in each checkpoint as
        plain data and tensors (trainer_rank_state[_R].pth); None: nothing."""
        return None

    def load_rank_state(self, state: dict | None) -> None:
        """rank_state()'s value back on resume (None: the checkpoint has none for this rank)."""

    def report_to_trial(self, trial, metrics: dict, checkpoint_dir: str | None = None) -> None:
        """An evaluation's metrics (and the checkpoint saved with them) to a sweep's trial reporter."""
        report = getattr(trial, "report", None)
        if callable(report):
            report(metrics, self.state.global_step, checkpoint_dir)

    def start_memory_tracking(self, stage: str = "train") -> None:
        """HF's memory metrics ({stage}_mem_cpu_alloc_delta ...) for init, train, eval and test."""
        if not self.args.skip_memory_metrics:
            self._memory.start(stage)

    def stop_memory_tracking(self, stage: str) -> dict[str, int]:
        """The stage's memory metrics (with init's, the first time), or {} under skip_memory_metrics."""
        return {} if self.args.skip_memory_metrics else self._memory.stop(stage)


class Seq2SeqTrainer(Seq2SeqMethods, Trainer):
    """transformers' Seq2SeqTrainer: Trainer with generation in evaluate() / predict() (raytrain.hf.seq2seq)."""


def trainer_class(args: Any) -> type[Trainer]:
    """The CLI's Trainer for `args`: a Seq2SeqTrainer for Seq2SeqTrainingArguments."""
    return Seq2SeqTrainer if isinstance(args, Seq2SeqTrainingArguments) else Trainer
