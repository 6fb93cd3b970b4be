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
