"""launch.py: the Trainer on 2 Ray workers (DDP, gloo): the same maths as one process with the same global
batch, the same TrainOutput on the driver, and restarts after SIGKILL or SIGTERM that end bit-exact."""

from __future__ import annotations

import glob
import json
import os
import signal

import pytest
import torch

from raytrain import Trainer, TrainOutput, load_weights, verify_checkpoint
from raytrain.driver.torch_trainer import worker_error
from tests.strategies._helpers import FaultInjector, PreemptionNotice, digits_args, digits_model, state_digest

pytestmark = pytest.mark.ray


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _starts(output_dir) -> list[int]:
    with open(os.path.join(output_dir, "starts.txt")) as f:
        return [int(line) for line in f]


@pytest.mark.xdist_group("ddp_run")
@pytest.mark.timeout(300)
def test_ddp_two_workers_equals_one_process(ddp_run, digits, tmp_path):
    out_dir, trainer, out = ddp_run
    train, _ = digits
    single = Trainer(digits_model(), digits_args(str(tmp_path / "single"), per_device_train_batch_size=32,
                                                 scaling={"num_workers": 1}), train_dataset=train)
    ref = single.train()

    # The driver gets rank 0's TrainOutput and state, as an in-process run returns them.
    assert isinstance(out, TrainOutput) and out.global_step == 30
    assert out.training_loss == pytest.approx(ref.training_loss, rel=1e-4)
    assert set(ref.metrics) <= set(out.metrics)
    assert trainer.state.global_step == 30 and trainer.state.max_steps == 30
    losses = _losses(trainer)
    assert len(losses) == 6 and losses[-1] < losses[0] * 0.6
    assert losses == pytest.approx(_losses(single), rel=1e-4)
    # Same maths as one process with the global batch; the driver's model holds the final weights.
    ddp_w, ref_w = trainer.model.state_dict(), single.model.state_dict()
    for name in ref_w:
        torch.testing.assert_close(ddp_w[name], ref_w[name], rtol=1e-4, atol=1e-5)
    # The consolidated checkpoint weights equal what each rank holds and load into plain PyTorch.
    saved = load_weights(str(out_dir / "checkpoint-30"))
    probes = [json.load(open(out_dir / f"probe-rank{r}.json")) for r in (0, 1)]
    assert probes[0]["digest"] == probes[1]["digest"] == state_digest(saved)
    plain = digits_model(seed=1)
    plain.load_state_dict(saved)
    assert state_digest(plain.state_dict()) == state_digest(trainer.model.state_dict())
    # After the run the driver evaluates in-process, as run.py does.
    evaluated = trainer.evaluate(eval_dataset=digits[1])["eval_loss"]
    assert evaluated == pytest.approx(single.evaluate(eval_dataset=digits[1])["eval_loss"], rel=1e-4)


@pytest.mark.xdist_group("ddp_run")
def test_two_workers_checkpoint_resumes_on_one(ddp_run, digits, tmp_path, caplog):
    """2 workers -> 1: weights and optimizer state carry over; the data order change is warned about."""
    out_dir, _, _ = ddp_run
    trainer = Trainer(digits_model(seed=3), digits_args(str(tmp_path / "one"), scaling={"num_workers": 1}),
                      train_dataset=digits[0])
    with caplog.at_level("WARNING"):
        out = trainer.train(resume_from_checkpoint=str(out_dir / "checkpoint-20"))
    assert out.global_step == 30 and trainer.state.log_history[0]["step"] == 5  # history carried over
    assert any("world_size 2 -> 1" in r.getMessage() for r in caplog.records)
    assert _losses(trainer)[-1] < _losses(trainer)[0]


@pytest.mark.xdist_group("ddp_run")
@pytest.mark.timeout(420)
def test_sigkill_sigterm_and_a_preemption_notice_restart_the_group_and_end_bit_exact(ddp_run, digits, tmp_path):
    """One run, three faults (a TorchTrainer start costs ~25 s here, so they share one):
    - rank 1 is SIGKILLed after step 15: Ray restarts the group, which resumes from checkpoint-10;
    - rank 0 gets SIGTERM after step 23: a checkpoint appears at the step boundary where the ranks agree
      on it (save_steps gives none before 30), the worker stops, and the restarted group resumes from it;
    - Ray's preemption notice for rank 1's node after step 28 (simulated, tests/strategies/_helpers.py
      PreemptionNotice: the rest is Ray's own): the workers save checkpoint-28 and stop; Ray's controller
      restarts the group at the deadline, charged to max_preemption_failures: max_failures (2) is spent
      by the first two faults, so the run would fail were the notice charged there.
    Checkpoints are written in the background (save_async: each rank's files, then the commit through a
    side channel), and Ray gets each one once it is complete.
    The final weights equal the uninterrupted run's bit for bit, and so do the logged losses (the checkpoints cut
    logging intervals: each rank's share of the unlogged loss comes back to it)."""
    _, reference, _ = ddp_run
    out_dir = tmp_path / "out"
    args = digits_args(str(out_dir), str(tmp_path / "ray"), scaling={"max_failures": 2, "max_preemption_failures": 1},
                       save_async=True)
    # the SIGKILL once checkpoint-10 is committed (its background save races 5 short steps on a loaded machine)
    faults = [FaultInjector(1, 15, signal.SIGKILL, record_starts=False, after="checkpoint-10/manifest.json"),
              FaultInjector(0, 23, signal.SIGTERM, record_starts=False), PreemptionNotice(28)]
    trainer = Trainer(digits_model(), args, train_dataset=digits[0], callbacks=faults)
    before = _dataset_actors()
    out = trainer.train()
    assert out.global_step == 30
    assert _dataset_actors() == before  # four group starts, none with Ray Datasets: no dataset actor
    first, after_kill, after_term, after_notice = _starts(out_dir)
    assert (first, after_kill, after_notice) == (0, 10, 28)
    assert 23 <= after_term <= 26 and after_term % 10  # the step all ranks agree on after the signal
    assert os.path.isdir(out_dir / f"checkpoint-{after_term}") and os.path.isdir(out_dir / "checkpoint-28")
    stored = [verify_checkpoint(os.path.dirname(m))["global_step"]
              for m in glob.glob(str(tmp_path / "ray" / "*" / "*" / "manifest.json"))]
    assert {after_term, 28, 30} <= set(stored), stored  # reported to Ray once complete, the last ones too
    assert state_digest(trainer.model.state_dict()) == state_digest(reference.model.state_dict())
    assert _losses(trainer) == _losses(reference)


def _dataset_actors() -> int:
    import ray

    return sum(a["ActorClassName"] == "DatasetManager" for a in ray._private.state.actors().values())


def test_worker_errors_surface_as_the_users_exception():
    """The driver raises what the worker raised (rank 0 first), as an in-process run would."""
    class Wrapped(Exception):
        def __init__(self, base):
            self._base_exc = base

    class GroupError(Exception):
        worker_failures = {1: Wrapped(RuntimeError("gloo: connection closed")), 0: Wrapped(FileExistsError("x"))}

    assert isinstance(worker_error(GroupError()), FileExistsError)
    plain = RuntimeError("controller died")
    assert worker_error(plain) is plain


def _free_ports(n: int) -> list[int]:
    """n ports free now, below the kernel's ephemeral range (32768-60999): no outgoing connection of the other
    clusters here can take one before the head binds it (a dashboard agent without its port ends the head)."""
    import random
    import socket

    ports: list[int] = []
    for port in random.sample(range(20000, 32768), 400):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise RuntimeError(f"no {n} free ports in 20000-32767")


@pytest.fixture
def ray_head():
    """A second, separate cluster from `ray start --head --block` (what `ray job submit` talks to),
    in its own process group so that it and everything it started can be ended by that group's id.
    Its ports are all chosen free, so it coexists with the session cluster (and anyone else's)."""
    import shutil
    import subprocess
    import tempfile
    import time
    import urllib.error
    import urllib.request

    for module in ("aiohttp_cors", "opencensus", "prometheus_client", "grpc"):
        pytest.importorskip(module, reason="`ray job submit` needs Ray's dashboard: pip install 'ray[default]'")
    gcs, dashboard, client, agent, agent_grpc, env_agent, metrics = _free_ports(7)
    temp = tempfile.mkdtemp(prefix="rt-head-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    # Token authentication, explicit for both the cluster and the `ray job` client (the token is
    # ~/.ray/auth_token, which `ray start` creates when missing).
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_AUTH_MODE": "token"}
    cmd = ["ray", "start", "--head", "--block", "--num-cpus", "4", "--port", str(gcs), "--temp-dir", temp,
           "--include-dashboard", "true", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard),
           "--ray-client-server-port", str(client), "--dashboard-agent-listen-port", str(agent),
           "--dashboard-agent-grpc-port", str(agent_grpc), "--runtime-env-agent-port", str(env_agent),
           "--metrics-export-port", str(metrics), "--disable-usage-stats"]
    head = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"{address}/api/version", timeout=2)
                break
            except urllib.error.HTTPError:  # 401 without the token: the dashboard is up
                break
            except OSError:
                if time.time() > deadline or head.poll() is not None:
                    pytest.fail(f"ray start --head did not come up (exit code {head.poll()})")
                time.sleep(1)
        yield address, env, head
    finally:
        import signal as sig

        for signum, wait in ((sig.SIGTERM, 5), (sig.SIGKILL, 10)):
            try:
                os.killpg(head.pid, signum)
            except ProcessLookupError:
                break
            try:
                head.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        shutil.rmtree(temp, ignore_errors=True)


def _wait_for_dashboard(address: str, seconds: float = 60) -> None:
    """Until the dashboard answers again (a 401 without the token is an answer), or `seconds` have passed."""
    import time
    import urllib.error
    import urllib.request

    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"{address}/api/version", timeout=5)
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(2)


@pytest.mark.timeout(400)
def test_ray_job_submit_end_to_end(ray_head, tmp_path):
    """`ray job submit --working-dir . -- python -m raytrain.run ... scaling.num_workers=2` against a
    `RAY_AUTH_MODE=token ray start --head` cluster: a client without RAY_AUTH_MODE=token gets HTTP 401;
    with it, the job joins the cluster (RAY_ADDRESS), trains on 2 workers, evaluates and saves, and its
    log holds the driver's progress lines (rank 0's, once each) and no worker's."""
    import re
    import subprocess
    import urllib.error
    import urllib.request

    address, env, head = ray_head
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # Without the token: HTTP 401 from the dashboard, and `ray job submit` (RAY_AUTH_MODE unset) refused.
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(f"{address}/api/jobs/", timeout=30)
    assert answer.value.code == 401
    no_token = {k: v for k, v in env.items() if k != "RAY_AUTH_MODE"}
    refused = subprocess.run(["ray", "job", "submit", "--address", address, "--no-wait", "--", "true"], cwd=root,
                             env=no_token, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0, refused.stdout[-2000:]
    assert "AuthenticationError: Authentication required: Unauthorized: Missing authentication token" \
        in refused.stderr, refused.stderr[-2000:]
    out, store = tmp_path / "out", f"sqlite:///{tmp_path / 'mlflow.db'}"
    cmd = ["ray", "job", "submit", "--address", address, "--working-dir", ".", "--",
           "env", f"MLFLOW_TRACKING_URI={store}", "python", "-m", "raytrain.run", "--config", "examples/digits.yaml",
           "--set", "scaling.num_workers=2", "--set", f"scaling.storage_path={tmp_path / 'ray'}",
           "--set", f"output_dir={out}", "--set", "num_train_epochs=2", "--set", "logging_steps=10",
           "--set", "report_to=mlflow", "--no-report"]
    for _ in range(12):  # the head's job agent can come up after its dashboard on a busy machine, and its
        # dashboard can miss the client's version check (a ConnectionError before anything is submitted)
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=360)
        log = proc.stdout + proc.stderr
        if "No available agent to submit job" not in log and "Failed to connect to Ray at address" not in log:
            break
        if head.poll() is not None:  # `ray start --block` ends the whole head when one of its processes dies
            pytest.fail(f"the head cluster exited ({head.poll()}): {log[-2000:]}")
        _wait_for_dashboard(address)
    assert proc.returncode == 0 and "succeeded" in log, log[-3000:]
    lines = log.splitlines()
    progress = [ln for ln in lines if re.match(r"step \d+/46 loss=", ln)]
    assert [ln.split()[1] for ln in progress] == ["10/46", "20/46", "30/46", "40/46"], progress
    assert all(re.search(r" learning_rate=\S+ .* eta=", ln) for ln in progress), progress
    assert len([ln for ln in lines if ln.startswith("training DigitsMLP")]) == 1
    workers = [ln for ln in lines if "RayTrainWorker" in ln]
    quiet = r"step \d+/|loss|Reporting training result|Checkpoint successfully"  # Ray's own lines included
    assert not [ln for ln in workers if re.search(quiet, ln)], workers
    summary = json.loads(next(line for line in log.splitlines() if line.startswith("summary: "))[len("summary: "):])
    assert summary["global_step"] == 46  # 2 epochs of 1438 samples in global batches of 2 x 32
    assert summary["eval_accuracy"] > 0.8
    assert {"checkpoint-23", "checkpoint-46", "final"} <= set(os.listdir(out))
    assert os.path.exists(out / "final" / "model.safetensors")
    # The MLflow run is tagged with the Ray job's submission id; rank 0 logged the metrics from its worker.
    import mlflow

    job = re.search(r"Job '(raysubmit_\w+)' submitted successfully", log).group(1)
    client = mlflow.tracking.MlflowClient(store)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.data.tags["ray.job_id"] == job and run.data.tags["raytrain.world_size"] == "2"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [10, 20, 30, 40]


def test_cluster_yaml_passes_rays_autoscaler_validation():
    """cluster.yaml as `ray up` reads it: merged with the AWS defaults, then checked against Ray's schema
    (no cloud call); the worker groups are spot, bounded, and install raytrain."""
    import copy

    import yaml
    from ray.autoscaler._private.util import prepare_config, validate_config

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "cluster.yaml")) as f:
        raw = yaml.safe_load(f)
    config = prepare_config(copy.deepcopy(raw))
    validate_config(config)
    assert config["provider"]["type"] == "aws"
    head = config["head_node_type"]
    workers = {k: v for k, v in config["available_node_types"].items() if k != head}
    assert workers and config["available_node_types"][head]["resources"] == {"CPU": 0}
    for node in workers.values():
        assert node["node_config"]["InstanceMarketOptions"]["MarketType"] == "spot"
        assert 0 <= node["min_workers"] <= node["max_workers"] <= config["max_workers"]
    for commands in (config["head_setup_commands"], config["worker_setup_commands"]):
        assert any("/home/ubuntu/raytrain" in c and "pip install" in c for c in commands)
    assert "--dashboard-host=127.0.0.1" in " ".join(config["head_start_ray_commands"])
    # A typo is caught, so the check is not vacuous.
    broken = copy.deepcopy(raw)
    broken["available_node_types"]["ray.worker.gpu_spot"]["min_worker"] = 1
    with pytest.raises(Exception, match="min_worker"):
        validate_config(prepare_config(broken))
