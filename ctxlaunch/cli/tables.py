"""The tables and lines the commands print (rich tables to `out`, or `err` for a sweep's points
before its submission)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.table import Table

from ctxlaunch.cli.common import out
from ctxlaunch.contract.hardware import GiB

if TYPE_CHECKING:
    from ctxlaunch.launch.backends.base import Status
    from ctxlaunch.launch.jobstore import JobRecord
    from ctxlaunch.launch.sweep import Point, SweepDefinition
    from ctxlaunch.perf.accounting import Accounting
    from ctxlaunch.planning.plan import PlanReport


def gib(value: float) -> str:
    """Bytes as GiB, two decimals."""
    return f"{value / GiB:,.2f}"


def print_plan(report: PlanReport) -> None:
    """`plan`'s tables: memory, other CP degrees, FLOPs, and the predicted step."""
    job, e = report.spec, report.estimate
    p, t = job.parallel, job.training
    out.print(
        f"[bold]{job.name}[/]: {job.model.preset or 'custom'} model, "
        f"seq_len {t.seq_len:,} x micro_batch {t.micro_batch}, {job.cluster.nodes} x "
        f"{job.cluster.gpus_per_node} {job.cluster.gpu}, tp {p.tp} pp {p.pp} cp {p.cp} "
        f"({p.cp_algorithm}, {p.cp_sharding}) dp {job.parallel_dims.dp}, ZeRO-{t.zero_stage}, "
        f"checkpointing {t.activation_checkpointing}, {job.model.dtype}"
    )
    table = Table(title="Per-GPU memory (busiest rank)", title_justify="left")
    table.add_column("part")
    table.add_column("GiB", justify="right")
    for name, value in e.parts():
        table.add_row(name.replace("_", " "), gib(value))
    table.add_row("[bold]total[/]", f"[bold]{gib(e.total)}[/]")
    table.add_row("capacity", gib(e.capacity))
    table.add_row("headroom", gib(e.headroom))
    out.print(table)
    if report.host is not None:
        h = report.host
        out.print(
            f"host memory per node ({h.ranks_per_node} ranks): optimizer {gib(h.optimizer)}, "
            f"parameters {gib(h.parameters)}, activations {gib(h.activations)}, allowance "
            f"{gib(h.allowance)} GiB per rank; {gib(h.per_node)} of {gib(h.capacity)} GiB"
        )
    colour = "green" if report.fits else "red"
    out.print(f"[bold {colour}]{report.verdict()}[/]")
    print_phases(report)

    cps = Table(title="At other CP degrees (TP, PP, DP held)", title_justify="left")
    offload = any(o.offload_layout is not None for o in report.cp_options)
    columns = ["cp", "GPUs", "nodes", "GiB/GPU", "fits", "longest seq that fits"]
    if offload:
        columns += ["with offload", "host GiB/node"]
    for column in [*columns, "note"]:
        cps.add_column(column, justify="left" if column == "note" else "right")
    for o in report.cp_options:
        note = "" if o.legal else (o.reason or "")
        row = [
            str(o.dims.cp),
            str(o.gpus),
            str(o.nodes),
            gib(o.estimate.total),
            "yes" if o.fits else "no",
            f"{o.longest_seq_len:,}",
        ]
        if offload:
            reach = o.offload_layout is not None and o.offload_host is not None
            row += [
                f"{o.offload_seq_len:,}" if reach else "",
                f"{o.offload_host.per_node / GiB:,.0f}" if o.offload_host is not None else "",
            ]
            if o.offload_layout is not None and o.offload_layout.dims.cp_algorithm != (
                report.layout.dims.cp_algorithm
            ):
                note = note or f"offload with cp_algorithm {o.offload_layout.dims.cp_algorithm}"
        cps.add_row(*row, note[:90] + ("..." if len(note) > 90 else ""))
    out.print(cps)
    if offload:
        recipes = [o.offload_layout for o in report.cp_options if o.offload_layout]
        recipe = recipes[0].replace(attention_tile_tokens=0)
        tiles = max(r.attention_tile_tokens for r in recipes)
        on_rings = f", attention tiles {tiles:,} on a ring" if tiles else ""
        out.print(
            f"with offload: {recipe.describe_memory_settings()}{on_rings}, ZeRO-3 "
            f"({recipe.engine}), full checkpointing, the longest-reaching CP algorithm; host "
            "memory against "
            f"{report.spec.cluster.host_memory_bytes / GiB:,.0f} GiB per node "
            "(cluster.host_memory_gib)"
        )

    f = report.flops
    flops = Table(title="Model FLOPs (forward + backward)", title_justify="left")
    flops.add_column("convention")
    flops.add_column("per token", justify="right")
    flops.add_column("per step", justify="right")
    flops.add_column("per GPU per step", justify="right")
    for conv in ("full", "causal"):
        flops.add_row(
            f"{conv}: {f['conventions'][conv]}",
            f"{f['per_token'][conv]:.4g}",
            f"{f['per_step'][conv]:.4g}",
            f"{f['per_gpu_per_step'][conv]:.4g}",
        )
    out.print(flops)
    out.print(
        f"parameters: {f['params_total']:,} ({f['params_active']:,} active, "
        f"{f['params_matmul']:,} in a token's matmuls); "
        f"tokens per step: {f['tokens_per_step']:,}"
    )
    if report.experts is not None:
        print_experts(report.experts)
    st = report.step_time
    if st is not None:
        out.print(
            f"predicted step: {st['step_seconds']:.4g} s, "
            f"{st['tokens_per_second_per_gpu']:,.0f} tokens/s/GPU, MFU "
            f"{st['mfu']['full']:.1%} (full) / {st['mfu']['causal']:.1%} (causal); "
            f"`ctxlaunch advise` ranks the other layouts"
        )
        out.print(step_time_provenance(st), markup=False)
    if report.accounting is not None:
        print_accounting(report.accounting)


def print_accounting(accounting: Accounting) -> None:
    """The whole run: time to train, GPU-hours, energy and cost, each with its range."""
    a = accounting
    out.print(f"the run: {a.summary()}", markup=False)
    if a.energy_kwh is not None:
        out.print(
            f"power: {a.gpu_watts:,.0f} W per GPU ({a.busy_fraction:.0%} of the step computing) "
            f"+ {a.other_watts:,.0f} W for the rest of the nodes = "
            f"{a.mean_power_watts / 1000:,.1f} kW (IT power, before the data centre's PUE)",
            markup=False,
        )
    else:
        out.print(f"energy: not estimated ({a.power_source})", markup=False)
    if a.price_per_gpu_hour is None:
        out.print("cost: set cluster.gpu_hour_price to see it", markup=False)


def print_experts(x: dict) -> None:
    """A mixture-of-experts model's own terms on the busiest rank (planning.experts_report)."""
    states = x["expert_states_bytes_per_rank"]
    table = Table(title="Mixture of experts (busiest rank)", title_justify="left")
    table.add_column("what")
    table.add_column("value", justify="right")
    rows = [
        ("parameters: total / active", f"{x['params_total']:,} / {x['params_active']:,}"),
        (
            f"experts: {x['experts']} a layer, {x['experts_per_token']} per token, "
            f"{x['moe_layers']} layers",
            f"{x['expert_params_per_rank']:,} parameters on the rank",
        ),
        (
            f"expert weights / gradients / optimizer (sharded over {x['experts_sharded_over']})",
            f"{gib(states['parameters'])} / {gib(states['gradients'])} / "
            f"{gib(states['optimizer_states'])} GiB",
        ),
        ("routing load planned (busiest EP rank / mean)", f"{x['routed_load']:.2f}"),
        (
            "experts' activations per layer at that load",
            f"{gib(x['expert_activation_bytes_per_layer'])} GiB",
        ),
        ("dispatch and combine buffers", f"{gib(x['dispatch_buffer_bytes'])} GiB"),
        (
            "all-to-all per step: in node / across nodes",
            f"{gib(x['all_to_all_bytes_per_step_in_node'])} / "
            f"{gib(x['all_to_all_bytes_per_step_across_nodes'])} GiB",
        ),
    ]
    for name, value in rows:
        table.add_row(name, value)
    out.print(table)


def print_phases(report: PlanReport) -> None:
    """What the busiest rank holds at the highest moment of each phase of a steady-state step,
    by part (before the allowance), the step's peak marked."""
    top = report.peak_phase
    if top is None:
        return
    table = Table(
        title="The step, phase by phase (busiest rank, GiB, before the allowance)",
        title_justify="left",
    )
    table.add_column("phase")
    for name, _ in top.parts():
        table.add_column(name.replace("_", " "), justify="right")
    table.add_column("total", justify="right")
    for phase in report.phases:
        label = f"[bold]{phase.name} (peak)[/]" if phase is top else phase.name
        table.add_row(label, *(gib(v) for _, v in phase.parts()), gib(phase.total))
    out.print(table)


def status_line(record: JobRecord, status: Status, scheduler: str) -> str:
    """One line for a job's state (and its story below it, when it has one); `scheduler` names
    whose word `status.scheduler_state` is (the backend's `scheduler_name`)."""
    parts = [f"{record.backend_id or record.id}: {status.state}"]
    if status.scheduler_state and status.scheduler_state != status.state:
        parts.append(f"({scheduler}: {status.scheduler_state})")
    if status.reason:
        parts.append(f"reason {status.reason}")
    if status.nodes:
        parts.append(f"on {status.nodes}")
    if status.exit_code:
        parts.append(f"exit {status.exit_code}")
    parts.append(f"restarts {status.restarts}")
    line = " ".join(parts) + f"  [{record.name}, {record.target}, {record.id}]"
    line += f"\n  {status.story}" if status.story else ""
    # training.heal: each re-plan, oldest first.
    return line + "".join(f"\n  healed: {text}" for text in status.healing)


def jobs_table(rows: list[tuple[JobRecord, str]]) -> Table:
    """`list`: each job with its current state."""
    import time

    table = Table()
    for column in ("job", "name", "target", "scheduler id", "state", "submitted"):
        table.add_column(column)
    for record, state in rows:
        table.add_row(
            record.id,
            record.name,
            record.target,
            record.backend_id,
            state,
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created)),
        )
    return table


def sweep_points_table(
    definition: SweepDefinition,
    points: list[Point],
    runnable: int,
    reasons: dict[int, str],
    accounts: dict[int, Accounting] | None = None,
) -> Table:
    """`sweep`: every point with its axis values, whether it runs (why not), and what its run
    takes (time to train, GPU-hours, energy, cost where priced)."""
    from ctxlaunch.perf.accounting import amount, duration, energy

    accounts = accounts or {}
    priced = any(a.cost is not None for a in accounts.values())
    table = Table(
        title=f"sweep {definition.name}: {len(points)} points, {runnable} to run",
        title_justify="left",
    )
    columns = ["name", *definition.axes, "runs", "time to train", "GPU-hours", "energy"]
    for column in columns + (["cost"] if priced else []):
        table.add_column(column)
    for point in points:
        a = accounts.get(point.index) if point.index not in reasons else None
        cells = ["", "", "", ""]
        if a is not None:
            cells = [
                duration(a.seconds.value),
                amount(a.gpu_hours.value),
                energy(a.energy_kwh.value) if a.energy_kwh else "",
                amount(a.cost.value) if a.cost else "",
            ]
        table.add_row(
            point.name,
            *(str(v) for v in point.values.values()),
            "yes" if point.index not in reasons else "no: " + reasons[point.index],
            *(cells if priced else cells[:3]),
        )
    return table


REPORT_COLUMNS = (
    "state",
    "step_seconds",
    "predicted_step_seconds",
    "step_error",
    "tokens_per_second_per_gpu",
    "predicted_tokens_per_second_per_gpu",
    "mfu_causal",
    "predicted_mfu_causal",
    "peak_memory_gib",
    "predicted_peak_memory_gib",
    "attention_balance",
    "expert_load",
    "aux_loss",
    "final_loss",
)
"""`report`'s columns after the point's name and axis values."""


def report_table(data: dict[str, Any], rows: list[dict[str, Any]]) -> Table:
    """`report`: one row per point, measured against predicted."""
    table = Table(
        title=f"{data.get('kind', 'sweep')} {data['name']} ({data['id']})", title_justify="left"
    )
    shown = ["name", *data["axes"], *REPORT_COLUMNS]
    # The evaluation's columns where some point evaluated (training.eval.interval).
    shown += [
        c
        for c in ("eval_loss", "eval_loss_longest", "passkey_retrieved")
        if any(row.get(c) is not None for row in rows)
    ]
    # training.heal's columns where some point was re-planned.
    shown += [c for c in ("replans", "healing") if any(row.get("replans") for row in rows)]
    for column in shown:
        table.add_column(
            column.replace("predicted_", "pred. ").replace("_", " "),
            justify="left" if column in ("name", "state", "healing") else "right",
        )
    for row in rows:
        table.add_row(
            *(
                ""
                if row.get(c) is None
                else f"{row[c]:+.1%}"
                if c == "step_error"
                else f"{row[c]:,.4g}"
                if isinstance(row.get(c), float)
                else str(row[c])
                for c in shown
            )
        )
    return table


def step_time_provenance(step_time: dict[str, Any]) -> str:
    """Where the predicted step's constants come from and how far to trust it, in a line: the
    error measured for them on their own machine, or that the figure is uncalibrated here and
    how to calibrate (docs/concepts/step-time-model.md explains each)."""
    calibration = step_time.get("calibration") or {}
    error = step_time.get("expected_error") or 0.0
    note = calibration.get("note", "")
    if not calibration.get("calibrated", True):
        return f"step time uncalibrated here: {note}; {calibration.get('calibrate', '')}"
    if error:
        return f"expected error: +/-{error:.0%} ({note})"
    return f"expected error: not measured ({note or step_time.get('framework', '')})"
