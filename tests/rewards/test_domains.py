"""Domains: seeded disjoint splits, demonstrations that verify, verifiers on good, wrong and hostile output."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rewards
from rewards import calc, protocol
from rewards.calculator import CalcError, calculate

NAMES = rewards.domains()


def test_at_least_three_domains_one_with_tools():
    assert len(NAMES) >= 3
    assert any(rewards.domain(n).uses_tools for n in NAMES)
    with pytest.raises(KeyError, match="unknown domain 'nope'; known: arith"):
        rewards.domain("nope")


@pytest.mark.parametrize("name", NAMES)
def test_prompts_seeded_and_splits_disjoint(name):
    d = rewards.domain(name)
    assert d.prompts("train", 50, 7) == d.prompts("train", 50, 7)
    assert d.prompts("train", 50, 7) != d.prompts("train", 50, 8)
    assert set(d.prompts("train", 2000, 1)).isdisjoint(d.prompts("eval", 300, 1))
    assert set(d.prompts("train", 300, 2)).isdisjoint(d.prompts("eval", 300, 3))
    with pytest.raises(ValueError, match="unknown split"):
        d.prompts("test", 1, 0)


@pytest.mark.parametrize("name", NAMES)
def test_demonstrations_verify(name):
    d = rewards.domain(name)
    for p in d.prompts("eval", 50, 0):
        assert d.verify(p, d.demonstration(p)) == (1.0, "correct")


@pytest.mark.parametrize("name", NAMES)
def test_wrong_answers_score_below_one_with_reason(name):
    d = rewards.domain(name)
    p = d.prompts("train", 1, 0)[0]
    good = d.demonstration(p)
    wrong = good[:-1] + ("0" if good[-1] != "0" else "1")
    r, reason = d.verify(p, wrong)
    assert reason.startswith("wrong")
    if name == "calc":  # partial credit for the digits of a near-right copy of the tool's result
        answer = protocol.final_answer(good)
        assert r == pytest.approx(calc.PARTIAL_CREDIT * (len(answer) - 1) / len(answer))
    else:
        assert r == 0.0


def test_calc_partial_credit_is_positional_and_below_a_right_answer():
    d, p = rewards.domain("calc"), "mul 113*376="
    transcript = "<call>calc: 113*376</call><result>42488</result>"
    assert d.verify(p, transcript + "42488")[0] == 1.0
    assert d.verify(p, transcript + "42248")[0] == pytest.approx(0.5 * 3 / 5)  # shifted copy: 4 2 . . 8
    assert d.verify(p, transcript + "422488")[0] == pytest.approx(0.5 * 3 / 6)  # an extra digit
    assert d.verify(p, transcript + "x")[0] == 0.0
    assert calc.digit_agreement("", "1") == 0.0 and calc.digit_agreement("12", "12") == 1.0


HOSTILE = ["", " ", "\x00\x01\xff", "9" * 100_000, "<call>calc: 1</call>" * 50, "<result>", "</result>" * 3,
           "<call>calc: __import__('os').system('rm -rf /')</call><result>0</result>0",
           "<call>calc: 10**10**10</call><result>1</result>1", "\ud800", "🙂" * 10, "\n" * 5000]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("completion", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_output_scores_zero_never_raises(name, completion):
    d = rewards.domain(name)
    p = d.prompts("train", 1, 0)[0]
    r, reason = d.verify(p, completion)
    assert r == 0.0 and isinstance(reason, str) and reason


@pytest.mark.parametrize("name", NAMES)
def test_non_text_and_bad_prompt(name):
    d = rewards.domain(name)
    assert d.verify(d.prompts("train", 1, 0)[0], None)[0] == 0.0
    assert d.verify(d.prompts("train", 1, 0)[0], b"123")[0] == 0.0
    assert d.verify("what?", "1") == (0.0, "unrecognised prompt")


@given(st.text(max_size=300))
@settings(max_examples=300, deadline=None)
def test_verifiers_never_raise_on_any_text(text):
    for name in NAMES:
        d = rewards.domain(name)
        r, reason = d.verify(d.prompts("train", 1, 0)[0], text)
        assert 0.0 <= r <= 1.0 and isinstance(reason, str)


def test_calc_requires_a_call_and_a_truthful_result():
    d = rewards.domain("calc")
    p = "mul 123*456="
    assert d.verify(p, "56088") == (0.0, "no calculator call")
    forged = "<call>calc: 123*456</call><result>56088</result>56088".replace("56088</result>", "1</result>")
    assert d.verify(p, forged)[1] == "tool result does not match the calculator"
    assert d.verify(p, "<call>calc: 123*456</call><result>56088</result>56088") == (1.0, "correct")
    # a different but correct expression is fine: the verifier checks the transcript, not the wording
    assert d.verify(p, "<call>calc: 456*123</call><result>56088</result>56088")[0] == 1.0


@pytest.mark.parametrize("expr,value", [("37*41", 1517), ("(2+3)*4", 20), ("-7//2", -4), ("10%3", 1), (" 5 ", 5)])
def test_calculator_values(expr, value):
    assert calculate(expr) == value


@pytest.mark.parametrize("expr", ["", "1/0", "2**3", "10**10**10", "x", "__import__('os')", "1;2", "-" * 100 + "1",
                                  "9" * 300, "1.5*2", "'a'*3", "[1]"])
def test_calculator_refuses_with_calcerror(expr):
    with pytest.raises(CalcError):
        calculate(expr)


def test_protocol_pending_call_and_result_format():
    assert protocol.pending_call("mul 1*2=<call>calc: 1*2</call>") == protocol.Call("calc", "1*2")
    assert protocol.pending_call("<call>calc: 1*2</call><result>2</result>") is None
    assert protocol.pending_call("no call</call>") is None
    assert protocol.format_result("<evil>") == "<result>(evil)</result>"
    assert len(protocol.format_result("x" * 10_000)) < 300
