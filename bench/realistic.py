"""A realistic agent: fresh start, preloaded template and in-process, side by side.

The agent's module imports litellm (the import that dominates real SWE agents' start) in a venv
this section builds for itself (cached under ``~/.cache/isolate-bench``; PyPI must be
reachable). With ``--quick`` a stand-in module that sleeps 0.3 s at import replaces it, so the
smoke test needs no network. Per mode:

- from ``run_episode`` to the entrypoint's first line, and the launch latency (the round trip
  of a no-op episode), sequential episodes after one warm-up;
- parent plus child CPU per episode over those episodes (a template's own and its forks' CPU
  included; its one-time start is reported apart);
- PSS per episode (``/proc/PID/smaps_rollup``, every process of the episodes, the template
  included) with 1, 16 and 64 episodes held open at once;
- throughput of 1-second episodes at concurrency 32.

In-process runs the same entrypoint inside one process of the agent's venv, the seed's model:
episodes are calls (threads for the 1-second ones), sharing everything.

Then the template against two fork-based contenders under the same interpreter and module
(bench/_fork_arms.py): the stdlib forkserver with the agent preloaded, a ``Process`` per
episode, and the floor, a bare ``os.fork()`` of a process that imported the agent. Each round
starts each of the three anew and measures launch, CPU per episode, PSS per episode with 64
held and throughput at concurrency 32, the three in an order that rotates from round to round;
the ratios are taken per round, their median reported.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import anyio
import psutil

import isolate
from isolate._core.system.procfs import GONE, stat_fields

from ._common import MARK_ENV, paired_ratio, summary
from ._context import Context

LITELLM = "litellm"
AGENT = """
import os, time
%(imports)s

def run(data):
    first_line = time.time()
    if data.get("hold"):
        open(os.path.join(data["dir"], "up-%%d" %% data["i"]), "w").close()
        while not os.path.exists(os.path.join(data["dir"], "go")):
            time.sleep(0.01)
    time.sleep(data.get("sleep", 0.0))
    return 1.0, {"first_line": first_line}
"""
#: The in-process contender: the same module imported into one process, episodes as calls.
IN_PROCESS = r"""
import json, os, resource, sys, threading, time
t0 = time.monotonic()
sys.path.insert(0, sys.argv[1])
import agent
import_s = time.monotonic() - t0
counts, held_dir = json.loads(sys.argv[2]), sys.argv[3]

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

def pss_kib():
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])

firsts, launches = [], []
c0 = cpu()
for _ in range(counts["seq"]):
    t = time.time()
    _, info = agent.run({})
    launches.append(time.time() - t)
    firsts.append(info["first_line"] - t)
cpu_per = (cpu() - c0) / counts["seq"]
pss = {}
for n in counts["pss"]:
    d = os.path.join(held_dir, "inproc-%d" % n)
    os.makedirs(d)
    threads = [threading.Thread(target=agent.run, args=({"hold": True, "dir": d, "i": i},))
               for i in range(n)]
    for t in threads:
        t.start()
    while len(os.listdir(d)) < n:
        time.sleep(0.01)
    pss[n] = pss_kib() / n
    open(os.path.join(d, "go"), "w").close()
    for t in threads:
        t.join()
sem = threading.Semaphore(counts["concurrency"])
def one():
    with sem:
        agent.run({"sleep": 1.0})
t = time.monotonic()
threads = [threading.Thread(target=one) for _ in range(counts["throughput"])]
for th in threads:
    th.start()
for th in threads:
    th.join()
print(json.dumps({"import_s": import_s, "first_line": firsts, "launch": launches,
                  "cpu_per_episode": cpu_per, "pss_kib": pss,
                  "throughput": counts["throughput"] / (time.monotonic() - t)}))
"""


def _venv(ctx: Context) -> tuple[str, str]:
    """The agent's interpreter and what it imports: a cached venv with litellm, or (quick) this
    interpreter and a stand-in."""
    if ctx.quick:
        return sys.executable, "time.sleep(0.3)  # stand-in for a heavy import"
    where = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "isolate-bench"
    venv = where / "litellm-venv"
    python = venv / "bin" / "python"
    if not (venv / "ok").exists():
        where.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", LITELLM],
            check=True,
        )
        (venv / "ok").touch()
    return str(python), "import litellm"


def _pss_kib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
                        break
        except OSError:
            continue
    return float(total)


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _template_cpu() -> float:
    """CPU of the running templates (each its outer process, PID 1 and importer), their reaped
    forks included (seconds)."""
    total = 0.0
    for template in isolate._core.templates.started_templates():
        for pid in template.own_pids():
            try:
                times = psutil.Process(pid).cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system + times.children_user + times.children_system
    return total


def _tree_cpu() -> float:
    """This process's CPU, its reaped children's and the running templates' (seconds)."""
    return _self_cpu() + _children_cpu() + _template_cpu()


async def _episode(spec: isolate.EpisodeSpec, data: dict[str, Any]) -> tuple[float, float]:
    """(run_episode to first line, round trip) of one episode, in seconds."""
    t0, m0 = time.time(), time.monotonic()
    outcome = await isolate.run_episode(spec, data)
    if outcome.status != "ok":
        raise RuntimeError(outcome.summary())
    return outcome.info["first_line"] - t0, time.monotonic() - m0


async def _held(spec: isolate.EpisodeSpec, box: Path, n: int) -> float:
    """PSS per episode with ``n`` episodes open at once (KiB)."""
    await anyio.Path(box).mkdir(parents=True)
    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(_episode, spec, {"hold": True, "dir": str(box), "i": i})
        with anyio.fail_after(900):
            while len(await anyio.to_thread.run_sync(os.listdir, box)) < n:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        mine = psutil.Process()
        pids = [p.pid for p in mine.children(recursive=True)]
        per = _pss_kib(pids) / n
        (box / "go").touch()
    return per


async def _throughput(spec: isolate.EpisodeSpec, total: int, concurrency: int) -> float:
    limit = anyio.CapacityLimiter(concurrency)

    async def one() -> None:
        async with limit:
            await _episode(spec, {"sleep": 1.0})

    t0 = time.monotonic()
    async with anyio.create_task_group() as tg:
        for _ in range(total):
            tg.start_soon(one)
    return total / (time.monotonic() - t0)


def _mem_available_kib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    return 0


async def _isolate(ctx: Context, spec: isolate.EpisodeSpec, counts: dict[str, Any]) -> Any:
    out: dict[str, Any] = {}
    t0, m0 = time.time(), time.monotonic()
    first = await isolate.run_episode(spec, {})
    out["first_episode_s"] = time.monotonic() - m0  # the template's start, for preload
    out["start"] = first.start
    out["containment"] = first.containment
    if first.status != "ok":
        raise RuntimeError(first.summary())
    del t0
    firsts, launches = [], []
    cpu0 = _self_cpu() + _children_cpu() + _template_cpu()
    for _ in range(counts["seq"]):
        f, r = await _episode(spec, {})
        firsts.append(f)
        launches.append(r)
    cpu = _self_cpu() + _children_cpu() + _template_cpu() - cpu0
    out["first_line"] = summary(firsts)
    out["launch"] = summary(launches)
    out["cpu_per_episode"] = cpu / counts["seq"]
    out["pss_kib"] = {}
    for n in counts["pss"]:
        per_fresh = out["pss_kib"].get(min(out["pss_kib"], default=n))
        if spec.preload is False and per_fresh and per_fresh * n * 1.5 > _mem_available_kib():
            out["pss_kib"][n] = None  # would not fit in memory: not run
            continue
        box = ctx.workdir / "realistic" / f"{'t' if spec.preload else 'f'}-{n}"
        out["pss_kib"][n] = await _held(spec, box, n)
    total = counts["throughput_fresh"] if spec.preload is False else counts["throughput"]
    out["throughput"] = await _throughput(spec, total, counts["concurrency"])
    out["throughput_episodes"] = total
    return out


def _in_process(ctx: Context, python: str, root: Path, counts: dict[str, Any]) -> Any:
    held = ctx.workdir / "realistic" / "inproc"
    held.mkdir(parents=True)
    proc = subprocess.run(
        [python, "-I", "-c", IN_PROCESS, str(root), json.dumps(counts), str(held)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"in-process driver failed: {proc.stderr[-2000:]}")
    raw = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        "first_episode_s": raw["import_s"],
        "first_line": summary(raw["first_line"]),
        "launch": summary(raw["launch"]),
        "cpu_per_episode": raw["cpu_per_episode"],
        "pss_kib": {int(k): v for k, v in raw["pss_kib"].items()},
        "throughput": raw["throughput"],
        "throughput_episodes": counts["throughput"],
    }


#: The contenders of the comparison, in the first round's order (each round rotates it by one).
ARMS = ("template", "forkserver", "floor")
#: The driver of a fork-based arm, run by the agent's interpreter from a copy of the module. In
#: Python 3.11 the fork server does not take its parent's sys.path (3.12 does), so the agent's
#: root and the driver's directory reach it by PYTHONPATH: ``-s -P`` instead of ``-I``, which
#: would ignore that variable.
DRIVER = "import sys, _fork_arms; _fork_arms.main(sys.argv[1:])"
FIGURES = ("launch", "cpu_per_episode", "pss_kib", "throughput")


def _group(pgid: int) -> list[int]:
    """Live processes of process group ``pgid``."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = stat_fields(int(name))
        if fields is not None and fields[0] not in GONE and int(fields[2]) == pgid:
            out.append(int(name))
    return out


def _fork_arm(
    ctx: Context, python: str, root: Path, arm: str, counts: dict[str, Any], tag: str
) -> dict[str, Any]:
    """One round of ``forkserver`` or ``floor`` (bench/_fork_arms.py) in a process of the
    agent's interpreter, its own session: whatever of it outlives it is killed and listed."""
    home = ctx.workdir / "realistic" / "driver"
    if not (home / "_fork_arms.py").exists():
        home.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(__file__).with_name("_fork_arms.py"), home / "_fork_arms.py")
    scratch = ctx.workdir / "realistic" / tag
    scratch.mkdir(parents=True)
    env = {
        **os.environ,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "PYTHONPATH": os.pathsep.join([str(root), str(home)]),
    }
    proc = subprocess.Popen(
        [python, "-s", "-P", "-c", DRIVER, arm, json.dumps(counts), str(scratch)],
        cwd=scratch,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=env,
    )
    try:
        stdout, stderr = proc.communicate(timeout=900)
    finally:
        if proc.returncode is None:
            proc.kill()
            proc.wait()
        stray = _group(proc.pid)
        for pid in stray:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    if proc.returncode != 0:
        raise RuntimeError(f"{arm} driver failed ({proc.returncode}): {stderr[-2000:]}")
    raw: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    raw["left"] = sorted(set(raw["left"]) | set(stray))
    return raw


async def _template_round(
    ctx: Context, spec: isolate.EpisodeSpec, counts: dict[str, Any], tag: str
) -> dict[str, Any]:
    """One round of the template, measured as the fork-based arms are: a template of its own
    (started by the first episode), one warm-up, then the four figures."""
    await isolate.close_templates()
    out: dict[str, Any] = {"arm": "template"}
    m0 = time.monotonic()
    first = await isolate.run_episode(spec, {})
    if first.status != "ok":
        raise RuntimeError(first.summary())
    out["start_s"] = time.monotonic() - m0
    try:
        await _episode(spec, {})  # warm-up
        firsts, launches = [], []
        cpu0 = _tree_cpu()
        for _ in range(counts["seq"]):
            f, r = await _episode(spec, {})
            firsts.append(f)
            launches.append(r)
        out["cpu_per_episode"] = (_tree_cpu() - cpu0) / counts["seq"]
        out["first_line"], out["launch"] = firsts, launches
        box = ctx.workdir / "realistic" / tag / "held"
        out["pss_kib"] = await _held(spec, box, counts["held"])
        out["throughput"] = await _throughput(spec, counts["throughput"], counts["concurrency"])
    finally:
        await isolate.close_templates()
    out["left"] = [p.pid for p in psutil.Process().children(recursive=True)]
    return out


async def _compare(
    ctx: Context, spec: isolate.EpisodeSpec, python: str, root: Path
) -> dict[str, Any]:
    """The template, the stdlib forkserver and the fork floor in interleaved rounds."""
    counts: dict[str, Any] = (
        {"rounds": 2, "seq": 3, "held": 4, "throughput": 8, "concurrency": 4}
        if ctx.quick
        else {"rounds": 3, "seq": 20, "held": 64, "throughput": 64, "concurrency": 32}
    )
    load_before = os.getloadavg()
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    orders = []
    for i in range(counts["rounds"]):
        order = ARMS[i % len(ARMS) :] + ARMS[: i % len(ARMS)]
        orders.append(list(order))
        for arm in order:
            tag = f"cmp-{i}-{arm}"
            if arm == "template":
                row = await _template_round(ctx, spec, counts, tag)
            else:
                row = await anyio.to_thread.run_sync(_fork_arm, ctx, python, root, arm, counts, tag)
            runs[arm].append(row)
    load_after = os.getloadavg()
    arms: dict[str, Any] = {}
    for arm, rows in runs.items():
        arms[arm] = {
            "start_s": summary([r["start_s"] for r in rows]),
            "first_line": summary([x for r in rows for x in r["first_line"]]),
            "launch": summary([x for r in rows for x in r["launch"]]),
            "launch_round_medians": summary([summary(r["launch"])["median"] for r in rows]),
            "cpu_per_episode": summary([r["cpu_per_episode"] for r in rows]),
            "pss_kib": summary([r["pss_kib"] for r in rows]),
            "throughput": summary([r["throughput"] for r in rows]),
            "left": sorted({p for r in rows for p in r["left"]}),
            "rounds": rows,
        }

    def per_round(arm: str, figure: str) -> list[float]:
        if figure == "launch":
            return [summary(r["launch"])["median"] for r in runs[arm]]
        return [r[figure] for r in runs[arm]]

    ratios = {
        f"{a}/{b}": {f: paired_ratio(per_round(a, f), per_round(b, f)) for f in FIGURES}
        for a, b in (("template", "forkserver"), ("template", "floor"), ("forkserver", "floor"))
    }
    return {
        "counts": counts,
        "orders": orders,
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in load_after],
        "arms": arms,
        "ratios": ratios,
    }


def _litellm_version(python: str) -> str:
    probe = "import importlib.metadata as m; print(m.version('litellm'))"
    return subprocess.run([python, "-c", probe], capture_output=True, text=True).stdout.strip()


async def _main(ctx: Context) -> dict[str, Any]:
    python, imports = _venv(ctx)
    root = ctx.workdir / "realistic" / "agent"
    root.mkdir(parents=True)
    (root / "agent.py").write_text(textwrap.dedent(AGENT % {"imports": imports}))
    counts: dict[str, Any] = (
        {"seq": 3, "pss": [1, 4], "throughput": 4, "throughput_fresh": 4, "concurrency": 4}
        if ctx.quick
        else {
            "seq": 10,
            "pss": [1, 16, 64],
            "throughput": 64,
            "throughput_fresh": 32,
            "concurrency": 32,
        }  # fmt: skip
    )
    base = isolate.EpisodeSpec(
        agent_root=root,
        entrypoint="agent:run",
        python=python,
        timeout=900,
        kill_grace=1.0,
        # Else litellm starts a thread at import that fetches its cost map (and a template
        # with a thread running is refused).
        env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", MARK_ENV: ctx.run_id},
    )
    template = base.model_copy(update={"preload": True})
    rows: dict[str, Any] = {}
    try:
        rows["template"] = await _isolate(ctx, template, counts)
        await isolate.close_templates()
        if not ctx.skip_fresh:
            rows["fresh"] = await _isolate(ctx, base, counts)
    finally:
        await isolate.close_templates()
    rows["inprocess"] = await anyio.to_thread.run_sync(_in_process, ctx, python, root, counts)
    try:
        compare = await _compare(ctx, template, python, root)
    finally:
        await isolate.close_templates()
    version = await anyio.to_thread.run_sync(_litellm_version, python)
    return {
        "agent": f"litellm {version}" if version else "stand-in (sleeps 0.3 s at import)",
        "counts": counts,
        "containment": [rows["fresh" if "fresh" in rows else "template"]["containment"]],
        "rows": rows,
        "compare": compare,
    }


def run(ctx: Context) -> dict[str, Any]:
    return anyio.run(_main, ctx)
