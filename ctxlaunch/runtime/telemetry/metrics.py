"""The metric names, units, types and labels ctxlaunch exports: one table that the exporter,
the Grafana dashboard, the alert rules and the tests all read.

Every series of a training rank carries LABELS; MFU and model FLOP/s also carry `convention`
("full": the whole s x s score matrix counted, as PaLM, torchtitan and NeMo do; "causal":
attention halved for causal masking, as Megatron-LM does).
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "ctxlaunch_"

LABELS = ("job", "run", "rank", "node", "model", "cp", "cp_algorithm", "seq_len")
"""Identity and layout of the rank: `job` is the spec's name, `run` one submission of it."""


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str  # gauge | counter
    help: str
    extra_labels: tuple[str, ...] = ()
    known_labels: tuple[tuple[tuple[str, str], ...], ...] = ()
    """The extra labels' values known before anything happens: a counter is served at 0 for
    each from a rank's first scrape, so increase() has its baseline and a panel reads 0, not
    no data."""
    event: bool = False
    """Served only once what it describes has happened (an OOM's, a re-plan's or an
    evaluation's series): its labels are the event's."""
    experts: bool = False
    """Served only by the ranks of a mixture-of-experts model (the routers' series)."""


METRICS: tuple[Metric, ...] = (
    Metric("ctxlaunch_step_duration_seconds", "gauge", "Wall time of the last optimizer step."),
    Metric(
        "ctxlaunch_tokens_per_second_per_gpu",
        "gauge",
        "Tokens trained per second per GPU over the last step.",
    ),
    Metric(
        "ctxlaunch_model_flops_per_second_per_gpu",
        "gauge",
        "Achieved model FLOP/s per GPU over the last step.",
        ("convention",),
    ),
    Metric(
        "ctxlaunch_mfu_ratio",
        "gauge",
        "Model FLOPs utilisation over the last step (achieved / peak). The full convention "
        "counts the masked half of causal attention too, so where attention dominates "
        "(long sequences, small models) it can read above 1; causal cannot.",
        ("convention",),
    ),
    Metric(
        "ctxlaunch_peak_flops_per_second",
        "gauge",
        "The peak FLOP/s MFU is measured against: the GPU table's dense BF16/FP32 figure, or "
        "on the CPU a matmul measured once at start.",
        ("source",),
    ),
    Metric("ctxlaunch_loss", "gauge", "Mean next-token loss of the last step."),
    Metric(
        "ctxlaunch_memory_peak_allocated_bytes",
        "gauge",
        "Peak memory allocated by tensors on this rank (CPU: peak RSS).",
    ),
    Metric(
        "ctxlaunch_memory_peak_reserved_bytes",
        "gauge",
        "Peak memory reserved by the allocator on this rank (CPU: peak RSS).",
    ),
    Metric(
        "ctxlaunch_memory_capacity_bytes", "gauge", "Memory of the device (CPU: the host's memory)."
    ),
    Metric(
        "ctxlaunch_planner_predicted_peak_bytes",
        "gauge",
        "The planner's prediction of this rank's peak memory, for comparison.",
    ),
    Metric(
        "ctxlaunch_predicted_step_duration_seconds",
        "gauge",
        "The step-time model's prediction of a step (ctxlaunch.perf.steptime; on the CPU with "
        "the constants `ctxlaunch calibrate` measured), for comparison.",
    ),
    Metric(
        "ctxlaunch_predicted_step_error_ratio",
        "gauge",
        "The expected relative error of the predicted step on this machine (its profile's or "
        "calibration's held-out check); 0 where it is not known (uncalibrated here), so no "
        "drift alert fires.",
    ),
    Metric(
        "ctxlaunch_predicted_tokens_per_second_per_gpu",
        "gauge",
        "The step-time model's tokens per second per GPU, for comparison with the measured.",
    ),
    Metric(
        "ctxlaunch_predicted_mfu_ratio",
        "gauge",
        "The step-time model's MFU, against the same peak as the measured ctxlaunch_mfu_ratio.",
        ("convention",),
        known_labels=((("convention", "full"),), (("convention", "causal"),)),
    ),
    Metric(
        "ctxlaunch_estimated_remaining_seconds",
        "gauge",
        "Time left until the run's last step: the steps left at the run's mean measured step "
        "(the first, warm-up step left out), or at the predicted step before one is measured.",
    ),
    Metric(
        "ctxlaunch_allocator_retries_total",
        "counter",
        "Times the CUDA caching allocator freed its cache and retried an allocation.",
    ),
    Metric("ctxlaunch_oom_events_total", "counter", "Out-of-memory errors caught at a step."),
    Metric(
        "ctxlaunch_oom_event_info",
        "gauge",
        "1 for an OOM that happened, labelled with the step, the planner's prediction and "
        "what the planner says would fit.",
        ("step", "predicted_peak_bytes", "capacity_bytes", "would_fit"),
        event=True,
    ),
    Metric(
        "ctxlaunch_replans_total",
        "counter",
        "Layout re-plans by training.heal that started this run (1 for a run that resumed at a "
        "new layout after an OOM or on a changed allocation).",
        ("why",),
        known_labels=((("why", "oom"),), (("why", "allocation"),)),
    ),
    Metric(
        "ctxlaunch_replan_info",
        "gauge",
        "1 for a re-plan that started this run, labelled with why (oom, allocation), the "
        "layouts from and to, and the checkpoint step it resumed from.",
        ("why", "from_layout", "to_layout", "step"),
        event=True,
    ),
    Metric(
        "ctxlaunch_replan_timestamp_seconds",
        "gauge",
        "Unix time of the re-plan that started this run (the dashboard's annotation).",
        ("why",),
        event=True,
    ),
    Metric("ctxlaunch_last_step", "gauge", "The last completed optimizer step."),
    Metric(
        "ctxlaunch_target_steps",
        "gauge",
        "The optimizer steps the run is to complete (training.steps): a run whose last step "
        "reached it finished, and its silence is not a stall.",
    ),
    Metric("ctxlaunch_last_step_timestamp_seconds", "gauge", "Unix time the last step completed."),
    Metric(
        "ctxlaunch_eval_loss",
        "gauge",
        "Held-out next-token loss at the last evaluation (training.eval.interval), per "
        'context-length bucket [start, stop) of token positions; bucket "all" is the '
        "mean over every token.",
        ("bucket",),
        event=True,
    ),
    Metric("ctxlaunch_eval_step", "gauge", "The training step of the last evaluation.", event=True),
    Metric(
        "ctxlaunch_passkey_retrieval_ratio",
        "gauge",
        "Share of passkey probes retrieved at the last evaluation (every answer token the "
        "arg-max), per prompt length in tokens and depth of the number in the filler.",
        ("length", "depth"),
        event=True,
    ),
    Metric(
        "ctxlaunch_attention_kernel_info",
        "gauge",
        "1, labelled with the attention kernel the rank's attention calls run on and how it "
        "was chosen: measured (the fastest forward and backward at the run's block shape), "
        "forced (CTXLAUNCH_ATTENTION_KERNEL) or only (one kernel fits the device and dtype).",
        ("kernel", "chosen_by"),
    ),
    Metric(
        "ctxlaunch_cp_exposed_comm_seconds",
        "gauge",
        "Time in the last step spent waiting for ring K/V (or dK/dV) transfers after the "
        "block's compute had finished: communication that compute did not hide.",
    ),
    Metric(
        "ctxlaunch_cp_attention_balance_ratio",
        "gauge",
        "The attention area the busiest rank of this rank's CP group computed in the last step "
        "over the group's mean (1: balanced; a ring waits for the busiest at every hop). "
        "Under a document mask it follows parallel.cp_sharding; balanced holds it near 1.",
    ),
    Metric(
        "ctxlaunch_moe_expert_load_ratio",
        "gauge",
        "A mixture-of-experts layer's busiest expert's routings over the mean in the last "
        "step, over every rank (1: balanced; E / experts_per_token: every token to the same "
        'experts, a collapsed router); layer "max" is the highest of the layers.',
        ("layer",),
        experts=True,
    ),
    Metric(
        "ctxlaunch_moe_ep_rank_load_ratio",
        "gauge",
        "The routings the busiest rank of an EP group received over the group's mean in the "
        "last step, in the layer where that is highest: what the all-to-all and the grouped "
        "GEMM wait for.",
        experts=True,
    ),
    Metric(
        "ctxlaunch_moe_planned_load_ratio",
        "gauge",
        "The routing load the planner admitted (model.moe.planned_load, or its default): the "
        "dispatch buffers and the experts' activations were planned for an EP rank load up "
        "to this.",
        experts=True,
    ),
    Metric(
        "ctxlaunch_moe_aux_loss",
        "gauge",
        "The load-balancing auxiliary loss of the last step, before its coefficient, apart "
        "from the language-model loss (ctxlaunch_loss).",
        experts=True,
    ),
    Metric(
        "ctxlaunch_moe_tokens_dropped_total",
        "counter",
        "Routings dropped over an expert's capacity (0 unless model.moe.capacity_factor is set).",
        experts=True,
    ),
)

BY_NAME = {m.name: m for m in METRICS}
