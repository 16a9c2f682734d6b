"""Run one bench command and keep what it printed, with where and when, for the docs.

    python scripts/bench_record.py [--name NAME] [--out DIR] -- COMMAND [ARG ...]

e.g. ``python scripts/bench_record.py -- fedpipe bench pipeline --json`` or
``python scripts/bench_record.py -- python benchmarks/codec_bench.py``. The command must print
one JSON object on stdout (its progress goes to stderr, which passes through). The record,
``DIR/NAME.json`` (default ``docs/benchmarks/data/``), holds:

- ``command``: the command as given; ``date``: when it started (UTC, ISO 8601);
- ``commit``: the repository's HEAD, and ``dirty``: the files under ``fedpipe/``,
  ``benchmarks/`` and ``pyproject.toml`` that differ from it (empty when none);
- ``machine``: CPU model, cores, RAM, GPU (if torch sees one), torch, Python, OS;
- ``load_average``: the machine's load before the run (1, 5 and 15 min) and the highest
  1-minute load seen during it, so a page can say when other work shared the machine;
- ``wall_s``: how long the command ran; ``result``: the JSON object it printed.

NAME defaults to the bench's own: ``fedpipe bench pipeline`` -> ``pipeline``,
``python benchmarks/codec_bench.py`` -> ``codec``, ``benchmarks/gpu_check.py`` -> ``gpu-check``.
``scripts/render_bench_docs.py`` turns the records into the tables of the benchmark pages.
Nothing is written when the command fails or prints anything but one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "docs" / "benchmarks" / "data"
CODE_PATHS = ("fedpipe", "benchmarks", "pyproject.toml")


def bench_name(command: list[str]) -> str:
    """The record's name for ``command``: the ``fedpipe bench`` subcommand or the script's stem."""
    if "bench" in command:
        i = command.index("bench")
        if i >= 1 and Path(command[i - 1]).name == "fedpipe" and i + 1 < len(command):
            return command[i + 1]
    for arg in command:
        if arg.endswith(".py"):
            stem = Path(arg).stem.removesuffix("_bench")
            return stem.replace("_", "-")
    if "-m" in command and command.index("-m") + 1 < len(command):
        module = command[command.index("-m") + 1].rsplit(".", 1)[-1]
        return module.removesuffix("_bench").replace("_", "-")
    raise ValueError(f"cannot name the record of {shlex.join(command)!r}: give --name")


def _git(*args: str) -> str:
    """git's stdout as it printed it (porcelain lines start with a status column that may be a
    space: strip nothing here)."""
    out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    return out.stdout


def changed_paths(porcelain: str) -> list[str]:
    """The paths of ``git status --porcelain`` output (``XY path``; a rename's new path)."""
    paths = []
    for line in porcelain.splitlines():
        if len(line) > 3:
            paths.append(line[3:].split(" -> ")[-1])
    return paths


def source_state() -> tuple[str, list[str]]:
    """``(HEAD's hash, files of the benched code that differ from it)``."""
    status = _git("status", "--porcelain", "--", *CODE_PATHS)
    return _git("rev-parse", "HEAD").strip(), changed_paths(status)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024**2, 1)
    except OSError:
        pass
    return None


def _torch_facts() -> dict[str, Any]:
    """torch's version and the GPU it sees, asked in a child so this script stays light."""
    code = (
        "import json, torch\n"
        "gpu = None\n"
        "if torch.cuda.is_available():\n"
        "    p = torch.cuda.get_device_properties(0)\n"
        "    gpu = {'name': p.name, 'count': torch.cuda.device_count(),\n"
        "           'memory_gib': round(p.total_memory / 1024**3, 1)}\n"
        "print(json.dumps({'torch': torch.__version__, 'gpu': gpu}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    try:
        facts: dict[str, Any] = json.loads(out.stdout)
    except json.JSONDecodeError:
        return {"torch": None, "gpu": None}
    return facts


def machine() -> dict[str, Any]:
    """What ran the bench: CPU, cores, RAM, GPU, torch, Python and OS."""
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "ram_gib": _ram_gib(),
        **_torch_facts(),
        "python": platform.python_version(),
        "os": platform.platform(),
    }


class LoadWatch:
    """Samples the 1-minute load average every ``every_s`` seconds while a command runs."""

    def __init__(self, every_s: float = 5.0) -> None:
        self.before = list(os.getloadavg())
        self.peak = self.before[0]
        self._every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            self.peak = max(self.peak, os.getloadavg()[0])

    def __enter__(self) -> LoadWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, os.getloadavg()[0])

    def as_dict(self) -> dict[str, Any]:
        return {"before": [round(x, 2) for x in self.before], "peak": round(self.peak, 2)}


def parse_result(stdout: str) -> dict[str, Any]:
    """The one JSON object a bench printed (surrounding whitespace allowed)."""
    try:
        result = json.loads(stdout)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the command did not print one JSON object on stdout ({exc})") from None
    if not isinstance(result, dict):
        raise ValueError(f"the command printed JSON, but not an object: {type(result).__name__}")
    return result


def record(command: list[str], out_dir: Path, name: str | None = None) -> Path:
    """Run ``command``, write its record to ``out_dir/NAME.json`` and return that path."""
    name = name or bench_name(command)
    commit, dirty = source_state()
    date = datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat()
    start = time.monotonic()
    with LoadWatch() as load:
        proc = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(command)} exited {proc.returncode}; nothing recorded")
    entry = {
        "command": shlex.join(command),
        "date": date,
        "commit": commit,
        "dirty": dirty,
        "machine": machine(),
        "load_average": load.as_dict(),
        "wall_s": round(wall, 1),
        "result": parse_result(proc.stdout),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(entry, indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        usage="%(prog)s [--name NAME] [--out DIR] -- COMMAND [ARG ...]",
    )
    parser.add_argument("--name", help="the record's name (default: the bench's own)")
    parser.add_argument("--out", type=Path, default=DATA_DIR, help="folder of the records")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the bench command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the bench command after --")
    try:
        path = record(command, args.out, args.name)
    except (RuntimeError, ValueError) as exc:
        print(f"bench_record: {exc}", file=sys.stderr)
        return 1
    print(f"bench_record: wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
