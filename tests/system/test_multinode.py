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
from conftest import once_per_run

# Every rank here is a fresh process started by a command (torchrun, a script), never the pool.
pytestmark = [pytest.mark.timeout(300), pytest.mark.fresh_processes]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "train_and_crash.py")
SUBNET = "10.213.7"  # private addresses that exist only inside the namespaces this test creates


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
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


STRATEGIES = ["ddp", "zero3"]


def _node(host, rank, strategies, folder, port):
    """One node's `shardwise run`: the script trains under each strategy in turn in the same rank (a new group
    each, as a script with several fits), so the launcher's and the rank's start-up are paid once."""
    ns, veth, addr = host
    runs: list[str] = []
    for strategy in strategies:
        runs += [*(["++"] if runs else []), "--strategy", strategy, "--steps", "6", "--checkpoint-dir",
                 str(folder / f"ck-{strategy}-{rank}"), "--checkpoint-every", "100",
                 "--out", str(folder / f"losses-{strategy}.json")]
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "shardwise", "run", "--nnodes", "2",
           "--nproc-per-node", "1", "--node-rank", str(rank), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"{SUBNET}.1:{port}", "--rdzv-id", "sw-two-nodes",
           "--rdzv-conf", f"is_host={'true' if rank == 0 else 'false'}", "--local-addr", addr, SCRIPT, *runs]
    env = {**os.environ, "PYTHONPATH": ROOT, "GLOO_SOCKET_IFNAME": veth}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _single():
    import functools

    import torch

    import shardwise as sw
    from shardwise.workloads import digits

    work = digits()
    return sw.Trainer("single", 1, accelerator="cpu", progress=False).fit(
        work.make_model(), work.train, work.loss_fn, functools.partial(torch.optim.AdamW, lr=1e-3),
        batch_size=64, max_steps=6).losses


@pytest.fixture(scope="module")
def two_node_runs(two_hosts, tmp_path_factory):
    """Both strategies (those in this build) trained by one two-node launch; (folder, each node's exit and log).
    Once per pytest run: the xdist worker that asks second reads the first one's result."""
    return once_per_run("two-node-runs", tmp_path_factory, lambda: _launch_two_nodes(two_hosts, tmp_path_factory))


def _launch_two_nodes(two_hosts, tmp_path_factory):
    from shardwise.strategies.registry import available_strategies

    folder = tmp_path_factory.mktemp("two_nodes")
    port = 29400 + os.getpid() % 500
    strategies = [s for s in STRATEGIES if s in available_strategies()]
    nodes = [_node(two_hosts[r], r, strategies, folder, port) for r in (0, 1)]
    logs = []
    for p in nodes:
        try:
            logs.append(p.communicate(timeout=400)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            logs.append(p.communicate()[0])
    return folder, [(p.returncode, log) for p, log in zip(nodes, logs)]


@pytest.mark.timeout(480)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_nodes_train_like_one_process(two_node_runs, strategy):
    from shardwise.strategies.registry import available_strategies

    if strategy not in available_strategies():
        pytest.skip(f"strategy {strategy} is not in this build")
    folder, nodes = two_node_runs
    out = folder / f"losses-{strategy}.json"
    assert out.exists(), "\n".join(f"node {i} exited {code}:\n{log[-3000:]}" for i, (code, log) in enumerate(nodes))
    result = json.loads(out.read_text())
    assert result["losses"] == pytest.approx(_single(), rel=1e-5)
    for code, log in nodes:
        assert code == 0, log[-3000:]
