"""Record codec: round trips (examples and properties), damage detection, token packing."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wal import codec
from wal.types import EnvInvokeRecord, EnvReleaseRecord, EnvResultRecord, FinalizeRecord, Starts, StepRecord, TokensRecord

ids = st.text(min_size=1, max_size=40).filter(lambda s: len(s.encode()) <= codec.MAX_ID_BYTES)
lsns = st.integers(0, 2**63 - 1)


@st.composite
def tokens_records(draw):
    n = draw(st.integers(0, 64))
    toks = draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n))
    lps = draw(st.lists(st.floats(allow_nan=False), min_size=n, max_size=n))
    return TokensRecord(draw(lsns), draw(ids), draw(st.integers(0, 2**63 - 1)), draw(st.integers(0, 2**63 - 1)),
                        codec.pack_tokens(toks), codec.pack_logprobs(lps, n))


@st.composite
def step_records(draw):
    traj_ids = draw(st.lists(ids, max_size=40, unique=True))
    n = len(traj_ids)
    toks = draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n))
    lps = draw(st.lists(st.floats(allow_nan=False), min_size=n, max_size=n))
    starts = draw(st.lists(st.integers(0, 2**63 - 1), min_size=n, max_size=n))
    return StepRecord(draw(lsns), draw(st.integers(0, 2**63 - 1)), tuple(traj_ids), tuple(starts),
                      codec.pack_tokens(toks), codec.pack_logprobs(lps, n))


records = st.one_of(
    tokens_records(),
    step_records(),
    st.builds(FinalizeRecord, lsns, ids),
    st.builds(EnvInvokeRecord, lsns, ids, st.integers(0, 2**63 - 1), st.binary(max_size=300)),
    st.builds(EnvResultRecord, lsns, ids, st.integers(0, 2**63 - 1), st.binary(max_size=300)),
    st.builds(EnvReleaseRecord, lsns, ids),
)


@settings(max_examples=300, deadline=None)
@given(records)
def test_roundtrip_property(rec):
    frame = codec.encode(rec)
    dec = codec.decode(frame)
    assert dec == rec
    assert codec.encode(dec) == frame
    if isinstance(rec, StepRecord):  # the packed positions recovery compares are the positions' own bytes
        assert type(dec.starts) is Starts and dec.starts.packed == codec.pack_positions(rec.starts)


@settings(max_examples=150, deadline=None)
@given(records, st.data())
def test_any_single_bit_flip_is_detected(rec, data):
    frame = bytearray(codec.encode(rec))
    bit = data.draw(st.integers(0, len(frame) * 8 - 1))
    frame[bit // 8] ^= 1 << (bit % 8)
    got, _, err = codec.read_frame(bytes(frame), 0, rec.lsn)
    assert err is not None and got is None


@settings(max_examples=100, deadline=None)
@given(st.lists(records, min_size=1, max_size=8), st.data())
def test_stream_of_frames_stops_at_truncation(recs, data):
    recs = [r._replace(lsn=i) for i, r in enumerate(recs)]
    buf = b"".join(codec.encode(r) for r in recs)
    cut = data.draw(st.integers(0, len(buf)))
    got = [r for _, r in codec.iter_frames(buf[:cut], 0, 0)]
    assert got == recs[:len(got)]
    ends = np.cumsum([len(codec.encode(r)) for r in recs])
    assert len(got) == int((ends <= cut).sum())


def test_tokens_record_example():
    frame = codec.encode_tokens(7, "traj-é", 12, 3, codec.pack_tokens([1, 2, 2**31 - 1]), codec.pack_logprobs([-0.5, -1e-9, 0.0], 3))
    rec = codec.decode(frame)
    assert rec.lsn == 7 and rec.traj_id == "traj-é" and rec.start == 12 and rec.policy_version == 3
    assert codec.unpack_tokens(rec.tokens) == [1, 2, 2**31 - 1]
    assert codec.unpack_logprobs(rec.logprobs) == [-0.5, -1e-9, 0.0]
    assert rec.n_tokens == 3


def test_lsn_mismatch_and_trailing_bytes_are_errors():
    frame = codec.encode_finalize(5, "x")
    assert codec.read_frame(frame, 0, 6)[2].startswith("lsn 5")
    with pytest.raises(codec.CodecError):
        codec.decode(frame + b"\0")


@pytest.mark.parametrize("bad", [[-1], [2**31], [1.5], "abc", [[1, 2]], b"\x01\x02"])
def test_pack_tokens_rejects_bad_input(bad):
    with pytest.raises(codec.CodecError):
        codec.pack_tokens(bad)


def test_pack_tokens_accepts_numpy_and_lists():
    assert codec.pack_tokens(np.array([1, 2], dtype=np.int64)) == codec.pack_tokens([1, 2]) == np.array([1, 2], "<i4").tobytes()
    assert codec.pack_tokens([]) == b""


def test_pack_logprobs_checks_count_and_nan():
    with pytest.raises(codec.CodecError, match="one per token"):
        codec.pack_logprobs([-0.1], 2)
    with pytest.raises(codec.CodecError, match="NaN"):
        codec.pack_logprobs([float("nan")], 1)
    with pytest.raises(codec.CodecError):
        codec.pack_logprobs(["x"], 1)


@pytest.mark.parametrize("seed", range(4))
def test_numpy_fast_paths_check_every_element(seed):
    """int32 / float64 arrays take their own path (argmin, x . x): a negative id or a NaN anywhere is
    refused; +-inf and huge log-probs (whose squares overflow) are not NaN; other dtypes and strided
    views give the same bytes as lists."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 700))
    toks = rng.integers(0, 2**31 - 1, n, dtype=np.int32)
    lps = -rng.random(n) * 10.0 ** rng.integers(0, 300)
    lps[rng.integers(n)] = -np.inf
    lps[rng.integers(n)] = np.finfo(np.float64).max
    assert codec.pack_tokens(toks) == codec.pack_tokens(toks.tolist()) == toks.astype("<i4").tobytes()
    assert codec.pack_logprobs(lps, n) == codec.pack_logprobs(lps.tolist(), n) == lps.tobytes()
    assert codec.check_packed(toks.tobytes(), lps.tobytes()) == n
    bad_t, bad_l = toks.copy(), lps.copy()
    bad_t[rng.integers(n)] = -int(rng.integers(1, 2**31))
    bad_l[rng.integers(n)] = np.nan
    with pytest.raises(codec.CodecError, match="0..2147483647"):
        codec.pack_tokens(bad_t)
    with pytest.raises(codec.CodecError, match="0..2147483647"):
        codec.pack_tokens(bad_t.tolist())
    positions = rng.integers(0, 2**40, n).tolist()
    assert codec.pack_positions(positions) == np.asarray(positions, "<i8").tobytes()
    positions[rng.integers(n)] = -1
    with pytest.raises(codec.CodecError, match=">= 0"):
        codec.pack_positions(positions)
    with pytest.raises(codec.CodecError, match="NaN"):
        codec.pack_logprobs(bad_l, n)
    with pytest.raises(codec.CodecError, match="negative"):
        codec.check_packed(bad_t.tobytes(), lps.tobytes())
    with pytest.raises(codec.CodecError, match="NaN"):
        codec.check_packed(toks.tobytes(), bad_l.tobytes())
    wide = np.concatenate([toks, toks])[::2]  # a strided view
    assert codec.pack_tokens(wide) == codec.pack_tokens(wide.tolist())


def test_encode_rejects_bad_ids_and_mismatched_payloads():
    with pytest.raises(codec.CodecError):
        codec.encode_finalize(0, "")
    with pytest.raises(codec.CodecError):
        codec.encode_finalize(0, "x" * (codec.MAX_ID_BYTES + 1))
    with pytest.raises(codec.CodecError):
        codec.encode_tokens(0, "t", 0, 0, b"\0" * 4, b"")


def test_segment_header_roundtrip_and_damage():
    head = codec.encode_segment_header(12345)
    assert codec.decode_segment_header(head) == 12345
    for i in range(len(head)):
        bad = bytearray(head)
        bad[i] ^= 0x10
        with pytest.raises(codec.CodecError):
            codec.decode_segment_header(bytes(bad))
    with pytest.raises(codec.CodecError):
        codec.decode_segment_header(head[:-1])


def test_find_valid_after_tells_torn_from_corrupt():
    frames = [codec.encode_finalize(i, f"t{i}") for i in range(4)]
    buf = b"".join(frames)
    bad = bytearray(buf)
    bad[len(frames[0]) + 9] ^= 1  # damage record 1
    off = len(frames[0])
    assert codec.find_valid_after(bytes(bad), off, 0) == off + len(frames[1])
    assert codec.find_valid_after(bytes(bad[:off + len(frames[1])]), off, 0) is None


def test_step_record_is_one_frame_equal_to_one_tokens_record_per_trajectory():
    ids = ["a", "bé", "c" * 50]
    toks, lps = codec.pack_tokens([1, 2, 3]), codec.pack_logprobs([-0.1, -0.2, -0.3], 3)
    frame = codec.encode_step_record(40, [t.encode() for t in ids], codec.pack_positions([0, 7, 9]), 5, toks, lps)
    rec = codec.decode(frame)
    assert isinstance(rec, StepRecord) and rec.n_tokens == 3
    assert rec.items() == [TokensRecord(40, t, [0, 7, 9][i], 5, toks[i * 4:i * 4 + 4], lps[i * 8:i * 8 + 8])
                           for i, t in enumerate(ids)]
    twice = codec.encode_step_record(41, [b"a", b"a"], codec.pack_positions([0, 1]), 5, toks[:8], lps[:16])
    with pytest.raises(codec.CodecError, match="twice"):  # a step names each trajectory once
        codec.decode(twice)
    with pytest.raises(codec.CodecError, match="positions"):
        codec.pack_positions([1, -2])
    with pytest.raises(codec.CodecError, match="positions"):
        codec.pack_positions([1.5])


def test_decoded_step_positions_are_a_tuple_to_every_reader():
    starts = (0, 5, 2**63 - 1)
    frame = codec.encode_step_record(3, [b"a", b"b", b"c"], codec.pack_positions(starts), 1,
                                     codec.pack_tokens([1, 2, 3]), codec.pack_logprobs([-1.0, -2.0, -3.0], 3))
    got = codec.decode(frame).starts
    assert type(got) is Starts and got.packed == codec.pack_positions(starts)
    assert got == starts and starts == got and got != (0, 5, 7) and got != list(starts)
    assert len(got) == 3 and got[1] == 5 and got[-1] == 2**63 - 1 and list(got) == list(starts) and 5 in got
    assert hash(got) == hash(starts) and repr(got) == repr(starts)
    assert got == Starts(codec.pack_positions(starts)) and got != Starts(codec.pack_positions((0, 5, 6)))


@pytest.mark.parametrize("n", [1, 3, 64, 65, 512])
def test_nan_is_refused_anywhere_and_huge_logprobs_pass_silently(n):
    import warnings

    lps = np.full(n, -1e300)  # finite: squared they overflow, which a NaN check must not trip on
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert codec.pack_logprobs(lps, n) == lps.tobytes()
        assert codec.pack_logprobs(lps.tolist(), n) == lps.tobytes()
    for at in {0, n // 2, n - 1}:
        bad = lps.copy()
        bad[at] = np.nan
        for given in (bad, bad.tolist()):
            with pytest.raises(codec.CodecError, match="NaN"):
                codec.pack_logprobs(given, n)
        with pytest.raises(codec.CodecError, match="NaN"):
            codec.check_packed(np.zeros(n, np.int32).tobytes(), bad.tobytes())
