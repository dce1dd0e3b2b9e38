"""Time to first token of a returning prompt, through a real vLLM engine (``vllm.LLM``).

The engines run side by side, one subprocess each, on the same model, the same device KV
cache, which holds one prompt and a little more, and the same OpenMP team (``--omp-cpus``):

- ``recompute``: no offloading; a returning prompt is prefilled again.
- ``primary``: kvtier with a primary tier large enough to keep several prompts; a returning
  prompt is loaded from the primary (the shared CPU region).
- ``file``: kvtier with a primary of about one prompt and a file tier below it; a returning
  prompt's blocks were evicted from the primary to the file tier, are promoted back (read
  with ``O_DIRECT``) and then loaded.
- ``primary-inherit`` (only when named in ``--configs``): ``primary`` with the copy thread
  left on the core of the engine thread that built it (``copy_cpus: "inherit"``).
- ``primary-1-thread`` (only when named in ``--configs``): ``primary`` with each job copied
  by one thread (``copy_threads: 1``; the default splits a load across 2).

A prompt is 4,096 tokens and 31 more (``--blocks 128`` full blocks of 32): with its first
token it fills the device cache, so the next prompt evicts every block of it, and a hit,
from the device cache or from kvtier, is its 128 full blocks; the 31 tokens after them are
computed again in every case.

Prompts go to each engine in turn (the order rotates from one repetition to the next).
Each repetition sends a new prompt (``cold``, which also pushes the previous one out of the
device cache), then the previous prompt (``return``: the figure this measures), then that
prompt ``--floor-samples`` more times (``floor``: from the engine's own device prefix cache,
nothing loaded). Each request asks for one token, so the time ``generate`` takes is its time
to first token. Between the engines' turns, this process times two baselines on the bytes a
return loads: one ``memcpy`` between two buffers in memory, and a raw ``O_DIRECT`` read of a
file of that size on the file tier's filesystem (one ``preadv`` per KV block, on 1 thread and
on as many threads as the tier has IO threads). One repetition more than ``--reps`` runs
first and is not reported: it brings the file engine to its steady state.

vLLM's load time (``vllm:kv_offload_load_time``) is the sum of kvtier's load jobs' times,
each from its submission to the worker to its end. Each engine warms up first (a short
prompt stored, loaded and hit in the device cache, and P0 cold; untimed). The model is a
random Llama made in ``--cache-dir`` (``py/e2e/tiny_model.py``).

Usage (in a Python with vLLM and kvtier installed)::

    python py/bench/ttft.py [--reps 5] [--configs recompute,primary,primary-1-thread,file]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "py" / "e2e"))

#: The model: a random Llama of about 160 M parameters (head size 64).
MODEL = dict(
    hidden=768, layers=12, heads=12, kv_heads=12, intermediate=3072, vocab=32000,
    max_len=8192, dtype="float32",
)
DTYPE_BYTES = 4
CONFIGS = ("recompute", "primary", "file")
#: Optional: ``primary`` with the copy thread left on the core of the engine thread that
#: built it (``copy_cpus: "inherit"``), or with one copy thread per job (``copy_threads: 1``),
#: to measure that setting side by side.
EXTRA_CONFIGS = ("primary-inherit", "primary-1-thread")


def kv_bytes_per_token() -> int:
    head_dim = MODEL["hidden"] // MODEL["heads"]
    return MODEL["layers"] * 2 * MODEL["kv_heads"] * head_dim * DTYPE_BYTES


def parameters() -> int:
    h, i, v, n = MODEL["hidden"], MODEL["intermediate"], MODEL["vocab"], MODEL["layers"]
    kv = MODEL["kv_heads"] * (h // MODEL["heads"])
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h
    return n * per_layer + 2 * v * h + h


# ---------------------------------------------------------------------------------------
# The engine side: one subprocess per configuration.


def metric_snapshot() -> dict[str, float]:
    """The engine's offloading and prefix-cache metrics as this process's Prometheus registry
    holds them (``LLM.get_metrics`` rounds counters to integers, and a load takes less than a
    second): counters' totals, histograms' sums and counts, by name and labels."""
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for metric in REGISTRY.collect():
        if not any(w in metric.name for w in ("offload", "prefix_cache", "external", "kvtier")):
            continue
        for s in metric.samples:
            if not s.name.endswith(("_total", "_sum", "_count")) and metric.type != "gauge":
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                              if k not in ("engine", "model_name"))
            out[s.name + (f"{{{labels}}}" if labels else "")] = float(s.value)
    return out


def serve(spec: dict, fd_in: int, fd_out: int) -> None:
    """Builds the engine ``spec`` describes, warms it up, then answers requests read as JSON
    lines from ``fd_in`` on ``fd_out``: the seconds of ``generate`` and the change of the
    engine's metrics."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict = dict(
        model=spec["model"],
        dtype="float32",
        block_size=spec["block_size"],
        num_gpu_blocks_override=spec["num_gpu_blocks"],
        max_model_len=spec["max_model_len"],
        max_num_batched_tokens=spec["max_model_len"],
        max_num_seqs=4,
        enable_prefix_caching=True,
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,
        # On the CPU backend the KV cache is sized in bytes (the share of the node's memory
        # that gpu_memory_utilization would reserve also has to hold the model).
        kv_cache_memory_bytes=spec["num_gpu_blocks"] * spec["block_bytes"],
    )
    if spec.get("offload") is not None:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=spec["offload"],
        )
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def generate(ids: list[int]) -> dict:
        before = metric_snapshot()
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        secs = time.perf_counter() - t0
        after = metric_snapshot()
        delta = {k: v - before.get(k, 0.0) for k, v in after.items()
                 if v - before.get(k, 0.0) != 0.0}
        return {"secs": secs, "cached_tokens": out.num_cached_tokens, "metrics": delta}

    # The engine's first request is slow (allocation, first kernels): not one of the driver's.
    generate(list(range(3, 3 + spec["block_size"])))
    with os.fdopen(fd_in, "r") as rx, os.fdopen(fd_out, "w") as tx:
        tx.write(json.dumps({"ready": True}) + "\n")
        tx.flush()
        for line in rx:
            req = json.loads(line)
            if req.get("quit"):
                break
            tx.write(json.dumps(generate(req["ids"])) + "\n")
            tx.flush()
    del llm


class Engine:
    """A configuration's engine in its own process."""

    def __init__(self, name: str, spec: dict, log: Path, omp_cpus: str):
        self.name = name
        to_child_r, self._tx_fd = os.pipe()
        self._rx_fd, from_child_w = os.pipe()
        self._log = open(log, "w")
        self.log_path = log
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", json.dumps(spec),
             "--fds", f"{to_child_r},{from_child_w}"],
            pass_fds=(to_child_r, from_child_w), stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": omp_cpus},
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self._tx = os.fdopen(self._tx_fd, "w")
        self._rx = os.fdopen(self._rx_fd, "r")

    def _read(self) -> dict:
        line = self._rx.readline()
        if not line:
            raise SystemExit(f"engine {self.name} exited; see {self.log_path}")
        return json.loads(line)

    def wait_ready(self) -> None:
        self._read()

    def generate(self, ids: list[int]) -> dict:
        self._tx.write(json.dumps({"ids": ids}) + "\n")
        self._tx.flush()
        return self._read()

    def close(self) -> None:
        try:
            self._tx.write(json.dumps({"quit": True}) + "\n")
            self._tx.flush()
        except BrokenPipeError:
            pass
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


# ---------------------------------------------------------------------------------------
# The baselines, in this process.


def time_memcpy(src, dst, n: int) -> float:
    t0 = time.perf_counter()
    ctypes.memmove(ctypes.addressof(dst), ctypes.addressof(src), n)
    return time.perf_counter() - t0


def time_direct_read(path: Path, n: int, chunk: int, threads: int) -> float:
    """Reads ``n`` bytes of ``path`` with ``O_DIRECT``, ``chunk`` bytes per ``preadv``, the
    chunks shared out to ``threads`` threads (each its own page-aligned buffer)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        offsets = list(range(0, n, chunk))
        bufs = [mmap.mmap(-1, chunk) for _ in range(threads)]
        got = [0] * threads

        def run(t: int) -> None:
            for off in offsets[t::threads]:
                got[t] += os.preadv(fd, [bufs[t]], off)

        t0 = time.perf_counter()
        workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        secs = time.perf_counter() - t0
        if sum(got) < n:
            raise SystemExit(f"{path}: read {sum(got)} of {n} bytes")
        return secs
    finally:
        os.close(fd)


def write_direct_file(path: Path, n: int, chunk: int) -> None:
    buf = mmap.mmap(-1, chunk)
    buf.write(os.urandom(chunk))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        for off in range(0, n, chunk):
            os.pwritev(fd, [buf], off)
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------
# The driver.


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="repetitions (default 5)")
    ap.add_argument("--blocks", type=int, default=128,
                    help="full blocks of a prompt (default 128: 4,096 tokens and 31 more)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--floor-samples", type=int, default=3,
                    help="device-cache requests of a prompt after its return, per repetition")
    ap.add_argument("--primary-prompts", type=int, default=4,
                    help="prompts the primary tier of the 'primary' engine holds (default 4)")
    ap.add_argument("--file-primary-blocks", type=int, default=0,
                    help="slots of the 'file' engine's primary (default: two prompts' blocks)")
    ap.add_argument("--io-threads", type=int, default=4, help="the file tier's IO threads")
    ap.add_argument("--baseline-samples", type=int, default=5,
                    help="samples of each baseline per repetition")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"engines, of {', '.join(CONFIGS + EXTRA_CONFIGS)}")
    ap.add_argument("--omp-cpus", default=None,
                    help="VLLM_CPU_OMP_THREADS_BIND of every engine (default: every CPU this "
                    "process may use, so that each engine's model runs on the same OpenMP team)")
    ap.add_argument("--cache-dir", type=Path,
                    default=Path.home() / ".cache" / "kvtier" / "bench-ttft",
                    help="the model, the file tier and the engines' logs")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--fds", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        fd_in, fd_out = (int(x) for x in args.fds.split(","))
        serve(json.loads(args.serve), fd_in, fd_out)
        return

    import tiny_model

    configs = [c for c in args.configs.split(",") if c]
    bs = args.block_size
    blocks = args.blocks
    # A prompt: `blocks` full blocks and one token short of another. With its first token it
    # fills the device cache (the blocks and vLLM's null block), so the next prompt evicts
    # every block of it; a hit (device or kvtier) is the full blocks, and the 31 tokens after
    # them are computed again.
    tokens = blocks * bs + bs - 1
    num_gpu_blocks = blocks + 2
    max_model_len = (num_gpu_blocks - 1) * bs
    block_bytes = kv_bytes_per_token() * bs
    load_bytes = blocks * block_bytes

    cache = args.cache_dir
    cache.mkdir(parents=True, exist_ok=True)
    model_dir = tiny_model.make(cache / "model-160m", **MODEL)
    run_dir = cache / f"run-{os.getpid()}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir()
    tier_dir = run_dir / "file-tier"
    file_slots = args.file_primary_blocks or 2 * blocks
    offload = {
        "recompute": None,
        "primary": {
            "spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.vllm",
            "cpu_bytes_to_use": args.primary_prompts * blocks * block_bytes,
            "eviction_policy": "lru",
        },
        "file": {
            "spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.vllm",
            "cpu_bytes_to_use": file_slots * block_bytes,
            "eviction_policy": "lru",
            "io_threads": args.io_threads,
            "secondary_tiers": [{"type": "file", "path": str(tier_dir),
                                 "capacity_bytes": (args.reps + 8) * blocks * block_bytes}],
        },
    }
    offload["primary-inherit"] = {**offload["primary"], "copy_cpus": "inherit"}
    offload["primary-1-thread"] = {**offload["primary"], "copy_threads": 1}
    unknown = set(configs) - set(offload)
    if unknown:
        raise SystemExit(f"--configs: no engine {sorted(unknown)}")
    # vLLM's CPU build sizes its OpenMP team by whether a KV connector is configured (it
    # reserves one more core for the connector): on 2 cores, an engine without offloading
    # gets one thread and one with it gets two. Every engine gets the same team here.
    omp_cpus = args.omp_cpus or ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    setup = {
        "model": {**MODEL, "parameters": parameters(), "path": str(model_dir)},
        "prompt_tokens": tokens, "block_size": bs, "hit_blocks": blocks,
        "hit_tokens": blocks * bs, "num_gpu_blocks": num_gpu_blocks,
        "max_model_len": max_model_len, "kv_bytes_per_token": kv_bytes_per_token(),
        "block_bytes": block_bytes, "load_bytes": load_bytes,
        "offload": {c: offload[c] for c in configs}, "reps": args.reps,
        "floor_samples": args.floor_samples, "omp_cpus": omp_cpus, "raw_read_file": "run directory (the file tier's "
        "filesystem), O_DIRECT, one preadv per block",
    }
    print(f"model: {parameters() / 1e6:.1f} M parameters, {kv_bytes_per_token()} KV bytes per "
          f"token; prompt {tokens} tokens, a hit is {blocks} blocks of {block_bytes} bytes "
          f"({load_bytes / 1e6:.1f} MB); device cache {num_gpu_blocks} blocks", flush=True)

    # The baselines' buffers and file, made before the engines take their memory.
    src = (ctypes.c_char * load_bytes)()
    dst = (ctypes.c_char * load_bytes)()
    ctypes.memset(src, 1, load_bytes)
    ctypes.memset(dst, 2, load_bytes)
    raw_file = run_dir / "raw-read.bin"
    write_direct_file(raw_file, load_bytes, block_bytes)

    # The prompts: P0 ... P[reps] and a short one, W, for the warm-up. Repetition k sends
    # P[k+1] (cold, and the push that evicts P[k] from the device cache), P[k] (its return),
    # then P[k] again (the floor).
    rng = random.Random(0)
    prompts = [[rng.randrange(3, MODEL["vocab"]) for _ in range(tokens)]
               for _ in range(args.reps + 2)]
    warm = [rng.randrange(3, MODEL["vocab"]) for _ in range(8 * bs + bs - 1)]

    engines: dict[str, Engine] = {}
    results: dict[str, list] = {c: [] for c in configs}
    warmups: dict[str, list] = {}
    read_n = f"read_{args.io_threads}"
    baselines: dict[str, list[float]] = {"memcpy": [], "read_1": [], read_n: []}
    try:
        for c in configs:
            spec = {"model": str(model_dir), "block_size": bs, "num_gpu_blocks": num_gpu_blocks,
                    "max_model_len": max_model_len, "offload": offload[c],
                    "block_bytes": block_bytes}
            t0 = time.perf_counter()
            e = engines[c] = Engine(c, spec, run_dir / f"{c}.log", omp_cpus)
            e.wait_ready()
            # The warm-up: every path once (a store, a load, the device cache), and P0 cold.
            warmups[c] = [e.generate(warm), e.generate(prompts[0]), e.generate(warm),
                          e.generate(warm)]
            print(f"engine {c}: ready and warm in {time.perf_counter() - t0:.0f} s "
                  f"(P0 cold {warmups[c][1]['secs']:.1f} s)", flush=True)

        steps = [*configs, "baselines"]
        # Repetition -1 is the warm-up's end, not reported: it brings the file engine to its
        # steady state (the primary holds the prompt stored last and the one promoted last,
        # so the next store evicts the prompt that returns next).
        for rep in range(-1, args.reps):
            order = steps[rep % len(steps):] + steps[:rep % len(steps)]
            for step in order:
                if step == "baselines":
                    if rep < 0:
                        continue
                    for _ in range(args.baseline_samples):
                        baselines["memcpy"].append(time_memcpy(src, dst, load_bytes))
                        baselines["read_1"].append(
                            time_direct_read(raw_file, load_bytes, block_bytes, 1))
                        baselines[read_n].append(
                            time_direct_read(raw_file, load_bytes, block_bytes, args.io_threads))
                    continue
                e = engines[step]
                r = {"rep": rep, "cold": e.generate(prompts[rep + 2]),
                     "return": e.generate(prompts[rep + 1]),
                     "floor": [e.generate(prompts[rep + 1]) for _ in range(args.floor_samples)]}
                (warmups[step] if rep < 0 else results[step]).append(r)
                m = r["return"]["metrics"]
                print(f"rep {rep} {step:9s} cold {r['cold']['secs']:.3f} s, return "
                      f"{r['return']['secs']:.3f} s (cached {r['return']['cached_tokens']}), "
                      f"floor {statistics.median(f['secs'] for f in r['floor']):.3f} s, load "
                      f"{m.get(LOAD_TIME, 0):.3f} s / {m.get(LOAD_BYTES, 0) / 1e6:.0f} MB, "
                      f"deferred lookups {m.get(DEFERRED + '_count', 0):.0f} "
                      f"({m.get(DEFERRED + '_sum', 0):.3f} s)",
                      flush=True)
    finally:
        for e in engines.values():
            e.close()
        shutil.rmtree(tier_dir, ignore_errors=True)
        raw_file.unlink(missing_ok=True)

    report(setup, results, warmups, baselines, args)


LOAD_TIME = "vllm:kv_offload_load_time_total"
LOAD_BYTES = "vllm:kv_offload_load_bytes_total"
#: From a lookup that had to wait (a promotion from the file tier) to the one that answered.
DEFERRED = "vllm:kv_offload_lookup_async_delay_seconds"


def report(setup: dict, results: dict, warmups: dict, baselines: dict, args) -> None:
    memcpy = statistics.median(baselines["memcpy"])
    read_n = f"read_{args.io_threads}"
    # The faster of the two reads: the stricter bound.
    raw_read = min(statistics.median(baselines["read_1"]), statistics.median(baselines[read_n]))
    table = {}
    for c, rs in results.items():
        floors = [f["secs"] for r in rs for f in r["floor"]]
        table[c] = {
            "return": summary([r["return"]["secs"] for r in rs]),
            "cold": summary([r["cold"]["secs"] for r in rs]),
            "floor": summary(floors),
            "load_time": summary([r["return"]["metrics"].get(LOAD_TIME, 0.0) for r in rs]),
            "load_bytes": summary([r["return"]["metrics"].get(LOAD_BYTES, 0.0) for r in rs]),
            "deferred": summary([r["return"]["metrics"].get(DEFERRED + "_sum", 0.0) for r in rs]),
            "cached_tokens": [r["return"]["cached_tokens"] for r in rs],
            "floor_loads": sum(f["metrics"].get(LOAD_BYTES, 0.0) for r in rs for f in r["floor"]),
        }
    targets = {}
    for c in ("primary", "primary-inherit", "primary-1-thread"):
        if c in table:
            t = table[c]
            suffix = "" if c == "primary" else "_" + c.removeprefix("primary-").replace("-", "_")
            targets[f"primary_return_over_floor{suffix}"] = {
                "value": t["return"]["median"] / t["floor"]["median"], "target": 1.3}
            targets[f"primary_load_over_memcpy{suffix}"] = {
                "value": t["load_time"]["median"] / memcpy, "target": 1.2}
    if "file" in table:
        t = table["file"]
        targets["file_return_over_floor_plus_read"] = {
            "value": t["return"]["median"] / (t["floor"]["median"] + raw_read), "target": 1.3}
    out = {
        "setup": setup,
        "baselines": {k: summary(v) for k, v in baselines.items()},
        "raw_read": raw_read, "memcpy": memcpy, "configs": table, "targets": targets,
        "raw": {"results": results, "warmups": warmups, "baselines": baselines},
    }

    def ms(x):
        return f"{x * 1e3:.0f}"

    def spread(x):
        return f"{ms(x['median'])} ({ms(x['min'])}–{ms(x['max'])})"

    print()
    print("ms, median (min–max)")
    print()
    print("| engine | TTFT, returning prompt | TTFT, same prompt from the device cache (floor) "
          "| ratio | load (vLLM's load time) | TTFT, new prompt |")
    print("|---|---:|---:|---:|---:|---:|")
    for c, t in table.items():
        print(f"| {c} | {spread(t['return'])} | {spread(t['floor'])} | "
              f"{t['return']['median'] / t['floor']['median']:.2f} | "
              f"{spread(t['load_time']) if t['load_bytes']['max'] else '—'} | "
              f"{spread(t['cold'])} |")
    print()
    b = out["baselines"]
    for k, v in b.items():
        print(f"{k}: {spread(v)} ms, {setup['load_bytes'] / v['median'] / 2**30:.2f} GiB/s "
              f"(n={v['n']})")
    for k, v in targets.items():
        print(f"{k}: {v['value']:.2f} (target {v['target']}: "
              f"{'met' if v['value'] <= v['target'] else 'missed'})")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
    # The engines' processes are gone once the LLM is; leave without waiting on stray threads.
    os._exit(0)
