"""kvtier behind vLLM's OpenAI-compatible server (``python -m
vllm.entrypoints.openai.api_server``; vLLM's CPU build has no ``vllm serve``): completions
equal the engine's without offloading, ``/metrics`` shows kvtier's figures, and Ctrl-C (SIGINT
to the server's process group, as a terminal sends it) leaves nothing in /dev/shm."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import (
    BLOCK, BLOCK_BYTES, DEVICE_BLOCKS, FIRST, SECOND, file_tier, kill_session, shm_regions,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 10) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


def post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def metric_values(text: str, name: str) -> list[float]:
    values = []
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            values.append(float(line.rsplit(" ", 1)[1]))
    return values


def test_the_openai_server_answers_the_same_reports_kvtier_and_leaves_nothing(
        model, reference, tmp_path):
    port = free_port()
    config = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "KvtierOffloadingSpec",
            "spec_module_path": "kvtier.vllm",
            "cpu_bytes_to_use": 16 * BLOCK_BYTES,
            "secondary_tiers": [file_tier(tmp_path / "tier")],
        },
    }
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--block-size", str(BLOCK), "--num-gpu-blocks-override", str(DEVICE_BLOCKS),
        "--max-model-len", str((DEVICE_BLOCKS - 1) * BLOCK), "--max-num-seqs", "4",
        "--enforce-eager", "--gpu-memory-utilization", "0.1", "--seed", "0",
        "--kv-transfer-config", json.dumps(config),
    ]
    before = shm_regions()
    log = tmp_path / "server.log"
    with open(log, "w") as logf:
        server = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None:
                pytest.fail(f"the server exited ({server.returncode}):\n{log.read_text()[-8000:]}")
            try:
                if get(base + "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the server did not start:\n{log.read_text()[-8000:]}")
            time.sleep(1)

        for r, prompts in enumerate([FIRST, SECOND]):
            for p, ids in enumerate(prompts):
                out = post(base + "/v1/completions", {
                    "model": model, "prompt": ids, "max_tokens": 8, "temperature": 0,
                    "logprobs": 4, "ignore_eos": True, "return_tokens_as_token_ids": True,
                })
                lp = out["choices"][0]["logprobs"]
                tokens = [int(t.split(":", 1)[1]) for t in lp["tokens"]]
                want = reference.rounds[r][p]
                assert tokens == want["tokens"], f"round {r} prompt {p}"
                for x, y in zip(lp["token_logprobs"], want["logprobs"]):
                    assert abs(x - y) <= 1e-5, f"round {r} prompt {p}: {x} vs {y}"

        status, text = get(base + "/metrics")
        assert status == 200
        # The primary's figures, as vLLM's own CPU tier reports them.
        for name in ("vllm:kv_offload_cpu_cache_usage_perc",
                     "vllm:kv_offload_cpu_allocation_size_count"):
            assert metric_values(text, name), f"{name} is not in /metrics"
        assert sum(metric_values(text, "vllm:external_prefix_cache_hits_total")) > 0
        # The file tier's own figures, labelled by tier.
        capacity = metric_values(text, "vllm:kvtier_tier_capacity_blocks")
        assert len(capacity) == 1 and 75 <= capacity[0] <= 128, capacity
        assert metric_values(text, "vllm:kvtier_tier_up") == [1.0]
        assert sum(metric_values(text, "vllm:kvtier_tier_cascaded_blocks_total")) > 0
        assert sum(metric_values(text, "vllm:kvtier_tier_promotions_total")) > 0
        assert sum(metric_values(text, "vllm:kvtier_tier_promotion_latency_seconds_count")) > 0
        assert sum(metric_values(text, "vllm:kvtier_tier_read_failures_total")) == 0
        assert 'tier="1:file"' in text
        # vLLM 0.32 has no config-info metric (0.33's); where it has, it names the tiers.
        info = [l for l in text.splitlines() if l.startswith("vllm:kv_offload_config_info{")]
        assert not info or any('tier="1:file"' in l for l in info)
    finally:
        # Ctrl-C: SIGINT to the server's process group.
        try:
            os.killpg(server.pid, signal.SIGINT)
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pass
        finally:
            # Whatever SIGINT left running is a failure below; end it so the run goes on.
            kill_session(server)
    assert server.returncode is not None
    left = shm_regions() - before
    assert not left, f"Ctrl-C left {sorted(left)} in /dev/shm"
