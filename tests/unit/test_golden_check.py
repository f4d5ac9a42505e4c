"""runtime/executors/golden.py check_golden: the warmup gate's comparison of a served engine's
teacher-forced logits with the build's golden record."""

from __future__ import annotations

from runtime.executors.golden import check_golden, golden_tolerance

# Two steps of a bf16 record: logits around 30 (tolerance 1.5e-2 * 30 = 0.45).
RECORD = {"top_logits": [[(5, 30.0), (7, 29.0), (9, 20.0)], [(3, 25.0), (4, 24.9), (1, 10.0)]],
          "tokens": [5, 3]}


def _observed(shift: dict[tuple[int, int], float]) -> list[list[tuple[int, float]]]:
    steps = []
    for i, step in enumerate(RECORD["top_logits"]):
        got = [(t, v + shift.get((i, t), 0.0)) for t, v in step]
        steps.append(sorted(got, key=lambda tv: -tv[1]))
    return steps


def test_noise_within_the_tolerance_passes_and_a_near_tie_may_flip() -> None:
    assert abs(golden_tolerance("bfloat16") * 30 - 0.45) < 1e-9
    ok, evidence = check_golden(RECORD, _observed({(0, 5): 0.2, (1, 4): 0.15}), "bfloat16")
    # step 1's recorded lead (0.1) is inside the noise: its flip is allowed
    assert ok, evidence
    assert "max logit deviation 0.2 " in evidence and "flipped" not in evidence


def test_a_deviation_beyond_the_tolerance_fails() -> None:
    ok, evidence = check_golden(RECORD, _observed({(1, 1): 0.6}), "bfloat16")
    assert not ok and "max logit deviation 0.6" in evidence


def test_a_clear_lead_that_flips_fails_even_inside_the_tolerance() -> None:
    # "5" led by 0.5 (> 0.45); each logit moves less than the tolerance, the lead is lost
    record = {"top_logits": [[(5, 30.0), (7, 29.5), (9, 20.0)]], "tokens": [5]}
    observed = [[(7, 29.9), (5, 29.6), (9, 20.0)]]  # |deviation| 0.4 <= 0.45, order flipped
    ok, evidence = check_golden(record, observed, "bfloat16")
    assert not ok and "greedy token flipped at steps [0]" in evidence


def test_bf16_tolerance_no_longer_covers_a_bf16_rounding_of_ties_far_apart() -> None:
    # the old 6e-2 of 30 (1.8 logits) let a token 1.5 logits off pass; 1.5e-2 does not
    ok, _ = check_golden(RECORD, _observed({(0, 7): 1.5}), "bfloat16")
    assert not ok
