"""Runs one scenario through a real vLLM engine (``vllm.LLM``) and writes what it answered.

    python run_engine.py SCENARIO.json OUT.json

The scenario (JSON): ``model`` (a directory), ``offload`` (``kv_connector_extra_config`` for
kvtier, or null for no offloading), ``block_size`` (vLLM's, a multiple of 32 on CPU),
``num_gpu_blocks`` (the device KV cache, small so that earlier prompts do not stay there),
``tp`` (tensor parallel size), ``kv_events`` (KV cache events on), ``max_tokens``,
``logprobs``, ``kill`` (after writing the output, wait to be killed), and ``rounds``: a list of ``{"prompts": [[token ids], ...], "reset": bool}``;
a round with ``reset`` first calls ``reset_prefix_cache(reset_connector=True)``. Each round
sends its prompts one at a time, so that each request finds the state the one before left.

The output: per round, per prompt, the generated token ids and each one's logprob (and the
top logprobs), and the engine's Prometheus metrics whose names mention offloading, prefix
caching or kvtier.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(scenario_path: str, out_path: str) -> None:
    sc = json.load(open(scenario_path))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict = dict(
        model=sc["model"],
        dtype=sc.get("dtype", "float32"),
        block_size=sc.get("block_size", 32),
        num_gpu_blocks_override=sc.get("num_gpu_blocks"),
        max_model_len=sc.get("max_model_len") or (sc["num_gpu_blocks"] - 1) * sc.get("block_size", 32),
        max_num_seqs=sc.get("max_num_seqs", 4),
        max_num_batched_tokens=sc.get("max_num_batched_tokens", 2048),
        enable_prefix_caching=True,
        enforce_eager=True,
        tensor_parallel_size=sc.get("tp", 1),
        seed=0,
        disable_log_stats=False,
        # On the CPU backend: the share of the node's memory vLLM reserves (its check refuses
        # to start when less is free); the KV cache itself is num_gpu_blocks.
        gpu_memory_utilization=sc.get("memory_utilization", 0.1),
    )
    if sc.get("offload") is not None:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=sc["offload"],
        )
    if sc.get("kv_events"):
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    llm = LLM(**kwargs)
    params = SamplingParams(
        temperature=0.0, max_tokens=sc.get("max_tokens", 8), logprobs=sc.get("logprobs", 4),
        ignore_eos=True,
    )
    rounds = []
    for rnd in sc["rounds"]:
        if rnd.get("reset"):
            ok = llm.reset_prefix_cache(reset_connector=True)
            if not ok:
                raise SystemExit("reset_prefix_cache(reset_connector=True) refused")
        answers = []
        for ids in rnd["prompts"]:
            t0 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
            secs = time.perf_counter() - t0
            c = out.outputs[0]
            answers.append({
                "tokens": list(c.token_ids),
                "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
                "top": [sorted((int(k), v.logprob) for k, v in lp.items()) for lp in c.logprobs],
                "cached_tokens": out.num_cached_tokens,
                "secs": secs,
            })
        rounds.append(answers)
    metrics = {}
    for m in llm.get_metrics():
        if any(w in m.name for w in ("offload", "prefix_cache", "kvtier", "external")):
            value = getattr(m, "value", None)
            if value is None:
                value = getattr(m, "count", None)
            metrics.setdefault(m.name, []).append({"labels": dict(m.labels), "value": value})
    with open(out_path + ".tmp", "w") as f:
        json.dump({"rounds": rounds, "metrics": metrics}, f)
    os.replace(out_path + ".tmp", out_path)
    if sc.get("kill"):
        # The caller kills every process of the engine with SIGKILL once the answers are
        # written: nothing here may clean up.
        while True:
            time.sleep(60)
    # A user's orderly end: the engine core shuts its connector (kvtier) down.
    llm.llm_engine.engine_core.shutdown()
    del llm


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # The engine's processes are gone once the LLM is; leave without waiting on stray threads.
    os._exit(0)
