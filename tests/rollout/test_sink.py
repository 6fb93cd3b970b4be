"""The data-plane sink: metadata and heavy fields land, loss mask and log-probs as the WAL had them, and a
repeated put (a worker died before its WAL finalize) stores nothing twice."""
import numpy as np

from rollout.sink import DataPlaneSink
from rollout.types import ENV_LOGPROB, Finished


def _fin(i):
    toks = [5, 6, 7, 8, 9, 10]
    lps = [ENV_LOGPROB, ENV_LOGPROB, -0.5, -1.5, ENV_LOGPROB, -0.25]
    return Finished(f"t{i}", "calc", "p", toks, lps, [0, 0, 1, 1, 1, 2], 2, "x", 1.0, "correct", "eos")


def test_put_is_idempotent_and_keeps_masks(tmp_path):
    sink = DataPlaneSink(str(tmp_path / "c.db"), str(tmp_path / "store"), run="r")
    assert sink.put([_fin(0), _fin(1)]) == 2
    assert sink.put([_fin(1), _fin(2)]) == 1
    sink.close()
    sink = DataPlaneSink(str(tmp_path / "c.db"), str(tmp_path / "store"), run="r")  # a restarted pool
    assert sink.put([_fin(2)]) == 0
    sel = sink.dp.select(run="r")
    assert sorted(sel.ids.tolist()) == ["t0", "t1", "t2"]
    assert sel.policy_min.tolist() == [1, 1, 1] and sel.policy_max.tolist() == [2, 2, 2]
    plan = sink.dp.plan(sel, tokens_per_rank=64, ranks=1, seed=0)
    batch = next(iter(sink.dp.loader(plan)))
    mask = np.asarray(batch.loss_mask).reshape(-1)[:6].tolist()
    assert mask == [0, 0, 1, 1, 0, 1]
    sink.close()
