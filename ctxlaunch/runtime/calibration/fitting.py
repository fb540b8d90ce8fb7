"""The fits that turn calibration readings into the step-time model's constants: a bandwidth
and latency through message times, an attention rate with its length ramp, the exchange cost's
growth with the compute between exchanges, and the trainer's elementwise, loss and fixed costs
by least squares. Plain arithmetic: no torch, nothing measured here."""

from __future__ import annotations

import statistics


def fit_line(xs: tuple[float, ...] | list[float], ys: list[float]) -> tuple[float, float]:
    """(bytes/s, latency s) of the least-squares line t = latency + x / bandwidth through the
    best time at each message size. A burst of load elsewhere can tilt the line: never below the
    largest message's own rate. The latency is the smallest message's time less its transfer
    (the intercept of a line through points this far apart is too noisy to use), at least 0."""
    count = len(xs)
    mean_x, mean_y = sum(xs) / count, sum(ys) / count
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = (
        sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread
        if spread > 0
        else 0.0
    )
    bandwidth = max(1.0 / slope if slope > 0 else 0.0, xs[-1] / ys[-1])
    latency = max(ys[0] - xs[0] / bandwidth, 0.0)
    return bandwidth, latency


def fit_ramp(short: int, short_rate: float, long: int, long_rate: float) -> tuple[float, float]:
    """(rate at any length, L0) of rate(L) = rate x L / (L + L0) through two measured rates:
    1 / rate(L) is linear in 1 / L. A rate that does not grow with the length (noise) gives no
    ramp: the longer block's rate, L0 = 0."""
    slope = (1 / short_rate - 1 / long_rate) / (1 / short - 1 / long)
    if slope <= 0:
        return long_rate, 0.0
    intercept = 1 / long_rate - slope / long
    if intercept <= 0:
        return long_rate, 0.0
    return 1 / intercept, slope / intercept


def fit_sync_jitter(short: tuple[float, float], long: tuple[float, float]) -> tuple[float, float]:
    """(s0, c) of cost(tau) = s0 + c x sqrt(tau) through two (cost, tau) readings of an exchange
    after tau seconds of compute (`cpu.measure_sync_intervals` at two sizes); no growth, c = 0 and
    s0 the shorter reading, where the longer compute's exchange did not cost more (noise)."""
    (cost_short, tau_short), (cost_long, tau_long) = short, long
    if tau_long <= tau_short or cost_long <= cost_short:
        return cost_short, 0.0
    growth = (cost_long - cost_short) / (tau_long**0.5 - tau_short**0.5)
    return max(0.0, cost_short - growth * tau_short**0.5), growth


def median_each(readings: list[tuple[float, ...]]) -> tuple[float, ...]:
    """The median of each position over equally long readings: (a1, b1), (a2, b2), ... ->
    (median a, median b)."""
    return tuple(statistics.median(values) for values in zip(*readings, strict=True))


def least_squares(rows: list[list[float]], values: list[float]) -> list[float]:
    """x minimising |rows x - values| (normal equations, Gauss-Jordan; a handful of unknowns).
    ValueError where the rows do not determine x."""
    unknowns = len(rows[0])
    # The normal equations (rows^T rows | rows^T values), one augmented row per unknown.
    augmented = [
        [sum(r[i] * r[j] for r in rows) for j in range(unknowns)]
        + [sum(r[i] * v for r, v in zip(rows, values, strict=True))]
        for i in range(unknowns)
    ]
    for col in range(unknowns):
        pivot = max(range(col, unknowns), key=lambda r: abs(augmented[r][col]))
        augmented[col], augmented[pivot] = augmented[pivot], augmented[col]
        if abs(augmented[col][col]) < 1e-300:
            raise ValueError("the calibration's trainer runs do not determine the constants")
        for r in range(unknowns):
            if r != col:
                factor = augmented[r][col] / augmented[col][col]
                augmented[r] = [
                    x - factor * y for x, y in zip(augmented[r], augmented[col], strict=True)
                ]
    return [augmented[i][unknowns] / augmented[i][i] for i in range(unknowns)]


def fit_residual(points: list[tuple[float, dict[str, float]]]) -> tuple[float, float, float]:
    """(blocks' elementwise rate, loss rate, both as fractions of the HBM bandwidth; fixed
    seconds per micro-batch) from trainer steps, each (measured seconds, the model's terms with
    both rates at the bandwidth and no fixed cost). What a step leaves beyond its other terms is
    fixed + E x u + S x w, E and S the elementwise and loss terms at the bandwidth, u and w the
    slowdowns (1 / rate): solved by least squares over the points (three determine it). A
    slowdown below 1 (faster than the bandwidth: noise) is held at 1 and a negative fixed cost
    at 0, the others fitted again with it held."""
    rows = [[1.0, t["compute_elementwise"], t["compute_loss"]] for _, t in points]
    values = [
        measured - (sum(t.values()) - t["compute_elementwise"] - t["compute_loss"])
        for measured, t in points
    ]
    bounds = (0.0, 1.0, 1.0)  # fixed >= 0; slowdowns >= 1
    best: tuple[float, list[float]] | None = None
    for held in range(8):  # each unknown free or held at its bound; the best feasible fit
        held_at = {i: bounds[i] for i in range(3) if held >> i & 1}
        free = [i for i in range(3) if i not in held_at]
        solution = [0.0] * 3
        for i, value in held_at.items():
            solution[i] = value
        if free:
            rest = [
                v - sum(r[i] * solution[i] for i in held_at)
                for r, v in zip(rows, values, strict=True)
            ]
            try:
                solved = least_squares([[r[i] for i in free] for r in rows], rest)
            except ValueError:
                continue
            for i, value in zip(free, solved, strict=True):
                solution[i] = value
        if any(solution[i] < bounds[i] - 1e-12 for i in range(3)):
            continue
        error = sum(
            (sum(r[i] * solution[i] for i in range(3)) - v) ** 2
            for r, v in zip(rows, values, strict=True)
        )
        if best is None or error < best[0] - 1e-18:
            best = (error, solution)
    assert best is not None  # every unknown held at its bound is always feasible
    fixed, elementwise_slowdown, loss_slowdown = best[1]
    return 1.0 / elementwise_slowdown, 1.0 / loss_slowdown, fixed
