"""The co-batched lane's rule (shared/co_batch.py): how many rollout rows, then rollout prefill tokens, ride in
serving's next iteration. A pure function: the executor calls it with its measured fit, the simulator with the
roofline."""

import numpy as np
import pytest

from rose.shared.co_batch import CoBatchBudget, co_batch_rows


def linear(base_s: float, per_row_s: float, per_token_s: float):
    """An iteration predictor: serving's planned work (``base_s``), then each rollout row and prefill token."""
    return lambda rows, tokens: base_s + per_row_s * rows + per_token_s * tokens


def test_the_most_rows_then_the_most_prefill_under_the_threshold():
    pass_s = linear(0.010, 0.001, 0.0001)
    # 80 ms: 70 rows would fit, 40 are ready; the prefill takes what the rows leave (30 ms: 300 tokens, 200 wait)
    assert co_batch_rows(pass_s, threshold_s=0.08, max_rows=40, max_prefill_tokens=200) == CoBatchBudget(40, 200)
    assert co_batch_rows(pass_s, threshold_s=0.08, max_rows=40, max_prefill_tokens=1000) == CoBatchBudget(40, 300)
    # 30 ms: the rows first (20), nothing left for prefill
    assert co_batch_rows(pass_s, threshold_s=0.03, max_rows=40, max_prefill_tokens=1000) == CoBatchBudget(20, 0)
    # exactly at the threshold rides; one more does not
    budget = co_batch_rows(linear(0.0, 1.0, 1.0), threshold_s=7.0, max_rows=10, max_prefill_tokens=10)
    assert budget == CoBatchBudget(7, 0)


def test_serving_past_the_threshold_leaves_rollout_out():
    """Reclaim: serving's own work alone is past the threshold, so the next iteration carries no rollout (its rows'
    KV stays where it is)."""
    assert co_batch_rows(linear(0.09, 0.001, 0.0), threshold_s=0.08, max_rows=64, max_prefill_tokens=512) == CoBatchBudget(0, 0)
    assert co_batch_rows(linear(0.01, 0.001, 0.0), threshold_s=0.08, max_rows=0, max_prefill_tokens=0) == CoBatchBudget(0, 0)


def test_without_serving_work_every_row_rides_and_the_quantum_bounds_the_prefill():
    pass_s = linear(0.0015, 0.0002, 0.00002)
    # 100 rows decode in 21.5 ms, past the 10 ms quantum: they all ride, and no prefill lengthens that iteration
    assert co_batch_rows(pass_s, threshold_s=0.010, max_rows=100, max_prefill_tokens=400, serving_busy=False) == CoBatchBudget(100, 0)
    # 10 rows take 3.5 ms: the prefill fills the quantum (325 tokens)
    assert co_batch_rows(pass_s, threshold_s=0.010, max_rows=10, max_prefill_tokens=400, serving_busy=False) == CoBatchBudget(10, 325)


def test_scalar_calls_hand_the_predictor_ints_and_get_ints_back():
    seen = []

    def pass_s(rows, tokens):
        seen.append((type(rows), type(tokens)))
        return 0.01 + 0.001 * rows + 0.0001 * tokens

    budget = co_batch_rows(pass_s, threshold_s=0.05, max_rows=100, max_prefill_tokens=50)
    assert type(budget.rows) is int and type(budget.prefill_tokens) is int
    assert set(seen) == {(int, int)}
    # a bisection: a few calls, not one per candidate
    assert len(seen) <= 2 * (int(np.log2(100)) + 3)


def test_arrays_answer_as_each_element_alone():
    """The simulator prices every instance at once: the array call equals the scalar calls element by element, for
    monotone predictors of any shape (here each element its own line with a convex term)."""
    rng = np.random.default_rng(0)
    n = 40
    base, per_row, per_token = rng.uniform(0.0, 0.05, n), rng.uniform(1e-5, 2e-3, n), rng.uniform(1e-6, 2e-4, n)
    curve = rng.uniform(0.0, 1e-6, n)
    threshold = rng.uniform(0.0, 0.1, n)
    rows_cap, tokens_cap = rng.integers(0, 300, n), rng.integers(0, 600, n)

    def pass_s(rows, tokens, i=slice(None)):
        return base[i] + per_row[i] * rows + curve[i] * rows**2 + per_token[i] * tokens

    for busy in (True, False):
        together = co_batch_rows(pass_s, threshold_s=threshold, max_rows=rows_cap, max_prefill_tokens=tokens_cap, serving_busy=busy)
        for i in range(n):
            alone = co_batch_rows(
                lambda r, p, i=i: pass_s(r, p, i),
                threshold_s=float(threshold[i]),
                max_rows=int(rows_cap[i]),
                max_prefill_tokens=int(tokens_cap[i]),
                serving_busy=busy,
            )
            assert (together.rows[i], together.prefill_tokens[i]) == (alone.rows, alone.prefill_tokens), i
            if busy and alone.rows + alone.prefill_tokens > 0:
                assert pass_s(alone.rows, alone.prefill_tokens, i) <= threshold[i]
            if busy and alone.rows < rows_cap[i]:
                assert pass_s(alone.rows + 1, 0, i) > threshold[i]  # the most rows


@pytest.mark.parametrize("threshold", [0.0, 1e-9])
def test_nothing_fits_a_threshold_below_any_iteration(threshold):
    assert co_batch_rows(linear(0.001, 0.001, 0.001), threshold_s=threshold, max_rows=5, max_prefill_tokens=5) == CoBatchBudget(0, 0)
