"""Run TRL's own tests of AsyncGRPOTrainer against trl and against raytrain, with only the import line changed.

    python benchmarks/trl_async_tests.py --tests TRL/tests/experimental/test_async_grpo_trainer.py [PR_COPY.py ...]

TRL's test file is not installed with trl: --tests takes it from a trl checkout, with that checkout's
tests/testing_utils.py (or --testing-utils). A further file (the same test file on a PR branch) adds the
test methods its classes have and the first file's classes lack, as a class of their own (named with
`Extra`); its new classes are not taken. Two copies run here, one against the installed trl and one whose
`from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer` imports from raytrain.trl.
Every other line is the same in both, and in both:
- a name the installed trl lacks (the file may be older or newer than it) becomes a stand-in that raises
  ImportError when called (`is_X_available`: whether X is installed), so only the tests using it fail;
- `from ..testing_utils` reads the copy beside it, whose Ampere-GPU gate (`is_ampere_or_newer`) is lifted,
  so the trainer tests run on CPU (--keep-gate leaves it: they skip here);
- the Hub ids the tests load are local folders built here (no download): tiny models of the same
  classes, raytrain's byte-level tokenizer with TRL's Qwen chat templates, and the Zen of Python as zen.
Prints each test's outcome in both copies with its error on one line, and the counts; "trainer" marks
the tests of a class that uses the moved names (the others test TRL's internals, the same code in both
copies). --json writes the same. Ray starts locally (RAY_ADDRESS=local unless set); 4-5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import ast
import codecs
import contextlib
import importlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# this folder first on sys.path would make `import trl` import benchmarks/trl.py: the repository root instead
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks"]
MOVED = "trl.experimental.async_grpo"  # its names that raytrain.trl exports come from raytrain.trl
HUB = "trl-internal-testing"
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>",
                "</think>", "<tool_response>", "</tool_response>"]
# written beside the test file: lifts the GPU gate before the test module imports it
CONFTEST = """import functools

import testing_utils

testing_utils.is_ampere_or_newer = functools.lru_cache(None)(lambda device_index=0: True)
"""


def merge(main: str, extras: list[str]) -> str:
    """`main` plus, per extra file, the test methods its classes add to main's classes of the same name,
    each such class as `<name>Extra` (its decorators, bases and helper methods kept) after that file's imports."""
    have = {c.name: {m.name for m in c.body if isinstance(m, ast.FunctionDef)}
            for c in ast.parse(main).body if isinstance(c, ast.ClassDef)}
    out = [main.rstrip("\n") + "\n"]
    for i, text in enumerate(extras):
        lines = text.splitlines(keepends=True)

        def segment(node):
            return "".join(lines[min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1:node.end_lineno])

        tree = ast.parse(text)
        added = []
        for cls in (c for c in tree.body if isinstance(c, ast.ClassDef) and c.name in have):
            methods = [m for m in cls.body if isinstance(m, ast.FunctionDef)]
            new = [m for m in methods if m.name.startswith("test") and m.name not in have[cls.name]]
            if not new:
                continue
            head = "".join(f"@{ast.get_source_segment(text, d)}\n" for d in cls.decorator_list)
            bases = ", ".join(ast.unparse(b) for b in cls.bases)
            body = [segment(m) for m in methods if not m.name.startswith("test")] + [segment(m) for m in new]
            added.append(f"{head}class {cls.name}Extra{i + 1 if i else ''}({bases}):\n" + "\n".join(body))
        if added:
            imports = [ast.get_source_segment(text, n) for n in tree.body
                       if isinstance(n, (ast.Import, ast.ImportFrom))]
            out.append("# from an extra file (--tests): its imports and the tests it adds\n" + "\n".join(imports))
            out += added
    return "\n\n\n".join(out)


def rewrite(source: str, moved: bool) -> tuple[str, set[str]]:
    """(the copy of `source` that runs here, the names imported from MOVED that raytrain.trl exports).

    `from ..testing_utils` becomes a top-level import; a name trl lacks becomes a stand-in; with `moved`,
    the MOVED names raytrain.trl exports are imported from raytrain.trl instead: the only difference."""
    import trl

    import raytrain.trl

    lines = source.splitlines(keepends=True)
    edits, names = [], set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level and node.module and node.module.split(".")[-1] == "testing_utils":
            edits.append((node, [ast.unparse(ast.ImportFrom("testing_utils", node.names, 0))]))
            continue
        if node.level or not (node.module or "").startswith("trl"):
            continue
        module = importlib.import_module(node.module)
        have = [a for a in node.names if hasattr(module, a.name)]
        ours = [a for a in have if node.module == MOVED and a.name in raytrain.trl.__all__]
        names |= {a.asname or a.name for a in ours}
        ours = ours if moved else []
        rest = [a for a in have if a not in ours]
        if len(rest) == len(node.names):
            continue
        new = [ast.unparse(ast.ImportFrom(m, a, 0)) for m, a in ((node.module, rest), ("raytrain.trl", ours)) if a]
        for a in (a for a in node.names if a not in have):
            name = a.asname or a.name
            if a.name.startswith("is_") and a.name.endswith("_available"):
                spec = f"__import__('importlib.util').util.find_spec({a.name[3:-10]!r})"
                new.append(f"def {name}(*a, **k): return {spec} is not None")
            else:
                new.append(f"def {name}(*a, **k): raise ImportError('{a.name} is not in trl {trl.__version__}')")
        edits.append((node, new))
    for node, new in sorted(edits, key=lambda e: e[0].lineno, reverse=True):
        indent = lines[node.lineno - 1][:node.col_offset]
        lines[node.lineno - 1:node.end_lineno] = ["".join(f"{indent}{s}\n" for s in new)]
    return "".join(lines), names


def trainer_classes(source: str, names: set[str]) -> set[str]:
    """The test classes that use one of `names` (themselves or through their methods)."""
    return {c.name for c in ast.parse(source).body if isinstance(c, ast.ClassDef)
            and any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(c))}


def zen() -> list[str]:
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13").splitlines()[2:]  # the 19 aphorisms


def build_hub(root: Path) -> None:
    """root/trl-internal-testing/: the tiny models (with their tokenizer) and the zen dataset the tests load."""
    import torch
    import trl
    from tokenizers import Tokenizer
    from transformers import (GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3MoeConfig, Qwen3MoeForCausalLM)

    from examples.lora import _tokenizer_json  # raytrain's byte-level tokenizer: one token per byte

    moe = dict(head_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    for name, config_cls, model_cls, template, extra in (
            ("tiny-Qwen2ForCausalLM-2.5", Qwen2Config, Qwen2ForCausalLM, "qwen2_5", {}),
            ("tiny-Qwen3MoeForCausalLM", Qwen3MoeConfig, Qwen3MoeForCausalLM, "qwen3", moe)):
        inner = Tokenizer.from_str(_tokenizer_json())
        inner.add_special_tokens(QWEN_SPECIAL)
        tok = PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<|im_end|>", pad_token="<|endoftext|>")
        tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / f"{template}.jinja").read_text()
        config = config_cls(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                            pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None,
                            tie_word_embeddings=True, **extra)
        torch.manual_seed(0)
        model = model_cls(config)
        model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        model.save_pretrained(root / HUB / name)
        tok.save_pretrained(root / HUB / name)
    # zen: two configs, each prompt a user turn; a completion is the second half of the line
    readme = ["---", "configs:"]
    for config in ("conversational_prompt_completion", "conversational_prompt_only"):
        (root / HUB / "zen" / config).mkdir(parents=True)
        with open(root / HUB / "zen" / config / "train.jsonl", "w") as f:
            for line in zen():
                words = line.split()
                cut = max(1, len(words) // 2)
                row = {"prompt": [{"role": "user", "content": " ".join(words[:cut]) if "completion" in config
                                   else line}]}
                if "completion" in config:
                    row["completion"] = [{"role": "assistant", "content": " ".join(words[cut:])}]
                f.write(json.dumps(row) + "\n")
        readme += [f"- config_name: {config}", "  data_files:", "  - split: train", f"    path: {config}/train.jsonl"]
    (root / HUB / "zen" / "README.md").write_text("\n".join(readme + ["---", "Local stand-in for zen.", ""]))


def build_tree(tree: Path, hub: Path, tests: list[Path], testing_utils: Path, moved: bool, gate: bool) -> set[str]:
    """The copy of the test file that runs in `tree`; returns its trainer test classes."""
    tree.mkdir(parents=True)
    source = merge(tests[0].read_text(), [p.read_text() for p in tests[1:]])
    text, names = rewrite(source, moved)
    (tree / "test_async_grpo_trainer.py").write_text(text)
    (tree / "testing_utils.py").write_text(rewrite(testing_utils.read_text(), moved)[0])
    if not gate:
        (tree / "conftest.py").write_text(CONFTEST)
    (tree / HUB).symlink_to(hub / HUB, target_is_directory=True)  # the ids resolve from the cwd
    return trainer_classes(source, names)


def run(tree: Path, timeout: int, select: str | None, workers: int) -> dict[str, tuple[str, str]]:
    """pytest in `tree`: {Class::test: (passed | failed | skipped, the first line of why)}."""
    xml = tree / "report.xml"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(tree), str(ROOT), os.environ.get("PYTHONPATH")])))
    env.setdefault("RAY_ADDRESS", "local")  # a Ray of its own unless told otherwise
    cmd = [sys.executable, "-m", "pytest", "test_async_grpo_trainer.py", "-q", "-p", "no:cacheprovider",
           "-o", "addopts=", "-n", str(workers), "-o", f"timeout={timeout}", "--junitxml", str(xml),
           *(["-k", select] if select else [])]
    with open(tree / "pytest.log", "w") as log:
        subprocess.run(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
    outcomes = {}
    cases = ET.parse(xml).iter("testcase") if xml.is_file() else []
    for case in cases:
        test = f"{(case.get('classname') or '').split('.')[-1]}::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            outcomes[test] = ("failed", " ".join(s.strip() for s in (bad.get("message") or "").splitlines()[:3]))
        elif skip is not None:
            outcomes[test] = ("skipped", skip.get("message") or "")
        else:
            outcomes[test] = ("passed", "")
    if not outcomes:
        outcomes["<pytest>::<collection>"] = ("failed", f"no test ran: see {tree / 'pytest.log'}")
    (tree / "outcomes.json").write_text(json.dumps(outcomes, indent=1))
    return outcomes


def counts(outcomes: dict, tests: list[str]) -> str:
    got = [outcomes.get(t, ("missing", ""))[0] for t in tests]
    return ", ".join(f"{got.count(k)} {k}" for k in ("passed", "failed", "skipped", "missing") if got.count(k))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=Path, nargs="+", required=True,
                        help="TRL's tests/experimental/test_async_grpo_trainer.py; then files adding tests to it")
    parser.add_argument("--testing-utils", type=Path,
                        help="default: tests/testing_utils.py of the first file's checkout")
    parser.add_argument("--json", type=Path, help="also write the outcome here")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per test")
    parser.add_argument("--workers", type=int, default=0, help="pytest-xdist processes (0: one process)")
    parser.add_argument("--keep", type=Path, help="build the trees here and keep them")
    parser.add_argument("--reuse", action="store_true", help="take trl's outcomes from an earlier run in --keep")
    parser.add_argument("--keep-gate", action="store_true", help="leave TRL's Ampere-GPU gate on the trainer tests")
    parser.add_argument("-k", dest="select", help="pytest -k expression: run only these tests")
    args = parser.parse_args()
    utils = args.testing_utils or args.tests[0].resolve().parent.parent / "testing_utils.py"
    missing = [str(p) for p in (*args.tests, utils) if not p.is_file()]
    if missing:
        sys.exit(f"not found: {', '.join(missing)} (expected files of a trl checkout's tests/; see --help)")
    root = args.keep or Path(tempfile.mkdtemp(prefix="trl_async_tests_"))
    hub, upstream, ours = root / "hub", root / "trl", root / "raytrain"
    reuse = args.reuse and args.keep and (upstream / "outcomes.json").is_file()
    if not (hub / HUB).is_dir():
        build_hub(hub)
    for tree in (ours,) if reuse else (upstream, ours):
        shutil.rmtree(tree, ignore_errors=True)
        trainer = build_tree(tree, hub, args.tests, utils, tree is ours, args.keep_gate)
    trl_out = (json.loads((upstream / "outcomes.json").read_text()) if reuse
               else run(upstream, args.timeout, args.select, args.workers))
    rt_out = run(ours, args.timeout, args.select, args.workers)
    import trl

    import raytrain

    tests = sorted(set(trl_out) | set(rt_out), key=lambda t: (t.split("::")[0] not in trainer, t))
    marked = [t for t in tests if t.split("::")[0] in trainer]
    width = max(map(len, tests)) + 2
    gate = "kept: they skip without an Ampere GPU" if args.keep_gate else "lifted in both copies"
    print(f"TRL's GPU gate on the trainer tests: {gate}")
    print(f"{'test':{width}}{'trl ' + trl.__version__:14}raytrain {raytrain.__version__}")
    table = {}
    for test in tests:
        (a, why_a), (b, why_b) = (tuple(o.get(test, ("missing", ""))) for o in (trl_out, rt_out))
        kind = "trainer" if test in marked else "internal"
        table[test] = {"kind": kind, "trl": [a, why_a], "raytrain": [b, why_b]}
        print(f"{test:{width}}{a:14}{b:9} {kind}")
        for who, why in ((("both", why_a),) if why_a == why_b else (("trl", why_a), ("raytrain", why_b))):
            if why:
                print(f"    {who}: {why[:240]}")
    totals = {who: {"all": counts(out, tests), "trainer": counts(out, marked)}
              for who, out in (("trl " + trl.__version__, trl_out), ("raytrain " + raytrain.__version__, rt_out))}
    for who, c in totals.items():
        print(f"{who}: {len(tests)} tests: {c['all']}; the {len(marked)} trainer tests: {c['trainer']}")
    if args.json:
        args.json.write_text(json.dumps({"trl": trl.__version__, "raytrain": raytrain.__version__,
                                         "files": [str(p) for p in args.tests], "gate_lifted": not args.keep_gate,
                                         "totals": totals, "tests": table}, indent=1))
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
