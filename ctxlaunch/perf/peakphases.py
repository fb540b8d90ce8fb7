"""The peak, phase by phase: what one rank holds at the highest moment of each phase of a
steady-state step of the bundled trainer. Part of the per-GPU memory model
(ctxlaunch.perf.memory, whose `estimate` never plans below this peak); pure arithmetic, no torch.

What is live at the highest moment of each phase of a steady-state step (step 2 on: AdamW
creates its states at the first step()), by part:
- forward end: model states and everything saved;
- the loss, forward and backward per chunk (runtime/modeling/loss.py): the loss input and the
  gradient of it (r*h per token each), the head's gradient, one chunk's logits and, in 16-bit,
  their fp32 upcast (no fp32 copy of all the logits; no recomputation in backward);
- the last block's feed-forward backward, the step's peak at long context: the loss's saved
  tensors released (final norm input, the gradient of the gathered loss input), the SwiGLU output
  replaced by its gradient, gate's and up's gradients (2*a*f per token), the chunked SwiGLU
  backward's fp32 temporaries (2 (chunk x f) in fp32, 4 in 16-bit), the gradient flowing into
  the block (r*h), under checkpointing the recomputed half (and its bf16 weight copies), and
  the gradients produced so far (head, final norm, down projection);
- the optimizer step: every gradient, and foreach AdamW's fp32 denominator per parameter.
(a, r, h and f are the symbols of ctxlaunch.perf.activations' table: the compute dtype's and
the residual stream's bytes, the hidden and the feed-forward widths.)

Under PP each stage is planned on its own (`peak_phases(..., stage=r)`; the step's peak is the
highest stage's), after torch.distributed.pipelining's Schedule1F1B as the trainer runs it:
stage r holds its own parameters, runs min(pp - r, micro-batches) forwards before its first
backward, keeps each forward's output (stages before the last) for the backward, and keeps one
receive buffer per micro-batch of the step for activations (stages after the first) and for
gradients (stages before the last); the last stage keeps every micro-batch's output until the
step ends (return_outputs), and a stage after the first the previous backward's input gradient.
Backward j of the step runs with min(j + in-flight, micro-batches) - j micro-batches saved and,
from the second on, with every gradient of the stage.

The SwiGLU and RMSNorm backward passes run their fp32 pointwise math in chunks
(activations.BACKWARD_CHUNK_TOKENS), so those temporaries stay one chunk's whatever the
sequence length. Measured against the allocator's own record (memtrace.AllocatorTrace) on the
CPU in tests/unit/test_memory_peak.py.

A mixture-of-experts block's feed-forward backward peaks at its first step, the combine's (a
batched matmul of the router weights and the experts' outputs): the gradient of the experts'
outputs (k rows a token) next to the gradient flowing in (and its 16-bit copy under autocast),
with everything saved still held (ctxlaunch.perf.moecost; measured in tests/unit/test_moe_memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ctxlaunch.perf import moecost
from ctxlaunch.perf.activations import (
    BACKWARD_CHUNK_TOKENS,
    attention_half_bytes_per_token,
    block_activation_bytes_per_token,
    loss_workspace_bytes,
    stage_activation_bytes,
)
from ctxlaunch.perf.flops import count_params
from ctxlaunch.perf.layout import Layout
from ctxlaunch.perf.modelstates import (
    block_params,
    deepspeed_bucket_bytes,
    fsdp_block_backward_bytes,
    fsdp_gather_buffer_bytes,
    fsdp_param_bytes,
    pipeline_accumulated_grad_bytes,
    pipeline_defers_gradient_sync,
    stage_params,
    stage_states,
)

if TYPE_CHECKING:
    from ctxlaunch.contract.spec import ModelSpec


@dataclass(frozen=True)
class Phase:
    """What one rank holds at the highest moment of one phase of a steady-state step (step 2 on:
    the Adam states exist from the first `step()`), in bytes by part."""

    name: str
    parameters: float
    gradients: float
    """Gradients that exist at that moment (set_to_none: only those produced so far)."""
    optimizer_states: float
    activations: float
    """Saved for backward and not yet released, recomputed parts included."""
    workspace: float
    """Transients: gradients in flight between ops, kernel temporaries, the loss chunk, the
    step's integer inputs (`input_bytes`), and the pipeline schedule's receive buffers."""
    stage: int = 0
    """The pipeline stage (PP rank) this is the phase of."""

    @property
    def total(self) -> float:
        return (
            self.parameters
            + self.gradients
            + self.optimizer_states
            + self.activations
            + self.workspace
        )

    def parts(self) -> list[tuple[str, float]]:
        return [
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer_states", self.optimizer_states),
            ("activations", self.activations),
            ("workspace", self.workspace),
        ]

    def to_dict(self) -> dict[str, str | int]:
        out: dict[str, str | int] = {"name": self.name, "stage": self.stage}
        out.update({f"{name}_bytes": int(value) for name, value in self.parts()})
        out["total_bytes"] = int(self.total)
        return out


# --------------------------------------------------------------------------------------------
# the step's inputs and the pipeline's buffers
# --------------------------------------------------------------------------------------------
INPUT_BYTES_PER_TOKEN = 3 * 8
"""A micro-batch's integer inputs on the device (runtime/data/batches.py, MicroBatch): token
ids, targets and RoPE positions, int64 each, of the rank's CP shard (all TP ranks hold them)."""


def input_bytes(layout: Layout) -> float:
    """The step's inputs held on a rank: one micro-batch's (the engine moves each to the device
    as it runs it; the embedding keeps its token ids for backward), or under PP every
    micro-batch's (the schedule takes the whole step's tokens and targets at once)."""
    micro_batches = layout.grad_accum if layout.dims.pp > 1 else 1
    return INPUT_BYTES_PER_TOKEN * layout.tokens_per_rank * micro_batches


def pipeline_recv_buffers(n_stages: int, stage: int, n_micro: int) -> tuple[int, int]:
    """Under 1F1B (one stage a rank) the trainer's receive buffers on stage `stage` of
    `n_stages`, (activations, gradients), micro-batch i using buffer i mod that count
    (runtime/parallel/pipeline.py, `trainer_stage`): a stage runs min(n_micro, n_stages - stage)
    warm-up forwards and receives micro-batch i + that many only after i's backward, which is
    when i's input (its blocks' saved input) is released; a gradient is received right before
    its backward, which consumes it, and the next one after."""
    return min(n_micro, n_stages - stage), min(n_micro, 1)


def pipeline_buffer_bytes(model: ModelSpec, layout: Layout, stage: int) -> float:
    """The schedule's receive buffers on PP rank `stage` (torch.distributed.pipelining), each
    one micro-batch's (micro_batch, tokens / tp, h) hidden states, for the activations coming
    in (every stage but the first) and the gradients coming back (every stage but the last),
    allocated at the first step and kept; in the residual stream's dtype (fp32 under
    autocast's fp32 weights, bf16 under FSDP2's bf16 parameters). Under 1F1B as many as
    `pipeline_recv_buffers`; under interleaved 1F1B torch's own, one per micro-batch."""
    if layout.dims.pp == 1:
        return 0.0
    one = layout.residual_bytes * model.hidden * layout.tokens_per_rank / layout.dims.tp
    if layout.dims.virtual_stages > 1:
        activations = gradients = layout.grad_accum
    else:
        activations, gradients = pipeline_recv_buffers(layout.dims.pp, stage, layout.grad_accum)
    return one * (activations * (stage > 0) + gradients * (stage < layout.dims.pp - 1))


# --------------------------------------------------------------------------------------------
# per-token and per-rank pieces of the backward phases
# --------------------------------------------------------------------------------------------
def _loss_released_bytes_per_token(model: ModelSpec, layout: Layout) -> float:
    """What the last stage saved outside the blocks for the loss (final norm input and rstd,
    the gradient of the gathered loss input), released once the final norm's backward is
    done; per sequence-parallel token."""
    residual_bytes = layout.residual_bytes
    return residual_bytes * model.hidden + 4 + residual_bytes * model.hidden * layout.dims.tp


def _feed_forward_recompute_bytes_per_token(model: ModelSpec, layout: Layout) -> float:
    """Under checkpointing, what recomputing the last block's feed-forward half saves again
    (norm output, gate and up, SwiGLU output, rstd); per sequence-parallel token. Tiled, the
    recomputation lives one tile at a time (`_tile_work_bytes`)."""
    if layout.activation_checkpointing == "none" or layout.mlp_tile_tokens:
        return 0.0
    return layout.compute_bytes * (model.hidden + 3 * model.ffn_hidden) + 4


def _attention_recompute_bytes_per_token(model: ModelSpec, layout: Layout) -> float:
    """Under full checkpointing, the attention half recomputed (all but the block input)."""
    if layout.activation_checkpointing != "full":
        return 0.0
    return attention_half_bytes_per_token(model, layout)


def _prefetched_input_bytes(model: ModelSpec, layout: Layout, step: _StageStep) -> float:
    """With activations offloaded, the input of the block before the one in backward, brought
    back from host memory while that block runs (runtime/modeling/offload.py)."""
    if not layout.offload_activations or model.layers < 2:
        return 0.0
    return step.hidden_bytes


def _tile_tokens(layout: Layout) -> float:
    """Tokens of one tile of the tiled feed-forward, gathered over TP."""
    return min(layout.mlp_tile_tokens, layout.tokens_per_rank / layout.dims.tp) * layout.dims.tp


def _tile_work_bytes(model: ModelSpec, layout: Layout) -> float:
    """One tile's feed-forward backward (runtime/modeling/tiling.py) at its SwiGLU backward:
    the tile's recomputed norm output, output and one more hidden-sized tensor, gate and up,
    the gradients of the SwiGLU output and of gate and up, the chunked SwiGLU backward's fp32
    temporaries, and under autocast with fp32 weights the tile's 16-bit weight copies.
    Measured on the CPU (tests/unit/test_memory_peak.py); under TP the tile's f-sized tensors
    are the gathered tile's over f / tp."""
    a, h = layout.compute_bytes, model.hidden
    tile = _tile_tokens(layout)
    ffn_per_rank = model.ffn_hidden / layout.dims.tp
    work = 3 * a * h * tile / layout.dims.tp + 5 * a * ffn_per_rank * tile
    work += _swiglu_backward_temporaries(model, layout, chunk_tokens=tile)
    if layout.fp32_weights and layout.dtype == "bf16":
        work += 2.0 * 3 * h * model.ffn_hidden / layout.dims.tp
    return work


def _swiglu_backward_temporaries(
    model: ModelSpec, layout: Layout, chunk_tokens: float | None = None
) -> float:
    """The chunked SwiGLU backward's fp32 temporaries: two (chunk x ffn) tensors in fp32, four
    in 16-bit (with the upcasts of gate and the incoming gradient). `chunk_tokens`: the rows
    it runs on (default: the rank's tokens), chunked by BACKWARD_CHUNK_TOKENS."""
    rows = layout.tokens_per_rank if chunk_tokens is None else chunk_tokens
    chunk_tokens = min(rows, BACKWARD_CHUNK_TOKENS)
    count = 2 if layout.compute_bytes == 4 else 4
    return count * 4 * chunk_tokens * model.ffn_hidden / layout.dims.tp


def _head_grad_bytes(model: ModelSpec, layout: Layout, params_bytes_per_param: float) -> float:
    """The output head's (or tied embedding's) gradient, which the chunked loss accumulates
    from its first chunk on."""
    counts = count_params(model)
    return params_bytes_per_param * (counts.head or counts.embedding) / layout.dims.tp


def _last_block_grad_bytes(
    model: ModelSpec, layout: Layout, params_bytes_per_param: float
) -> float:
    """Gradients produced by the time the last block's feed-forward is differentiated: the
    output head (or tied embedding), the final norm gain, the down projection."""
    counts = count_params(model)
    head = counts.head if counts.head else counts.embedding
    return (
        params_bytes_per_param
        * (head + model.hidden + model.hidden * model.ffn_hidden)
        / layout.dims.tp
    )


# --------------------------------------------------------------------------------------------
# one stage's step, phase by phase
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _StageStep:
    """What every phase of PP rank `stage`'s step shares."""

    stage: int
    first: bool
    last: bool
    parameters: float
    gradients: float
    """Every gradient of the stage (after its last backward)."""
    optimizer_states: float
    optimizer_states_held: float
    """The optimizer states held outside the optimizer step (DeepSpeed ZeRO-1/2 in bf16 makes
    its fp32 gradient partition only inside the step)."""
    gradient_bytes_per_param: float
    micro_batches: int
    in_flight: int
    """Forwards the stage runs before its first backward (1F1B warm-up; 1 without PP)."""
    saved_per_micro_batch: float
    """What one forward leaves saved on the stage, with (stages before the last) its output,
    which the schedule keeps for the backward."""
    forward_buffers: float
    """The step's inputs and the pipeline's receive buffers."""
    bucket: int
    """DeepSpeed's reduce bucket, from the first backward hook to the end of backward."""
    hidden_bytes: float
    """One micro-batch's hidden states on the rank (residual stream, sequence-parallel): what
    goes between stages, and the gradient flowing into a block."""
    sequence_parallel_tokens: float
    shard_tokens: int
    """Tokens of the rank's CP shard (gathered over TP)."""
    fsdp: bool
    accumulated_unsharded: float
    """FSDP2 under PP at ZeRO-1: the stage's unsharded gradients accumulated from the first
    backward on (`pipeline_accumulated_grad_bytes`)."""
    sharded_sync: bool
    """FSDP2 reduce-scatters each block's gradients at the end of its backward."""

    @property
    def saved(self) -> float:
        """What the forwards in flight leave saved at the end of the warm-up."""
        return self.in_flight * self.saved_per_micro_batch

    @property
    def backward_buffers(self) -> float:
        return self.forward_buffers + self.bucket


def _produced_gradient_bytes_per_param(model: ModelSpec, layout: Layout, stage: int) -> float:
    """Bytes per parameter of the gradients backward produces on the device: the engine's
    gradient partition's, which an offloaded optimizer's gradients pass through on their way
    to host memory."""
    device = layout.replace(offload_optimizer=False, offload_parameters=False)
    gradients = stage_states(model, device, stage)[1]
    return gradients / max(stage_params(model, layout, stage), 1)


def _stage_step(model: ModelSpec, layout: Layout, stage: int) -> _StageStep:
    pp = layout.dims.pp
    first, last = stage == 0, stage == pp - 1
    blocks = layout.rank_layers(model.layers)[stage] if pp > 1 else model.layers
    parameters, gradients, optimizer_states = stage_states(model, layout, stage)
    held_params = stage_params(model, layout, stage)
    sequence_parallel_tokens = layout.tokens_per_rank / layout.dims.tp
    hidden_bytes = layout.residual_bytes * model.hidden * sequence_parallel_tokens
    # 1F1B: stage r runs pp - r forwards before its first backward (at most the step's
    # micro-batches), each leaving what it saved, and on a stage that sends its output on,
    # that output, which the schedule keeps for the stage's backward. On every stage but the
    # first the blocks' input is the schedule's receive buffer (`pipeline_buffer_bytes`),
    # not a tensor of its own.
    in_flight = min(pp - stage, layout.grad_accum) if pp > 1 else 1
    saved_per_micro_batch = stage_activation_bytes(model, layout, blocks, first=first, last=last)
    if pp > 1:
        saved_per_micro_batch += hidden_bytes * ((not last) - (not first))
    # DeepSpeed ZeRO-1/2 (bf16): the fp32 gradient partition exists only inside the optimizer
    # step, and backward fills one reduce bucket (`deepspeed_bucket_bytes`).
    bucket = deepspeed_bucket_bytes(layout)
    # FSDP2 under PP at ZeRO-1: from the first backward on the stage's unsharded gradients
    # accumulate (`pipeline_accumulated_grad_bytes`); at ZeRO-2/3 each block's are
    # reduce-scattered at the end of its backward, as without PP (`sharded_sync`).
    fsdp = layout.fsdp_sharded
    return _StageStep(
        stage=stage,
        first=first,
        last=last,
        parameters=parameters,
        gradients=gradients,
        optimizer_states=optimizer_states,
        optimizer_states_held=optimizer_states
        - (4 * held_params // layout.dims.shard_group if bucket and optimizer_states else 0),
        gradient_bytes_per_param=_produced_gradient_bytes_per_param(model, layout, stage),
        micro_batches=layout.grad_accum,
        in_flight=in_flight,
        saved_per_micro_batch=saved_per_micro_batch,
        forward_buffers=pipeline_buffer_bytes(model, layout, stage) + input_bytes(layout),
        bucket=bucket,
        hidden_bytes=hidden_bytes,
        sequence_parallel_tokens=sequence_parallel_tokens,
        shard_tokens=layout.tokens_per_rank,
        fsdp=fsdp,
        accumulated_unsharded=pipeline_accumulated_grad_bytes(layout, held_params),
        sharded_sync=fsdp and not pipeline_defers_gradient_sync(layout),
    )


def _forward_phase(step: _StageStep) -> Phase:
    """The end of the warm-up forwards: model states and everything they saved."""
    return Phase(
        "forward",
        step.parameters,
        0.0,
        step.optimizer_states_held,
        step.saved,
        step.forward_buffers,
        step.stage,
    )


def _loss_phases(model: ModelSpec, layout: Layout, step: _StageStep) -> list[Phase]:
    """The loss, forward and backward chunk by chunk (last stage only): the gradient of its
    whole input (in `saved`) and the head weight's exist from the first chunk on, next to the
    input itself and one chunk's logits and their fp32 work. From the second micro-batch on,
    next to every gradient the earlier ones left (FSDP2: the sharded ones, or under PP the
    accumulating unsharded ones), the head's new gradient not yet added in (FSDP2: unsharded,
    in the gathered weights' dtype)."""
    if not step.last:
        return []
    loss_input = layout.residual_bytes * model.hidden * step.shard_tokens
    head_grad = _head_grad_bytes(
        model, layout, fsdp_param_bytes(layout) if step.fsdp else step.gradient_bytes_per_param
    )
    work = step.backward_buffers + loss_input + loss_workspace_bytes(model, layout)
    if layout.dims.pp == 1:
        # The trainer's loss runs inside the root module's forward, where FSDP2 still
        # holds its last all-gather's flat output (`fsdp_gather_buffer_bytes`).
        work += fsdp_gather_buffer_bytes(model, layout)
    held_states = step.optimizer_states_held
    phases = [Phase("loss", step.parameters, head_grad, held_states, step.saved, work, step.stage)]
    if step.micro_batches > 1:
        kept = step.hidden_bytes * (1 + (not step.first)) if layout.dims.pp > 1 else 0.0
        phases.append(
            Phase(
                f"loss (micro-batch 2 of {step.micro_batches})",
                step.parameters,
                head_grad + (step.accumulated_unsharded or step.gradients),
                held_states,
                step.saved,
                work + kept,
                step.stage,
            )
        )
    return phases


@dataclass(frozen=True)
class _LastBlockBackward:
    """The last block's feed-forward backward on a stage, whichever micro-batch it is for."""

    recomputed: float
    """What checkpointing recomputes for it (and its bf16 weight copies)."""
    released: float
    """The loss's saved tensors, released by then (last stage), and the post-norm's after the
    feed-forward."""
    produced: float
    """Gradients produced by then, in the dtype they are produced in."""
    root_unsharded: float
    """FSDP2 on the last stage: the root's (head, final norm) unsharded gradients."""
    workspace: float
    """Gate's and up's gradients, the chunked SwiGLU backward's temporaries and (last stage)
    the gradient flowing into the block."""


def _last_block_backward(model: ModelSpec, layout: Layout, step: _StageStep) -> _LastBlockBackward:
    """The loss's saved tensors released (last stage), the SwiGLU output replaced by its
    gradient (same bytes), gate and up's gradients and the chunk's fp32 temporaries on top,
    with the gradient flowing into the block (on a stage that is not the last it arrived in a
    receive buffer)."""
    if model.moe is not None:
        return _moe_last_block_backward(model, layout, step)
    tokens = step.sequence_parallel_tokens
    hidden = model.hidden
    ffn_per_rank = model.ffn_hidden / layout.dims.tp
    recomputed = tokens * (
        _feed_forward_recompute_bytes_per_token(model, layout)
        + _attention_recompute_bytes_per_token(model, layout)
    )
    if layout.activation_checkpointing != "none" and layout.fp32_weights and layout.dtype == "bf16":
        recomputed += (
            2.0 * 3 * hidden * model.ffn_hidden / layout.dims.tp
        )  # bf16 weight copies again
    # Under FSDP2 the gradients of the block being differentiated, and of the root's weights
    # (head, final norm), are produced unsharded, in the gathered weights' dtype, and only
    # reduce-scattered into their fp32 shards after the block's (the root's) backward.
    produced_per_param = fsdp_param_bytes(layout) if step.fsdp else step.gradient_bytes_per_param
    if step.last:
        released = tokens * _loss_released_bytes_per_token(model, layout)
        produced = _last_block_grad_bytes(model, layout, produced_per_param)
    else:
        released = 0.0
        produced = (
            produced_per_param * hidden * model.ffn_hidden / layout.dims.tp
        )  # down projection
    if (
        model.post_norms
        and layout.activation_checkpointing == "none"
        and not layout.mlp_tile_tokens
    ):
        # The norm after the feed-forward is differentiated first: its saved output of the
        # down projection and reciprocal RMS are gone before the gated activation's backward.
        released += tokens * (layout.compute_bytes * hidden + 4)
    root_unsharded = (
        _head_grad_bytes(model, layout, produced_per_param) if step.fsdp and step.last else 0.0
    )
    if layout.mlp_tile_tokens:
        # Tiled: from the second tile on the gate/up projection's gradient exists too; the
        # input's gradient is allocated whole, next to the one flowing into the block; the
        # rest lives one tile at a time.
        produced += produced_per_param * 2 * hidden * model.ffn_hidden / layout.dims.tp
        workspace = (
            (step.hidden_bytes if step.last else 0.0)
            + step.hidden_bytes
            + _tile_work_bytes(model, layout)
        )
    else:
        workspace = (
            (step.hidden_bytes if step.last else 0.0)
            + 2 * layout.compute_bytes * ffn_per_rank * step.shard_tokens
            + _swiglu_backward_temporaries(model, layout)
        )
    return _LastBlockBackward(recomputed, released, produced, root_unsharded, workspace)


def _moe_last_block_backward(
    model: ModelSpec, layout: Layout, step: _StageStep
) -> _LastBlockBackward:
    """The last block's mixture-of-experts backward at the combine: the gradient flowing in
    (on the last stage; a receive buffer's on the others), its 16-bit copy where the
    residual is wider, and the gradient of the k experts' outputs per token (moecost's module
    docstring); the gradients produced so far are the head's and the final norm's (last
    stage). Under checkpointing the recomputation's end can be higher: its experts' outputs
    and the norm's output are still alive there."""
    tokens = step.sequence_parallel_tokens
    moe = model.moe
    assert moe is not None  # the caller's test
    a, h, k = layout.compute_bytes, model.hidden, moe.experts_per_token
    recomputed = 0.0
    if layout.activation_checkpointing != "none":
        # Under full checkpointing the feed-forward's input (x + attention) is recomputed too;
        # selective keeps it.
        again = layout.residual_bytes * h if layout.activation_checkpointing == "full" else 0
        recomputed = tokens * (again + moecost.feed_forward_bytes_per_token(model, layout) + 4)
        if layout.fp32_weights and layout.dtype == "bf16":
            recomputed += moecost.weight_copy_bytes(model, layout)
    recomputed += tokens * _attention_recompute_bytes_per_token(model, layout)
    produced_per_param = fsdp_param_bytes(layout) if step.fsdp else step.gradient_bytes_per_param
    released = produced = root_unsharded = 0.0
    if step.last:
        released = tokens * _loss_released_bytes_per_token(model, layout)
        counts = count_params(model)
        produced = produced_per_param * ((counts.head or counts.embedding) + h) / layout.dims.tp
        root_unsharded = _head_grad_bytes(model, layout, produced_per_param) if step.fsdp else 0.0
    incoming = (step.hidden_bytes if step.last else 0.0) + (
        a * h * tokens if layout.residual_bytes != a else 0.0
    )
    workspace = incoming + k * a * h * tokens
    if layout.activation_checkpointing != "none":
        # The recomputation's end, before the combine's backward: its forward's experts'
        # outputs (k rows a token) and, where the residual is wider, the norm's output the
        # feed-forward was called with, are still alive.
        transient = k * a * h * tokens + (
            layout.residual_bytes * h * tokens if layout.residual_bytes != a else 0.0
        )
        workspace = max(workspace, incoming + transient)
    return _LastBlockBackward(recomputed, released, produced, root_unsharded, workspace)


def _backwards_to_plan(layout: Layout, step: _StageStep) -> tuple[list[int], int]:
    """(the backwards of the step whose peaks can be the highest, in order; the first backward
    from which the stage holds one more output). Backward j (1F1B) runs with
    min(j + in_flight, micro-batches) - j micro-batches still saved, the current one included,
    and from the second on with every gradient of the stage (accumulated), so later backwards
    only hold fewer micro-batches, except the last stage's kept outputs, and on a stage that
    warms up with two forwards or more (in_flight >= 2) the output of its last-but-one warm-up
    forward: Schedule1F1B keeps that forward's send work (which holds the sent tensor) in
    `send_work` until the step returns, so from that micro-batch's own backward on
    (j >= in_flight - 1) one more output is held."""
    pipelined = layout.dims.pp > 1
    micro_batches = step.micro_batches
    retained_from = (
        step.in_flight - 1 if pipelined and not step.last and step.in_flight >= 2 else micro_batches
    )
    backwards = (
        {0, min(1, micro_batches - 1)}
        | ({micro_batches - 1} if pipelined and step.last else set())
        | ({retained_from} if retained_from < micro_batches else set())
    )
    return sorted(backwards), retained_from


def _kept_between_stages(
    layout: Layout, step: _StageStep, backward: int, retained_from: int
) -> float:
    """Hidden states the pipeline schedule still holds at backward `backward`: on the last
    stage every micro-batch's output until the step ends (torch's return_outputs=True, which
    the trainer does not turn off); on every stage but the first the previous backward's input
    gradient, referenced (the stage's grads_input) until the next one replaces it; and the
    output `_backwards_to_plan` says is retained."""
    kept = 0.0
    if layout.dims.pp > 1 and step.last:
        kept += (backward + 1) * step.hidden_bytes
    if layout.dims.pp > 1 and not step.first and backward > 0:
        kept += step.hidden_bytes
    if backward >= retained_from:
        kept += step.hidden_bytes
    return kept


def _block_backward_phases(model: ModelSpec, layout: Layout, step: _StageStep) -> list[Phase]:
    """The last block's feed-forward backward of each backward that can hold the peak, and
    under FSDP2's per-block sync the end of that block's backward."""
    ffn = _last_block_backward(model, layout, step)
    micro_batches = step.micro_batches
    backwards, retained_from = _backwards_to_plan(layout, step)
    phases = []
    for backward in backwards:
        held = (
            (min(backward + step.in_flight, micro_batches) - backward) * step.saved_per_micro_batch
            + ffn.recomputed
            - ffn.released
            + _prefetched_input_bytes(model, layout, step)
        )
        kept = _kept_between_stages(layout, step, backward, retained_from)
        name = (
            "block backward"
            if backward == 0
            else f"block backward (micro-batch {backward + 1} of {micro_batches})"
        )
        accumulated = (step.accumulated_unsharded or step.gradients) if backward > 0 else 0.0
        phases.append(
            Phase(
                name,
                step.parameters,
                ffn.produced + accumulated
                if step.fsdp
                else (ffn.produced if backward == 0 else step.gradients),
                step.optimizer_states_held,
                held,
                step.backward_buffers + ffn.workspace + kept,
                step.stage,
            )
        )
        if layout.mlp_tile_tokens and backward == 0:
            phases.append(_attention_backward_phase(model, layout, step, phases[-1]))
        if step.sharded_sync:
            # The end of that block's backward: what the micro-batch saved in it released, its
            # unsharded gradients and the fp32 reduce-scatter input.
            phases.append(
                Phase(
                    f"{name}, FSDP2 reduce-scatter",
                    step.parameters,
                    ffn.root_unsharded + accumulated,
                    step.optimizer_states_held,
                    held
                    - step.sequence_parallel_tokens
                    * block_activation_bytes_per_token(model, layout),
                    step.backward_buffers
                    + kept
                    + step.hidden_bytes
                    + fsdp_block_backward_bytes(model, layout),
                    step.stage,
                )
            )
    first = _first_block_backward_phase(model, layout, step, ffn)
    if first is not None:
        phases.append(first)
        if layout.mlp_tile_tokens:
            phases.append(_attention_backward_phase(model, layout, step, first))
    return phases


def _first_block_backward_phase(
    model: ModelSpec, layout: Layout, step: _StageStep, ffn: _LastBlockBackward
) -> Phase | None:
    """With activations offloaded every block's backward holds the same activations (its
    input brought back and its recomputation), so the first block's, which runs with every
    later block's gradients produced, is the highest (one micro-batch at a time: PP 1)."""
    if not layout.offload_activations or model.layers < 2:
        return None
    later = (model.layers - 1) * block_params(model, layout)
    if step.fsdp:
        # Later blocks' gradients are reduce-scattered into fp32 shards, in host memory
        # under the CPU offload policy.
        produced = ffn.produced + (
            0.0 if layout.offload_optimizer else 4 * later / layout.dims.shard_group
        )
    else:
        produced = ffn.produced + step.gradient_bytes_per_param * later
    held = step.saved_per_micro_batch + ffn.recomputed - ffn.released
    return Phase(
        "first block backward",
        step.parameters,
        produced,
        step.optimizer_states_held,
        held,
        step.backward_buffers + ffn.workspace,
        step.stage,
    )


def attention_backward_bytes_per_token(model: ModelSpec, layout: Layout) -> float:
    """One block's attention backward at its peak, per token of the rank's CP shard (over TP):
    the kernel's dq, dk, dv and its row statistics (delta, fp32), and for the CP algorithms
    their buffers: the ring's fp32 dq accumulator, its fp32 dK/dV (this rank's, the pair in
    hand and the pair arriving) and the K/V arriving (cp/ring.py, `_ring_backward`); Ulysses'
    all-to-all buffers of q, k, v and their gradients (cp/ulysses.py). Under attention tiles
    the kernel's share is one tile's."""
    a, h, h_kv = layout.compute_bytes, model.hidden, model.kv_hidden
    kernel = (a * (h + 2 * h_kv) + 4 * model.heads) * layout.attention_tile_fraction
    if layout.dims.cp == 1:
        return kernel
    if layout.dims.cp_algorithm == "ulysses":
        return kernel + 2 * a * (h + 2 * h_kv)
    spare_kv = min(layout.dims.ring_degree - 1, 2)
    ring = 4 * h + 3 * 2 * 4 * h_kv + spare_kv * 2 * a * h_kv
    if layout.dims.cp_algorithm == "hybrid":
        ring += 2 * a * (h + 2 * h_kv)
    return kernel + ring


def _attention_backward_phase(
    model: ModelSpec, layout: Layout, step: _StageStep, feed_forward: Phase
) -> Phase:
    """Under the tiled feed-forward the attention backward of the same block can be the
    higher: the feed-forward's input (x + attention) and the token-major attention output
    released, the gradient flowing into the block and that of the attention output held, and
    the attention kernel's outputs and the CP algorithm's buffers
    (`attention_backward_bytes_per_token`); the gradients of the output projection and of the
    whole feed-forward produced."""
    tokens = step.sequence_parallel_tokens
    a, h = layout.compute_bytes, model.hidden
    released = tokens * (layout.residual_bytes * h + a * h)
    produced_per_param = fsdp_param_bytes(layout) if step.fsdp else step.gradient_bytes_per_param
    # The incoming gradient and the feed-forward's input gradient are one by now (x + attention's
    # gradient), and the tile's work is gone.
    feed_forward_only = (step.hidden_bytes if step.last else 0.0) + _tile_work_bytes(model, layout)
    return Phase(
        feed_forward.name.replace("backward", "attention backward", 1),
        feed_forward.parameters,
        feed_forward.gradients + produced_per_param * (h * h + h) / layout.dims.tp,
        feed_forward.optimizer_states,
        feed_forward.activations - released,
        feed_forward.workspace
        - feed_forward_only
        + tokens * (a * h + attention_backward_bytes_per_token(model, layout)),
        feed_forward.stage,
    )


def _deferred_reduce_scatter_phases(
    model: ModelSpec, layout: Layout, step: _StageStep
) -> list[Phase]:
    """After the last backward, where the pipeline deferred FSDP2's gradient sync: each
    block's accumulated gradients copied into an fp32 reduce-scatter input, the previous
    block's still held (one retained by default)."""
    if not step.accumulated_unsharded:
        return []
    return [
        Phase(
            "FSDP2 reduce-scatter after the last backward",
            step.parameters,
            step.accumulated_unsharded + step.gradients,
            step.optimizer_states_held,
            0.0,
            step.backward_buffers + 2 * 4 * block_params(model, layout),
            step.stage,
        )
    ]


def _optimizer_step_phase(step: _StageStep, layout: Layout) -> Phase:
    """The optimizer step: every gradient, and foreach AdamW's fp32 denominator for every
    parameter (sqrt of the second moment, divided, plus eps) before the update; a fused (or
    one-tensor-at-a-time) step has no such temporaries (`Layout.foreach_optimizer`)."""
    denominators = step.parameters if layout.foreach_optimizer else 0.0
    return Phase(
        "optimizer step",
        step.parameters,
        step.gradients,
        step.optimizer_states,
        0.0,
        step.backward_buffers - step.bucket + denominators,
        step.stage,
    )


def _stage_phases(model: ModelSpec, layout: Layout, stage: int) -> list[Phase]:
    step = _stage_step(model, layout, stage)
    return [
        _forward_phase(step),
        *_loss_phases(model, layout, step),
        *_block_backward_phases(model, layout, step),
        *_deferred_reduce_scatter_phases(model, layout, step),
        _optimizer_step_phase(step, layout),
    ]


def peak_phases(model: ModelSpec, layout: Layout, stage: int | None = None) -> list[Phase]:
    """The highest moment of each phase of a steady-state step on PP rank `stage` (default:
    the rank whose peak is highest): the end of forward, the loss chunk in backward (last
    stage), the feed-forward backward of the stage's last block (SwiGLU), and the optimizer
    step. The peak of the step is the largest (`peak`)."""
    if stage is not None or layout.dims.pp == 1:
        return _stage_phases(model, layout, stage or 0)
    per_stage = [_stage_phases(model, layout, rank) for rank in range(layout.dims.pp)]
    return max(per_stage, key=lambda phases: max(p.total for p in phases))


def peak(model: ModelSpec, layout: Layout, stage: int | None = None) -> Phase:
    """The highest phase of a steady-state step on PP rank `stage` (default: the busiest;
    see `peak_phases`)."""
    return max(peak_phases(model, layout, stage), key=lambda p: p.total)
