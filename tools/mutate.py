"""Mutation testing of the modules that keep isolate's promises: ``make mutate``.

    python tools/mutate.py [MODULE ...] [--jobs N] [--workdir DIR] [--show] [--limit N]

Each module of ``[tool.mutmut.modules]`` in pyproject.toml (all of them, or those named) is
mutated in a copy of the tree under ``--workdir`` and tested with that module's test files only.
A module is run one of two ways:

- ``mutmut`` (the default): mutmut 3 in the copy, with ``only_mutate`` set to the module and
  its test selection to the module's ``tests``; ``functions``, where given, limits the run to
  the mutants of those functions (mutmut's names: ``x_name`` for a function, ``xǁClassǁname``
  for a method). mutmut keeps its results in the copy, so a second run redoes only what changed.
- ``file``: for ``agent_shim/shim.py``, which runs as the episode's child process under the
  agent's interpreter, with ``-I`` and an environment isolate builds. mutmut's trampolines
  cannot reach it there (they read the mutant's name from an environment variable the child
  never gets, and import mutmut, which the agent's Python does not have). Instead each mutant
  mutmut's operators make of the listed functions is written into the copy's file as it is, and
  the module's tests run against it with plain pytest: a test failure (or a hang past the time
  bound) kills it.

At the end: ``N killed of M`` for each module and overall, and every survivor (``--show``: with
its diff). Exit status 0 whatever the score: the run reports, it does not gate.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: What a copy of the tree holds: the code, the tests and what they read.
COPIED = ("isolate", "agent_shim", "tests", "examples", "pyproject.toml", "README.md")
#: A mutant that killed mutmut's own test runner (a sweep that signals what is not the episode's).
RUNNER_ENDED = "ended the test runner"
#: Outcomes that count as killed (mutmut's words; the file runner uses the first two).
KILLED = ("killed", "timeout", "caught by type check", "segfault", RUNNER_ENDED)


@dataclass
class Module:
    path: str
    tests: list[str]
    runner: str = "mutmut"
    functions: list[str] = field(default_factory=list)
    pid_namespace: bool = False

    @property
    def dotted(self) -> str:
        return self.path.removesuffix(".py").replace("/", ".")

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9]+", "_", self.dotted)


@dataclass
class Result:
    module: str
    outcomes: dict[str, str]  # mutant -> outcome
    diffs: dict[str, str] = field(default_factory=dict)

    def killed(self) -> int:
        return sum(outcome in KILLED for outcome in self.outcomes.values())

    def survivors(self) -> list[str]:
        return [m for m, outcome in self.outcomes.items() if outcome not in KILLED]


def load_config() -> tuple[dict[str, object], dict[str, Module]]:
    try:
        from tomllib import loads
    except ImportError:  # Python 3.10: mutmut brings toml there
        from toml import loads  # type: ignore[import-untyped,no-redef]
    data = loads((REPO / "pyproject.toml").read_text())
    base = dict(data["tool"]["mutmut"])
    modules = {
        path: Module(path=path, **entry) for path, entry in dict(base.pop("modules")).items()
    }
    return base, modules


def copy_tree(into: Path) -> None:
    """A fresh copy of what the tests need, keeping mutmut's state (``mutants/``) if there."""
    into.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in COPIED:
        source, target = REPO / name, into / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
        if source.is_dir():
            shutil.copytree(source, target, symlinks=True, ignore=ignore)
        elif source.exists():
            shutil.copy2(source, target)


def toml_value(value: object) -> str:
    # JSON's strings and arrays of strings are TOML's too (\\uXXXX escapes included).
    return json.dumps(value)


def write_mutmut_config(copy: Path, base: dict[str, object], module: Module) -> None:
    """The copy's pyproject.toml with a [tool.mutmut] of the base settings plus this module's
    file and tests (the per-module tables removed: mutmut reads the rest)."""
    text = (copy / "pyproject.toml").read_text()
    text = re.sub(r"(?ms)^\[tool\.mutmut(\.[^\]]*)?\]\n.*?(?=^\[(?!tool\.mutmut)|\Z)", "", text)
    settings = {
        **base,
        "only_mutate": [module.path],
        "pytest_add_cli_args_test_selection": module.tests,
    }
    lines = ["", "[tool.mutmut]"] + [f"{k} = {toml_value(v)}" for k, v in settings.items()]
    (copy / "pyproject.toml").write_text(text.rstrip() + "\n" + "\n".join(lines) + "\n")


def child_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MUTANT_UNDER_TEST")}


def mutmut_results(copy: Path, env: dict[str, str], wanted: list[str]) -> dict[str, str]:
    """mutant -> outcome, for the mutants whose names match one of ``wanted`` (regexes)."""
    listed = subprocess.run(
        [sys.executable, "-m", "mutmut", "results", "--all", "true"],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    outcomes = {}
    for line in listed.stdout.splitlines():
        name, _, outcome = line.strip().rpartition(": ")
        if any(re.fullmatch(w, name) for w in wanted):
            outcomes[name] = outcome
    return outcomes


def mutmut_pass(command: list[str], copy: Path, env: dict[str, str]) -> list[str]:
    """One ``mutmut run``, its output passed through; the mutants it lost (in flight when its
    test runner died), which ``mutmut run`` would only start again."""
    with subprocess.Popen(
        command, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    ) as run:
        assert run.stdout is not None
        output = b""
        fd = run.stdout.fileno()
        for chunk in iter(lambda: os.read(fd, 65536), b""):
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
            output = (output + chunk)[-65536:]
    if run.returncode == 0:
        return []
    text = output.decode(errors="replace")
    return re.findall(r"(?m)^\s+- (\S+__mutmut_\d+)$", text.partition("in-flight mutant")[2])


def run_mutmut(
    module: Module, base: dict[str, object], copy: Path, jobs: int, limit: int | None
) -> Result:
    copy_tree(copy)
    write_mutmut_config(copy, base, module)
    names = [f"{module.dotted}.{fn}__mutmut_*" for fn in module.functions]
    if limit is not None:
        names = [
            f"{module.dotted}.{fn}__mutmut_{i}"
            for fn in module.functions or ["*"]
            for i in range(1, limit + 1)
        ]
    env = child_env()
    wanted = [re.escape(n).replace(r"\*", ".*") for n in names or [f"{module.dotted}.*"]]
    print(f"== {module.path}: mutmut in {copy}", flush=True)
    ended_runner: set[str] = set()
    todo = names
    while True:
        command = [sys.executable, "-m", "mutmut", "run", "--max-children", str(jobs), *todo]
        if module.pid_namespace:
            command = as_pid_1(command)
        lost = mutmut_pass(command, copy, env)
        if not lost:
            break
        # A mutant of the sweep that killed mutmut's test runner: it signalled a process
        # that is none of the episode's. Counted as killed, and the run goes on without it.
        print(f"== {module.path}: {', '.join(lost)} ended mutmut's test runner", flush=True)
        ended_runner.update(lost)
        todo = [
            name
            for name, outcome in mutmut_results(copy, env, wanted).items()
            if outcome == "not checked" and name not in ended_runner
        ]
        if not todo:
            break
    outcomes = mutmut_results(copy, env, wanted)
    outcomes.update({name: RUNNER_ENDED for name in ended_runner})
    result = Result(module.path, outcomes)
    for name in result.survivors():
        shown = subprocess.run(
            [sys.executable, "-m", "mutmut", "show", name],
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        result.diffs[name] = shown.stdout
    return result


def as_pid_1(command: list[str]) -> list[str]:
    """``command`` as PID 1 of a PID (and mount) namespace of its own, where it can: a mutant of
    the sweep may signal every process it can see, and PID 1 is the one process of a namespace
    that a signal from inside it cannot kill (mutmut's own children can die: that mutant then
    counts as killed). Without root or ``unshare`` the command runs as it is, with a warning."""
    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None:
        print("== no root or no unshare: mutmut runs where a sweep mutant can kill it", flush=True)
        return command
    return [unshare, "--pid", "--fork", "--mount-proc", "--kill-child", *command]


def file_mutants(copy: Path, module: Module) -> list[tuple[str, str]]:
    """(name, mutated source) of each mutation mutmut's operators make in ``functions``."""
    script = f"""
import json, sys
from mutmut.mutation.file_mutation import create_mutations, deep_replace
code = open({module.path!r}).read()
tree, mutations, _, _ = create_mutations({module.path!r}, code)
wanted = set({module.functions!r})
out, count = [], {{}}
for m in mutations:
    fn = m.contained_by_top_level_function
    name = fn.name.value if fn is not None else None
    if wanted and name not in wanted:
        continue
    count[name] = count.get(name, 0) + 1
    out.append(["%s__mutant_%d" % (name, count[name]),
                deep_replace(tree, m.original_node, m.mutated_node).code])
json.dump(out, sys.stdout)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=copy, capture_output=True, text=True, check=True
    )
    return [(name, source) for name, source in json.loads(done.stdout)]


def pytest_run(copy: Path, tests: list[str], timeout: float) -> tuple[int | None, float]:
    started = time.monotonic()
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        done = subprocess.run(
            command,
            cwd=copy,
            env=child_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=timeout,
            start_new_session=True,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None, time.monotonic() - started
    return done.returncode, time.monotonic() - started


def run_file(module: Module, base: dict[str, object], copy: Path, limit: int | None) -> Result:
    copy_tree(copy)
    write_mutmut_config(copy, base, module)  # create_mutations reads [tool.mutmut] too
    target = copy / module.path
    original = target.read_text()
    print(f"== {module.path}: each mutant in {copy}, then {' '.join(module.tests)}", flush=True)
    code, seconds = pytest_run(copy, module.tests, timeout=3600)
    if code != 0:
        raise SystemExit(f"{module.path}: the tests fail unmutated (exit {code}): fix that first")
    bound = 3 * seconds + 30
    result = Result(module.path, {})
    mutants = file_mutants(copy, module)
    if limit is not None:
        mutants = [(n, src) for n, src in mutants if int(n.rpartition("_")[2]) <= limit]
    try:
        for i, (name, source) in enumerate(mutants, 1):
            target.write_text(source)
            # Bytecode is checked by the source's mtime (in seconds) and size: a mutant of the
            # same size written within the second would run the previous one's.
            shutil.rmtree(target.parent / "__pycache__", ignore_errors=True)
            code, took = pytest_run(copy, module.tests, bound)
            outcome = "timeout" if code is None else ("survived" if code == 0 else "killed")
            result.outcomes[name] = outcome
            if outcome == "survived":
                result.diffs[name] = "".join(
                    difflib.unified_diff(
                        original.splitlines(True), source.splitlines(True), module.path, name, n=1
                    )
                )
            print(f"  {i}/{len(mutants)} {name}: {outcome} ({took:.0f} s)", flush=True)
    finally:
        target.write_text(original)
    return result


def main() -> int:
    base, modules = load_config()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help=f"of: {', '.join(modules)} (default: all)")
    parser.add_argument("--jobs", type=int, default=2, help="mutmut's --max-children")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path(tempfile.gettempdir()) / f"isolate-mutate-{os.getuid()}",
        help="where the copies live (kept between runs)",
    )
    parser.add_argument("--show", action="store_true", help="print each survivor's diff")
    parser.add_argument(
        "--limit", type=int, help="only the first N mutants of each function (a quick check)"
    )
    args = parser.parse_args()
    unknown = [m for m in args.modules if m not in modules]
    if unknown:
        parser.error(f"not in [tool.mutmut.modules]: {', '.join(unknown)}")
    results = []
    for path in args.modules or list(modules):
        module = modules[path]
        copy = args.workdir / module.slug
        if module.runner == "file":
            results.append(run_file(module, base, copy, args.limit))
        else:
            results.append(run_mutmut(module, base, copy, args.jobs, args.limit))
    print()
    for result in results:
        survivors = result.survivors()
        print(f"{result.module}: {result.killed()} killed of {len(result.outcomes)}")
        for name in survivors:
            print(f"  {result.outcomes[name]}: {name}")
            if args.show:
                print("    " + result.diffs.get(name, "").rstrip().replace("\n", "\n    "))
    killed = sum(r.killed() for r in results)
    total = sum(len(r.outcomes) for r in results)
    print(f"overall: {killed} killed of {total}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
