"""The CLI: python -m raytrain.run --config X.yaml [--set key=value ...] [--resume auto|never|PATH].

Reproducible: the seed is set before the model factory runs. Errors the user can fix print one line
(exit 2 for configuration, 1 for the rest); the traceback goes to OUTPUT_DIR/raytrain.log, and to
stderr with --debug. Ctrl-C or SIGTERM saves a checkpoint at the next step boundary and exits
130 / 143 with the command that continues; a second Ctrl-C exits at once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import signal
import sys

from .config.args import ConfigError, TrainingArguments, cli_help
from .cli.job import build_job
from .cli.search import SEARCH_HELP, run_search_cli
from .cli.trl import trainer_for, trl_arguments
from .config.seq2seq import arguments_from_yaml, seq2seq_help

EXIT_CONFIG = 2
EXIT_ERROR = 1
LOG_FILE = "raytrain.log"
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))

logger = logging.getLogger(__name__)
_ARGV: list[str] | None = None  # main()'s argv when called from Python (else sys.argv)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own errors: one line, exit 2
        self.exit(EXIT_CONFIG, f"error: {message}{_set_hint(self.argv)}\n")

    def parse_args(self, args=None, namespace=None):
        self.argv = list(sys.argv[1:] if args is None else args)
        return super().parse_args(args, namespace)


def _set_hint(argv: list[str]) -> str:
    """`--set key value` (a space for the '='): say how to write it."""
    for flag, key, value in zip(argv, argv[1:], argv[2:]):
        if flag == "--set" and "=" not in key and not value.startswith("-"):
            return f" (--set takes KEY=VALUE: write --set {key}={value})"
    return ""


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m raytrain.run",
        description="Train (and evaluate) a model described by a YAML config.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config fields (set in the YAML or with --set):\n" + cli_help() + "\n\n" + seq2seq_help() + "\n\n"
               + SEARCH_HELP,
    )
    p.add_argument("--config", required=True, help="YAML file with TrainingArguments and model/data sections")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field, dotted for sections (model.hidden_size=128); repeatable")
    p.add_argument("--resume", default="auto",
                   help="auto: continue the newest valid checkpoint in output_dir if any (default); "
                        "never: start fresh (fails if output_dir has checkpoints); or a checkpoint path")
    p.add_argument("--search", default=None, help="YAML search space: run a hyperparameter search instead "
                                                  "(--resume auto continues the sweep of the same name)")
    p.add_argument("--debug", action="store_true", help="print the full traceback of an error")
    p.add_argument("--no-report", dest="report", action="store_false",
                   help="do not write the PNG plots (OUTPUT_DIR/plots) at the end of the run")
    return p


def _resume_arg(value: str, args: TrainingArguments):
    """--resume as the Trainer's resume_from_checkpoint; mistakes named with CLI flags."""
    from .checkpoint.store import MANIFEST, sorted_checkpoints
    from .worker.resume import fresh_start_refusal

    if value == "auto":
        return "auto"
    if value == "never":
        refusal = None if args.overwrite_output_dir else fresh_start_refusal(args.output_dir)
        if refusal:
            raise ConfigError(refusal)
        return None
    if not os.path.isdir(value):
        raise ConfigError(f"--resume: {value!r} is not a checkpoint directory (or use auto / never)")
    inside = sorted_checkpoints(value)
    if not os.path.exists(os.path.join(value, MANIFEST)) and inside:
        raise ConfigError(f"--resume: {value!r} is an output directory, not a checkpoint; pass one of its "
                          f"checkpoints (--resume {inside[-1][1]}) or --resume auto with --set output_dir={value}")
    return value


# Advice written for Python callers, said with CLI flags here.
_CLI_WORDS = [
    ("resume_from_checkpoint=True", "--resume auto"),
    ("resume_from_checkpoint='auto'", "--resume auto"),
    ("pass its path", "pass it with --resume PATH"),
    ("set overwrite_output_dir to", "--set overwrite_output_dir=true to"),
    ("set ignore_data_skip to", "--set ignore_data_skip=true to"),
    ("the model returned no loss", "the model (model.factory) returned no loss"),
    (", or pass compute_loss_func(outputs, labels, num_items_in_batch)", ""),
]


def _cli_words(message: str) -> str:
    for python, cli in _CLI_WORDS:
        message = message.replace(python, cli)
    return message


def _record(line: str) -> None:
    """A line in OUTPUT_DIR/raytrain.log alone (the run's start and end): the console has its own."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and handler.baseFilename.endswith(LOG_FILE):
            handler.handle(logging.LogRecord("raytrain.run", logging.INFO, __file__, 0, line, None, None))


class _Session:
    """Where errors go: one line on stderr, the traceback in OUTPUT_DIR/raytrain.log (and with --debug)."""

    def __init__(self, ns):
        self.ns = ns
        self.log_path: str | None = None
        self.output_dir: str | None = None  # known once the configuration is valid
        self.handler: logging.Handler | None = None
        self.phase = "before training started (while building the model and the data)"

    def open_log(self, output_dir: str) -> None:
        os.makedirs(output_dir, exist_ok=True)
        self.log_path = os.path.join(output_dir, LOG_FILE)
        self.handler = logging.FileHandler(self.log_path)
        self.handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        with open(self.log_path, "a") as f:  # the command heads each invocation's part of the log
            f.write(f"\n=== {continue_command(keep_resume=True)}\n")
        logging.getLogger().addHandler(self.handler)
        _record(f"started: output_dir {os.path.abspath(output_dir)}, checkpoints in "
                f"{os.path.abspath(output_dir)}/checkpoint-N (pid {os.getpid()})")

    def close(self) -> None:
        if self.handler is not None:
            logging.getLogger().removeHandler(self.handler)
            self.handler.close()

    def fail(self, error: BaseException) -> int:
        from .worker.signals import Interrupted

        if self.log_path is None and self.output_dir is not None:
            try:  # an error before training started: its traceback goes to the run's log all the same
                self.open_log(self.output_dir)
            except OSError:
                pass
        if self.log_path:  # the traceback goes to the file only
            import traceback

            with open(self.log_path, "a") as f:
                f.write("".join(traceback.format_exception(error)))
                first = (str(error).strip().splitlines() or [""])[0]
                f.write(f"=== ended: failed ({type(error).__name__}: {first})\n")
        if isinstance(error, (Interrupted, KeyboardInterrupt)):
            signum = getattr(error, "signum", signal.SIGINT)
            print(f"{signal.Signals(signum).name}: interrupted {self.phase}; nothing new was saved; "
                  f"continue with: {continue_command()}", file=sys.stderr)
            return 128 + signum
        fixable = _fixable(error)
        if fixable is None or self.ns.debug:
            import traceback

            traceback.print_exception(error)
        if fixable is None:
            return EXIT_ERROR
        where = f" (traceback in {self.log_path}; --debug prints it)" if self.log_path and not self.ns.debug else ""
        print(f"error: {_cli_words(fixable)}{where}", file=sys.stderr)
        return EXIT_CONFIG if isinstance(error, (ConfigError, FileExistsError)) else EXIT_ERROR


def _fixable(error: BaseException) -> str | None:
    """The one-line message of an error the user can fix, or None for a crash (show the traceback).
    Fixable: raytrain's own error types, and the standard ones raytrain raises with a message."""
    checkpoint = sys.modules.get(f"{__package__}.checkpoint")  # not loaded: no CheckpointError (and no torch import)
    if isinstance(error, (ConfigError, FileExistsError)) or type(error).__name__ in ("NonFiniteError", "Preempted") \
            or (checkpoint is not None and isinstance(error, checkpoint.CheckpointError)):
        return str(error)
    if isinstance(error, (ValueError, KeyError, TypeError, FileNotFoundError)) and _raised_by_raytrain(error):
        return error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    return None


def _raised_by_raytrain(error: BaseException) -> bool:
    tb = error.__traceback__
    last = None
    while tb is not None:
        last, tb = tb, tb.tb_next
    return last is not None and os.path.abspath(last.tb_frame.f_code.co_filename).startswith(_PACKAGE_DIR)


def continue_command(keep_resume: bool = False) -> str:
    """This invocation again, with --resume auto (the default): what continues an interrupted run."""
    argv, out, skip = _ARGV if _ARGV is not None else sys.argv[1:], [], False
    if keep_resume:
        return shlex.join(["python", "-m", "raytrain.run", *argv])
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--resume":
            skip = True
            continue
        if a.startswith("--resume="):
            continue
        out.append(a)
    return shlex.join(["python", "-m", "raytrain.run", *out])


def _status(text: str) -> None:
    """A transient line on a terminal (cleared by the next output); nothing in logs."""
    if sys.stderr.isatty():
        sys.stderr.write(f"\r\033[K{text}\r")
        sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    global _ARGV
    ns = _parser().parse_args(argv)
    _ARGV = list(argv) if argv is not None else None
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    # HF's "***** Running training *****" blocks (on transformers' loggers): only with log_level info, which
    # Trainer.__init__ applies; until then transformers' own default level, warning, imported or not.
    if logging.getLogger("transformers").level == logging.NOTSET:
        logging.getLogger("transformers").setLevel(logging.WARNING)
    session = _Session(ns)
    try:
        return _main(ns, session)
    except (Exception, KeyboardInterrupt) as e:
        return session.fail(e)
    finally:
        session.close()


def _main(ns, session: _Session) -> int:
    searching = [s for s in ns.overrides if s.startswith("search.")]
    if searching and not ns.search:
        raise ConfigError(f"--set {searching[0]}: search settings need --search FILE (the search YAML they change)")
    args = _training_arguments(ns.config, [s for s in ns.overrides if not s.startswith("search.")])
    search = None
    if ns.search:  # checked before any work: a bad search YAML fails in one line, writing nothing
        from .sweep import load_search_spec

        search = load_search_spec(ns.search, [s.removeprefix("search.") for s in searching])
    session.output_dir = args.output_dir
    resume = _resume_arg(ns.resume, args)
    _status(f"importing torch and {args.model.factory if args.model else 'the model'} ...")
    from .worker.signals import graceful_stop
    from .trainer import set_seed

    with graceful_stop() as stop:
        set_seed(args.seed, args.full_determinism)  # before the factory: the initial weights follow the seed
        _status("building the model and the datasets ...")
        job = build_job(args)
        if not ns.search:
            return _train(ns, session, args, job, resume, stop)
    return run_search_cli(  # outside graceful_stop: Ray Tune handles Ctrl-C itself
        args, job, ns.search, resume, search)


def _training_arguments(config: str, overrides: list[str]) -> TrainingArguments:
    """TrainingArguments from the YAML and --set; a search setting given as a training field says where it goes."""
    from .sweep.space import SPEC_KEYS

    try:
        return arguments_from_yaml(config, overrides)  # Seq2SeqTrainingArguments if it names their fields
    except ConfigError as e:
        name = str(e).split("'")[1] if str(e).startswith("unknown field '") else None
        trl_args = trl_arguments(config, overrides, name)
        if trl_args is not None:
            return trl_args
        if name in SPEC_KEYS:
            raise ConfigError(f"{name} is a search setting, not a training field: put it in the --search YAML "
                              f"or write --set search.{name}=VALUE") from None
        raise


def _train(ns, session: _Session, args: TrainingArguments, job: dict, resume, stop) -> int:
    from .driver.signals import ray_train_signals
    from .worker.signals import StopOnSignal

    session.open_log(args.output_dir)
    trainer = trainer_for(args)(args=args, **job)
    run = _TrackedRun.open(trainer, resume)
    trainer.add_callback(StopOnSignal(stop))
    resumed_at = _resumed_step(args.output_dir, resume)  # before this run writes checkpoints of its own
    try:
        # In Ray workers, a signal makes them save and stop (ray_train_signals); here, StopOnSignal.
        with ray_train_signals(stop) if args.should_use_distributed else contextlib.nullcontext():
            out = trainer.train(resume_from_checkpoint=resume)
    except BaseException:
        run.end("KILLED" if stop.signum else "FAILED")
        if stop.signum and args.should_use_distributed:  # the workers saved; Ray reports their stop
            return _stopped_workers(args, stop)
        raise
    if stop.stopped_at is not None:
        run.end("KILLED")
        return _stopped(trainer, stop)
    if trainer.state.global_step == resumed_at:
        print(f"already complete at step {trainer.state.global_step} (max_steps {trainer.state.max_steps}): "
              f"nothing left to train; raise max_steps (--set max_steps=N) to train on, or start over with "
              f"--resume never --set overwrite_output_dir=true (its checkpoints are then deleted)",
              file=sys.stderr, flush=True)
    session.phase = "after training (in the final evaluation and save; the last checkpoint is complete)"
    try:
        summary = _finish(trainer, out, ns.report, run)
    except BaseException:
        run.end("KILLED" if stop.signum else "FAILED")
        raise
    print("summary: " + json.dumps(summary, default=str))
    run.print_ui_line()
    _record(f"ended: finished at step {trainer.state.global_step}; checkpoints in "
            f"{os.path.abspath(args.output_dir)}; final model {summary.get('model')}")
    return 0


def _resumed_step(output_dir: str, resume) -> int | None:
    """The step of the checkpoint this run continued from (None for a fresh start)."""
    from .callbacks.state import TrainerState
    from .worker.resume import likely_checkpoint

    path = likely_checkpoint(output_dir, resume) if os.path.isdir(output_dir) else None
    if path is None or not os.path.isfile(os.path.join(path, "trainer_state.json")):
        return None
    return TrainerState.load_from_json(os.path.join(path, "trainer_state.json")).global_step


def _last_evaluation(trainer) -> dict | None:
    """The evaluation logged at the run's last step, when the model is still the one it evaluated (no other
    best checkpoint loaded at the end): the summary reuses it rather than evaluating and printing it again."""
    state, args = trainer.state, trainer.args
    best = state.best_model_checkpoint
    if args.load_best_model_at_end and best and os.path.basename(best) != f"checkpoint-{state.global_step}":
        return None
    last = next((e for e in reversed(state.log_history) if any(k.startswith("eval_") for k in e)), None)
    if last is None or last.get("step") != state.global_step:
        return None
    return {k: v for k, v in last.items() if k.startswith("eval_")}


def _finish(trainer, out, report: bool, run: _TrackedRun) -> dict:
    """After training: the final evaluation, model, trainer_state.json, plots and MLflow artifacts."""
    from .checkpoint.store import ADAPTER_WEIGHTS, WEIGHTS, WEIGHTS_INDEX

    args = trainer.args
    summary = {"global_step": out.global_step, "train_loss": out.training_loss,
               "train_runtime": out.metrics.get("train_runtime")}
    if trainer.eval_dataset is not None:
        summary.update(_last_evaluation(trainer) or trainer.evaluate())
    final = trainer.save_model(os.path.join(args.output_dir, "final"))
    trainer.state.save_to_json(os.path.join(args.output_dir, "trainer_state.json"))
    summary["model"] = next((p for p in (os.path.join(final, n) for n in (WEIGHTS, ADAPTER_WEIGHTS, WEIGHTS_INDEX))
                             if os.path.exists(p)), final)
    if trainer.state.best_model_checkpoint:
        summary["best_model_checkpoint"] = trainer.state.best_model_checkpoint
    if report:
        from .report import write_report

        try:
            write_report(args.output_dir)
            summary["plots"] = os.path.join(args.output_dir, "plots")
        except Exception as e:  # noqa: BLE001 - plots are a convenience: never fail a finished run
            logger.warning("plots not written (%s: %s); python -m raytrain.report %s retries",
                           type(e).__name__, e, args.output_dir)
    run.finish(final, trainer.state.best_model_checkpoint)
    return summary


def _stopped(trainer, stop) -> int:
    from .checkpoint.store import checkpoint_dir

    step, args = stop.stopped_at, trainer.args
    if args.save_strategy == "no":
        saved = "nothing saved (save_strategy is 'no')"
    else:
        saved = f"saved {checkpoint_dir(args.output_dir, step)}"
    print(f"{stop.name}: stopped at step {step}/{trainer.state.max_steps}; {saved}; "
          f"continue with: {continue_command()}", file=sys.stderr, flush=True)
    _record(f"ended: stopped by {stop.name} at step {step}; {saved}")
    return stop.exit_code


def _stopped_workers(args, stop) -> int:
    from .checkpoint.store import get_last_checkpoint

    path = get_last_checkpoint(args.output_dir)
    saved = f"saved {path}" if path and args.save_strategy != "no" else "nothing saved"
    print(f"{stop.name}: the workers stopped; {saved}; continue with: {continue_command()}", file=sys.stderr,
          flush=True)
    return stop.exit_code


class _TrackedRun:
    """The CLI's MLflow run (report_to: mlflow): opened before training (the run of the checkpoint
    being resumed, else a new one), it spans the final evaluation and ends after the artifacts."""

    def __init__(self, callback=None, args=None):
        self.callback, self.args = callback, args

    @classmethod
    def open(cls, trainer, resume) -> _TrackedRun:
        from .callbacks.mlflow import MLflowCallback

        cb = next((c for c in trainer.callback_handler.callbacks if isinstance(c, MLflowCallback)), None)
        if cb is None:
            return cls()
        from .tracking import mlflow as tracking
        from .worker.resume import likely_checkpoint

        args = trainer.args
        run_id = tracking.run_id_in_checkpoint(likely_checkpoint(args.output_dir, resume))
        if run_id:
            tracking.reopen_run(cb.client, run_id, args)
        else:
            run_id = tracking.create_run(cb.client, args)
        cb.run_id, cb.owns_run = run_id, False
        logger.info("MLflow run %s in %s", run_id, cb.tracking_uri)
        return cls(cb, args)

    def end(self, status: str) -> None:
        if self.callback is not None:
            self.callback.client.set_terminated(self.callback.run_id, status)

    def finish(self, model_dir: str, best_checkpoint: str | None) -> None:
        if self.callback is None:
            return
        from .tracking import mlflow as tracking

        tracking.log_final(self.callback.client, self.callback.run_id, self.args, model_dir, best_checkpoint)
        self.end("FINISHED")

    def print_ui_line(self) -> None:
        if self.callback is not None:
            from .tracking import mlflow as tracking

            print(f"mlflow: run {self.callback.run_id}; see it with: {tracking.ui_command(self.callback.tracking_uri)}")




if __name__ == "__main__":
    sys.exit(main())
