"""Fixtures that start real servers on loopback for a test: redis-server and SeaweedFS's S3
gateway. Imported by py/tests/conftest.py and py/hicache_tests/conftest.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture
def redis_url(redis_server):
    """The URL of a redis-server of its own (``redis_server``)."""
    return redis_server[0]


@pytest.fixture
def redis_server(tmp_path):
    """A redis-server of its own on a free loopback port, as ``(url, process)``
    (``scripts/redis-setup.sh`` installs it); without one the test is skipped loudly, except
    under ``CI=true``, where it fails."""
    import shutil
    import socket
    import subprocess
    import time

    exe = shutil.which("redis-server")
    if exe is None:
        if os.environ.get("CI") == "true":
            pytest.fail("redis-server is not installed (scripts/redis-setup.sh installs it)")
        pytest.skip("SKIPPED: redis-server is not installed (scripts/redis-setup.sh)")
    for _ in range(5):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(tmp_path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2) as c:
                    c.sendall(b"PING\r\n")
                    if c.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                time.sleep(0.02)
        if proc.poll() is None:
            break
        # Another process took the port between the probe and the start: try another.
    else:
        pytest.fail("redis-server did not start")
    try:
        yield f"redis://127.0.0.1:{port}", proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def s3_server(tmp_path):
    """SeaweedFS's S3 gateway of its own on free loopback ports, with bucket ``kvtier-py``,
    as ``(endpoint, bucket, access_key, secret_key)``. The binary comes from
    ``scripts/seaweedfs-setup.sh`` (``KVTIER_WEED``, else ``weed`` on PATH); without one the
    test is skipped loudly, except under ``CI=true``, where it fails."""
    import json
    import shutil
    import socket
    import subprocess
    import time
    import urllib.request

    exe = os.environ.get("KVTIER_WEED") or shutil.which("weed")
    if exe is None or not Path(exe).is_file():
        if os.environ.get("CI") == "true":
            pytest.fail("SeaweedFS's weed is not installed (scripts/seaweedfs-setup.sh installs it)")
        pytest.skip("SKIPPED: SeaweedFS's weed is not installed (scripts/seaweedfs-setup.sh)")
    access, secret, bucket = "kvtier-py-access", "kvtier-py-secret", "kvtier-py"
    config = tmp_path / "s3.json"
    config.write_text(json.dumps({"identities": [{
        "name": "kvtier", "credentials": [{"accessKey": access, "secretKey": secret}],
        "actions": ["Read", "Write", "List"]}]}))
    data = tmp_path / "weed"
    data.mkdir()

    def free_ports(n):
        socks = [socket.socket() for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        ports = [s.getsockname()[1] for s in socks]
        for s in socks:
            s.close()
        return ports

    def request(port, method, path, body=None):
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method=method)
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except OSError:
            return None, b""

    for _ in range(5):
        p = free_ports(8)
        proc = subprocess.Popen(
            [exe, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}",
             f"-master.port={p[0]}", f"-master.port.grpc={p[1]}", f"-volume.port={p[2]}",
             f"-volume.port.grpc={p[3]}", f"-filer.port={p[4]}", f"-filer.port.grpc={p[5]}",
             "-s3", f"-s3.port={p[6]}", f"-s3.port.grpc={p[7]}", "-s3.port.iceberg=0",
             "-s3.port.lance=0", f"-s3.config={config}", "-master.telemetry=false",
             "-master.volumeSizeLimitMB=256", "-volume.max=64"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            if request(p[6], "GET", "/")[0] is not None:
                break
            time.sleep(0.1)
        if proc.poll() is None:
            break
    else:
        pytest.fail("weed server did not start")
    try:
        deadline = time.monotonic() + 30
        while True:
            out = subprocess.run([exe, "shell", f"-master=127.0.0.1:{p[0]}.{p[1]}"],
                                 input=f"s3.bucket.create -name {bucket}\n", text=True,
                                 capture_output=True)
            if "created bucket" in out.stdout + out.stderr:
                break
            assert time.monotonic() < deadline, out.stdout + out.stderr
            time.sleep(0.2)
        # A new bucket has no volumes until the master grows some: one write and one read
        # through the filer wait for them.
        probe = f"/buckets/{bucket}/.kvtier-py-probe"
        while request(p[4], "PUT", probe, b"probe")[0] != 201 or \
                request(p[4], "GET", probe)[1] != b"probe":
            assert time.monotonic() < deadline, "the bucket takes no writes"
            time.sleep(0.2)
        request(p[4], "DELETE", probe)
        yield f"http://127.0.0.1:{p[6]}", bucket, access, secret
    finally:
        proc.kill()
        proc.wait()
