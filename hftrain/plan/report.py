"""The plan as a readable table (the default) and as JSON (``--json``)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import hftrain.plan.formulas as formulas
from hftrain.plan.rows import Plan, Row
from hftrain.plan.terms import IN_AXIS_ORDER, TERMS

GB = 1e9


def _row_dict(row: Row) -> dict[str, Any]:
    """One row as plain data: its fields, with each term's axis size and figures (0 when it set none) as keys of
    their own after the memory figures, then ``model_states`` and ``total``."""
    data = dataclasses.asdict(row)
    data.pop("sizes"), data.pop("figures")
    flat: dict[str, Any] = {}
    for key, value in data.items():
        flat[key] = value
        if key == "working":
            flat.update({term.axis: row.size(term.axis) for term in IN_AXIS_ORDER})
            flat.update({name: row.figures.get(name, 0.0) for term in IN_AXIS_ORDER for name in term.figures})
    flat.update(model_states=row.model_states, total=row.total)
    return flat


def plan_dict(plan: Plan) -> dict[str, Any]:
    """The plan as plain data (bytes, seconds), with every formula."""
    rows = [_row_dict(row) for row in plan.rows]
    return {
        "model": {**dataclasses.asdict(plan.model), "axes": sorted(plan.model.axes)},
        "hardware": dataclasses.asdict(plan.hardware),
        "workload": dataclasses.asdict(plan.workload),
        "rows": rows,
        "recommended": plan.rows[plan.recommended].label if plan.recommended is not None else None,
        "nearest": plan.rows[plan.nearest].label if plan.nearest is not None else None,
        "reasons": plan.reasons,
        "formulas": {
            "activations": formulas.ACTIVATION_FORMULA,
            "communication": formulas.RING_FORMULA,
            "bubble": formulas.BUBBLE_FORMULA,
            **{name: text for term in IN_AXIS_ORDER for name, text in term.formulas.items()},
            **({"logits": formulas.LOGITS_FORMULA} if plan.model.causal_lm else {}),
        },
    }


def plan_json(plan: Plan) -> str:
    """``plan_dict`` as indented JSON."""
    return json.dumps(plan_dict(plan), indent=1)


def plan_table(plan: Plan) -> str:
    """The readable answer: the inputs, one line per option (GB per GPU), the recommendation and the formulas."""
    m, hw, w = plan.model, plan.hardware, plan.workload
    lines = [
        f"model {m.name}{' (causal_lm)' if m.causal_lm else ''}: Ψ = {m.parameters:,} parameters ({m.counted}), "
        f"{m.layers} layers, hidden {m.hidden}, "
        f"{m.heads} heads ({m.kv_heads} key/value), vocabulary {m.vocab:,}"
        + (
            f"; mixture of experts: {m.experts} experts, top-{m.top_k}, in {m.moe_layers} layers, "
            f"{m.expert_parameters:,} expert parameters ({m.active_parameters:,.0f} active per token)"
            if m.moe
            else ""
        ),
        f"hardware: {hw.nodes} node(s) × {hw.gpus_per_node} GPUs, {hw.gpu_memory / GB:g} GB each "
        f"({hw.usable_memory / GB:g} usable), CPU {hw.cpu_memory / GB:g} GB per node, links {hw.intra}/{hw.inter}",
        f"workload: {w.precision}, micro-batch {w.micro_batch} × sequence {w.seq}, accumulation {w.accumulation}, "
        f"{'LoRA r=' + str(w.lora_rank) if w.lora_rank else 'full fine-tuning'}, recompute "
        f"{w.recompute or 'off'}, dropout {'on' if w.dropout else 'off'}, "
        f"{'fused' if w.fused_attention else 'eager'} attention",
        "",
    ]
    head = [
        "option",
        "params",
        "grads",
        "optim",
        "activ",
        "other",
        "total GB",
        "CPU/node",
        "comm GB/step",
        "bubble",
        "tokens/s",
        "fits",
    ]
    table = [head]
    for i, row in enumerate(plan.rows):
        mark = " *" if i == plan.recommended else (" ~" if i == plan.nearest else "")
        comm = " ".join(f"{link} {nbytes / GB:.2f}" for link, nbytes in row.comm.items()) or "0"
        table.append(
            [
                row.label + mark,
                *(
                    f"{b / GB:.2f}"
                    for b in (row.params, row.grads, row.optimizer, row.activations, row.working, row.total)
                ),
                f"{row.cpu_per_node / GB:.1f}" if row.cpu_per_node else "-",
                comm,
                f"{row.bubble:.1%}" if row.pp > 1 else "-",
                f"{row.tokens_per_second:,.0f}",
                ("yes" if row.fits else "no") + ("" if row.runnable else " (formula only)"),
            ]
        )
    widths = [max(len(r[c]) for r in table) for c in range(len(head))]
    for r in table:
        lines.append(
            "  ".join(
                cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(r, widths, strict=True))
            ).rstrip()
        )
    lines.append("")
    title = "recommendation" if plan.recommended is not None else "nothing fits"
    lines.append(f"{title}:")
    lines += [f"  - {reason}" for reason in plan.reasons]
    lines += ["", "formulas (N = data-parallel ranks, Ψ parameters, * = recommended, ~ = nearest):"]
    seen: dict[str, str] = {}
    for row in plan.rows:
        seen.setdefault(row.label.split(" ")[0], row.formulas.get("model states", ""))
    lines += [f"  {name}: {text}" for name, text in seen.items()]
    lines += [
        f"  activations: {formulas.ACTIVATION_FORMULA}",
        *([f"  logits: {formulas.LOGITS_FORMULA}"] if m.causal_lm else []),
        f"  communication: {formulas.RING_FORMULA}",
        f"  bubble: {formulas.BUBBLE_FORMULA}",
    ]
    lines += [f"  {line}" for term in TERMS for line in term.table_formulas(m)]
    return "\n".join(lines)
