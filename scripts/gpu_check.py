"""What hftrain does on a GPU, checked in under ten minutes: one PASS/FAIL/SKIP line per check, exit 1 on a FAIL.

Run by ``scripts/gpu_check.sh`` from a fresh checkout (after ``scripts/setup.sh``, or with a CUDA torch installed).
On a machine without a GPU only the CPU net runs (the host-side collectives in a group without a CPU backend, and
the static check that no collective takes a host tensor): it is then the gate, and every GPU line says SKIP.

GPU checks (a tiny BERT classifier built locally, the embedded MiniLM job for speed):
- ``ddp fp32 resume``: 1 process on CUDA, fp32, a background checkpoint at step 3, 6 steps; the run resumed from
  step 3 exports the same weights (within 1e-6: cuBLAS may pick other kernels after a restart).
- ``megatron tp1``: the megatron strategy on one GPU (its schedule, export and reload).
- ``cp fused kernels``: ring and all-to-all attention's CUDA kernels (cp = 1) against
  ``scaled_dot_product_attention``, outputs and gradients, fp32 and bf16, causal and padded.
- ``host syncs per step``: ``torch.cuda.set_sync_debug_mode`` counts the synchronising calls of a run of 4 and of
  12 steps (no evaluation or checkpoint between), each attributed to the innermost line outside torch that made
  it; hftrain's and Accelerate's must be at most 1 per step (the step's one read of the reduced loss). The model's
  own are listed apart: transformers reads the padding mask on the host to drop an all-ones mask.
- ``attention per shape``: ``scaled_dot_product_attention`` at the main job's shapes per backend, a new sequence
  length against a repeated one (informational: a backend that plans per shape shows here).
- ``main job bf16``: the embedded MiniLM job for 60 steps: tokens/s, MFU and ``torch.cuda.max_memory_allocated``.
- ``N processes``: DDP, ZeRO-2, ZeRO-3, FSDP2, megatron tp2 and pp2 under ``torchrun`` when the machine has at
  least 2 GPUs. One GPU cannot host them: NCCL refuses two ranks on one device, and every launcher gives rank
  ``r`` the device ``cuda:r``; they are SKIPPED there with that reason.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS: list[tuple[str, str, str]] = []


def check(name: str, work: Callable[[], str]) -> None:
    """Run one check; its line is ``PASS name: figures``, ``FAIL name: why`` or ``SKIP name: why``."""
    start = time.perf_counter()
    try:
        detail = work()
        status = "SKIP" if detail.startswith("skip:") else "PASS"
        detail = detail.removeprefix("skip:").strip()
    except Exception as error:  # noqa: BLE001 - every failure is one FAIL line, and the script goes on
        status, detail = "FAIL", " ".join(f"{type(error).__name__}: {error}".split())[:400]
        print(f"--- {name}: what failed, in full\n{traceback.format_exc()}--- end of {name}", flush=True)
    RESULTS.append((status, name, detail))
    print(f"{status} {name}: {detail} ({time.perf_counter() - start:.0f} s)", flush=True)


def cpu_net() -> str:
    tests = ["tests/test_host_agreement.py", "tests/test_collective_devices.py"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(done.stdout[-600:])
    return done.stdout.strip().splitlines()[-1]


def _tiny(where: Path) -> tuple[Path, Path]:
    from tests.tiny import save_model_folder, write_csv

    return save_model_folder(where / "model"), write_csv(where / "train.csv", rows=120)


def _train(sections: dict | None = None, **fields) -> object:
    import hftrain

    return hftrain.train(sections, log_with="none", **fields)


def ddp_fp32_resume(where: Path) -> str:
    from safetensors.torch import load_file

    model, data = _tiny(where)
    common = dict(model_name_or_path=str(model), dataset_name=None, train_file=str(data), mixed_precision="no",
                  per_device_train_batch_size=8, max_steps=6, save_steps=3)  # fmt: skip
    _train(output_dir=str(where / "a"), **common)
    shutil.copytree(where / "a", where / "b")
    shutil.rmtree(where / "b" / "checkpoints" / "step_00000006")
    shutil.rmtree(where / "b" / "model")
    _train(output_dir=str(where / "b"), resume_from_checkpoint="auto", **common)
    a, b = load_file(where / "a/model/model.safetensors"), load_file(where / "b/model/model.safetensors")
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    if worst > 1e-6:
        raise AssertionError(f"resumed run differs from the straight one by {worst:.2e}")
    return f"resumed = straight within {worst:.1e}"


def megatron_tp1(where: Path) -> str:
    model, data = _tiny(where)
    result = _train({"strategy": {"name": "megatron", "tp": 1}}, model_name_or_path=str(model), dataset_name=None,
                    train_file=str(data), max_steps=6, output_dir=str(where / "m"))  # fmt: skip
    return f"{result.global_step} steps, eval_loss {result.metrics['eval_loss']:.4f}, export reloaded"


def host_syncs_per_step(where: Path) -> str:
    """Synchronising CUDA calls per optimizer step, each attributed to the innermost line outside torch that made it
    (hftrain's own, Accelerate's, or the model's: transformers checks a padding mask on the host to drop it)."""
    import collections

    import torch

    model, data = _tiny(where)

    def syncs(steps: int) -> collections.Counter:
        sites: collections.Counter = collections.Counter()

        def record(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" not in str(message):
                return
            frames = [f for f in traceback.extract_stack()[:-1]
                      if "/torch/" not in f.filename and not f.filename.endswith("warnings.py")]  # fmt: skip
            site = frames[-1] if frames else None
            name = site.filename if site else filename
            name = f"hftrain/{name.split('/hftrain/')[-1]}" if "/hftrain/" in name else name
            name = f"transformers/{name.split('/transformers/')[-1]}" if "/transformers/" in name else name
            sites[f"{name}:{site.lineno if site else lineno}"] += 1

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                _train(model_name_or_path=str(model), dataset_name=None, train_file=str(data), max_steps=steps,
                       save_steps=None, eval_steps=100, output_dir=str(where / f"s{steps}"))  # fmt: skip
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sites

    few, many = syncs(4), syncs(12)
    growth = {site: (many[site] - few[site]) / 8 for site in many if many[site] != few[site]}
    model_own = sum(n for site, n in growth.items() if site.startswith("transformers/"))
    ours = sum(growth.values()) - model_own
    where_from = ", ".join(f"{site} {n:.2f}" for site, n in sorted(growth.items(), key=lambda x: -x[1])[:6])
    figures = (
        f"{ours:.2f} per optimizer step outside the model, {model_own:.2f} in the model's forward (4 steps: "
        f"{sum(few.values())} in all, 12 steps: {sum(many.values())}); per step by site: {where_from or 'none'}"
    )
    if ours > 1:
        raise AssertionError(figures)
    return figures


CP_KERNELS = """
import socket, torch, torch.distributed as dist, torch.nn.functional as F
from hftrain.parallel.context_parallel import Shard, ring_attention, all_to_all_attention
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
g = torch.Generator(device="cuda").manual_seed(0)
b, h, hkv, seq, d = 2, 4, 2, 64, 64
worst = 0.0
for dtype, bound in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
    for causal in (False, True):
        q, k, v = (torch.randn(b, n, seq, d, device="cuda", generator=g, dtype=dtype) for n in (h, hkv, hkv))
        keep = torch.arange(seq, device="cuda")[None] < torch.tensor([[seq], [seq - 9]], device="cuda")
        tril = torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril()
        mask = keep[:, None, None, :] & (tril if causal else True)
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        k2, v2 = ref[1].repeat_interleave(2, 1), ref[2].repeat_interleave(2, 1)
        out_ref = F.scaled_dot_product_attention(ref[0], k2, v2, attn_mask=mask)
        out_ref.float().square().sum().backward()
        for attention in (ring_attention, all_to_all_attention):
            mine = [t.clone().requires_grad_() for t in (q, k, v)]
            out = attention(*mine, Shard(keep, torch.arange(seq, device="cuda"), causal, d ** -0.5, dist.group.WORLD))
            out.float().square().sum().backward()
            for got, want in zip((out, *(t.grad for t in mine)), (out_ref, *(t.grad for t in ref))):
                error = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
                worst = max(worst, error / bound)
print(f"RESULT {worst:.3f}")
"""


def cp_kernels(where: Path) -> str:
    """Ring and all-to-all attention's fused CUDA kernels (cp = 1, one process) against
    ``scaled_dot_product_attention``: outputs and gradients, fp32 and bf16, causal and padded."""
    done = subprocess.run([sys.executable, "-c", CP_KERNELS], cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(done.stderr[-4000:])
    share = float(lines[0].split()[1])
    if share > 1:
        raise AssertionError(f"largest error {share:.2f} of its bound (fp32 1e-4, bf16 3e-2 of the largest entry)")
    return f"largest error {share:.3f} of its bound (fp32 1e-4, bf16 3e-2 of the largest entry)"


def attention_shapes(where: Path) -> str:
    """``scaled_dot_product_attention`` of the main job's shapes (MiniLM: 12 heads of 32, batch 32, a padding mask,
    bf16) per backend, forward and backward: the first call of each new sequence length (as ``group_by_length``
    batches bring) against a repeated one. A backend that builds a plan per shape shows here."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(seq: int) -> float:
        q, k, v = (torch.randn(32, 12, seq, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))  # fmt: skip
        mask = torch.ones(32, 1, seq, seq, device="cuda", dtype=torch.bool)
        mask[::2, ..., seq // 2 :] = False
        torch.cuda.synchronize()
        start = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.1).sum().backward()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    figures = []
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH, None):
        name = backend.name.lower() if backend is not None else "default"
        try:
            with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                run(40)
                new = [run(seq) for seq in range(41, 49)]
                same = [run(48) for _ in range(8)]
            figures.append(f"{name} new shape {sum(new) / 8:.1f} ms, repeated {sum(same) / 8:.1f} ms")
        except RuntimeError as error:
            figures.append(f"{name}: {str(error).splitlines()[0][:60]}")
    return "; ".join(figures)


def main_job_bf16(where: Path) -> str:
    import torch

    torch.cuda.reset_peak_memory_stats()
    result = _train(max_steps=60, output_dir=str(where / "job"), mixed_precision="bf16")
    figures = result.throughput
    peak = torch.cuda.max_memory_allocated() / 2**30
    return (f"{figures['train_tokens_per_second']:.0f} tokens/s, {figures['train_samples_per_second']:.0f} "
            f"samples/s over {figures['train_steps_seconds']:.1f} s of steps, MFU {figures.get('train_mfu', 0):.4f}, "
            f"max_memory_allocated {peak:.2f} GiB")  # fmt: skip


def processes(where: Path, strategy: list[str], nproc: int = 2) -> Callable[[], str]:
    def run() -> str:
        import torch

        if torch.cuda.device_count() < nproc:
            return (f"skip: {torch.cuda.device_count()} GPU(s); NCCL refuses two ranks on one device and launchers "
                    f"give rank r cuda:r")  # fmt: skip
        model, data = _tiny(where)
        out = where / "-".join(strategy)
        args = ["train", "--model_name_or_path", str(model), "--dataset_name", "null", "--train_file", str(data),
                "--log_with", "none", "--max_steps", "6", "--save_steps", "3", "--output_dir", str(out),
                *strategy]  # fmt: skip
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "-m", "hftrain"]
        for extra in ([], ["--max_steps", "8", "--resume_from_checkpoint", "auto"]):
            done = subprocess.run([*launcher, *args, *extra], cwd=ROOT, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(done.stderr[-4000:])
        state = json.loads((out / "trainer_state.json").read_text())
        return f"trained, checkpointed, resumed to step {state['global_step']}, exported"

    return run


def main() -> int:
    check("cpu net (host collectives without a CPU backend)", cpu_net)
    import torch

    if not torch.cuda.is_available():
        for name in ("ddp fp32 resume", "megatron tp1", "cp fused kernels", "host syncs per step", "main job bf16",
                     "attention per shape", "N processes"):  # fmt: skip
            RESULTS.append(("SKIP", name, "no CUDA device"))
            print(f"SKIP {name}: no CUDA device (the CPU net above is the gate)", flush=True)
    else:
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
        with tempfile.TemporaryDirectory() as scratch:
            where = Path(scratch)
            checks = (("ddp fp32 resume", ddp_fp32_resume), ("megatron tp1", megatron_tp1),
                      ("cp fused kernels", cp_kernels), ("host syncs per step", host_syncs_per_step),
                      ("attention per shape", attention_shapes),
                      ("main job bf16", main_job_bf16))  # fmt: skip
            for name, work in checks:
                folder = where / name.replace(" ", "_")
                folder.mkdir()
                check(name, lambda work=work, folder=folder: work(folder))
            for strategy in (["--strategy.name", "ddp"], ["--strategy.name", "zero2"], ["--strategy.name", "zero3"],
                             ["--strategy.name", "fsdp", "--strategy.fsdp_version", "2"],
                             ["--strategy.name", "megatron", "--parallelism.tp", "2"],
                             ["--strategy.name", "megatron", "--parallelism.pp", "2"]):  # fmt: skip
                folder = where / "-".join(strategy).strip("-")
                folder.mkdir()
                check(f"2 processes {' '.join(strategy[1::2])}", processes(folder, strategy))
    failed = [name for status, name, _ in RESULTS if status == "FAIL"]
    print(f"{'FAIL' if failed else 'PASS'} gpu_check: {len(RESULTS) - len(failed)} of {len(RESULTS)} checks passed "
          f"or skipped{': failed ' + ', '.join(failed) if failed else ''}")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
