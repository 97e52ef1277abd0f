"""bench-spec's configurations, its natural-text filter and the keys it derives from a sweep."""

from __future__ import annotations

import pytest

from bench.spec import TREES, is_fixed, loops, pipelined_keys, repetition_rate, spec_configs, wan_keys


def test_repetition_rate_counts_answers_that_loop():
    looping = [1, 2, 3, 4] * 4  # the 4-gram 1 2 3 4 four times
    natural = list(range(16))
    assert loops(looping) and not loops(natural)
    assert repetition_rate([looping, natural]) == 0.5
    assert repetition_rate([natural, [1, 2, 3, 4] * 3]) == 0.0  # three times is allowed


def test_every_source_gets_chains_trees_and_both_adaptive_modes():
    configs = spec_configs(("ngram", "feature"), (5,))
    assert configs["plain"] == ("none", 0, "off")
    for source in ("ngram", "feature"):
        assert configs[f"{source}-k5"] == (source, 5, "off")
        assert configs[f"{source}-chain-auto"] == (source, 0, "off")
        assert configs[f"{source}-auto"] == (source, 0, "auto")
        assert all(configs[f"{source}-tree{shape}"] == (source, 0, shape) for shape in TREES)
    fixed = {n for n, c in configs.items() if is_fixed(c)}
    assert fixed == {f"{s}-{x}" for s in ("ngram", "feature") for x in ("k5", *(f"tree{t}" for t in TREES))}
    # stages that verify no trees (paged at the default precision): tree=auto drafts chains there, so
    # adaptive K is measured once, beside the fixed chains
    chains = spec_configs(("ngram",), (5,), trees=False)
    assert set(chains) == {"plain", "ngram-k5", "ngram-auto"}


def _point(stages, delay, ngram, feature):
    def source(best, best_fixed, over_fixed, over_plain):
        return {
            "best": best,
            "best_fixed": best_fixed,
            "adaptive_over_best_fixed": over_fixed,
            "adaptive_over_plain": over_plain,
        }

    def row(speedup, per_traversal, by_kind):
        return {
            "speedup": speedup,
            "speedup_ci95": [speedup, speedup],
            "tokens_per_verify": per_traversal,
            "tok_s_by_kind": by_kind,
            "tokens_per_traversal_by_kind": {"chat": per_traversal, "code": (per_traversal or 0) + 1},
        }

    configs = {
        "plain": row(1.0, None, {"chat": 2.0, "code": 4.0}),
        "ngram-k5": row(ngram, 1.5, {"chat": 2.0 * ngram, "code": 4.0}),
        "feature-auto": row(feature, 2.5, {"chat": 3.0, "code": 4.0 * feature}),
    }
    return {
        "stages": stages,
        "delay_ms": delay,
        "configs": configs,
        "ngram": source("ngram-k5", "ngram-k5", 0.97, 1.1),
        "feature": source("feature-auto", "feature-k5", 1.02, 0.93),
    }


def test_wan_keys_take_each_sources_best_at_100ms_and_the_worst_adaptive_point():
    wan = {"3s-0ms": _point(3, 0.0, 1.0, 1.1), "3s-100ms": _point(3, 100.0, 1.4, 2.2)}
    keys = wan_keys(wan, "ngram", ("feature",))
    assert keys["speedup_at_100ms"] == 1.4 and keys["tokens_per_traversal_at_100ms"] == 1.5
    assert keys["feature_speedup_at_100ms"] == 2.2 and keys["feature_tokens_per_traversal_at_100ms"] == 2.5
    assert keys["adaptive_vs_best_fixed_min"] == pytest.approx(0.97)
    assert keys["adaptive_over_plain_min"] == pytest.approx(0.93)
    without = wan_keys(wan, "ngram", ())
    assert "feature_speedup_at_100ms" not in without and without["adaptive_over_plain_min"] == pytest.approx(
        1.1
    )


def test_pipelined_keys_take_the_best_source_at_100ms_per_kind_and_the_batch():
    wan = {"3s-0ms": _point(3, 0.0, 1.0, 1.1), "3s-100ms": _point(3, 100.0, 1.4, 2.2)}
    keys = pipelined_keys(wan, ("ngram", "feature"))
    assert keys["pipelined_speedup_at_100ms"] == 2.2 and keys["pipelined_source_at_100ms"] == "feature-auto"
    assert keys["best_tokens_per_traversal_at_100ms"] == 2.5
    assert keys["by_kind_at_100ms"]["ngram"]["speedup"] == {"chat": pytest.approx(1.4), "code": 1.0}
    assert keys["by_kind_at_100ms"]["feature"]["speedup"] == {"chat": 1.5, "code": pytest.approx(2.2)}
    assert keys["by_kind_at_100ms"]["feature"]["tokens_per_traversal"] == {"chat": 2.5, "code": 3.5}
    assert "batch8_spec_over_plain_at_100ms" not in keys  # no batch measured at that point
    batch = {"spec_over_plain": 1.3, "spec_over_plain_ci95": [1.1, 1.5], "source": "feature"}
    batch |= {"steady_spec_over_plain": 1.6, "steady_spec_over_plain_ci95": [1.2, 1.9]}
    wan["3s-100ms"]["batch"] = batch
    keys = pipelined_keys(wan, ("ngram",))
    assert keys["pipelined_speedup_at_100ms"] == 1.4 and keys["batch8_spec_over_plain_at_100ms"] == 1.3
    assert keys["batch8_steady_spec_over_plain_at_100ms"] == 1.6
    assert pipelined_keys({"3s-0ms": wan["3s-0ms"]}, ("ngram",)) == {}


def test_steady_tok_s_counts_every_users_tokens_until_the_first_one_finishes():
    from bench.spec import UserRound, steady_tok_s
    from pipeshard.clients.client import GenerateResult

    fast = UserRound([(0.5, 1), (1.0, 4), (2.0, 5)], GenerateResult())  # done at 2 s
    slow = UserRound([(0.5, 1), (1.5, 1), (2.5, 1), (4.0, 7)], GenerateResult())
    assert steady_tok_s([fast, slow]) == (10 + 2) / 2.0  # slow's tokens by 2 s only
    assert fast.finished_s == 2.0 and slow.tokens_by(2.5) == 3
