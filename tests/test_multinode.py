"""Two machines, for real: two network namespaces joined by a veth pair, `shardwise run --nnodes 2`.

Each "node" is a network namespace with its own private address; torchrun's c10d
rendezvous and gloo traffic cross the veth pair. Skipped, with the reason, where
namespaces cannot be created (not root, no iproute2).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

# Every rank here is a fresh process started by a command (torchrun, a script), never the pool.
pytestmark = [pytest.mark.timeout(300), pytest.mark.fresh_processes]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "train_and_crash.py")
SUBNET = "10.213.7"  # private addresses that exist only inside the namespaces this test creates


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def two_hosts():
    if shutil.which("ip") is None:
        pytest.skip("iproute2 ('ip') is not installed: cannot create network namespaces")
    tag = str(os.getpid() % 100000)
    ns = [f"swn{tag}a", f"swn{tag}b"]
    veth = [f"swv{tag}a", f"swv{tag}b"]
    try:
        _ip("netns", "add", ns[0])
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot create network namespaces here ({e.stderr.strip() or e}); need root and netns support")
    try:
        _ip("netns", "add", ns[1])
        _ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for i in (0, 1):
            _ip("link", "set", veth[i], "netns", ns[i])
            _ip("-n", ns[i], "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", veth[i])
            _ip("-n", ns[i], "link", "set", veth[i], "up")
            _ip("-n", ns[i], "link", "set", "lo", "up")
        yield [(ns[i], veth[i], f"{SUBNET}.{i + 1}") for i in (0, 1)]
    finally:
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


def _node(host, rank, strategy, tmp_path, port):
    ns, veth, addr = host
    out = tmp_path / f"losses-{strategy}.json"
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "shardwise", "run", "--nnodes", "2",
           "--nproc-per-node", "1", "--node-rank", str(rank), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"{SUBNET}.1:{port}", "--rdzv-id", f"sw-{strategy}",
           "--rdzv-conf", f"is_host={'true' if rank == 0 else 'false'}", "--local-addr", addr,
           SCRIPT, "--strategy", strategy, "--steps", "6", "--checkpoint-dir", str(tmp_path / f"ck-{strategy}-{rank}"),
           "--checkpoint-every", "100", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": ROOT, "GLOO_SOCKET_IFNAME": veth}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out


def _single(tmp_path):
    import functools

    import torch

    import shardwise as sw
    from shardwise.workloads import digits

    work = digits()
    return sw.Trainer("single", 1, accelerator="cpu", progress=False).fit(
        work.make_model(), work.train, work.loss_fn, functools.partial(torch.optim.AdamW, lr=1e-3),
        batch_size=64, max_steps=6).losses


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_two_nodes_train_like_one_process(two_hosts, tmp_path, strategy):
    from shardwise.strategies.registry import available_strategies

    if strategy not in available_strategies():
        pytest.skip(f"strategy {strategy} is not in this build")
    port = 29400 + os.getpid() % 500
    nodes = [_node(two_hosts[r], r, strategy, tmp_path, port) for r in (0, 1)]
    logs = []
    for p, _ in nodes:
        try:
            logs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            logs.append(p.communicate()[0])
    for (p, _), log in zip(nodes, logs):
        assert p.returncode == 0, log[-3000:]
    result = json.loads(nodes[0][1].read_text())
    assert result["losses"] == pytest.approx(_single(tmp_path), rel=1e-5)
