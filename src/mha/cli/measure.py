"""How every benchmark measures and records: the machine (CPU, BLAS kernel, torch's CPU
capability), interleaved medians, traced peak memory, the run again with OpenBLAS free to
choose its kernel, and the results files and README sections they write.

``mha bench`` (:mod:`.bench`) and the scripts under ``benchmarks/`` share these.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .._files import atomic_write
from .._kernel import compiled
from .._kernel.team import cores

__all__ = [
    "FORCED_BLAS",
    "check_readme",
    "cpu",
    "environment",
    "finish_script",
    "interleaved_medians",
    "machine_memory",
    "matmul_ceiling",
    "measured_on",
    "peak_traced_bytes",
    "readme_script",
    "runs_with_free_blas",
    "save_results",
    "script_parser",
    "splice",
    "write",
]


def machine_memory() -> int:
    """This machine's physical memory in bytes."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 24 * 2**30


def bandwidth(threads: int, gib: float = 0.5, repeats: int = 5) -> float:
    """Bytes per second read by ``np.sum`` over a large float32 array, on ``threads``."""
    data = np.ones(int(gib * 2**30) // 4, np.float32)
    parts = np.array_split(data, threads)
    data.sum()
    best = []
    for _ in range(repeats):
        workers = [threading.Thread(target=part.sum) for part in parts]
        start = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        best.append(data.nbytes / (time.perf_counter() - start))
    return float(np.median(best))


WARM = 0.1
"""Seconds of untimed calls before each timed one (``mha bench`` and the scripts under
``benchmarks/``). On the README's
virtual machine, for some tens of milliseconds after a pause (the 0.3 s that lets OpenBLAS's
and OpenMP's threads stop spinning) two threads each ran at about half speed: a 2-worker S3
layer call took 18.6 ms after a pause, each of its phases one worker's time, against 10.1
back to back; warmed first, the S3 rows measured mha 0.60 (float32) and 0.54 (float64) of
torch's time, against 0.84 and 0.80 cold in the same run (medians of 9). A model runs its
layers back to back: the steady state is what it sees."""


def interleaved_medians(
    functions: dict[str, Callable[[], Any]], repeats: int, pause: float = 0.3, warm: float = 0.0
) -> dict[str, list[float]]:
    """Run each function ``repeats`` times, interleaved, in a new order every round (shuffled
    by a seeded generator). A rotation kept each function after the same neighbour, and
    what a call leaves behind slows the next one (a variants benchmark measured its plain
    causal row 25% slower than with sinks, always after the largest call): shuffled, each
    follows a different one from round to round. After each pause, the function runs
    untimed for ``warm`` seconds (:data:`WARM`) before its timed call."""
    times: dict[str, list[float]] = {name: [] for name in functions}
    names = list(functions)
    shuffle = random.Random(0).shuffle
    for function in functions.values():
        function()  # warm-up
    for _ in range(repeats):
        order = names.copy()
        shuffle(order)
        for name in order:
            time.sleep(pause)  # OpenBLAS and OpenMP threads spin ~0.2 s after a call: let them rest
            warmed = time.perf_counter()
            while time.perf_counter() - warmed < warm:
                functions[name]()
            start = time.perf_counter()
            functions[name]()
            times[name].append(time.perf_counter() - start)
    return times


def matmul_ceiling(dtype: Any, n: int = 2048, repeats: int = 5) -> float:
    """This machine's square-matmul rate in GFLOP/s for ``dtype`` (the BLAS ceiling)."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, n, n)).astype(dtype)
    times = interleaved_medians({"matmul": lambda: a @ b}, repeats)["matmul"]
    return 2 * n**3 / statistics.median(times) / 1e9


def peak_traced_bytes(function: Callable[[], Any]) -> tuple[int, float]:
    """Peak bytes ``tracemalloc`` sees during one call, and the call's seconds."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    start = time.perf_counter()
    function()
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak, seconds


def environment(torch: Any) -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": None if torch is None else torch.__version__,
        "torch_threads": None if torch is None else torch.get_num_threads(),
        "torch_cpu_capability": None if torch is None else torch.backends.cpu.get_cpu_capability(),
        "cores": cores(),
        "machine": platform.machine(),
        "processor": _cpu_name(),
        "microarchitecture": _microarchitecture(),
        "family_model": _family_model(),
        **{name: os.environ.get(name) for name in FORCED_BLAS + HELD_INSTRUCTIONS},
        "instruction_sets": _instruction_sets(),
        "numba": _version("numba"),
        "compiled_step": compiled.available(),
        "walks_avx512": _walks_avx512(),
    }
    try:
        from threadpoolctl import threadpool_info  # type: ignore[import-untyped]
    except ImportError:
        return info
    info["blas"] = [
        {key: pool.get(key) for key in ("internal_api", "version", "architecture", "num_threads")}
        for pool in threadpool_info()
        if pool.get("user_api") == "blas"
    ]
    return info


def _walks_avx512() -> bool | None:
    """Whether numba compiles mha's walks with AVX-512 (``None``: no numba)."""
    if not compiled.available():
        return None
    from .._kernel import _numba_vectors

    return "+avx512f" in _numba_vectors.target_features()


FORCED_BLAS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
"""Variables some machines set, which hold OpenBLAS to an older kernel; users' machines don't."""


WALKS_HELD = ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")
TORCH_HELD = ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")
HELD_INSTRUCTIONS = WALKS_HELD + TORCH_HELD
"""Variables that hold mha's compiled walks (numba's target CPU and its features: the
name alone changes the tuning, the features the instruction sets) and torch's MKL and
oneDNN to older instruction sets (torch's own kernels: ``ATEN_CPU_CAPABILITY``, which its
recorded CPU capability shows): a run that sets them measures this machine as a CPU with
those instruction sets, and says so; its table is kept apart (:func:`keep_per_cpu`)."""


def runs_with_free_blas(
    command: list[str], results: Any, environ: Mapping[str, str] | None = None
) -> list[Any]:
    """``[results]``, and when the environment (``os.environ`` unless given) sets a
    :data:`FORCED_BLAS` variable, the same measurement again from ``command`` (which must
    print its results as JSON) in a child process without them: the configuration users
    have. Only the child's environment changes."""
    environ = os.environ if environ is None else environ
    runs = [results]
    if any(name in environ for name in FORCED_BLAS):
        env = {k: v for k, v in environ.items() if k not in FORCED_BLAS}
        child = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        runs.append(json.loads(child.stdout))
    return runs


def measured_on(env: dict[str, Any]) -> str:
    """The sentence a results table opens with: when, on what CPU, BLAS kernel and torch."""
    blas = env.get("blas", [{}])[0]
    forced = " ".join(f"{name}={env[name]}" for name in FORCED_BLAS if env.get(name))
    torch_held = " ".join(f"{name}={env[name]}" for name in TORCH_HELD if env.get(name))
    walks_held = [name for name in WALKS_HELD if env.get(name) is not None]
    target = ""
    if walks_held:  # what the walks were compiled for, where a variable chose it
        avx512 = env.get("walks_avx512")
        width = "" if avx512 is None else (" with" if avx512 else " without") + " AVX-512"
        name = env.get("NUMBA_CPU_NAME") or "this CPU"
        target = f" for {name}{width} ({', '.join(walks_held)})"
    return (
        f"Measured {env['date'][:10]} on {env['cores']} cores of an {cpu(env)}: NumPy "
        f"{env['numpy']} with OpenBLAS {blas.get('version')} using its "
        f"{blas.get('architecture')} kernel"
        + (f" (held there by {forced})" if forced else " (free to choose it)")
        + (
            f"; torch {env['torch']} (CPU capability {env.get('torch_cpu_capability')}). "
            if env.get("torch")
            else ". "
        )
        + (
            f"Instruction sets: {' '.join(env['instruction_sets'])}. "
            if env.get("instruction_sets")
            else ""
        )
        + (
            f"mha's tile walks compiled by numba {env['numba']}{target}. "
            if env.get("compiled_step")
            else ""
        )
        + (f"torch's libraries held by {torch_held}. " if torch_held and env.get("torch") else "")
    )


SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512dq", "avx512bw", "avx512vl",
              "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "asimd", "sve")  # fmt: skip


def _instruction_sets() -> list[str]:
    """The SIMD instruction sets this CPU reports (Linux's /proc/cpuinfo), in a fixed order."""
    flags: set[str] = set()
    for line in _cpuinfo_lines():
        if line.startswith(("flags", "Features")):
            flags |= set(line.split(":", 1)[1].split())
    return [flag for flag in SIMD_FLAGS if flag in flags]


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def cpu(env: Mapping[str, Any]) -> str:
    """The CPU of ``env`` as a table names it: the processor's name and, where recorded,
    its microarchitecture (``AMD EPYC (znver4)``). A virtual machine's name alone may not
    tell two CPUs apart: KVM reports "AMD EPYC" for Zen 4 and Zen 5 alike."""
    micro = env.get("microarchitecture")
    return f"{env['processor']} ({micro})" if micro else str(env["processor"])


def _microarchitecture() -> str | None:
    """This CPU's microarchitecture as LLVM names it (``znver4``, ``skylake-avx512``, ...;
    llvmlite comes with numba, the ``fast`` extra), else :func:`_family_model`'s numbers.
    (Without numba the same CPU's tables take the other name.)"""
    try:
        from llvmlite import binding

        name = str(binding.get_host_cpu_name())
        if name and name != "generic":
            return name
    except (ImportError, OSError):
        pass
    return _family_model()


def _family_model() -> str | None:
    """This CPU's family and model numbers from /proc/cpuinfo (``family 25 model 17``),
    recorded beside LLVM's name (which older LLVMs give two generations alike)."""
    fields = _cpuinfo()
    if "cpu family" in fields and "model" in fields:
        return f"family {fields['cpu family']} model {fields['model']}"
    return None


def _cpu_name() -> str:
    return _cpuinfo().get("model name") or platform.processor() or "unknown"


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in Linux's /proc/cpuinfo (none elsewhere)."""
    fields: dict[str, str] = {}
    for line in _cpuinfo_lines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


@functools.cache
def _cpuinfo_lines() -> tuple[str, ...]:
    """Linux's /proc/cpuinfo, read once a process (the name, family, model and flags of a
    table's environment all come from it); none elsewhere."""
    try:
        return tuple(Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return ()


def write(path: Path, text: str) -> None:
    atomic_write(path, lambda handle: handle.write(text.encode()))


def check_readme(readme: Path, begin: str, end: str) -> None:
    """Refuse, before measuring anything, a README with no section to rewrite."""
    try:
        text = readme.read_text()
    except OSError as error:
        raise ValueError(f"cannot read {readme}: {error.strerror or error}") from None
    if begin not in text or end not in text:
        raise ValueError(f"{readme} has no {begin} ... {end} section to rewrite")


def splice(readme: Path, table: str, begin: str, end: str) -> None:
    check_readme(readme, begin, end)
    text = readme.read_text()
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    write(readme, f"{head}{begin}\n{table}{end}{tail}")


def script_parser(doc: str, output: Path, readme: bool = False) -> argparse.ArgumentParser:
    """The options every script under ``benchmarks/`` takes: ``--quick``, ``--output``
    (default ``output``), ``--readme`` when it has a README section, and the hidden
    ``--json-only`` of its free-BLAS child."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--output", type=Path, default=output)
    if readme:
        parser.add_argument("--readme", type=Path, help="rewrite this README's section")
    parser.add_argument("--json-only", action="store_true", help=argparse.SUPPRESS)
    return parser


def finish_script(
    script: str,
    args: argparse.Namespace,
    results: Any,
    name: str,
    markdown: Callable[[list[Any]], str],
    markers: tuple[str, str] = ("", ""),
) -> int:
    """The end of every script under ``benchmarks/``: as the free-BLAS child (``--json-only``)
    print ``results`` as JSON; otherwise add that child's run where this environment holds
    OpenBLAS (:func:`runs_with_free_blas`), write ``name[-quick].json`` and ``.md`` under
    ``--output`` (and the README's section between ``markers`` with ``--readme``), and print
    the table."""
    if args.json_only:
        print(json.dumps(results))
        return 0
    child = [sys.executable, script, "--json-only", *(["--quick"] if args.quick else [])]
    runs = runs_with_free_blas(child, results)
    table = markdown(runs)
    readme = getattr(args, "readme", None)
    save_results(args.output, f"{name}-quick" if args.quick else name, runs, table, readme, markers)
    print(table)
    return 0


def readme_script(
    argv: list[str] | None,
    doc: str,
    script: str,
    measure: Callable[[bool], Any],
    name: str,
    markdown: Callable[[list[Any]], str],
    markers: tuple[str, str],
    per_cpu: bool = False,
) -> int:
    """The whole ``main`` of a script under ``benchmarks/`` whose table has a README section
    between ``markers``: its options (:func:`script_parser`, results under
    ``benchmarks/results``), the README checked before anything is measured, ``measure
    (quick)``, then :func:`finish_script`; with ``per_cpu``, a full run's results also kept
    under this CPU's name (:func:`keep_per_cpu`)."""
    output = Path(script).resolve().parent / "results"
    args = script_parser(doc, output, readme=True).parse_args(argv)
    if args.readme:
        check_readme(args.readme, *markers)  # before measuring anything
    status = finish_script(script, args, measure(args.quick), name, markdown, markers)
    if per_cpu and status == 0 and not args.json_only and not args.quick:
        keep_per_cpu(args.output, name)  # one table per CPU
    return status


def save_results(
    output: Path, name: str, results: Any, table: str, readme: Path | None, markers: tuple[str, str]
) -> None:
    """Write ``name.json`` and ``name.md`` under ``output``, and the README's section
    between ``markers`` (the benchmark scripts under ``benchmarks/`` share this)."""
    output.mkdir(parents=True, exist_ok=True)
    write(output / f"{name}.json", json.dumps(results, indent=2) + "\n")
    write(output / f"{name}.md", table)
    if readme is not None:
        splice(readme, table, *markers)


def keep_per_cpu(output: Path, name: str) -> None:
    """Copy ``name.json`` and ``.md`` under ``output`` to ``name-<cpu>.json`` and ``.md``
    (:func:`cpu`'s name in lower case, words joined by hyphens: ``amd-epyc-znver4``): one
    table per CPU. A run held to other instruction sets (a variable of
    :data:`HELD_INSTRUCTIONS` set) is kept apart, never over the CPU's own: as the CPU its
    walks were compiled for (``amd-epyc-znver4-as-haswell``), else as held
    (``amd-epyc-znver4-held``)."""
    results = json.loads((output / f"{name}.json").read_text())
    env = (results[0] if isinstance(results, list) else results)["environment"]  # (run, runs)
    held = any(env.get(variable) is not None for variable in HELD_INSTRUCTIONS)
    target = env.get("NUMBA_CPU_NAME")
    name_of = cpu(env) + (f" as {target}" if target else " held" if held else "")
    slug = re.sub(r"[^a-z0-9]+", "-", name_of.lower()).strip("-")
    for suffix in (".json", ".md"):
        shutil.copyfile(output / f"{name}{suffix}", output / f"{name}-{slug}{suffix}")
