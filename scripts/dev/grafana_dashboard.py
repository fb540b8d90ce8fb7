"""The Grafana dashboard of a ctxlaunch training run, built with Grafana's dashboards-as-code SDK.

The panels are data (`ROWS`: title, unit, PromQL per target); `build_dashboard()` turns them into
the dashboard's JSON model with `grafana-foundation-sdk`, which only the generator needs, so it is
imported inside that function. The committed file is regenerated with

    python scripts/dev/grafana_dashboard.py \\
        [--output manifests/grafana/ctxlaunch-training.json]

and `panel_queries()` gives every target's PromQL with the dashboard variables filled in, so
tests can run the exact queries against a real Prometheus.

Every query selects one job and some runs and ranks through the `job`, `run` and `rank`
variables; the metric names come from `ctxlaunch.runtime.telemetry.metrics`.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DEFAULT_OUTPUT = Path("manifests/grafana/ctxlaunch-training.json")
"""Where `main()` writes the dashboard, relative to the repository root."""

UID = "ctxlaunch-training"
TITLE = "ctxlaunch: training"

SELECTOR = 'job="$job", run=~"$run", rank=~"$rank"'
"""The label matchers every query carries: one job, the chosen runs and ranks."""

RANK_LEGEND = "rank {{rank}} ({{run}})"

GRAFANA_BUILTIN_DEFAULTS = {"__range": "1h"}
"""Values `panel_queries` gives Grafana's own variables when the caller gives none."""

# The alert thresholds of manifests/prometheus/ctxlaunch-rules.yml, drawn on the matching panels.
STALL_SECONDS = 600
MEMORY_HEADROOM_MIN = 0.05
EXPOSED_COMM_MAX = 0.20
MFU_CAUSAL_MIN = 0.25
EXPERT_COLLAPSE = 4.0


@dataclass(frozen=True)
class Target:
    """One PromQL query of a panel and the legend of its series."""

    expr: str
    legend: str
    instant: bool = False
    """Ask for the latest value only (stat and table panels)."""
    table: bool = False
    """Return the labels as columns (Prometheus "table" format)."""


@dataclass(frozen=True)
class PanelSpec:
    """A panel: what it shows, in which unit, from which queries."""

    title: str
    description: str
    kind: str
    """timeseries | stat | table"""
    unit: str
    """Grafana unit id: percentunit (0..1), bytes, s, flops, short, none."""
    targets: tuple[Target, ...]
    width: int = 12
    height: int = 8
    min: float | None = None
    max: float | None = None
    thresholds: tuple[tuple[float | None, str], ...] = ()
    """(value, colour) steps; the first value is None (base). Drawn as dashed lines on graphs."""
    dashed: str = ""
    """Regexp of series names drawn dashed: reference lines such as capacity or peak FLOP/s."""
    dotted: str = ""
    """Regexp of series names drawn dotted: predictions."""
    decimals: int | None = None


def _q(metric: str, extra: str = "") -> str:
    """`metric{job="$job", run=~"$run", rank=~"$rank"[, extra]}`."""
    return f"{metric}{{{SELECTOR}{', ' + extra if extra else ''}}}"


def _per_rank(metric: str, extra: str = "", legend: str = RANK_LEGEND) -> Target:
    return Target(_q(metric, extra), legend)


_EVERY_LAYER = 'layer!="max"'
_CAUSAL = 'convention="causal"'
_RANK0 = 'rank="0"'
_FULL = 'convention="full"'
_CAUSAL_NOTE = (
    "causal convention: attention FLOPs halved for the causal mask, as Megatron-LM counts them"
)
_FULL_NOTE = (
    "full convention: the whole s x s attention score matrix counted, as PaLM, "
    "torchtitan and NeMo count it; higher than causal for the same run"
)
_PEAK = Target(
    f"max by (run, source) ({_q('ctxlaunch_peak_flops_per_second')})",
    "peak FLOP/s ({{source}}, {{run}})",
)

ROWS: tuple[tuple[str, tuple[PanelSpec, ...]], ...] = (
    (
        "Overview",
        (
            PanelSpec(
                "Last step",
                "The last completed optimizer step, highest over the selected ranks.",
                "stat",
                "none",
                (Target(f"max by (run) ({_q('ctxlaunch_last_step')})", "{{run}}", instant=True),),
                width=4,
                height=5,
                decimals=0,
            ),
            PanelSpec(
                "Time since last step",
                "Seconds since the slowest selected rank completed its last step (ranks step "
                f"together, so one that lags is stuck). Red at {STALL_SECONDS} s, where the "
                "CtxlaunchTrainingStalled alert starts counting.",
                "stat",
                "s",
                (
                    Target(
                        f"time() - min by (run) ({_q('ctxlaunch_last_step_timestamp_seconds')})",
                        "{{run}}",
                        instant=True,
                    ),
                ),
                width=4,
                height=5,
                thresholds=(
                    (None, "green"),
                    (STALL_SECONDS // 5, "orange"),
                    (STALL_SECONDS, "red"),
                ),
            ),
            PanelSpec(
                "MFU, mean over ranks (causal and full conventions)",
                f"Mean model FLOPs utilisation over the selected ranks. {_CAUSAL_NOTE}; "
                f"{_FULL_NOTE}.",
                "stat",
                "percentunit",
                (
                    Target(
                        f"avg by (run) ({_q('ctxlaunch_mfu_ratio', _CAUSAL)})",
                        "causal {{run}}",
                        instant=True,
                    ),
                    Target(
                        f"avg by (run) ({_q('ctxlaunch_mfu_ratio', _FULL)})",
                        "full {{run}}",
                        instant=True,
                    ),
                ),
                width=6,
                height=5,
                thresholds=((None, "red"), (MFU_CAUSAL_MIN, "green")),
            ),
            PanelSpec(
                "Tokens/s, all selected GPUs",
                "Tokens trained per second, summed over the selected ranks.",
                "stat",
                "short",
                (
                    Target(
                        f"sum by (run) ({_q('ctxlaunch_tokens_per_second_per_gpu')})",
                        "{{run}}",
                        instant=True,
                    ),
                ),
                width=5,
                height=5,
            ),
            PanelSpec(
                "OOM events in the time range",
                "Out-of-memory errors caught at a step, summed over the selected ranks, within the "
                "dashboard's time range (increase of ctxlaunch_oom_events_total).",
                "stat",
                "none",
                (
                    Target(
                        f"sum by (run) (increase({_q('ctxlaunch_oom_events_total')}[$__range]))",
                        "{{run}}",
                        instant=True,
                    ),
                ),
                width=5,
                height=5,
                decimals=0,
                thresholds=((None, "green"), (1, "red")),
            ),
            PanelSpec(
                "Run layout",
                "Model, context-parallel degree and algorithm, and sequence length of each run.",
                "table",
                "none",
                (
                    Target(
                        "count by (run, model, cp, cp_algorithm, seq_len) "
                        f"({_q('ctxlaunch_last_step')})",
                        "",
                        instant=True,
                        table=True,
                    ),
                ),
                width=24,
                height=4,
            ),
        ),
    ),
    (
        "Throughput",
        (
            PanelSpec(
                "MFU per rank, causal convention",
                f"Model FLOPs utilisation (achieved / peak), {_CAUSAL_NOTE}. The "
                f"CtxlaunchMFULow alert fires when the mean is below {MFU_CAUSAL_MIN:.0%}.",
                "timeseries",
                "percentunit",
                (_per_rank("ctxlaunch_mfu_ratio", _CAUSAL),),
                min=0,
                thresholds=((None, "red"), (MFU_CAUSAL_MIN, "transparent")),
            ),
            PanelSpec(
                "MFU per rank, full convention",
                f"Model FLOPs utilisation (achieved / peak), {_FULL_NOTE}.",
                "timeseries",
                "percentunit",
                (_per_rank("ctxlaunch_mfu_ratio", _FULL),),
                min=0,
            ),
            PanelSpec(
                "Achieved TFLOP/s per GPU, causal convention",
                f"Model FLOP/s per GPU over the last step, {_CAUSAL_NOTE}; dashed: the peak MFU is "
                "measured against.",
                "timeseries",
                "flops",
                (_per_rank("ctxlaunch_model_flops_per_second_per_gpu", _CAUSAL), _PEAK),
                min=0,
                dashed="^peak",
            ),
            PanelSpec(
                "Achieved TFLOP/s per GPU, full convention",
                f"Model FLOP/s per GPU over the last step, {_FULL_NOTE}; dashed: the peak MFU is "
                "measured against.",
                "timeseries",
                "flops",
                (_per_rank("ctxlaunch_model_flops_per_second_per_gpu", _FULL), _PEAK),
                min=0,
                dashed="^peak",
            ),
            PanelSpec(
                "Tokens/s per GPU",
                "Tokens trained per second per GPU over the last step.",
                "timeseries",
                "short",
                (_per_rank("ctxlaunch_tokens_per_second_per_gpu"),),
                min=0,
            ),
            PanelSpec(
                "Step time: measured against predicted",
                "Wall time of the last optimizer step per rank; dotted: the step-time model's "
                "prediction for the run; dashed: the prediction's expected error either side "
                "(none where the error is not known on this machine). The "
                "CtxlaunchStepDriftedFromPrediction alert fires when a rank's step stays outside "
                "that band.",
                "timeseries",
                "s",
                (
                    _per_rank("ctxlaunch_step_duration_seconds"),
                    Target(
                        f"max by (run) ({_q('ctxlaunch_predicted_step_duration_seconds')})",
                        "predicted ({{run}})",
                    ),
                    Target(
                        f"max by (run) ({_q('ctxlaunch_predicted_step_duration_seconds')} * "
                        f"(1 + {_q('ctxlaunch_predicted_step_error_ratio')}) and "
                        f"{_q('ctxlaunch_predicted_step_error_ratio')} > 0)",
                        "expected error, slow side ({{run}})",
                    ),
                    Target(
                        f"max by (run) ({_q('ctxlaunch_predicted_step_duration_seconds')} * "
                        f"(1 - {_q('ctxlaunch_predicted_step_error_ratio')}) and "
                        f"{_q('ctxlaunch_predicted_step_error_ratio')} > 0)",
                        "expected error, fast side ({{run}})",
                    ),
                ),
                width=24,
                min=0,
                dotted="^predicted",
                dashed="^expected error",
            ),
        ),
    ),
    (
        "Progress",
        (
            PanelSpec(
                "Progress",
                "The share of the run's steps done (the last step over training.steps).",
                "stat",
                "percentunit",
                (
                    Target(
                        f"max by (run) ({_q('ctxlaunch_last_step')}) / "
                        f"max by (run) ({_q('ctxlaunch_target_steps')})",
                        "{{run}}",
                        instant=True,
                    ),
                ),
                width=6,
                height=5,
            ),
            PanelSpec(
                "Time left",
                "Until the run's last step: the steps left at the run's mean measured step, or at "
                "the predicted step before one is measured.",
                "stat",
                "s",
                (
                    Target(
                        f"max by (run) ({_q('ctxlaunch_estimated_remaining_seconds')})",
                        "{{run}}",
                        instant=True,
                    ),
                ),
                width=6,
                height=5,
            ),
            PanelSpec(
                "Loss",
                "Mean next-token loss of the last step.",
                "timeseries",
                "none",
                (_per_rank("ctxlaunch_loss"),),
            ),
            PanelSpec(
                "Time since last step per rank",
                "Seconds since each rank completed its last step; a rank that stops while the "
                "others go on stands out here.",
                "timeseries",
                "s",
                (Target(f"time() - {_q('ctxlaunch_last_step_timestamp_seconds')}", RANK_LEGEND),),
                min=0,
                thresholds=((None, "transparent"), (STALL_SECONDS, "red")),
            ),
        ),
    ),
    (
        "Memory",
        (
            PanelSpec(
                "Memory per rank against capacity",
                "Peak allocated and peak reserved memory of each rank, the device's capacity "
                "(dashed) and the planner's predicted peak (dotted). On the CPU allocated and "
                "reserved are both the peak RSS and capacity is the host's memory.",
                "timeseries",
                "bytes",
                (
                    _per_rank(
                        "ctxlaunch_memory_peak_allocated_bytes",
                        legend="rank {{rank}} peak allocated ({{run}})",
                    ),
                    _per_rank(
                        "ctxlaunch_memory_peak_reserved_bytes",
                        legend="rank {{rank}} peak reserved ({{run}})",
                    ),
                    _per_rank(
                        "ctxlaunch_memory_capacity_bytes", legend="rank {{rank}} capacity ({{run}})"
                    ),
                    _per_rank(
                        "ctxlaunch_planner_predicted_peak_bytes",
                        legend="rank {{rank}} planner predicted peak ({{run}})",
                    ),
                ),
                width=24,
                height=9,
                min=0,
                dashed="capacity",
                dotted="predicted",
            ),
            PanelSpec(
                "Memory headroom per rank",
                "1 - peak reserved / capacity. The CtxlaunchMemoryHeadroomLow alert fires below "
                f"{MEMORY_HEADROOM_MIN:.0%}.",
                "timeseries",
                "percentunit",
                (
                    Target(
                        f"1 - {_q('ctxlaunch_memory_peak_reserved_bytes')} / "
                        f"{_q('ctxlaunch_memory_capacity_bytes')}",
                        RANK_LEGEND,
                    ),
                ),
                width=8,
                min=0,
                max=1,
                thresholds=((None, "red"), (MEMORY_HEADROOM_MIN, "transparent")),
            ),
            PanelSpec(
                "Allocator retries per rank (increase over 5m)",
                "Times the CUDA caching allocator freed its cache and retried an allocation: "
                "memory pressure short of an OOM.",
                "timeseries",
                "none",
                (Target(f"increase({_q('ctxlaunch_allocator_retries_total')}[5m])", RANK_LEGEND),),
                width=8,
                min=0,
            ),
            PanelSpec(
                "OOM events per rank (increase over 5m)",
                "Out-of-memory errors caught at a step (increase of ctxlaunch_oom_events_total).",
                "timeseries",
                "none",
                (Target(f"increase({_q('ctxlaunch_oom_events_total')}[5m])", RANK_LEGEND),),
                width=8,
                min=0,
            ),
            PanelSpec(
                "OOM events: step, planner prediction, what would fit",
                "One row per OOM in the time range (ctxlaunch_oom_event_info): the step, the "
                "planner's predicted peak and the capacity in bytes, and what the planner says "
                "would fit.",
                "table",
                "none",
                (
                    Target(
                        "max by (run, rank, node, step, predicted_peak_bytes, capacity_bytes, "
                        "would_fit) (last_over_time("
                        f"{_q('ctxlaunch_oom_event_info')}[$__range]))",
                        "",
                        instant=True,
                        table=True,
                    ),
                ),
                width=24,
                height=6,
            ),
        ),
    ),
    (
        "Healing (training.heal)",
        (
            PanelSpec(
                "Re-plans in the time range",
                "Layouts re-planned by training.heal after an OOM or on a changed allocation, "
                "by cause (increase of ctxlaunch_replans_total over the dashboard's time range, "
                "rank 0). Each is also an annotation on every graph.",
                "stat",
                "none",
                (
                    Target(
                        "sum by (why) (increase("
                        f"{_q('ctxlaunch_replans_total', _RANK0)}[$__range]))",
                        "{{why}}",
                    ),
                ),
                width=6,
                height=6,
            ),
            PanelSpec(
                "Re-plans: why, from, to, resumed step",
                "One row per re-plan in the time range (ctxlaunch_replan_info of rank 0): why "
                "(oom, allocation), the layout before and after, and the checkpoint step the run "
                "resumed from.",
                "table",
                "none",
                (
                    Target(
                        "max by (run, why, from_layout, to_layout, step) (last_over_time("
                        f"{_q('ctxlaunch_replan_info', _RANK0)}[$__range]))",
                        "",
                        instant=True,
                        table=True,
                    ),
                ),
                width=18,
                height=6,
            ),
        ),
    ),
    (
        "Evaluation at length",
        (
            PanelSpec(
                "Held-out loss per context length",
                "Next-token loss on held-out data at each evaluation (training.eval.interval), one "
                "series per context-length bucket of token positions, and the mean (bucket all). "
                "A model that uses its long context predicts late tokens better: the long buckets "
                "lie below the short ones.",
                "timeseries",
                "none",
                (
                    Target(
                        f"max by (run, bucket) ({_q('ctxlaunch_eval_loss')})",
                        "{{bucket}} ({{run}})",
                    ),
                ),
                width=12,
            ),
            PanelSpec(
                "Passkey retrieval by prompt length and depth",
                "Share of passkey probes retrieved at the last evaluation (every answer token the "
                "model's arg-max), per prompt length in tokens and depth of the number in the filler.",
                "table",
                "percentunit",
                (
                    Target(
                        f"max by (run, length, depth) ({_q('ctxlaunch_passkey_retrieval_ratio')})",
                        "",
                        instant=True,
                        table=True,
                    ),
                ),
                width=12,
            ),
        ),
    ),
    (
        "Context parallelism",
        (
            PanelSpec(
                "Exposed ring communication per rank (seconds)",
                "Time in the last step spent waiting for ring K/V (or dK/dV) transfers after the "
                "block's compute had finished: communication that compute did not hide.",
                "timeseries",
                "s",
                (_per_rank("ctxlaunch_cp_exposed_comm_seconds"),),
                min=0,
            ),
            PanelSpec(
                "Exposed ring communication, fraction of step time",
                "Exposed communication / step time. The CtxlaunchExposedCommHigh alert fires above "
                f"{EXPOSED_COMM_MAX:.0%}.",
                "timeseries",
                "percentunit",
                (
                    Target(
                        f"{_q('ctxlaunch_cp_exposed_comm_seconds')} / "
                        f"{_q('ctxlaunch_step_duration_seconds')}",
                        RANK_LEGEND,
                    ),
                ),
                min=0,
                thresholds=((None, "transparent"), (EXPOSED_COMM_MAX, "red")),
            ),
            PanelSpec(
                "Attention balance per rank (busiest / mean area of its CP group)",
                "The attention area the busiest rank of each rank's CP group computed in the last "
                "step over the group's mean (ctxlaunch_cp_attention_balance_ratio): 1 is "
                "balanced; under a document mask zigzag and contiguous reach 1.3-3, the balanced "
                "sharding holds it near 1.",
                "timeseries",
                "none",
                (_per_rank("ctxlaunch_cp_attention_balance_ratio"),),
                min=1,
                thresholds=((None, "transparent"), (1.1, "orange")),
            ),
            PanelSpec(
                "Attention kernel per rank",
                "The attention kernel each rank's attention calls run on (ctxlaunch_attention_kernel"
                "_info) and how it was chosen: measured at the run's block shape, forced by "
                "CTXLAUNCH_ATTENTION_KERNEL, or the only one for the device and dtype.",
                "table",
                "none",
                (
                    Target(
                        "max by (run, rank, node, kernel, chosen_by) (last_over_time("
                        f"{_q('ctxlaunch_attention_kernel_info')}[$__range]))",
                        "",
                        instant=True,
                        table=True,
                    ),
                ),
                width=24,
                height=5,
            ),
        ),
    ),
    (
        "Mixture of experts",
        (
            PanelSpec(
                "Expert load per layer (busiest expert / mean routings)",
                "For each mixture-of-experts layer, the routings its busiest expert received in "
                "the last step over the mean, over every rank (ctxlaunch_moe_expert_load_ratio): "
                "1 is balanced; E / experts_per_token means every token went to the same "
                "experts. A line climbing and staying up is a router collapsing onto a few "
                f"experts: the CtxlaunchExpertCollapse alert fires above {EXPERT_COLLAPSE:g}.",
                "timeseries",
                "none",
                (
                    Target(
                        "max by (run, layer) ("
                        f"{_q('ctxlaunch_moe_expert_load_ratio', _EVERY_LAYER)})",
                        "layer {{layer}} ({{run}})",
                    ),
                ),
                min=1,
                thresholds=((None, "transparent"), (EXPERT_COLLAPSE, "red")),
            ),
            PanelSpec(
                "EP rank load against the planned load",
                "The routings the busiest rank of an EP group received over the group's mean "
                "(ctxlaunch_moe_ep_rank_load_ratio), beside the load the planner admitted for "
                "the dispatch buffers and the experts' activations "
                "(ctxlaunch_moe_planned_load_ratio, dashed): above it, the "
                "CtxlaunchExpertLoadOverPlan alert fires.",
                "timeseries",
                "none",
                (
                    Target(
                        f"max by (run) ({_q('ctxlaunch_moe_ep_rank_load_ratio')})",
                        "busiest EP rank ({{run}})",
                    ),
                    Target(
                        f"max by (run) ({_q('ctxlaunch_moe_planned_load_ratio')})",
                        "planned ({{run}})",
                    ),
                ),
                min=1,
                dashed="planned.*",
            ),
            PanelSpec(
                "Load-balancing loss",
                "The auxiliary load-balancing loss of each step before its coefficient "
                "(ctxlaunch_moe_aux_loss), apart from the language-model loss: experts_per_token at a "
                "perfectly balanced router (E x sum of share x mean probability), higher as it skews.",
                "timeseries",
                "none",
                (Target(f"max by (run) ({_q('ctxlaunch_moe_aux_loss', _RANK0)})", "{{run}}"),),
            ),
            PanelSpec(
                "Routings dropped over capacity",
                "Routings dropped because their expert was full (ctxlaunch_moe_tokens_dropped_total"
                "), per second: 0 unless model.moe.capacity_factor is set.",
                "timeseries",
                "short",
                (
                    Target(
                        f"sum by (run) (rate({_q('ctxlaunch_moe_tokens_dropped_total')}[5m]))",
                        "{{run}}",
                    ),
                ),
                min=0,
            ),
        ),
    ),
)


def build_dashboard() -> dict:
    """The dashboard's JSON model (a plain dict), built from `ROWS` with grafana-foundation-sdk."""
    from grafana_foundation_sdk.builders import common as common_builders
    from grafana_foundation_sdk.builders import dashboard as dash
    from grafana_foundation_sdk.builders import prometheus, stat, table, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models import common
    from grafana_foundation_sdk.models import dashboard as model
    from grafana_foundation_sdk.models import prometheus as prometheus_model

    datasource = model.DataSourceRef(type_val="prometheus", uid="${datasource}")

    def label_values(
        name: str, query: str, *, label: str, multi: bool, sort: model.VariableSort
    ) -> dash.QueryVariable:
        variable = (
            dash.QueryVariable(name)
            .label(label)
            .datasource(datasource)
            .query(query)
            .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(sort)
        )
        if multi:
            variable = variable.multi(True).include_all(True).all_value(".*")
        return variable

    def thresholds(steps: tuple[tuple[float | None, str], ...]) -> dash.ThresholdsConfig:
        return (
            dash.ThresholdsConfig()
            .mode(model.ThresholdsMode.ABSOLUTE)
            .steps([model.Threshold(value=value, color=colour) for value, colour in steps])
        )

    def query(target: Target, ref_id: str) -> prometheus.Dataquery:
        q = prometheus.Dataquery().expr(target.expr).ref_id(ref_id).datasource(datasource)
        q = q.editor_mode(prometheus_model.QueryEditorMode.CODE)
        if target.legend:
            q = q.legend_format(target.legend)
        if target.table:
            q = q.format(prometheus_model.PromQueryFormat.TABLE)
        return q.instant() if target.instant else q.range()

    def panel(spec: PanelSpec):
        builder: timeseries.Panel | stat.Panel | table.Panel
        if spec.kind == "timeseries":
            builder = (
                timeseries.Panel()
                .legend(
                    common_builders.VizLegendOptions()
                    .display_mode(common.LegendDisplayMode.TABLE)
                    .placement(common.LegendPlacement.BOTTOM)
                    .show_legend(True)
                    .calcs(["lastNotNull", "mean"])
                )
                .tooltip(
                    common_builders.VizTooltipOptions()
                    .mode(common.TooltipDisplayMode.MULTI)
                    .sort(common.SortOrder.DESCENDING)
                )
                .line_width(1)
                .fill_opacity(0)
                .show_points(common.VisibilityMode.NEVER)
                .span_nulls(True)
            )
            if spec.thresholds:
                builder = builder.thresholds_style(
                    common_builders.GraphThresholdsStyleConfig().mode(
                        common.GraphTresholdsStyleMode.DASHED
                    )
                )
            for regexp, fill in ((spec.dashed, "dash"), (spec.dotted, "dot")):
                if regexp:
                    builder = builder.override_by_regexp(
                        regexp,
                        [
                            model.DynamicConfigValue(
                                id_val="custom.lineStyle",
                                value={
                                    "fill": fill,
                                    "dash": [10, 10] if fill == "dash" else [0, 10],
                                },
                            )
                        ],
                    )
        elif spec.kind == "stat":
            builder = (
                stat.Panel()
                .reduce_options(
                    common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False)
                )
                .graph_mode(common.BigValueGraphMode.NONE)
                .color_mode(common.BigValueColorMode.VALUE)
                .text_mode(common.BigValueTextMode.VALUE_AND_NAME)
            )
        elif spec.kind == "table":
            builder = table.Panel().with_transformation(
                model.DataTransformerConfig(
                    id_val="organize", options={"excludeByName": {"Time": True, "Value": True}}
                )
            )
        else:
            raise ValueError(f"unknown panel kind {spec.kind!r} of panel {spec.title!r}")
        builder = (
            builder.title(spec.title)
            .description(spec.description)
            .datasource(datasource)
            .unit(spec.unit)
            .span(spec.width)
            .height(spec.height)
        )
        for i, target in enumerate(spec.targets):
            builder = builder.with_target(query(target, chr(ord("A") + i)))
        if spec.min is not None:
            builder = builder.min(spec.min)
        if spec.max is not None:
            builder = builder.max(spec.max)
        if spec.decimals is not None:
            builder = builder.decimals(spec.decimals)
        if spec.thresholds:
            builder = builder.thresholds(thresholds(spec.thresholds))
        return builder

    builder = (
        dash.Dashboard(TITLE)
        .uid(UID)
        .description(
            "Throughput, MFU (both FLOP-counting conventions), memory against "
            "capacity, OOMs and exposed context-parallel communication of "
            "ctxlaunch training runs, per rank."
        )
        .tags(["ctxlaunch", "training", "context-parallel"])
        .editable()
        .tooltip(model.DashboardCursorSync.CROSSHAIR)
        .time("now-1h", "now")
        .refresh("10s")
        .timezone("browser")
        .with_variable(
            dash.DatasourceVariable("datasource").label("Data source").type("prometheus")
        )
        .with_variable(
            label_values(
                "job",
                "label_values(ctxlaunch_last_step, job)",
                label="Job",
                multi=False,
                sort=model.VariableSort.ALPHABETICAL_ASC,
            )
        )
        .with_variable(
            label_values(
                "run",
                'label_values(ctxlaunch_last_step{job="$job"}, run)',
                label="Run",
                multi=True,
                sort=model.VariableSort.ALPHABETICAL_DESC,
            )
        )
        .with_variable(
            label_values(
                "rank",
                'label_values(ctxlaunch_last_step{job="$job", run=~"$run"}, rank)',
                label="Rank",
                multi=True,
                sort=model.VariableSort.NUMERICAL_ASC,
            )
        )
    )
    panel_id = 1
    for row_title, specs in ROWS:
        builder = builder.with_row(dash.Row(row_title).id(panel_id))
        panel_id += 1
        for spec in specs:
            builder = builder.with_panel(panel(spec).id(panel_id))
            panel_id += 1
    builder = builder.annotation(
        dash.AnnotationQuery()
        .name("Re-plans (training.heal)")
        .datasource(datasource)
        .enable(True)
        .icon_color("orange")
        .expr(REPLAN_ANNOTATION["expr"])
    )
    # Through the SDK's encoder and back: plain dicts, lists and scalars only.
    built = json.loads(json.dumps(builder.build(), cls=JSONEncoder))
    # The Prometheus annotation's own fields, which the SDK's AnnotationQuery does not model.
    for annotation in built.get("annotations", {}).get("list", []):
        if annotation.get("name") == "Re-plans (training.heal)":
            annotation.update({k: v for k, v in REPLAN_ANNOTATION.items() if k != "expr"})
    return built


REPLAN_ANNOTATION = {
    "expr": 'ctxlaunch_replan_timestamp_seconds{job="$job", run=~"$run", rank="0"} * 1000',
    "useValueForTime": True,
    "step": "15s",
    "titleFormat": "re-planned ({{why}})",
    "textFormat": "run {{run}}: re-planned after {{why}}",
    "tagKeys": "why",
}
"""A mark on every graph where training.heal re-planned a run: the re-plan's own time (the
series' value, in ms), titled with its cause."""


def dashboard_json(dashboard: dict) -> str:
    """The dashboard as the committed file holds it: sorted keys, 2-space indent, final newline."""
    return json.dumps(dashboard, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def iter_panels(dashboard: dict) -> Iterator[dict]:
    """Every panel that is not a row, including those inside collapsed rows, in order."""
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


_VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


def panel_queries(dashboard: dict, variables: dict[str, str]) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel, with `$name` and `${name}` replaced.

    A variable missing from `variables` takes its "All" value when the dashboard offers one
    (`.*` for run and rank), and Grafana's `$__range` defaults to 1h; any other missing variable
    is a `KeyError`. Values are inserted as given: pass regexps for `=~` matchers.
    """
    defaults = dict(GRAFANA_BUILTIN_DEFAULTS)
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("includeAll") and variable.get("allValue") is not None:
            defaults[variable["name"]] = variable["allValue"]
    values = {**defaults, **variables}

    def substitute(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise KeyError(f"no value for dashboard variable ${name}; pass it in variables")
        return values[name]

    return [
        (panel["title"], _VARIABLE.sub(substitute, target["expr"]))
        for panel in iter_panels(dashboard)
        for target in panel.get("targets", [])
    ]


def main(argv: list[str] | None = None) -> None:
    """Write the dashboard JSON (default: manifests/grafana/ctxlaunch-training.json)."""
    parser = argparse.ArgumentParser(
        prog="python scripts/dev/grafana_dashboard.py",
        description="Generate the ctxlaunch Grafana dashboard (JSON model).",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=DEFAULT_OUTPUT,
        help=f"file to write, '-' for stdout (default: {DEFAULT_OUTPUT})",
    )
    args = parser.parse_args(argv)
    text = dashboard_json(build_dashboard())
    if str(args.output) == "-":
        print(text, end="")
        return
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
