"""``hftrain doctor`` and the launch preflight: strict hostfiles, process counts, rendezvous, launcher arguments."""

from __future__ import annotations

import contextlib
import io
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hftrain.cli import main
from hftrain.errors import ConfigError
from hftrain.launch.args import translate_launcher_args
from hftrain.launch.hostfile import HostfileError, parse_hostfile, parse_hostfile_text
from hftrain.launch.preflight import preflight_launch
from tests.distributed import free_port

ROOT = Path(__file__).resolve().parents[1]

GOOD = """# two machines
node-a slots=2
10.0.0.2 slots=2   # the second one
gpu17.cluster.example.org slots=8
fd00::1 slots=1
"""

MALFORMED = {
    "no slots": ("node-a\n", "is not 'host slots=N'"),
    "slots misspelt": ("node-a slot=2\n", "is not 'host slots=N'"),
    "zero slots": ("node-a slots=0\n", "between 1 and"),
    "negative slots": ("node-a slots=-1\n", "not a positive integer"),
    "fractional slots": ("node-a slots=1.5\n", "not a positive integer"),
    "huge slots": ("node-a slots=99999\n", "between 1 and"),
    "duplicate host": ("node-a slots=1\nNODE-A slots=1\n", "already listed on line 1"),
    "duplicate address": ("10.0.0.1 slots=1\n10.0.0.1 slots=2\n", "already listed on line 1"),
    "extra field": ("node-a slots=2 extra\n", "is not 'host slots=N'"),
    "empty": ("# nothing here\n\n", "no 'host slots=N' line"),
    "bad IPv4": ("10.0.0.256 slots=1\n", "not a plain host name"),
}

HOSTILE = [
    "$(touch /tmp/pwned) slots=1",
    "node-a;reboot slots=1",
    "`id` slots=1",
    "node-a|cat slots=1",
    "-oProxyCommand=sh slots=1",
    "../../etc/passwd slots=1",
    "node_a slots=1",
    "node-a\x1b[2J slots=1",
    "a" * 64 + " slots=1",
    "fe80::1%$(reboot) slots=1",  # an IPv6 scope is handed to ssh/pdsh like the rest
    "fe80::1%eth0;id slots=1",
    "fe80::1% slots=1",
    "0x7f.1 slots=1",  # inet_aton: 127.0.0.1
    "0x7f slots=1",  # inet_aton: 0.0.0.127
    "node.1 slots=1",
]


def test_good_hostfile_parses(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text(GOOD)
    hosts = parse_hostfile(path)
    assert [(h.host, h.slots, h.line) for h in hosts] == [
        ("node-a", 2, 2),
        ("10.0.0.2", 2, 3),
        ("gpu17.cluster.example.org", 8, 4),
        ("fd00::1", 1, 5),
    ]


def test_ipv6_scopes_naming_an_interface_are_hosts():
    hosts = parse_hostfile_text("fe80::1%eth0 slots=1\nfe80::2%3 slots=1\nfe80::3%enp1s0.10 slots=1\n")
    assert [h.host for h in hosts] == ["fe80::1%eth0", "fe80::2%3", "fe80::3%enp1s0.10"]


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_hostfile_names_the_line(case):
    text, fragment = MALFORMED[case]
    with pytest.raises(HostfileError) as raised:
        parse_hostfile_text(text, source="hf")
    assert fragment in str(raised.value)
    assert str(raised.value).startswith("hf")


@pytest.mark.parametrize("line", HOSTILE)
def test_hostile_host_names_are_refused_and_never_run(tmp_path, line):
    path = tmp_path / "hostfile"
    path.write_bytes(f"node-b slots=1\n{line}\n".encode())
    with pytest.raises(HostfileError) as raised:
        parse_hostfile(path)
    message = str(raised.value)
    assert f"{path}:2" in message and "\n" not in message and "\x1b" not in message
    assert not Path("/tmp/pwned").exists()


def test_binary_or_missing_hostfile_is_refused(tmp_path):
    path = tmp_path / "hostfile"
    path.write_bytes(b"n\xc3\xb6de slots=1\n")
    with pytest.raises(HostfileError, match="non-ASCII"):
        parse_hostfile(path)
    with pytest.raises(HostfileError, match="does not exist"):
        parse_hostfile(tmp_path / "nope")


def _doctor(*args: str) -> subprocess.CompletedProcess:
    """``hftrain doctor ARGS`` in this process (its checks open real sockets; only the import cost is saved)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["doctor", *args])
    return subprocess.CompletedProcess(["hftrain", "doctor", *args], code, out.getvalue(), "")


def test_doctor_good_launch_on_this_machine(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=2\n")
    port = str(free_port())
    done = _doctor("--hostfile", str(hostfile), "--master_port", port, "--num_processes", "2", "--nnodes", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "hostfile: " in done.stdout and "1 hosts, 2 processes" in done.stdout
    assert f"this machine hosts 127.0.0.1:{port}: port opened and reachable" in done.stdout
    assert "backend: gloo" in done.stdout and "torch 2." in done.stdout
    assert done.stdout.strip().endswith("no problem found")


def test_doctor_fails_on_bad_hostfile_count_mismatch_and_unreachable_rendezvous(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=2\n127.0.0.1 slots=2\n")
    done = _doctor("--hostfile", str(hostfile), "--master_addr", "127.0.0.1", "--master_port", str(free_port()))
    assert done.returncode == 1
    assert "FAIL  hostfile:" in done.stdout and "already listed on line 1" in done.stdout
    hostfile.write_text("127.0.0.1 slots=2\n")
    done = _doctor("--hostfile", str(hostfile), "--num_processes", "4", "--nproc_per_node", "1")
    assert done.returncode == 1
    assert "--num_processes 4 but the hostfile's slots add up to 2" in done.stdout
    assert "--nproc_per_node 1 but 127.0.0.1 has slots=2" in done.stdout
    # node 1 of a job whose rendezvous (on loopback) has nothing listening: connection refused
    port = str(free_port())
    done = _doctor("--master_addr", "127.0.0.1", "--master_port", port, "--node_rank", "1", "--timeout", "1")
    assert done.returncode == 1
    assert f"cannot connect to 127.0.0.1:{port}" in done.stdout
    assert "a launch would fail: rendezvous:" in done.stdout
    # a port already taken on the rendezvous machine
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        done = _doctor("--master_addr", "127.0.0.1", "--master_port", str(taken.getsockname()[1]))
    assert done.returncode == 1 and "cannot listen on" in done.stdout
    done = _doctor()
    assert done.returncode == 1 and "rendezvous address and port are not set" in done.stdout
    done = _doctor("--master_addr", "127.0.0.1", "--master_port", str(free_port()), "--nnodes", "2")
    assert done.returncode == 1 and "is loopback but the job spans 2 machines" in done.stdout


def test_doctor_does_not_replace_a_port_or_take_a_numeric_name(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "0")
    done = _doctor("--master_addr", "127.0.0.1")
    assert done.returncode == 1 and "port '0' is not a TCP port (1-65535)" in done.stdout
    assert "29500" not in done.stdout
    monkeypatch.delenv("MASTER_PORT")
    done = _doctor("--master_addr", "0x7f.1", "--master_port", str(free_port()))
    assert done.returncode == 1 and "'0x7f.1' is not a plain host name or IP address" in done.stdout


def _hftrain_copy_with_version(tmp_path: Path, version: str) -> Path:
    copy = tmp_path / "other"
    shutil.copytree(ROOT / "hftrain", copy / "hftrain", ignore=shutil.ignore_patterns("__pycache__"))
    init = copy / "hftrain" / "__init__.py"
    init.write_text(init.read_text().replace('__version__ = "0.1.0"', f'__version__ = "{version}"'))
    return copy


def test_doctor_compares_versions_across_machines(tmp_path):
    import os

    port = str(free_port())
    common = ["--master_addr", "127.0.0.1", "--master_port", port, "--nnodes", "2", "--timeout", "20"]
    serve = [sys.executable, "-m", "hftrain", "doctor", *common, "--node_rank", "0", "--wait", "60"]
    main_node = subprocess.Popen(serve, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        peer = _doctor(*common, "--node_rank", "1")
        main_out, _ = main_node.communicate(timeout=120)
    finally:
        main_node.kill()
    # two "machines" on loopback: the only failure is that loopback cannot carry a real 2-machine job
    for out in (peer.stdout, main_out):
        assert [line for line in out.splitlines() if line.startswith("FAIL")] == [
            f"FAIL  interface: 127.0.0.1:{port} is loopback but the job spans 2 machines; give the main machine's "
            "address on the network the machines share"
        ]
    assert "the rendezvous machine has the same versions" in peer.stdout
    assert "node 1 (127.0.0.1) has the same versions" in main_out and "all 1 other machines reported" in main_out
    # the second machine runs another hftrain: both sides say so and fail
    env = {**os.environ, "PYTHONPATH": str(_hftrain_copy_with_version(tmp_path, "0.0.9"))}
    main_node = subprocess.Popen(serve, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        peer = subprocess.run(
            [sys.executable, "-m", "hftrain", "doctor", *common, "--node_rank", "1"],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=120,
        )
        main_out, _ = main_node.communicate(timeout=120)
    finally:
        main_node.kill()
    assert peer.returncode == 1 and main_node.returncode == 1
    assert "hftrain 0.1.0 vs 0.0.9 here" in peer.stdout
    assert "node 1 (127.0.0.1) differs: hftrain 0.0.9 vs 0.1.0 here" in main_out


# ----------------------------------------------------------------- launcher arguments and environment
def test_local_rank_and_deepspeed_arguments_are_translated(tmp_path):
    ds = ROOT / "ds_configs" / "zero3.json"
    args = translate_launcher_args(
        ["--local_rank=1", "--config", "x", "--learning_rate", "1e-3", "--deepspeed", str(ds)], {"LOCAL_RANK": "1"}
    )
    assert args.overrides == ["--config", "x", "--learning_rate", "1e-3"]
    assert (args.deepspeed_strategy, args.deepspeed_config) == ("zero3", str(ds))
    from hftrain.config import load_config

    config = args.apply(load_config(None, ["--strategy.name", "zero3"]))
    assert config.strategy.deepspeed_config == str(ds)
    assert translate_launcher_args(["--local-rank", "0", "--seed=3"], {}).overrides == ["--seed=3"]
    with pytest.raises(ConfigError, match="LOCAL_RANK=0"):
        translate_launcher_args(["--local_rank=1"], {"LOCAL_RANK": "0"})
    with pytest.raises(ConfigError, match="zero_optimization.stage 7"):
        bad = tmp_path / "bad.json"
        bad.write_text('{"zero_optimization": {"stage": 7}}')
        translate_launcher_args(["--deepspeed", str(bad)], {})


def _train_args(out: Path) -> list[str]:
    return ["train", "--output_dir", str(out), "--train_file", str(ROOT / "tests" / "nonexistent.csv")]


LAUNCH_MISMATCHES = {
    "deepspeed with strategy fsdp": (
        lambda: ["--deepspeed", str(ROOT / "ds_configs/zero2.json"), "--strategy.name", "fsdp"],
        {},
        "strategy.name is 'fsdp' but --deepspeed",
    ),
    "deepspeed with an FSDP accelerate config": (
        lambda: ["--deepspeed", str(ROOT / "ds_configs/zero2.json")],
        {"ACCELERATE_USE_FSDP": "true"},
        "the accelerate config launched FSDP",
    ),
    "missing rendezvous variables": (
        lambda: [],
        {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"},
        "rendezvous address and port are not set",
    ),
    "missing rank": (lambda: [], {"WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK is not set"),
    "zero local processes": (
        lambda: [],
        {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "0"},
        "LOCAL_WORLD_SIZE='0' is not an integer >= 1",
    ),
    "inconsistent counts": (
        lambda: [],
        {"WORLD_SIZE": "3", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"},
        "inconsistent",
    ),
    "multi-machine over loopback": (
        lambda: [],
        {
            "WORLD_SIZE": "2",
            "RANK": "0",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500",
        },
        "reached over loopback",
    ),
}


@pytest.mark.parametrize("case", list(LAUNCH_MISMATCHES))
def test_bad_launch_is_one_line_exit_2_nothing_written(tmp_path, capsys, monkeypatch, case):
    make_args, env, fragment = LAUNCH_MISMATCHES[case]
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "out"
    code = main([*_train_args(out), *make_args()])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("hftrain: error:"), err
    assert fragment in err[0]
    assert not out.exists()


def test_preflight_sets_the_interface_of_the_route_to_the_rendezvous():
    # MASTER_ADDR is this machine's own non-loopback address: its interface carries the job
    import psutil

    candidates = [
        (name, a.address)
        for name, addrs in psutil.net_if_addrs().items()
        for a in addrs
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]
    if not candidates:
        pytest.skip("this machine has no non-loopback IPv4 address")
    name, address = candidates[0]
    env = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    env |= {"MASTER_ADDR": address, "MASTER_PORT": "29500"}
    found = preflight_launch(env, backend="gloo")
    assert env["GLOO_SOCKET_IFNAME"] == name and found.num_machines == 2
    assert found.notes == [
        f"GLOO_SOCKET_IFNAME was unset; set it to {name} ({address}), the interface that reaches {address}:29500"
    ]
    env["GLOO_SOCKET_IFNAME"] = "nosuch0"
    with pytest.raises(ConfigError, match="nosuch0, which this machine does not have"):
        preflight_launch(env, backend="gloo")
    # Under nccl, gloo's variable is set too: hftrain's host-side agreements run over gloo groups beside NCCL's.
    del env["GLOO_SOCKET_IFNAME"]
    found = preflight_launch(env, backend="nccl")
    assert env["GLOO_SOCKET_IFNAME"] == name and "NCCL_SOCKET_IFNAME" not in env
    assert found.notes[1] == f"NCCL_SOCKET_IFNAME unset; nccl will choose (the rendezvous is reached over {name})"


def test_more_local_processes_than_gpus_are_refused():
    env = {"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    with pytest.raises(ConfigError, match=r"4 processes on this machine but 2 GPU\(s\) visible.*--nproc_per_node 2"):
        preflight_launch(env, backend="nccl", gpus=2)
    assert preflight_launch(env, backend="nccl", gpus=4).world_size == 4
