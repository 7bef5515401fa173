"""The documentation: the site builds with `mkdocs build --strict`, and every command and Python
snippet it shows (docs/snippets/, included by the pages; the README's copies) runs or is checked here.

Snippets in RUN are run: shell commands of `python -m raytrain.run` / `raytrain.report` in this
process through their main() (quickstart.sh in a real shell, as a newcomer types it), with the
--set overrides below that keep them small; Python files with runpy; tracking.sh's `mlflow ui` is a
server: the store it names is read instead. Snippets in RUN_BY_RAY_TEST are run by the Ray test
named there, which reads the snippet and adds the overrides shown. Snippets in CHECKED need what this
suite cannot spend (pip installs, a cloud, minutes): their configs are validated, every name they use
is looked up, and the scripts and executables they call exist.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
SNIPPETS = os.path.join(DOCS, "snippets")

# snippet -> what a test run adds to each raytrain.run command (the page shows the full run)
RUN = {
    "quickstart.sh": ["--set", "max_steps=30"],   # in a real shell, as the README's first command
    "cli.sh": ["--set", "max_steps=20", "--no-report"],
    "resume.sh": ["--no-report"],                  # 45 + 45 + 45 digits steps
    "chargpt.sh": ["--set", "max_steps=2", "--no-report"],
    "llm.sh": ["--set", "max_steps=2", "--no-report"],
    "sweep_report.sh": [],                         # on a sweep directory laid out as Ray Tune writes it
    "tracking.sh": ["--set", "max_steps=20", "--no-report"],  # `mlflow ui`, a server: the store it opens is read
    "quickstart.py": [], "concepts.py": [], "checkpoints.py": [], "data_files.py": [],
    "hf_switch.py": [], "hf_dataclass.py": [], "llm.py": [], "grpo.py": [],
}
# snippet -> the Ray test that runs it (read from the snippet, with the overrides it adds); the Ray tests
# share the session's cluster, so the snippet is run there rather than here
RUN_BY_RAY_TEST = {
    "sweep.sh": ("tests/sweep/test_search.py", "--set search.num_samples=2"),
    "distributed.sh": ("tests/driver/test_quiet.py", "--set max_steps=10"),
    "sweep.py": ("tests/sweep/test_search.py", "n_trials=2, max_steps=20"),
    "llm_workers.sh": ("tests/hf/test_lora_example.py", "8 steps of 8 blocks of 32 bytes"),
    "llm_sweep.sh": ("tests/hf/test_lora_example.py", "--set search.num_samples=2, 8 steps"),
    "grpo_cli.sh": ("tests/hf/test_grpo_cli.py", "--set max_steps=2, in a subprocess"),  # no Ray: as users run it
    "grpo_async_cli.sh": ("tests/hf/test_async_grpo_on_ray.py", "--set max_steps=3, in a subprocess on the cluster"),
}
# snippet -> why it is only checked
CHECKED = {
    "install.sh": "pip installs: compared with .ci/run, which CI runs",
    "install_cpu.sh": "a pip install from download.pytorch.org: no network in tests",
    "data_ray.py": "Ray Data on an S3 bucket and two Ray Train workers",
    "cluster.sh": "a Ray cluster on a cloud; the job submitted to a token head: test_ray_job_submit_end_to_end",
    "benchmarks.sh": "minutes each",
    "local_cluster.sh": "a laptop cluster: its own test, tests/driver/test_local_cluster.py",
    "llm_install.sh": "a pip install of the peft extra; the run is llm.sh's, run above",
    "health_checks.sh": "a Ray head of one's own; its settings are cluster.yaml's (test_health_check_snippets)",
    "kuberay_health_checks.yaml": "a KubeRay cluster; its settings are cluster.yaml's (test_health_check_snippets)",
    "grpo_workers.sh": "2 Ray workers and a sweep: tests/hf/test_grpo_backends_on_ray.py and test_grpo_sweep.py run them",
    "grpo_sweep.py": "a Ray Tune sweep of 8 trials: tests/hf/test_grpo_sweep.py runs one of 2",
    "grpo_async.py": "2 Ray rollout actors beside the trainer: tests/hf/test_async_grpo_on_ray.py runs this trainer on 1 "
                     "and 2 actors, and examples/grpo_async.yaml from the CLI",
}


def _read(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


def _commands(text: str) -> list[list[str]]:
    """A shell snippet's commands: comments dropped, continuations joined, split on && and &."""
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        for part in re.split(r"\s&&\s|\s&\s*$", line):
            words = shlex.split(part, comments=True)
            if words:
                commands.append(words)
    return commands


def _program(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """(environment assignments, the rest) of one command."""
    env = {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", words[0]):
        key, _, value = words[0].partition("=")
        env[key] = value
        words = words[1:]
    return env, words


# ---------------------------------------------------------------- the site


def test_every_snippet_is_tested_and_shown():
    files = set(os.listdir(SNIPPETS))
    assert files == set(RUN) | set(CHECKED) | set(RUN_BY_RAY_TEST), "each snippet is run or checked"
    for name, (test_file, _) in RUN_BY_RAY_TEST.items():  # the named test reads the snippet itself
        assert f'"snippets", "{name}"' in _read(test_file), f"{test_file} does not run docs/snippets/{name}"
    pages = "".join(_read("docs", p) for p in os.listdir(DOCS) if p.endswith(".md"))
    shown = set(re.findall(r'--8<-- "docs/snippets/([^"]+)"', pages))
    assert files == shown, f"not shown on any page: {files - shown}; missing: {shown - files}"


def test_site_builds_strict(tmp_path):
    """A broken link, a missing page or snippet, a bad docstring reference fails the build."""
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f",
                           os.path.join(ROOT, "mkdocs.yml"), "-d", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reference = (site / "configuration" / "index.html").read_text()
    from raytrain.config.args import SECTIONS, TrainingArguments

    names = [f.name for f in dataclasses.fields(TrainingArguments) if f.name not in SECTIONS]
    names += [f"{s}.{n}" for s, model in SECTIONS.items() for n in model.model_fields]
    missing = [n for n in names if f"<code>{n}</code>" not in reference]
    assert not missing, f"configuration reference lacks {missing}"
    assert "peak learning rate" in reference  # the help texts come along
    architecture = (site / "architecture" / "index.html").read_text()
    assert "Driver and worker rules" in architecture  # ARCHITECTURE.md itself, included
    assert "hyperparameter_search" in (site / "api" / "index.html").read_text()


# ---------------------------------------------------------------- the README


def test_readme_is_short_and_shows_only_tested_snippets():
    readme = _read("README.md")
    assert len(readme.splitlines()) <= 150  # issue 54: at most 150 lines, the Benchmarks table one row a claim
    snippets = {line.strip() for name in os.listdir(SNIPPETS) for line in _read("docs", "snippets", name).splitlines()}
    for block in re.findall(r"```\w*\n(.*?)```", readme, re.S):
        for line in block.splitlines():
            assert not line.strip() or line.strip() in snippets, f"README line not in docs/snippets: {line!r}"
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", readme)
    for link in links:
        assert os.path.exists(os.path.join(ROOT, link)), f"README links to a missing {link}"
    pages = {os.path.basename(link) for link in links if link.startswith("docs/")}
    nav = set(re.findall(r":\s*(\w+\.md)$", _read("mkdocs.yml"), re.M)) - {"index.md"}
    assert nav <= pages, f"README links no docs page {nav - pages}"


def test_install_commands_are_what_ci_runs():
    ci = [w for w in _commands(_read(".ci", "run")) if w[:3] in (["python", "-m", "pip"], ["python", "-m", "pytest"])]
    ci_pip = [[x for x in w[3:] if x != "-q"] for w in ci if w[2] == "pip"]
    ci_test = [w for w in ci if w[2] == "pytest"]
    lines = _read("docs", "snippets", "install.sh").splitlines()
    demo, tests = (_commands(line) for line in lines)
    assert [w[1:] for w in tests if w[0] == "pip"] == ci_pip  # the CPU torch pin, then .[dev]
    assert [w for w in tests if w[0] == "python"] == ci_test
    assert [w[1:] for w in demo if w[0] == "pip"] == [ci_pip[0], ["install", "-e", "."]]
    assert demo[-1] == _commands(_read("docs", "snippets", "quickstart.sh"))[0]  # run below


# ---------------------------------------------------------------- snippets that run


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A fresh directory that looks like the repository root to relative paths (outputs land here)."""
    for name in ("examples", "search_spaces", "benchmarks", "cluster.yaml"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _run_in_process(words: list[str], extra: list[str], capsys) -> str:
    """`python -m raytrain.run|report ...` through its main() in this process; what it printed."""
    assert words[:2] == ["python", "-m"], words
    if words[2] == "raytrain.run":
        from raytrain.run import main
        argv = words[3:] + (extra if "--help" not in words else [])
    else:
        assert words[2] == "raytrain.report", words
        from raytrain.report import main
        argv = words[3:]
    try:
        code = main(argv)
    except SystemExit as e:  # --help
        code = e.code
    out, err = capsys.readouterr()
    assert code in (0, None), f"{shlex.join(words)} -> {code}: {err[-2000:]}"
    return out + err


def test_quickstart_runs_in_a_shell(workdir):
    """The README's first command (less the installs), as typed, with a --set that keeps it short."""
    text = _read("docs", "snippets", "quickstart.sh")
    extra = " " + shlex.join(RUN["quickstart.sh"])
    script = re.sub(r"(python -m raytrain\.run .*)", lambda m: m.group(1) + extra, text)
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=workdir, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1",
                               "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert '"global_step": 30' in proc.stdout
    assert (workdir / "runs/digits/final/model.safetensors").is_file()
    assert (workdir / "runs/digits/plots/overview.png").is_file()


@pytest.mark.parametrize("name", ["cli.sh", "resume.sh", "chargpt.sh", "llm.sh"])
def test_cli_snippet_runs(name, workdir, capsys):
    outputs = [_run_in_process(w, RUN[name], capsys) for w in _commands(_read("docs", "snippets", name))]
    if name == "cli.sh":
        assert "learning_rate" in outputs[1] and '"global_step": 20' in outputs[0]
    if name == "resume.sh":
        assert [45, 90, 135] == [int(re.search(r'"global_step": (\d+)', o).group(1)) for o in outputs]
        assert "resuming at step 45" in outputs[1] and "resuming at step 90" in outputs[2]
    if name == "llm.sh":
        assert '"global_step": 2' in outputs[0]
        assert (workdir / "runs/lora/final/adapter_model.safetensors").is_file()
        assert (workdir / "runs/lora/final/merged/model.safetensors").is_file()


def test_sweep_report_runs(workdir, capsys):
    """report.py on a sweep's directory (OUTPUT_DIR/sweeps/<name>/), laid out as Ray Tune writes it."""
    for trial, objective in (("trial_0f32ea79", 0.9), ("trial_67b5bb59", 0.97)):
        d = workdir / "runs/digits/sweeps/digits" / trial
        d.mkdir(parents=True)
        (d / "result.json").write_text("".join(f'{{"objective": {objective * s / 90}, "step": {s}}}\n'
                                               for s in (45, 90)))
    (words,) = _commands(_read("docs", "snippets", "sweep_report.sh"))
    out = _run_in_process(words, [], capsys)
    assert out.strip().splitlines()[-1] == "runs/digits/sweeps/digits/plots/objective.png"
    assert (workdir / "runs/digits/sweeps/digits/plots/objective.png").stat().st_size > 0


def test_tracking_runs_into_the_store_mlflow_ui_opens(workdir, capsys, monkeypatch):
    """The MLflow run goes to mlflow.db in the working directory; `mlflow ui` (a server, not started)
    is pointed at that store, which holds the run, and the run prints that very command."""
    mlflow = pytest.importorskip("mlflow")
    from raytrain.tracking.mlflow import ui_command

    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    train, ui = _commands(_read("docs", "snippets", "tracking.sh"))
    out = _run_in_process(train, RUN["tracking.sh"], capsys)
    assert shutil.which(ui[0]) and " ".join(ui) == ui_command("sqlite:///$PWD/mlflow.db")
    uri = ui[-1].replace("$PWD", os.getcwd())
    (run_id,) = re.findall(rf"mlflow: run (\w+); see it with: {re.escape(ui_command(uri))}\n", out)
    client = mlflow.tracking.MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["max_steps"] == "20"
    assert [m.step for m in client.get_metric_history(run_id, "train_loss")] == [20]
    # the epoch's evaluation (training stops within it) and the CLI's final one
    assert [m.step for m in client.get_metric_history(run_id, "eval_accuracy")] == [20]  # the summary reuses it


@pytest.mark.parametrize("name", sorted(n for n in RUN if n.endswith(".py")))
def test_python_snippet_runs(name, workdir, capsys):
    runpy.run_path(os.path.join(SNIPPETS, name), run_name="__main__")
    if name == "quickstart.py":
        assert (workdir / "runs/digits-py/final/model.safetensors").is_file()
        assert "eval_accuracy" in capsys.readouterr().out
    if name == "llm.py":
        assert (workdir / "runs/lora-py/final/adapter_config.json").is_file()
        assert "PeftModelForCausalLM LlamaForCausalLM" in capsys.readouterr().out
    if name == "checkpoints.py":
        assert sorted(os.listdir(workdir / "runs/ckpt")) >= ["checkpoint-40", "checkpoint-60"]
    if name == "grpo.py":  # the adapter as PEFT writes it; the checkpoints hold the rollout buffer
        assert {"adapter_config.json", "trainer_rank_state.pth"} <= set(os.listdir(workdir / "runs/grpo/checkpoint-2"))
        assert "rewards/has_digit/mean" in capsys.readouterr().err  # the progress lines


# ---------------------------------------------------------------- snippets that are checked only


def _check_raytrain_run(argv: list[str]) -> None:
    """A `raytrain.run` command line: its flags exist, its config with every --set validates, its
    search space loads (what the CLI checks before it starts anything)."""
    from raytrain.config.args import TrainingArguments
    from raytrain.sweep import load_search_spec

    flags = {"--config", "--set", "--resume", "--search", "--debug", "--no-report", "--help"}
    config, overrides, i = None, [], 0
    while i < len(argv):
        assert argv[i] in flags, f"raytrain.run has no {argv[i]}"
        if argv[i] in ("--config", "--set", "--resume", "--search"):
            value = argv[i + 1]
            if argv[i] == "--config":
                config = value
            elif argv[i] == "--set":
                overrides.append(value)
            elif argv[i] == "--search":
                load_search_spec(os.path.join(ROOT, value))
            i += 1
        i += 1
    from raytrain.cli.trl import trl_arguments
    from raytrain.config.args import ConfigError

    try:
        TrainingArguments.from_yaml(os.path.join(ROOT, config), overrides)
    except ConfigError as e:  # as the CLI: a TRL field picks raytrain.trl's config
        name = str(e).split("'")[1] if str(e).startswith("unknown field '") else None
        if trl_arguments(os.path.join(ROOT, config), overrides, name) is None:
            raise


def _script_flags(path: str) -> set[str]:
    tree = ast.parse(_read(path))
    return {a.value for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "add_argument"
            for a in n.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}


@pytest.mark.parametrize("name", sorted(n for n in (*CHECKED, *RUN_BY_RAY_TEST) if n.endswith(".sh") and n != "install.sh"))
def test_shell_snippet_checks(name):
    for words in _commands(_read("docs", "snippets", name)):
        env, words = _program(words)
        if words[:3] == ["python", "-m", "raytrain.run"]:
            _check_raytrain_run(words[3:])
        elif words[0] == "python" and words[1].startswith("benchmarks/"):
            flags = {w for w in words[2:] if w.startswith("--")}
            assert flags <= _script_flags(words[1]), f"{words[1]} lacks {flags - _script_flags(words[1])}"
        elif words[:2] == ["bash", "benchmarks/gpu.sh"]:
            assert set(words[2:]) <= set(re.findall(r'"(--[\w-]+)"', _read(words[1]))), words
            assert set(env) <= {"OUT"}, env
        elif words[:3] == ["python", "-m", "raytrain.cli.local_cluster"]:
            from raytrain.cli.local_cluster import parser

            parser().parse_args(words[3:])
        elif words[0] == "ray":
            assert shutil.which("ray"), "the ray CLI comes with ray[default]"
            assert words[1] in ("get-auth-token", "up", "dashboard", "job", "status", "start"), words
            if words[1] == "start":  # a head of one's own, noticing a lost node as cluster.yaml's does
                assert words[2] == "--head" and env == _cluster_yaml_health_checks(), (words, env)
            if "cluster.yaml" in words:
                assert os.path.isfile(os.path.join(ROOT, "cluster.yaml"))
            if "--" in words:  # the job's entrypoint
                assert env == {"RAY_AUTH_MODE": "token"}
                inner = words[words.index("--") + 1:]
                assert inner[:3] == ["python", "-m", "raytrain.run"]
                _check_raytrain_run(inner[3:])
        elif words[:3] == ["pip", "install", "-e"]:  # an extra of this checkout, one pyproject.toml declares
            import tomllib

            extra = re.fullmatch(r"\.\[(\w+)\]", words[3]).group(1)
            with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
                assert extra in tomllib.load(f)["project"]["optional-dependencies"], extra
        elif words[0] == "pip":
            assert words[:3] == ["pip", "install", "torch==2.13.0"]
            assert "torch==2.13.0" in _read(".ci", "run")
        else:
            raise AssertionError(f"{name}: no check for {words}")


def _cluster_yaml_health_checks() -> dict:
    import yaml

    from raytrain.cli.local_cluster import health_checks

    found = health_checks(yaml.safe_load(_read("cluster.yaml")))
    assert found, "cluster.yaml's head starts with no RAY_health_check_* settings"
    return found


def test_health_check_snippets():
    """What the docs tell a `ray start` or KubeRay user to set is what cluster.yaml's head sets."""
    import yaml

    expected = _cluster_yaml_health_checks()
    assert set(expected) == {"RAY_health_check_period_ms", "RAY_health_check_timeout_ms",
                             "RAY_health_check_failure_threshold"}
    for words in _commands(_read("docs", "snippets", "health_checks.sh")):
        assert _program(words)[0] == expected
    spec = yaml.safe_load(_read("docs", "snippets", "kuberay_health_checks.yaml"))["spec"]["headGroupSpec"]
    (container,) = spec["template"]["spec"]["containers"]
    assert {e["name"]: e["value"] for e in container["env"]} == expected


def _undefined_names(tree: ast.AST) -> set[str]:
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return used - bound


@pytest.mark.parametrize("name", sorted(n for n in (*CHECKED, *RUN_BY_RAY_TEST) if n.endswith(".py")))
def test_python_snippet_checks(name):
    """Compiles; every imported name exists; every keyword given to an imported callable (and to
    hyperparameter_search) is one it takes; every attribute read from its result exists."""
    import importlib
    import inspect

    from raytrain import BestRun, hyperparameter_search

    source = _read("docs", "snippets", name)
    tree = ast.parse(source)
    compile(source, name, "exec")
    assert not _undefined_names(tree), _undefined_names(tree)
    imported = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            for a in node.names:
                assert hasattr(module, a.name), f"{node.module} has no {a.name}"
                imported[a.asname or a.name] = getattr(module, a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                imported[a.asname or a.name] = importlib.import_module(a.name)
    def resolve(expr):  # the object a dotted name rooted in an import stands for (None: not one)
        if isinstance(expr, ast.Name):
            return imported.get(expr.id)
        if isinstance(expr, ast.Attribute):
            owner = resolve(expr.value)
            if owner is not None:
                assert hasattr(owner, expr.attr), f"{ast.unparse(expr.value)} has no {expr.attr}"
                return getattr(owner, expr.attr)
        return None

    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        target = resolve(node.func)
        if isinstance(node.func, ast.Attribute) and node.func.attr == "hyperparameter_search":
            target = hyperparameter_search
        if target is None or not callable(target):
            continue
        given = {k.arg for k in node.keywords if k.arg}
        if dataclasses.is_dataclass(target):  # TrainingArguments, RayData, Files: their fields
            takes = {f.name for f in dataclasses.fields(target)}
        else:
            try:
                params = inspect.signature(target).parameters
            except (TypeError, ValueError):
                continue
            if any(p.kind is p.VAR_KEYWORD for p in params.values()):
                continue
            takes = set(params)
        assert given <= takes, f"{ast.unparse(node.func)} takes no {given - takes}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "best":
            assert hasattr(BestRun, node.attr), f"BestRun has no {node.attr}"
