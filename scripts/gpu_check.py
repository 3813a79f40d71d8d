"""What hftrain does on one GPU, checked in under ten minutes: one PASS/FAIL/SKIP line per check, exit 1 on a FAIL.

Run by ``scripts/gpu_check.sh`` from a fresh checkout (after ``scripts/setup.sh``, or with a CUDA torch installed).
On a machine without a GPU only the CPU net runs (the host-side collectives in a group without a CPU backend, and
the static check that no collective takes a host tensor): it is then the gate, and every GPU line says SKIP. The
checks of two or more GPUs (ddp, zero2/3, fsdp1/2, megatron tp2/pp2/cp2/ep2 under ``torchrun``) are
``scripts/gpu_check_multi.py``.

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
- ``main job bf16``: the embedded MiniLM job for ``MAIN_STEPS`` steps; tokens/s and MFU of the steps after the first
  ``MAIN_WARMUP`` (the window's two ends stamped at a step's end after ``torch.cuda.synchronize``), beside the whole
  run's figures, which include the warm-up.

``ddp fp32 resume``, ``megatron tp1`` and ``main job bf16`` also set ``torch.cuda.max_memory_allocated`` over their
training steps (reset when the steps start, read at the last step's end: not the load or the export) against
``hftrain plan``'s per-GPU estimate for the same model and workload on one GPU (``hftrain.plan.plan``; its ``ddp``
row, which is also megatron's layout on one GPU: the plan lists no megatron tp1·pp1):
the measured/planned ratio is informational, and one more than 15% from 1 is flagged on the line, never failed.
A time budget (570 s) skips, with a SKIP line, each check that would not end within it (``EXPECTED_SECONDS``).
"""

from __future__ import annotations

import contextlib
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
BUDGET = 570.0  # seconds for every check together: a check that would start later is a SKIP line
FLAG_APART = 0.15  # a measured/planned memory ratio further than this from 1 is flagged on the line
MAIN_WARMUP, MAIN_STEPS = 20, 80  # the main job's steps, and those before its timed window
EXPECTED_SECONDS = {"ddp fp32 resume": 60, "megatron tp1": 40, "cp fused kernels": 40, "host syncs per step": 60,
                    "attention per shape": 20, "main job bf16": 90}  # fmt: skip  # generous: a check must end in BUDGET


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


@contextlib.contextmanager
def step_probe(warmup: int = 0):
    """Within it, every ``hftrain.train`` records into the yielded dict: ``peak``, ``torch.cuda.max_memory_allocated``
    over the training steps (reset as they start, read at the last step's end: not the load, the final evaluation or
    the export), and, when ``warmup`` > 0, the stamps ``start`` (the end of step ``warmup``) and ``end`` (the last
    step's), each ``(seconds, step, the run's token and FLOP totals)`` after ``torch.cuda.synchronize``. The totals
    are exact at a step whose losses were read (``logging_steps`` must divide ``warmup`` and the last step)."""
    import torch

    import hftrain.trainers.base as base

    seen: dict = {}
    fit, on_step_end = base.Trainer.fit, base.Trainer._on_step_end

    def fit_probe(self, *args, **kwargs):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return fit(self, *args, **kwargs)

    def end_probe(self, *args, **kwargs):
        reason = on_step_end(self, *args, **kwargs)
        step, last = self.state.global_step, self.state.global_step >= self.max_steps or reason is not None
        if (warmup and step == warmup) or last:
            torch.cuda.synchronize()
            seen["end" if last else "start"] = (time.perf_counter(), step, dict(self.throughput.totals))
        if last:
            seen["peak"] = torch.cuda.max_memory_allocated()
            seen["peak_flops"], seen["processes"] = self.throughput.peak[0], self.runtime.num_processes
        return reason

    base.Trainer.fit, base.Trainer._on_step_end = fit_probe, end_probe
    try:
        yield seen
    finally:
        base.Trainer.fit, base.Trainer._on_step_end = fit, on_step_end


def against_plan(measured: float, model: str, work: dict, label: str = "ddp") -> str:
    """``measured`` bytes against ``hftrain plan``'s per-GPU total for ``model`` (a folder or ``embedded:name``) on
    this GPU, its row ``label``; informational, flagged beyond ``FLAG_APART``."""
    import torch

    from hftrain.plan import Hardware, Workload, model_from_config, plan

    hardware = Hardware(gpus_per_node=1, gpu_memory=torch.cuda.get_device_properties(0).total_memory, reserve=0)
    rows = [r for r in plan(model_from_config(model), hardware, Workload(**work)).rows if r.label == label]
    if not rows:
        return "plan: no row for this layout"
    row = rows[0]
    if not row.fits:
        return f"plan: {row.label} does not fit"
    ratio = measured / row.total
    flag = f" FLAG: more than {FLAG_APART:.0%} apart" if abs(ratio - 1) > FLAG_APART else ""
    return (f"steps' max_memory_allocated {measured / 2**20:.1f} MiB, plan {row.label} {row.total / 2**20:.1f} MiB, "
            f"measured/planned {ratio:.2f}{flag}")  # fmt: skip


def ddp_fp32_resume(where: Path) -> str:
    from safetensors.torch import load_file

    model, data = _tiny(where)
    common = dict(model_name_or_path=str(model), dataset_name=None, train_file=str(data), mixed_precision="no",
                  per_device_train_batch_size=8, max_steps=6, save_steps=3)  # fmt: skip
    with step_probe() as seen:
        _train(output_dir=str(where / "a"), **common)
    shutil.copytree(where / "a", where / "b")
    shutil.rmtree(where / "b" / "checkpoints" / "step_00000006")
    shutil.rmtree(where / "b" / "model")
    _train(output_dir=str(where / "b"), resume_from_checkpoint="auto", **common)
    a, b = load_file(where / "a/model/model.safetensors"), load_file(where / "b/model/model.safetensors")
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    if worst > 1e-6:
        raise AssertionError(f"resumed run differs from the straight one by {worst:.2e}")
    work = dict(precision="fp32", micro_batch=8, seq=128, dropout=False)  # seq: data.max_seq_length, the longest
    return f"resumed = straight within {worst:.1e}; " + against_plan(seen["peak"], str(model), work)


def megatron_tp1(where: Path) -> str:
    model, data = _tiny(where)
    with step_probe() as seen:
        result = _train({"strategy": {"name": "megatron", "tp": 1}}, model_name_or_path=str(model), dataset_name=None,
                        train_file=str(data), max_steps=6, output_dir=str(where / "m"))  # fmt: skip
    work = dict(precision="bf16", micro_batch=32, seq=128, dropout=False)  # the defaults of a job on this GPU
    # the plan has no megatron layout of one GPU (tp·pp·cp = 1 is its ddp row: whole states, Adam, autocast)
    return (f"{result.global_step} steps, eval_loss {result.metrics['eval_loss']:.4f}, export reloaded; "
            + against_plan(seen["peak"], str(model), work))  # fmt: skip


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
    """The embedded MiniLM job, ``MAIN_STEPS`` steps: tokens/s and MFU of the steps after the first ``MAIN_WARMUP``
    (past the warm-up: allocator growth, kernel choice, the first batches' new shapes), beside the whole run's."""
    with step_probe(MAIN_WARMUP) as seen:
        result = _train(max_steps=MAIN_STEPS, logging_steps=10, output_dir=str(where / "job"), mixed_precision="bf16")
    (t0, step0, start), (t1, step1, end) = seen["start"], seen["end"]
    seconds = t1 - t0
    tokens = (end["tokens"] - start["tokens"]) / seconds
    mfu = (end["model_flops"] - start["model_flops"]) / seconds / seen["processes"] / seen["peak_flops"]
    whole = result.throughput
    work = dict(precision="bf16", micro_batch=32, seq=128)  # the job's defaults; dropout as MiniLM's config
    return (f"steps {step0 + 1}-{step1}: {tokens:.0f} tokens/s, MFU {mfu:.4f} over {seconds:.2f} s; whole run "
            f"(with warm-up) {whole['train_tokens_per_second']:.0f} tokens/s, MFU {whole.get('train_mfu', 0):.4f}; "
            + against_plan(seen["peak"], "embedded:minilm", work))  # fmt: skip


def main() -> int:
    started = time.perf_counter()
    check("cpu net (host collectives without a CPU backend)", cpu_net)
    import torch

    names = ("ddp fp32 resume", "megatron tp1", "cp fused kernels", "host syncs per step", "attention per shape",
             "main job bf16")  # fmt: skip
    if not torch.cuda.is_available():
        for name in names:
            RESULTS.append(("SKIP", name, "no CUDA device"))
            print(f"SKIP {name}: no CUDA device (the CPU net above is the gate)", flush=True)
    else:
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
        with tempfile.TemporaryDirectory() as scratch:
            where = Path(scratch)
            works = (ddp_fp32_resume, megatron_tp1, cp_kernels, host_syncs_per_step, attention_shapes, main_job_bf16)
            for name, work in zip(names, works, strict=True):
                spent = time.perf_counter() - started
                if spent + EXPECTED_SECONDS[name] > BUDGET:
                    RESULTS.append(("SKIP", name, "time budget spent"))
                    print(f"SKIP {name}: the time budget is spent ({spent:.0f} s of {BUDGET:.0f} s, "
                          f"~{EXPECTED_SECONDS[name]} s needed)", flush=True)  # fmt: skip
                    continue
                folder = where / name.replace(" ", "_")
                folder.mkdir()
                check(name, lambda work=work, folder=folder: work(folder))
    failed = [name for status, name, _ in RESULTS if status == "FAIL"]
    print(f"{'FAIL' if failed else 'PASS'} gpu_check: {len(RESULTS) - len(failed)} of {len(RESULTS)} checks passed "
          f"or skipped{': failed ' + ', '.join(failed) if failed else ''}")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
