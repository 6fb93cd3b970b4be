"""The prompt mixture of multi-domain runs: largest-remainder shares and the KL-following weights."""
from __future__ import annotations

import pytest

from core.errors import UserError
from deploy.mixture import domain_shares, kl_weights

DOMAINS = ["arith", "reverse", "calc"]


def test_shares_sum_to_the_total_and_follow_the_weights():
    assert domain_shares(48, DOMAINS) == {"arith": 16, "reverse": 16, "calc": 16}
    assert domain_shares(10, DOMAINS, {"arith": 2, "reverse": 1, "calc": 1}) == {"arith": 5, "reverse": 3, "calc": 2}
    with pytest.raises(UserError, match="must be >= 0"):
        domain_shares(10, DOMAINS, {"arith": -1, "calc": 1})


def test_kl_weights_keep_the_floor_and_give_the_rest_by_kl():
    w = kl_weights(DOMAINS, {"arith": 0.3, "reverse": 0.0, "calc": 0.1}, floor=0.1)
    assert w["reverse"] == pytest.approx(0.1)
    assert w["arith"] == pytest.approx(0.1 + 0.7 * 0.75) and w["calc"] == pytest.approx(0.1 + 0.7 * 0.25)
    assert sum(w.values()) == pytest.approx(1.0)
    assert domain_shares(48, DOMAINS, w) == {"arith": 30, "reverse": 5, "calc": 13}


def test_kl_weights_are_equal_until_every_domain_has_a_kl():
    assert kl_weights(DOMAINS, {}, 0.1) == {d: 1.0 for d in DOMAINS}
    assert kl_weights(DOMAINS, {"arith": 0.5}, 0.1) == {d: 1.0 for d in DOMAINS}
    assert kl_weights(DOMAINS, {d: 0.0 for d in DOMAINS}, 0.1) == {d: 1.0 for d in DOMAINS}


def test_kl_weights_refuse_a_bad_floor_or_kl():
    with pytest.raises(UserError, match="mixture floor"):
        kl_weights(DOMAINS, {}, 0.5)
    with pytest.raises(UserError, match="not finite"):
        kl_weights(DOMAINS, {"arith": float("nan"), "reverse": 0.1, "calc": 0.1}, 0.1)


def test_domain_kl_per_token_and_per_sequence():
    from deploy.mixture import domain_kl

    teachers = [("calc:0", "calc", 1.0), ("rev:0", "reverse", 3.0), ("rev:1", "reverse", 1.0), ("ari:0", "arith", 1.0)]
    row = {"kl_calc:0": 0.005, "positions_calc:0": 1360.0, "prompts_calc": 20,
           "kl_rev:0": 0.04, "kl_rev:1": 0.0, "positions_rev:0": 160.0, "positions_rev:1": 160.0, "prompts_reverse": 20,
           "kl_ari:0": 0.001}  # arith's positions and prompts missing
    domains = ["arith", "reverse", "calc"]
    token = domain_kl(row, teachers, domains)
    assert token == pytest.approx({"arith": 0.001, "reverse": 0.03, "calc": 0.005})  # reverse: (3 x 0.04 + 0) / 4
    seq = domain_kl(row, teachers, domains, "sequence", samples_per_prompt=2)
    # calc: 68 positions per sample (1360 / 40) x 0.005; reverse: 4 per sample x 0.03; arith left out
    assert seq == pytest.approx({"reverse": 0.12, "calc": 0.17})
    full = domain_kl(row | {"positions_ari:0": 160.0, "prompts_arith": 20}, teachers, domains, "sequence", 2)
    assert full["arith"] == pytest.approx(0.004)
    assert kl_weights(domains, full, 0.1)["calc"] > 0.5 > kl_weights(domains, token, 0.1)["calc"]  # calc leads now
    assert domain_kl({}, teachers, domains, "sequence") == {}
