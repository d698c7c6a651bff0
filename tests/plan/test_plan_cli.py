"""`shardwise plan` on the command line: the JSON contract, the table, the inputs."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap

import pytest

from shardwise.plan.__main__ import main
from shardwise.plan.command.cli import (
    add_arguments,
    parse_bytes,
    parse_count,
    parse_rate,
    parse_seconds,
)

pytestmark = pytest.mark.timeout(60)

ISSUE_EXAMPLE = ["--params", "7.5e9", "--devices", "64", "--precision", "bf16-mixed", "--optimizer", "adamw",
                 "--format", "json"]
REQUIRED_KEYS = {"strategy", "dp", "tp", "pp", "cp", "cp_mode", "sequence_parallel", "devices", "model_states_bytes",
                 "activation_bytes", "comm_bytes_per_step", "step_time_s", "fits"}


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_issue_example_json(capsys):
    rows = _json(capsys, ISSUE_EXAMPLE)
    assert isinstance(rows, list) and len(rows) > 10
    for r in rows:
        assert set(r) >= REQUIRED_KEYS
        assert r["dp"] * r["cp"] * r["tp"] * r["pp"] == r["devices"] == 64
    assert {r["strategy"] for r in rows} == {"ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp"}
    # Fitting layouts first, each group by predicted step time; the recommendation is the first.
    fit_flags = [r["fits"] for r in rows]
    assert fit_flags == sorted(fit_flags, reverse=True)
    fitting = [r for r in rows if r["fits"]]
    assert [r["step_time_s"] for r in fitting] == sorted(r["step_time_s"] for r in fitting)
    assert [r["recommended"] for r in rows].count(True) == 1 and rows[0]["recommended"]
    # The ZeRO paper's numbers for this very case (Table 1, 7.5B at N_d = 64).
    plain = {r["strategy"]: r for r in rows if r["tp"] == r["pp"] == r["cp"] == 1}
    assert plain["ddp"]["model_states_bytes"] == 120_000_000_000
    assert round(plain["zero1"]["model_states_bytes"] / 1e9, 1) == 31.4
    assert round(plain["zero3"]["model_states_bytes"] / 1e9, 2) == 1.88
    assert not plain["ddp"]["fits"]


def test_table_has_the_recommendation_on_top(capsys):
    assert main(["--model", "llama2-7b", "--devices", "8", "--activation-checkpointing", "--width", "150"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    rec = next(i for i, line in enumerate(lines) if line.startswith("Recommended:"))
    first_row = next(i for i, line in enumerate(lines) if line.startswith("│  1 │"))
    assert rec < first_row
    assert lines[rec].split("Recommended: ")[1].split(" - ")[0] in lines[first_row]


def test_nothing_fits_exits_1(capsys):
    assert main(["--model", "llama2-70b", "--devices", "8", "--device-memory", "16GB"]) == 1
    assert "Nothing fits" in capsys.readouterr().out


def test_traced_factory(tmp_path, capsys):
    src = tmp_path / "my_model.py"
    src.write_text(textwrap.dedent("""
        from shardwise.models import GPT, GPTConfig

        def build():
            return GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128))
    """))
    rows = _json(capsys, ["--model", f"{src}:build", "--input-shape", "8,64", "--input-dtype", "long",
                          "--devices", "4", "--format", "json"])
    assert {(r["tp"], r["pp"]) for r in rows} == {(1, 1)}  # no shape to split: data-parallel family only
    assert all(r["activation_bytes"] > 0 and r["seq_len"] == 64 for r in rows)


def test_bad_inputs_exit_2(capsys):
    assert main(["--devices", "8"]) == 2
    assert "describe the model" in capsys.readouterr().err
    assert main(["--model", "gpt5"]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert main(["--params", "1e9", "--devices", "12"]) == 2  # 12 does not fill nodes of 8
    assert "whole nodes" in capsys.readouterr().err


def test_shape_flags_and_filters(capsys):
    rows = _json(capsys, ["--layers", "24", "--hidden", "2048", "--heads", "16", "--seq-len", "1024",
                          "--devices", "16", "--strategies", "zero1,zero3", "--max-tp", "2", "--format", "json"])
    assert {r["strategy"] for r in rows} <= {"zero1", "zero3", "ddp"}  # ddp only where dp = 1
    assert max(r["tp"] for r in rows) == 2 and all(r["seq_len"] == 1024 for r in rows)


def test_unit_parsing():
    assert parse_bytes("80GB") == 80 * 10**9 and parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("1e9") == 10**9
    assert parse_rate("450GB/s") == 450e9
    assert parse_seconds("3us") == pytest.approx(3e-6) and parse_seconds("2ms") == pytest.approx(2e-3)
    assert parse_count("7B") == 7 * 10**9 and parse_count("7.5e9") == 7_500_000_000 and parse_count("350M") == 350e6
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("80 parsecs")


def test_registers_on_a_subparser():
    """The lead's `shardwise` CLI calls add_arguments on its `plan` sub-parser."""
    p = argparse.ArgumentParser(prog="shardwise")
    add_arguments(p.add_subparsers(dest="cmd").add_parser("plan"))
    a = p.parse_args(["plan", "--params", "7B", "--devices", "16", "--format", "json"])
    assert (a.cmd, a.params, a.devices, a.format) == ("plan", 7 * 10**9, 16, "json")


def test_python_dash_m():
    out = subprocess.run([sys.executable, "-m", "shardwise.plan", *ISSUE_EXAMPLE], capture_output=True, text=True,
                         timeout=60, check=True)
    assert set(json.loads(out.stdout)[0]) >= REQUIRED_KEYS


def test_ranks_fsdp_with_tensor_and_pipeline_parallelism(capsys):
    """A 70B model on 64 devices of 80 GB: which FSDP x TP x PP layouts fit, and why."""
    rows = _json(capsys, ["--params", "70e9", "--devices", "64", "--format", "json"])
    fsdp3d = [r for r in rows if r["zero"] == 3 and r["tp"] > 1 and r["pp"] > 1]
    assert fsdp3d and {r["strategy"] for r in fsdp3d} <= {"fsdp", "hsdp"}
    for r in fsdp3d:
        assert r["code"].startswith(f"sw.Parallel(dp={r['dp']}, tp={r['tp']}, pp={r['pp']}, zero=3")
    assert any(r["fits"] for r in fsdp3d)
    for r in rows:
        terms = r["params_bytes"] + r["grads_bytes"] + r["optimizer_bytes"] + r["activation_bytes"]
        assert terms + r["buffer_bytes"] == r["total_bytes"]
        assert r["fits"] == (r["total_bytes"] <= r["available_bytes"] == 79 * 10**9)
    # Plain FSDP over all 64 devices keeps only 1/64 of the states but every layer's activations:
    # it does not fit, and the reason given is the activations.
    flat = next(r for r in rows if r["strategy"] == "fsdp" and r["tp"] == r["pp"] == r["cp"] == 1)
    assert not flat["fits"] and flat["largest_term"] == "activations"
    assert flat["model_states_bytes"] == 70 * 10**9 * 16 // 64


def test_table_explains_why(capsys):
    assert main(["--params", "70e9", "--devices", "64", "--strategies", "fsdp,hsdp", "--max-cp", "1", "--explain", "2",
                 "--width", "300"]) == 0
    out = capsys.readouterr().out
    why = out.split("why (per device):")[1].splitlines()
    assert why[1].lstrip().startswith("1. fsdp") and "= sw.Parallel(" in why[1] and "GB free" in why[1]
    assert "In GB: parameters" in why[1] and "activations" in why[1]
    assert "no (activ.)" in out  # layouts that do not fit say which term is the largest


def test_checkpoint_async_adds_the_staging_host_line(capsys):
    argv = ["--model", "gpt2", "--devices", "2", "--precision", "fp32", "--strategies", "ddp,fsdp", "--max-cp", "1",
            "--format", "json"]
    assert all(r["host_buffers"] == {} for r in _json(capsys, argv))
    for r in _json(capsys, argv + ["--checkpoint-async"]):  # what a checkpoint holds: weights and states
        assert r["host_buffers"] == {"checkpoint staging (checkpoint_async)": r["params_bytes"] + r["optimizer_bytes"]}
