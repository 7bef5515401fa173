"""DefaultFlowCallback: turns the logging/eval/save strategies into TrainerControl flags."""

from __future__ import annotations

from .base import TrainerCallback


class DefaultFlowCallback(TrainerCallback):
    """HF's default flow: log, evaluate and save every N steps or each epoch, stop at max_steps."""

    drives_the_loop = True  # CallbackHandler warns when no callback does

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if step == 1 and args.logging_first_step:
            control.should_log = True
        if args.logging_strategy == "steps" and state.logging_steps > 0 and step % state.logging_steps == 0:
            control.should_log = True
        evaluating_steps = args.eval_strategy == "steps" and state.eval_steps > 0 and args.eval_delay <= step
        if evaluating_steps and step % state.eval_steps == 0:
            control.should_evaluate = True
        if args.save_strategy == "steps" and state.save_steps > 0 and step % state.save_steps == 0:
            control.should_save = True
        if step >= state.max_steps:
            control.should_training_stop = True
            if evaluating_steps and step % state.eval_steps != 0:
                control.should_evaluate = True  # the final step is always evaluated, as HF 5
            # A run always ends with a checkpoint. With save_strategy "epoch" it is the epoch-end
            # save (on_epoch_end fires after the last step), which follows the epoch-end evaluation,
            # so the last epoch can become the best checkpoint.
            if args.save_strategy == "steps":
                control.should_save = True
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        if args.logging_strategy == "epoch":
            control.should_log = True
        if args.eval_strategy == "epoch" and args.eval_delay <= (state.epoch or 0):
            control.should_evaluate = True
        if args.save_strategy == "epoch":
            control.should_save = True
        return control
