"""`hftrain convert` against the usual way of turning a DCP checkpoint into a save_pretrained folder: peak memory, time.

The usual way (``reference``) loads the whole model state from the checkpoint with ``dcp.load`` into full-size
tensors, puts it in a model built from the config and calls ``save_pretrained`` (what one writes without hftrain,
as ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` does for a torch.save file). ``hftrain`` runs
``hftrain convert`` (one tensor at a time, each read back and compared). Each conversion runs in a fresh process;
``peak`` is that process's VmHWM increase over its resident memory once the libraries are imported, ``s`` the
wall time of the conversion alone. Sides alternate (A, B, A, B, ...) over ``--rounds``; medians are printed.

    .venv/bin/python benchmarks/convert.py                  # GPT-2-shaped classifiers of ~256 MiB and ~1.3 GiB
    .venv/bin/python benchmarks/convert.py --sizes small --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = {
    # GPT-2's vocabulary (50,257 rows): the embedding is the largest tensor.
    "small": {"vocab_size": 50257, "n_embd": 768, "n_layer": 4, "n_head": 12, "n_positions": 128},
    "medium": {"vocab_size": 50257, "n_embd": 1024, "n_layer": 24, "n_head": 16, "n_positions": 128},
}

CHILD = r"""
import json, sys, time
import torch, transformers, peft
from hftrain.cli import main
from hftrain.checkpoint import convert  # noqa: F401 - imported before the baseline, as the reference's libraries
from tests.memory import process_memory, reset_peak
side, run, out = sys.argv[1:4]
reset_peak()
before = process_memory("VmRSS")
start = time.perf_counter()
if side == "hftrain":
    assert main(["convert", run, out]) == 0
else:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoConfig, AutoModelForSequenceClassification
    step = sorted((__import__("pathlib").Path(run) / "checkpoints").iterdir())[-1] / "state"
    metadata = FileSystemReader(str(step / "dcp")).read_metadata()
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in metadata.state_dict_metadata.items()
             if k.startswith("model.")}
    dcp.load(state, storage_reader=FileSystemReader(str(step / "dcp")), no_dist=True)
    model = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(step / "hf_model"))
    model.load_state_dict({k[len("model."):]: v for k, v in state.items()})
    model.save_pretrained(out)
seconds = time.perf_counter() - start
print(json.dumps({"peak": process_memory("VmHWM") - before, "s": seconds}))
"""


def build(size: str, directory: Path) -> dict[str, int]:
    """Write a checkpoint of a random GPT-2-shaped classifier of ``size`` (in a child process); its byte sizes."""
    code = (
        "import json, sys; from pathlib import Path\n"
        "from transformers import AutoModelForSequenceClassification, GPT2Config\n"
        "from tests.test_convert import write_dcp_checkpoint\n"
        f"config = GPT2Config(num_labels=2, pad_token_id=0, **{SIZES[size]})\n"
        "model = AutoModelForSequenceClassification.from_config(config)\n"
        "write_dcp_checkpoint(model, Path(sys.argv[1]))\n"
        "sizes = [v.numel() * v.element_size() for v in model.state_dict().values()]\n"
        "print(json.dumps({'largest': max(sizes), 'total': sum(sizes)}))"
    )
    done = subprocess.run([sys.executable, "-c", code, str(directory)], **_child_options())
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(side: str, checkpoint: Path, out: Path) -> dict[str, float]:
    shutil.rmtree(out, ignore_errors=True)
    done = subprocess.run([sys.executable, "-c", CHILD, side, str(checkpoint), str(out)], **_child_options())
    shutil.rmtree(out, ignore_errors=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _child_options() -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return {"cwd": ROOT, "env": env, "capture_output": True, "text": True, "check": True, "timeout": 1800}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    mib = 1 << 20
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for size in args.sizes:
            checkpoint = Path(scratch) / size
            sizes = build(size, checkpoint)
            results: dict[str, list[dict[str, float]]] = {"hftrain": [], "reference": []}
            for _ in range(args.rounds):
                for side in results:
                    results[side].append(run(side, checkpoint, Path(scratch) / "out"))
            load = os.getloadavg()[0]
            medians = {
                side: {key: statistics.median(r[key] for r in runs) for key in ("peak", "s")}
                for side, runs in results.items()
            }
            rows.append((size, sizes, medians, results, load))
            shutil.rmtree(checkpoint)
    print("| model | weights | largest tensor | side | peak RSS increase | time | per round (peak MiB / s) |")
    print("|---|---|---|---|---|---|---|")
    for size, sizes, medians, results, load in rows:
        for side, median in medians.items():
            rounds = ", ".join(f"{r['peak'] / mib:.0f}/{r['s']:.1f}" for r in results[side])
            print(
                f"| {size} | {sizes['total'] / mib:.0f} MiB | {sizes['largest'] / mib:.0f} MiB | {side} | "
                f"{median['peak'] / mib:.0f} MiB | {median['s']:.1f} s | {rounds} |"
            )
        ratio_peak = medians["hftrain"]["peak"] / medians["reference"]["peak"]
        ratio_time = medians["hftrain"]["s"] / medians["reference"]["s"]
        print(f"| {size} | | | hftrain / reference | {ratio_peak:.2f} | {ratio_time:.2f} | load {load:.1f} |")


if __name__ == "__main__":
    main()
