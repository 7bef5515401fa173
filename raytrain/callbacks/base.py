"""TrainerCallback (HF's events and signature) and the CallbackHandler that fires them."""

from __future__ import annotations

import logging
from typing import Any

from .state import TrainerControl, TrainerState

# HF's names: transformers.logging settings (and HF's tests) govern the Trainer's HF messages.
logger = logging.getLogger("transformers.trainer_callback")
trainer_logger = logging.getLogger("transformers.trainer")

EVENTS = (
    "on_init_end", "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
    "on_step_begin", "on_pre_optimizer_step", "on_optimizer_step", "on_substep_end",
    "on_step_end", "on_evaluate", "on_predict", "on_prediction_step", "on_save", "on_log",
)


class TrainerCallback:
    """Observe the loop and steer it through TrainerControl. Override any `on_EVENT`.

    Each event is called as `on_EVENT(args, state, control, **kwargs)`; kwargs carry model,
    processing_class, optimizer, lr_scheduler, train_dataloader, eval_dataloader and, where they
    exist, metrics or logs (as HF passes them).
    A callback may return a TrainerControl to replace the current one.
    """

    def on_init_end(self, args, state, control, **kwargs): pass
    def on_train_begin(self, args, state, control, **kwargs): pass
    def on_train_end(self, args, state, control, **kwargs): pass
    def on_epoch_begin(self, args, state, control, **kwargs): pass
    def on_epoch_end(self, args, state, control, **kwargs): pass
    def on_step_begin(self, args, state, control, **kwargs): pass
    def on_pre_optimizer_step(self, args, state, control, **kwargs): pass
    def on_optimizer_step(self, args, state, control, **kwargs): pass
    def on_substep_end(self, args, state, control, **kwargs): pass
    def on_step_end(self, args, state, control, **kwargs): pass
    def on_evaluate(self, args, state, control, **kwargs): pass
    def on_predict(self, args, state, control, **kwargs): pass
    def on_prediction_step(self, args, state, control, **kwargs): pass
    def on_save(self, args, state, control, **kwargs): pass
    def on_log(self, args, state, control, **kwargs): pass
    def on_push_begin(self, args, state, control, **kwargs): pass


class ExportableState:
    """A callback whose state must survive a restart: `state()` returns
    {"args": constructor kwargs, "attributes": attributes to restore}; it rides in
    trainer_state.json's stateful_callbacks and is restored on resume."""

    def state(self) -> dict:
        raise NotImplementedError

    @classmethod
    def from_state(cls, state: dict):
        instance = cls(**state.get("args", {}))
        for k, v in state.get("attributes", {}).items():
            setattr(instance, k, v)
        return instance


class CallbackHandler(TrainerCallback):
    """Calls every callback in order for each event and resets the control flags as HF does."""

    def __init__(self, callbacks, model=None, processing_class=None, optimizer=None, lr_scheduler=None):
        self.callbacks: list[TrainerCallback] = []
        for cb in callbacks or []:
            self.add_callback(cb)
        self._warn_without_flow()
        self.model = model
        self.processing_class = processing_class
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.train_dataloader = None
        self.eval_dataloader = None

    def add_callback(self, callback) -> None:
        cb = callback() if isinstance(callback, type) else callback
        cb_class = type(cb)
        if any(type(c) is cb_class for c in self.callbacks):
            logger.warning(f"You are adding a {cb_class} to the callbacks of this Trainer, but there is already "
                           f"one. The current list of callbacks is\n:{self.callback_list}")  # HF's words
        self.callbacks.append(cb)

    def pop_callback(self, callback):
        """Remove and return a callback given as an instance or a class (its first instance)."""
        for cb in self.callbacks:
            if (isinstance(callback, type) and type(cb) is callback) or cb is callback:
                self.callbacks.remove(cb)
                return cb
        return None

    def remove_callback(self, callback) -> None:
        self.pop_callback(callback)
        self._warn_without_flow()

    def _warn_without_flow(self) -> None:
        """As HF: without DefaultFlowCallback nothing logs, evaluates, saves or stops at max_steps."""
        if not any(getattr(cb, "drives_the_loop", False) for cb in self.callbacks):
            logger.warning("The Trainer will not work properly if you don't have a `DefaultFlowCallback` in its "
                           "callbacks. You should add one before training with "
                           "`trainer.add_callback(DefaultFlowCallback)`. The current list of callbacks is:\n"
                           f"{self.callback_list}")

    @property
    def callback_list(self) -> str:
        return "\n".join(type(cb).__name__ for cb in self.callbacks)

    def on_init_end(self, args, state, control):
        return self.call_event("on_init_end", args, state, control)

    def on_train_begin(self, args, state, control):
        control._new_training()
        return self.call_event("on_train_begin", args, state, control)

    def on_train_end(self, args, state, control):
        return self.call_event("on_train_end", args, state, control)

    def on_epoch_begin(self, args, state, control):
        control._new_epoch()
        return self.call_event("on_epoch_begin", args, state, control)

    def on_epoch_end(self, args, state, control):
        return self.call_event("on_epoch_end", args, state, control)

    def on_step_begin(self, args, state, control):
        control._new_step()
        return self.call_event("on_step_begin", args, state, control)

    def on_pre_optimizer_step(self, args, state, control):
        return self.call_event("on_pre_optimizer_step", args, state, control)

    def on_optimizer_step(self, args, state, control):
        return self.call_event("on_optimizer_step", args, state, control)

    def on_substep_end(self, args, state, control):
        return self.call_event("on_substep_end", args, state, control)

    def on_step_end(self, args, state, control):
        return self.call_event("on_step_end", args, state, control)

    def on_evaluate(self, args, state, control, metrics):
        control.should_evaluate = False
        return self.call_event("on_evaluate", args, state, control, metrics=metrics)

    def on_predict(self, args, state, control, metrics):
        return self.call_event("on_predict", args, state, control, metrics=metrics)

    def on_prediction_step(self, args, state, control):
        return self.call_event("on_prediction_step", args, state, control)

    def on_save(self, args, state, control):
        control.should_save = False
        return self.call_event("on_save", args, state, control)

    def on_log(self, args, state, control, logs):
        control.should_log = False
        return self.call_event("on_log", args, state, control, logs=logs)

    def on_push_begin(self, args, state, control, **kwargs):
        return self.call_event("on_push_begin", args, state, control, **kwargs)

    def _listeners(self, event: str) -> list[TrainerCallback]:
        """Callbacks that override `event` (the others' no-op is skipped: it runs every step)."""
        key = (event, tuple(map(id, self.callbacks)))
        cache = self.__dict__.setdefault("_listener_cache", {})
        if key not in cache:
            base = getattr(TrainerCallback, event)
            cache[key] = [cb for cb in self.callbacks
                          if getattr(type(cb), event, base) is not base or event in vars(cb)]
        return cache[key]

    def call_event(self, event: str, args, state: TrainerState, control: TrainerControl, **kwargs):
        for cb in self._listeners(event):
            result = getattr(cb, event)(
                args, state, control, model=self.model, processing_class=self.processing_class,
                optimizer=self.optimizer, lr_scheduler=self.lr_scheduler, train_dataloader=self.train_dataloader,
                eval_dataloader=self.eval_dataloader, **kwargs,
            )
            if result is not None:
                control = result
        return control

    def export_states(self) -> dict[str, Any]:
        """stateful_callbacks for trainer_state.json: class name -> state (a list if several)."""
        out: dict[str, Any] = {}
        for cb in self.callbacks:
            if isinstance(cb, ExportableState):
                name = type(cb).__name__
                if name in out:
                    prev = out[name] if isinstance(out[name], list) else [out[name]]
                    out[name] = prev + [cb.state()]
                else:
                    out[name] = cb.state()
        return out

    def rebuild_from_states(self, stateful: dict[str, Any]) -> None:
        """HF's restore_callback_states_from_checkpoint: each saved callback of a class the trainer has
        is rebuilt as `cls(**args)` with its attributes set, replacing the trainer's instance."""
        for name, saved in stateful.items():
            saved = saved if isinstance(saved, list) else [saved]
            matching = [cb for cb in self.callbacks if type(cb).__name__ == name and isinstance(cb, ExportableState)]
            if not matching:
                trainer_logger.warning("Checkpoint included callbacks not included in current configuration. "
                                       f"Ignoring. ({name})")
            for cb, st in zip(matching, saved):
                self.callbacks[self.callbacks.index(cb)] = type(cb).from_state(st)

    def restore_states(self, stateful: dict[str, Any]) -> None:
        """Put saved callback state back into the callbacks of the same class, in order."""
        for name, saved in stateful.items():
            saved = saved if isinstance(saved, list) else [saved]
            matching = [cb for cb in self.callbacks
                        if type(cb).__name__ == name and isinstance(cb, ExportableState)]
            if len(matching) != len(saved):
                trainer_logger.warning(f"checkpoint has state for {len(saved)} {name} callback(s) but the trainer "
                                       f"has {len(matching)}; restoring the first {min(len(saved), len(matching))}")
            for cb, st in zip(matching, saved):
                for k, v in st.get("attributes", {}).items():
                    setattr(cb, k, v)
