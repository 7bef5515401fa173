"""Run transformers' own Trainer tests against raytrain, with only their imports changed.

    python benchmarks/hf_trainer_tests.py --tests /path/to/transformers/tests [--all]

The test files are not installed with transformers (nor in its sdist): point --tests at the
`tests/` folder of a transformers checkout at the installed version. Both copies of the selected
files run here, one unchanged and one whose imports of the Trainer's names come from raytrain.
The selection is what passes against transformers on this machine (no GPU, no Hub download), so
a test skipped or failing for HF here is not counted. Prints raytrain's count, the tests that pass
for transformers only with their first error line, and writes the same as JSON with --json.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

FILES = ["test_trainer_callback.py", "test_trainer_checkpointing.py", "test_trainer_data.py",
         "test_trainer_evaluation.py", "test_trainer_optimizers.py", "trainer_test_utils.py"]
OPTIONAL = ["test_trainer.py"]  # the rest of HF's Trainer tests: with --all
# HF's tests of TrainingArguments, accelerator_config, MoE losses, Liger's skip_logits and the searches: with --extra
EXTRA = ["test_training_args.py", "test_trainer_accelerator.py", "test_trainer_moe_loss.py",
         "test_skip_logits_eval.py", "test_trainer_hyperparameter.py"]
TESTING = "transformers.testing_utils"  # its missing require_* skip; no name of it is raytrain's
# The transformers modules whose Trainer names raytrain provides under the same name.
MODULES = {"transformers", "transformers.trainer", "transformers.trainer_callback",
           "transformers.trainer_utils", "transformers.training_args"}


def raytrain_names() -> set[str]:
    import raytrain

    # set_seed stays HF's: the tests seed their own models with it, not the Trainer.
    return set(raytrain.__all__) - {"set_seed", "ConfigError", "__version__"}


def rewrite(source: str, names: set[str]) -> str:
    """Move the imports of `names` from transformers' modules to raytrain; leave all else.

    A name the installed transformers lacks (test files a little older or newer than it) is
    dropped from its import in both copies, so only the tests that use it fail, on both sides.
    """
    import importlib

    lines = source.splitlines(keepends=True)
    edits = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.ImportFrom) and node.module in MODULES | {TESTING} and node.level == 0):
            continue
        module = importlib.import_module(node.module)
        ours = [a for a in node.names if a.name in names and node.module != TESTING]
        rest = [a for a in node.names if a not in ours and hasattr(module, a.name)]
        if len(ours) + len(rest) == len(node.names) and not ours:
            continue
        indent = lines[node.lineno - 1][: node.col_offset]
        new = [ast.unparse(ast.ImportFrom(m, a, 0)) for m, a in ((node.module, rest), ("raytrain", ours)) if a]
        # a requirement the installed testing_utils no longer has skips its tests (in both copies)
        new += [f"{a.name} = __import__('unittest').skip('{a.name}: not in this transformers')"
                for a in node.names if a not in ours and a not in rest and a.name.startswith("require_")]
        new = new or ["pass"]
        edits.append((node.lineno, node.end_lineno, "".join(f"{indent}{s}\n" for s in new)))
    for start, end, text in sorted(edits, reverse=True):
        lines[start - 1:end] = [text]
    return "".join(lines)


def copy_tree(src: Path, dest: Path, names: set[str] | None, files: list[str]) -> None:
    trainer = dest / "tests" / "trainer"
    trainer.mkdir(parents=True)
    (dest / "tests" / "__init__.py").write_text("")
    (trainer / "__init__.py").write_text("")
    for name in files:
        text = (src / "trainer" / name).read_text()
        (trainer / name).write_text(rewrite(text, names or set()))
    fixtures = src / "fixtures"
    if fixtures.is_dir():
        shutil.copytree(fixtures, dest / "tests" / "fixtures")


def run(tree: Path, timeout: int, select: str | None, workers: int) -> dict[str, tuple[str, str]]:
    xml = tree / "report.xml"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "pytest", "tests/trainer", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           "-n", str(workers), "-o", f"timeout={timeout}", "--junitxml", str(xml), *(["-k", select] if select else [])]
    subprocess.run(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    outcomes = {}
    for case in ET.parse(xml).iter("testcase"):
        test = f"{case.get('classname').split('.')[-1]}::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            outcomes[test] = ("failed", next(iter((bad.get("message") or "").splitlines()), "")[:200])
        elif case.find("skipped") is not None:
            outcomes[test] = ("skipped", "")
        else:
            outcomes[test] = ("passed", "")
    (tree / "outcomes.json").write_text(json.dumps(outcomes, indent=1))
    return outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=Path, required=True, help="a transformers checkout's tests/ folder")
    parser.add_argument("--json", type=Path, help="also write the outcome here")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test")
    parser.add_argument("--keep", type=Path, help="build the two trees here and keep them")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist processes")
    parser.add_argument("--all", action="store_true", help="also tests/trainer/test_trainer.py")
    parser.add_argument("--extra", action="store_true", help="also the files in EXTRA")
    parser.add_argument("--only-extra", action="store_true", help="only the files in EXTRA (with trainer_test_utils.py)")
    parser.add_argument("-k", dest="select", help="pytest -k expression: run only these tests")
    parser.add_argument("--reuse", action="store_true",
                        help="take transformers' outcomes from an earlier run in --keep (rerun raytrain only)")
    args = parser.parse_args()
    files = FILES + (OPTIONAL if args.all else []) + (EXTRA if args.extra else [])
    if args.only_extra:
        files = ["trainer_test_utils.py", *EXTRA]
    missing = [n for n in files if not (args.tests / "trainer" / n).is_file()]
    if missing:
        sys.exit(f"--tests: {args.tests / 'trainer'} lacks {', '.join(missing)} "
                 "(expected the tests/ folder of a transformers checkout)")
    root = args.keep or Path(tempfile.mkdtemp(prefix="hf_trainer_tests_"))
    hf, ours = root / "transformers", root / "raytrain"
    reuse = args.reuse and args.keep and (hf / "outcomes.json").is_file()
    for tree in (ours,) if reuse else (hf, ours):
        shutil.rmtree(tree, ignore_errors=True)
        copy_tree(args.tests, tree, raytrain_names() if tree is ours else None, files)
    hf_out = (json.loads((hf / "outcomes.json").read_text()) if reuse
              else run(hf, args.timeout, args.select, args.workers))
    rt_out = run(ours, args.timeout, args.select, args.workers)
    if args.select:
        hf_out = {t: o for t, o in hf_out.items() if t in rt_out}
    selected = sorted(t for t, (o, _) in hf_out.items() if o == "passed")
    passed = [t for t in selected if rt_out.get(t, ("missing", ""))[0] == "passed"]
    differ = {t: rt_out.get(t, ("missing", "not collected"))[1] for t in selected if t not in passed}
    import transformers

    print(f"transformers {transformers.__version__}: {len(hf_out)} collected, {len(selected)} pass here "
          f"(the selection); raytrain passes {len(passed)} of {len(selected)}")
    for test, why in differ.items():
        print(f"  {test}: {why}")
    if args.json:
        args.json.write_text(json.dumps({"transformers": transformers.__version__, "collected": len(hf_out),
                                         "selected": selected, "passed": passed, "differ": differ}, indent=1))
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
