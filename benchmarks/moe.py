"""Expert parallelism: per-rank memory, step time, all-to-all bytes and tokens per expert, ep = 2 against ep = 1.

A Mixtral classifier of 8 experts (top-2), hidden 512, expert intermediate 1,024, 4 layers, vocabulary 2,048
(the experts are 92% of its 55 M parameters) trains ``--steps`` fp32 steps of 8 random sequences of 128 tokens
per rank with AdamW, on 2 gloo processes through ``MegatronPlugin`` (the Trainer's own adapter), the routers'
load-balancing loss over the global batch included (``hftrain.parallel.expert_parallel``):

- ep = 1: data parallelism, every rank holds all 8 experts of every layer (their weights, gradients, Adam moments);
- ep = 2: each rank holds 4 experts per layer and exchanges tokens by all-to-all.

Each rank reports its resident memory after the model, its optimizer state and a first step exist (``VmRSS``,
``/proc/self/status``) and its peak (``VmHWM``); the median step time; its MoE layers' parameters; and, under
ep = 2, the bytes its row all-to-alls sent to the other rank per layer and step (dispatch and combine, forward and
backward), against the formula ``4 · T·k · h · 4 bytes · (ep−1)/ep`` for ``T`` tokens per rank (a rank keeps the
rows of its own experts) and against the same with the routed counts (what the formula assumes is a balanced
router: its share of rows for the other rank's experts is ``(ep−1)/ep``). The tokens per expert (layer 0, step 1
and last step) show the balance the load-balancing loss keeps.

A third run, ep = 2 with ``moe_capacity_factor`` E/k (fixed slots no expert can overflow: dropless, exact, no host
read), is set beside the dropless ep = 2 run (exact split sizes, one host read per layer): the MoE layers' host
reads per step (``hftrain.metrics.syncs``), peak, step time and all-to-all bytes.

Times are on 2 shared cores with one thread per process: they compare ep against ep = 1 in one run only.

Usage (about 30 s idle, 4 GB at most):
    python benchmarks/moe.py [--steps 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tests` and an uninstalled hftrain

from tests.distributed import run_distributed  # noqa: E402
from tests.memory import process_memory as _status  # noqa: E402

HIDDEN, EXPERT_INTERMEDIATE, EXPERTS, TOP_K, LAYERS, VOCAB, BATCH, SEQ = 512, 1024, 8, 2, 4, 2048, 8, 128


def _config():
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=EXPERT_INTERMEDIATE, num_hidden_layers=LAYERS,
        num_attention_heads=8, num_key_value_heads=4, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
        router_aux_loss_coef=0.02, max_position_embeddings=SEQ, num_labels=2, pad_token_id=0,
    )  # fmt: skip


def _train(ep: int, steps: int, capacity_factor: float | None = None) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForSequenceClassification

    from hftrain.config import ParallelismConfig
    from hftrain.parallel.expert_parallel import ExpertParallelExperts, RouterMonitor
    from hftrain.strategies.megatron.plugin import MegatronPlugin

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(_config())
    plugin = MegatronPlugin(ParallelismConfig(ep=ep, moe_capacity_factor=capacity_factor)).setup()
    model = plugin.prepare_model(model)
    monitor = RouterMonitor(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    moe_params = sum(p.numel() for m in model.modules() if isinstance(m, ExpertParallelExperts) for p in m.parameters())
    if ep == 1:
        hf = getattr(model, "module", model)
        moe_params = sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n)

    sent = [0]
    all_to_all = dist.all_to_all_single

    def counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kwargs):
        if input_split_sizes is not None and input.dim() == 2:  # the row exchanges, not the per-expert counts
            mine = dist.get_rank(group)
            rows = sum(size for peer, size in enumerate(input_split_sizes) if peer != mine)
            sent[0] += rows * input.shape[1] * input.element_size()
        return all_to_all(output, input, output_split_sizes, input_split_sizes, group=group, **kwargs)

    dist.all_to_all_single = counted
    from hftrain.metrics.syncs import count_host_syncs

    reads: list[int] = []
    generator = torch.Generator().manual_seed(rank)
    times, loads, sent_per_step = [], [], []
    rss_after_first = 0
    for step in range(steps):
        ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=generator)
        labels = torch.randint(0, 2, (BATCH,), generator=generator)
        mask = torch.ones_like(ids)
        sent[0] = 0
        start = time.perf_counter()
        with count_host_syncs(trace=True) as report:  # the MoE layers' reads (the CPU counter)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss = loss + monitor.aux_loss(mask, group=dist.group.WORLD)
            loss.backward()
        reads.append(sum("expert_parallel.py" in where for where in report.where))
        plugin.finalize_grads(model)
        plugin.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        sent_per_step.append(sent[0])
        counts = monitor.take_counts()
        dist.all_reduce(counts)
        loads.append(counts[0].tolist())
        if step == 0:
            rss_after_first = _status("VmRSS")
    dist.all_to_all_single = all_to_all
    result = {
        "rank": rank,
        "rss_mib": rss_after_first / 2**20,
        "peak_mib": _status("VmHWM") / 2**20,
        "step_s": statistics.median(times[1:]),
        "moe_params": moe_params,
        "sent_per_layer_step": statistics.mean(sent_per_step) / LAYERS,
        "reads_per_step": statistics.mean(reads),
        "load_first": loads[0],
        "load_last": loads[-1],
    }
    dist.destroy_process_group()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="training steps per run (the first is not timed)")
    args = parser.parse_args()
    padded = EXPERTS / TOP_K  # a capacity factor of E/k: fixed slots no expert overflows (dropless, no host read)
    runs = {ep: run_distributed(_train, nprocs=2, timeout=1800, ep=ep, steps=args.steps) for ep in (1, 2)}
    slots = run_distributed(_train, nprocs=2, timeout=1800, ep=2, steps=args.steps, capacity_factor=padded)
    tokens = BATCH * SEQ
    formula = 4 * tokens * TOP_K * HIDDEN * 4 * (2 - 1) / 2
    print(
        f"# Mixtral {EXPERTS} experts top-{TOP_K}, hidden {HIDDEN}, expert intermediate {EXPERT_INTERMEDIATE}, "
        f"{LAYERS} layers; {BATCH}×{SEQ} tokens per rank; 2 gloo processes, fp32, AdamW; {args.steps} steps\n"
    )
    columns = "MoE params held | RSS after step 1 MiB | peak MiB | median step s | all-to-all MiB/layer/step"
    print(f"| layout | rank | {columns} |")
    print("|---|---|---|---|---|---|---|")
    for ep, ranks in runs.items():
        for r in ranks:
            sent = f"{r['sent_per_layer_step'] / 2**20:.2f}" if ep > 1 else "0"
            print(
                f"| ep={ep} | {r['rank']} | {r['moe_params'] / 1e6:.1f} M | {r['rss_mib']:.0f} | {r['peak_mib']:.0f} "
                f"| {r['step_s']:.3f} | {sent} |"
            )
    one, two = runs[1], runs[2]
    for rank in range(2):
        print(
            f"\nrank {rank}: ep=2 / ep=1: MoE params {two[rank]['moe_params'] / one[rank]['moe_params']:.2f}, RSS "
            f"{two[rank]['rss_mib'] / one[rank]['rss_mib']:.2f} ({one[rank]['rss_mib'] - two[rank]['rss_mib']:.0f} MiB "
            f"less), peak {two[rank]['peak_mib'] / one[rank]['peak_mib']:.2f}, step time "
            f"{two[rank]['step_s'] / one[rank]['step_s']:.2f}"
        )  # fmt: skip
    measured = statistics.mean(r["sent_per_layer_step"] for r in two)
    print(
        f"\nall-to-all bytes per layer and step per rank: measured {measured / 2**20:.3f} MiB, formula "
        f"4·T·k·h·4 B·(ep−1)/ep = {formula / 2**20:.3f} MiB (balanced router): {measured / formula:.3f}×"
    )
    print(f"\nep=2 dropless, exact split sizes against fixed slots (moe_capacity_factor {padded:g} = E/k, no drop):")
    print("| exchange | rank | MoE-layer host reads per step | peak MiB | median step s | all-to-all MiB/layer/step |")
    print("|---|---|---|---|---|---|")
    for label, ranks in (("exact sizes", two), ("fixed slots", slots)):
        for r in ranks:
            print(
                f"| {label} | {r['rank']} | {r['reads_per_step']:.0f} | {r['peak_mib']:.0f} | {r['step_s']:.3f} | "
                f"{r['sent_per_layer_step'] / 2**20:.2f} |"
            )
    for rank in range(2):
        print(
            f"rank {rank}: fixed slots / exact sizes: step time {slots[rank]['step_s'] / two[rank]['step_s']:.2f}, "
            f"bytes {slots[rank]['sent_per_layer_step'] / two[rank]['sent_per_layer_step']:.2f}, peak "
            f"{slots[rank]['peak_mib'] / two[rank]['peak_mib']:.2f}"
        )
    print(f"tokens per expert, layer 0, step 1:    {[int(x) for x in two[0]['load_first']]}")
    print(f"tokens per expert, layer 0, step {args.steps}:    {[int(x) for x in two[0]['load_last']]}  "
          f"(ideal {2 * tokens * TOP_K // EXPERTS} each)")  # fmt: skip


if __name__ == "__main__":
    main()
