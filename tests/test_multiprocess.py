"""Two processes joined by jax.distributed on loopback agree on skipping."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

WORKER = pathlib.Path(__file__).with_name("multiprocess_worker.py")
TIMEOUT_S = 90


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(port: int, pid: int, *extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}
    env["JAX_PLATFORMS"] = "cpu"
    root = str(WORKER.parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (root, env.get("PYTHONPATH")) if p
    )
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(port), str(pid), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


@pytest.mark.slow
def test_two_processes_skip_together():
    port = free_port()
    procs = [launch(port, pid) for pid in (0, 1)]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=TIMEOUT_S)
            assert proc.returncode == 0, err[-3000:]
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    except subprocess.TimeoutExpired:
        pytest.fail(f"a worker did not finish within {TIMEOUT_S}s")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    for result in outputs:
        # Every device of both processes skipped (the inf was in process 1).
        assert result["finite_flags"] == [False, False], result
        assert result["scales"] == [128.0, 128.0], result
        assert result["params_unchanged"], result
        # Control: finite data on the same step updates everywhere.
        assert result["control_applied"], result


@pytest.mark.slow
def test_dead_peer_fails_fast():
    """A process whose peer never comes fails within seconds, not hangs."""
    proc = launch(free_port(), 0, "3")
    try:
        proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"a lone worker still ran after {TIMEOUT_S}s")
    assert proc.returncode != 0
