"""A Ray cluster of several nodes on this one machine, each worker node with a private disk.

Every node is a `ray start --block` in its own mount namespace (`unshare -m`); a worker node mounts a
tmpfs over `local/` first, so each sees its own, empty `local/` at the same path (the node-local
output_dir's parent) while `storage/` (host /tmp) stands in for NFS or S3. A node is lost by SIGKILLing
every process of its namespace (its tmpfs goes with it). Nothing here runs `ray stop`, which would
kill every Ray process on the machine: cleanup kills this cluster's namespaces only, by PID.

The driver of a training run is a subprocess (`python -m tests.driver.cluster SPEC`): the pytest
process keeps its own session cluster.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from torch import nn

from raytrain import TrainerCallback
from raytrain.cli.local_cluster import _free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Ray notices a lost node in about 2 s instead of 15 (read by the GCS only). SimCluster(health_checks="default")
# sets none of them: the cluster as `ray start` makes it.
FAST_HEALTH_CHECKS = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "2",
                      "RAY_health_check_timeout_ms": "1000", "RAY_health_check_initial_delay_ms": "1000"}


def _free_range(n: int = 60) -> tuple[int, int]:
    """n consecutive free ports (each node's worker ports), probed at random in 20000-45000."""
    for _ in range(200):
        start = random.randrange(20000, 45000 - n)
        try:
            socks = []
            for port in range(start, start + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("", port))
            return start, start + n - 1
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no range of free ports")


def _mount_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def kill_namespace(ns: str) -> None:
    """SIGKILL every process in mount namespace `ns` (never this process's own)."""
    if ns is None or ns == _mount_ns(os.getpid()):
        return
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _mount_ns(int(entry)) == ns:
            try:
                os.kill(int(entry), signal.SIGKILL)
            except OSError:
                pass


class SimCluster:
    """A head (no CPUs) and worker nodes started one at a time, each with `spot: 1` (one worker each);
    health_checks "fast" (FAST_HEALTH_CHECKS) or "default" (Ray's own)."""

    def __init__(self, health_checks: str = "fast"):
        if health_checks not in ("fast", "default"):
            raise ValueError(f"health_checks: 'fast' or 'default', got {health_checks!r}")
        self.health_checks = health_checks
        self.base = tempfile.mkdtemp(prefix="rtspot", dir="/tmp")  # short: Ray's socket paths < 107 bytes
        self.local, self.storage = os.path.join(self.base, "local"), os.path.join(self.base, "storage")
        self.temp_dir, self.ray_tmp = os.path.join(self.base, "t"), os.path.join(self.base, "rt")
        for d in (self.local, self.storage, self.temp_dir, self.ray_tmp):
            os.makedirs(d)
        self.address = f"{socket.gethostbyname(socket.gethostname())}:{_free_port()}"
        self.nodes: dict[str, tuple[subprocess.Popen, str | None]] = {}
        self.logs: list = []
        self.token = secrets.token_hex(32)  # where the machine has no token of its own

    def env(self) -> dict:
        """For every node and the driver: token auth (an explicit address does not turn it on), this
        cluster's address (Ray Train's state API would otherwise see other clusters on the machine); of the
        caller's RAY_ variables, the token and Ray Train's poll interval (tests/conftest.py) alone."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("RAY_") or k in ("RAY_AUTH_TOKEN", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S")}
        if "RAY_AUTH_TOKEN" not in env and not os.path.exists(os.path.expanduser("~/.ray/auth_token")):
            env["RAY_AUTH_TOKEN"] = self.token
        pythonpath = [ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env.update(RAY_AUTH_MODE="token", RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=self.ray_tmp,
                   RAY_ADDRESS=self.address, PYTHONPATH=os.pathsep.join(dict.fromkeys(pythonpath)),
                   RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO="0", DS_ACCELERATOR="cpu")
        return env

    def _start(self, name: str, ray_args: str, env: dict, private_disk: bool) -> None:
        lo, hi = _free_range()
        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        cmd = (f"exec {ray} start --block --temp-dir={self.temp_dir} --disable-usage-stats "
               f"--dashboard-agent-listen-port={_free_port()} --min-worker-port={lo} --max-worker-port={hi} "
               f"{ray_args}")
        if private_disk:
            cmd = f"mount -t tmpfs tmpfs {self.local} && {cmd}"
        log = open(os.path.join(self.base, f"{name}.log"), "ab")
        self.logs.append(log)
        proc = subprocess.Popen(["setsid", "unshare", "-m", "--propagation", "private", "sh", "-c", cmd],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        ns = None
        for _ in range(100):  # the namespace exists once unshare has run
            ns = _mount_ns(proc.pid)
            if ns is not None and ns != _mount_ns(os.getpid()):
                break
            time.sleep(0.05)
        self.nodes[name] = (proc, ns)

    def start_head(self) -> None:
        port = self.address.rsplit(":", 1)[1]
        self._start("head", f"--head --port={port} --num-cpus=0 --include-dashboard=false "
                    f"--ray-client-server-port={_free_port()}",
                    {**self.env(), **(FAST_HEALTH_CHECKS if self.health_checks == "fast" else {})}, False)
        self.wait_nodes(1)

    def add_node(self, name: str, tries: int = 3) -> None:
        """A worker node; started again (new ports) if `ray start` exits, e.g. on a port taken meanwhile."""
        alive = self.alive_nodes()
        for attempt in range(tries):
            self._start(name, f"--address={self.address} --num-cpus=1 --resources='{{\"spot\": 1}}'", self.env(), True)
            try:
                return self.wait_nodes(alive + 1)
            except RuntimeError:
                if attempt == tries - 1:
                    raise

    def alive_nodes(self) -> int:
        """Alive nodes as the GCS lists them (0 while the GCS does not answer yet)."""
        host, port = self.address.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
        except OSError:
            return 0
        code = ("import ray._raylet as r, sys; c = r.GcsClient(address=sys.argv[1]); "
                "print(sum(n.state == 0 for n in c.get_all_node_info().values()))")
        try:
            out = subprocess.run([sys.executable, "-c", code, self.address], env=self.env(), capture_output=True,
                                 text=True, timeout=30)
        except subprocess.TimeoutExpired:
            return 0
        return int(out.stdout.strip() or 0)

    def wait_nodes(self, n: int, timeout: float = 180) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.alive_nodes() >= n:
                return
            dead = [name for name, (proc, _) in self.nodes.items() if proc.poll() is not None]
            if dead and dead[-1] == list(self.nodes)[-1]:
                with open(os.path.join(self.base, f"{dead[-1]}.log"), "rb") as f:
                    tail = f.read()[-1500:].decode(errors="replace")
                raise RuntimeError(f"node {dead[-1]} exited:\n{tail}")
            time.sleep(1)
        raise TimeoutError(f"{n} alive node(s) expected; logs in {self.base}")

    def lose(self, ns: str, wait: bool = True) -> str:
        """SIGKILL the node whose mount namespace is `ns` (its tmpfs goes with it); its name. With `wait`,
        return once the GCS lists it dead."""
        name = next(n for n, (_, node_ns) in self.nodes.items() if node_ns == ns)
        before = self.alive_nodes() if wait else 0
        kill_namespace(ns)
        self.nodes[name][0].wait(30)
        deadline = time.time() + 60
        if wait:  # the GCS notices in ~2 s (fast health checks), ~15-30 s (Ray's default)
            while self.alive_nodes() >= before and time.time() < deadline:
                time.sleep(0.5)
        return name

    def drive(self, spec: dict, timeout: float = 400) -> subprocess.Popen:
        """Start a driver (this module's main) for `spec`; its result goes to spec["result"]."""
        return drive(spec, self.address, self.env())

    def run(self, name: str, output_dir: str, storage: str | None, timeout: float = 420, during=None,
            **spec) -> dict:
        """A driver for one run, its result (asserted error-free); `during(sim, proc)` acts on the cluster
        while it trains."""
        result = os.path.join(self.base, f"{name}.json")
        proc = self.drive({"result": result, "output_dir": output_dir, "storage": storage, **spec})
        try:
            if during is not None:
                during(self, proc)
            proc.wait(timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
        with open(result) as f:
            out = json.load(f)
        assert "error" not in out, out["error"]
        return out

    @staticmethod
    def paused(flag: str, proc: subprocess.Popen, seconds: float = 400) -> str:
        """Wait for the paused rank to write `flag`; the mount namespace it wrote there."""
        deadline = time.time() + seconds
        while not os.path.exists(flag):
            assert proc.poll() is None and time.time() < deadline, "the rank never reached its pause"
            time.sleep(0.5)
        with open(flag) as f:
            return f.read()

    def close(self) -> None:
        for proc, ns in self.nodes.values():
            kill_namespace(ns)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for log in self.logs:
            log.close()
        for record in (os.path.join(self.temp_dir, "ray_current_cluster"),
                       os.path.join(self.ray_tmp, "ray", "ray_current_cluster")):
            if os.path.exists(record):
                os.remove(record)
        shutil.rmtree(self.base, ignore_errors=True)


# ---------------------------------------------------------------- the driver (a subprocess)


def drive(spec: dict, address: str, env: dict) -> subprocess.Popen:
    """Start a driver (this module's main) for `spec` on the cluster at `address`; its result goes to
    spec["result"], its console to spec["result"] + ".log"."""
    path = spec["result"] + ".spec.json"
    with open(path, "w") as f:
        json.dump({**spec, "address": address}, f)
    pythonpath = [ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {"DS_ACCELERATOR": "cpu", **env, "PYTHONPATH": os.pathsep.join(dict.fromkeys(pythonpath))}
    with open(spec["result"] + ".log", "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "tests.driver.cluster", path], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT)


class PauseOnce(TrainerCallback):
    """On `rank`, after `step` of the first attempt (at its step end, or `at="save"`: once checkpoint-`step`
    is written on the node's disk, before Ray has it): record this process's mount namespace (which
    node to lose) in `flag`, then wait to be killed with the node."""

    def __init__(self, rank: int, step: int, flag: str, at: str = "step_end"):
        self.rank, self.step, self.flag, self.at = rank, step, flag, at

    def _pause(self, state) -> None:
        if int(os.environ.get("RANK", 0)) == self.rank and state.global_step == self.step \
                and not os.path.exists(self.flag):
            import ray

            with open(self.flag + ".node", "w") as f:  # Ray's id of the node (the local twin's own id)
                f.write(ray.get_runtime_context().get_node_id())
            with open(self.flag + ".tmp", "w") as f:
                f.write(_mount_ns(os.getpid()))
            os.replace(self.flag + ".tmp", self.flag)
            time.sleep(600)

    def on_step_end(self, args, state, control, **kwargs):
        if self.at == "step_end":
            self._pause(state)

    def on_save(self, args, state, control, **kwargs):
        if self.at == "save":  # user callbacks run before the one that reports the checkpoint to Ray
            self._pause(state)


class WorldLog(TrainerCallback):
    """Rank 0 appends [step, world size, gradient_accumulation_steps] at every step end to `path`; with
    `hold` ({"world", "step"}), a group of that size waits at that step (up to 5 minutes) for a resize
    to replace it."""

    def __init__(self, path: str, hold: dict | None = None):
        self.path, self.hold = path, hold

    def on_step_end(self, args, state, control, **kwargs):
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else 1
        if state.is_world_process_zero:
            with open(self.path, "a") as f:
                f.write(json.dumps([state.global_step, world, args.gradient_accumulation_steps]) + "\n")
        hold = self.hold
        if hold and world == hold["world"] and state.global_step == hold["step"]:
            deadline = time.time() + 300
            while time.time() < deadline:
                time.sleep(0.5)


class StepMarks(TrainerCallback):
    """Rank 0 appends [wall time, perf_counter, step] at every step end to `path` (across restarts)."""

    def __init__(self, path: str):
        self.path = path

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            with open(self.path, "a") as f:
                f.write(json.dumps([time.time(), time.perf_counter(), state.global_step]) + "\n")


class IdDigits(nn.Module):
    """The digits MLP, recording the sample ids of every training micro-batch."""

    def __init__(self):
        super().__init__()
        from tests.strategies._helpers import digits_model

        self.net = digits_model()
        self.seen: list[list[int]] = []

    def forward(self, pixels, idx, labels=None):
        if self.training:
            self.seen.append(idx.tolist())
        return self.net(pixels, labels)


class IdLog(TrainerCallback):
    """Every rank appends {start, world, step, ids} at each step end to `path`/ids-rank{R}.jsonl: the ids of
    its micro-batches (IdDigits) and the step its group started from."""

    def __init__(self, path: str):
        self.path = path

    def on_train_begin(self, args, state, control, **kwargs):
        self.start, self.done = state.global_step, 0

    def on_step_end(self, args, state, control, model=None, **kwargs):
        seen = getattr(model, "module", model).seen
        record = {"start": self.start, "world": int(os.environ.get("WORLD_SIZE", 1)), "step": state.global_step,
                  "ids": seen[self.done:]}
        self.done = len(seen)
        with open(os.path.join(self.path, f"ids-rank{os.environ.get('RANK', 0)}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")


def trained_ids(path: str) -> dict[int, dict]:
    """step -> {"world": w, "start": s, "batches": [ids of each micro-batch of every rank]}, from the last group
    that trained the step (a group lost after its last checkpoint trained steps its successor trains again)."""
    records = [json.loads(line) for name in sorted(os.listdir(path)) if name.startswith("ids-rank")
               for line in open(os.path.join(path, name))]
    last: dict[int, int] = {}
    for r in records:
        last[r["step"]] = max(last.get(r["step"], -1), r["start"])
    steps: dict[int, dict] = {}
    for r in records:
        if r["start"] == last[r["step"]]:
            step = steps.setdefault(r["step"], {"world": r["world"], "start": r["start"], "batches": []})
            step["batches"] += r["ids"]
    return steps


def _placement_groups() -> list[dict]:
    """This job's placement groups (Ray Train's worker groups): bundles, and whether Ray ever placed it."""
    import ray

    job = ray.get_runtime_context().get_job_id()
    return [{"bundles": len(g["bundles"]), "placed": g["stats"]["end_to_end_creation_latency_ms"] > 0}
            for pg_id, g in ray.util.placement_group_table().items() if pg_id.endswith(job)]


def job(spec: dict) -> tuple:
    """The digits job that `spec` describes: (args, model, train dataset, evaluation dataset or None, callbacks)."""
    from examples.digits import build_datasets
    from tests.strategies._helpers import digits_args, digits_model

    train, val = build_datasets()
    # "best": evaluate at every save, the best checkpoint being the first (the highest eval_loss), so
    # that load_best_model_at_end reads a checkpoint written before any node was lost.
    best = dict(eval_strategy="steps", eval_steps=5, load_best_model_at_end=True, metric_for_best_model="loss",
                greater_is_better=True) if spec.get("best") else {}
    args = digits_args(spec["output_dir"], spec.get("storage"), max_steps=spec.get("max_steps", 20), logging_steps=1,
                       save_steps=5,
                       scaling={"max_failures": spec.get("max_failures", 0), "max_wait_s": spec.get("max_wait_s"),
                                "resources_per_worker": spec.get("resources", {"CPU": 1, "spot": 1}),
                                **({"num_workers": [1, 2], "resize_interval_s": 1} if spec.get("elastic") else {})},
                       distributed=spec.get("distributed") or {"strategy": spec.get("strategy", "ddp")},
                       save_async=spec.get("save_async", False), save_total_limit=spec.get("keep"), **best)
    if spec.get("lora"):  # the LoRA job instead: a tiny Llama's adapter, checkpoints holding it alone
        from tests.hf.peft_jobs import lm_rows, lora_model
        train, model = lm_rows(64), lora_model(dropout=0.1)
    elif spec.get("ids"):  # 256 samples (8 steps an epoch), each step's ids logged by every rank
        import numpy as np

        train = {**{k: v[:256] for k, v in train.items()}, "idx": np.arange(256)}
        model = IdDigits()
    else:
        model = digits_model()
    callbacks = [PauseOnce(**spec["pause"])] if spec.get("pause") else []
    if spec.get("worlds"):
        callbacks.append(WorldLog(spec["worlds"], spec.get("hold")))
    if spec.get("marks"):  # benchmarks/distributed.py
        callbacks.append(StepMarks(spec["marks"]))
    if spec.get("ids"):
        callbacks.append(IdLog(spec["ids"]))
    return args, model, train, val if best else None, callbacks


def _logs(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "loss" in h]


def rank_job(spec: dict) -> dict:
    """On each of 2 gloo processes (tests/strategies/_gloo.py): `spec`'s job, uninterrupted; its steps, losses and
    the digest of its final weights, as main() reports a Ray run's."""
    from raytrain import Trainer
    from raytrain.worker import loop
    from tests.strategies._helpers import full_weights, state_digest

    args, model, train, val, callbacks = job(spec)
    trainer = Trainer(model, args, train_dataset=train, eval_dataset=val, callbacks=callbacks)
    loop.train(trainer, None)
    return {"global_step": trainer.state.global_step, "digest": state_digest(full_weights(trainer.model_wrapped)),
            "logs": _logs(trainer)}


def local_run(root: str, **spec) -> dict:
    """`spec`'s job without Ray, on 2 gloo processes of this machine (DDP's maths do not depend on where its ranks
    run, and a Ray run's driver and worker group cost 30-60 s here): rank 0's rank_job."""
    from tests.strategies._gloo import launch

    spec = {"output_dir": os.path.join(root, "out"), **spec, "storage": None}
    return launch(root, 2, {"run": ("tests.driver.cluster:rank_job", {"spec": spec})})[0]["run"]


def main(spec_path: str) -> None:
    """Train the digits job on the cluster at spec["address"]; write losses, a digest of the final
    weights and what the driver's output_dir holds to spec["result"]."""
    with open(spec_path) as f:
        spec = json.load(f)
    import ray

    env = {k: os.environ[k] for k in ("PYTHONPATH", "RAY_ADDRESS", "RAY_AUTH_MODE", "DS_ACCELERATOR")}
    ray.init(address=spec["address"], log_to_driver=False, runtime_env={"env_vars": env})
    from raytrain import Trainer
    from tests.strategies._helpers import digits_args, digits_model, state_digest

    args, model, train, val, callbacks = job(spec)
    result: dict = {}
    if spec.get("refused"):  # first, the same job without storage_path into this output_dir: its error
        try:
            refused = digits_args(spec["refused"], None,
                                  scaling={"resources_per_worker": spec.get("resources", {"CPU": 1, "spot": 1})})
            Trainer(digits_model(), refused, train_dataset=train).train()
            result["refused"] = None
        except Exception as e:  # noqa: BLE001 - the test asserts on it
            result["refused"] = f"{type(e).__name__}: {e}"
    try:
        trainer = Trainer(model, args, train_dataset=train, eval_dataset=val, callbacks=callbacks)
        out = trainer.train(resume_from_checkpoint=spec.get("resume"))
        trainer.save_model(os.path.join(spec["output_dir"], "final"))
        trainer.save_state()
        result = {**result, "global_step": out.global_step, "digest": state_digest(trainer.model.state_dict()),
                  "logs": _logs(trainer), "best_model_checkpoint": trainer.state.best_model_checkpoint,
                  "output_dir": sorted(os.listdir(spec["output_dir"])), "placement_groups": _placement_groups()}
    except Exception as e:  # noqa: BLE001 - the test asserts on it
        result = {**result, "error": f"{type(e).__name__}: {e}"}
    with open(spec["result"], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
