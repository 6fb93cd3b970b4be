"""The pool injector's kill gating (pure, on a scripted pool): a kill waits for a warm spare that no earlier
kill is due, counting kills whose death the pool has not seen yet; with mid_decode, for a worker whose
requests have shown committed positions."""
from chaos.pool_faults import PoolInjector
from chaos.schedule import Fault


class ScriptedPool:
    """The hooks PoolInjector uses, moved by hand: two workers, each holding a request, and `spares` spares."""

    def __init__(self, spares: int):
        self.slots = [0, 1]
        self.spares, self.warm = spares, spares
        self.inc = {0: 1, 1: 1}
        self.boot: set[int] = set()
        self.killed: list[int] = []
        self.committed = {"t0": 1, "t1": 1}  # positions each request's stream has shown

    # hooks
    def in_flight(self, k):
        return [] if k in self.boot else [f"t{k}"]

    def incarnation(self, k):
        return self.inc[k]

    def starting(self, k):
        return k in self.boot

    def warm_spares(self):
        return self.warm

    def kill(self, k):
        self.killed.append(k)

    def seen(self, traj):
        return self.committed[traj]

    def finished(self, traj):
        return False

    # what the real pool does once Ray reports a death, and once the spare is up
    def sees_death(self, k):
        self.boot.add(k)
        self.warm -= 1

    def replaced(self, k):
        self.boot.discard(k)
        self.inc[k] += 1


def test_a_kill_waits_for_a_spare_no_earlier_unseen_kill_is_due():
    pool = ScriptedPool(spares=2)
    inj = PoolInjector([Fault("actor_kill", 0, 0), Fault("actor_kill", 1, 0), Fault("actor_kill", 0, 0)],
                       wait_for_spare=True)
    inj(pool)
    inj(pool)  # the pool has seen neither death: two spares, one due to the first kill, one free
    assert pool.killed == [0, 1]
    pool.sees_death(0)
    pool.replaced(0)  # worker 0 runs again on a spare; worker 1's death not seen yet
    inj(pool)  # one warm spare left, and it is worker 1's: the third kill waits
    assert pool.killed == [0, 1] and inj.spare_waits == 1
    pool.sees_death(1)  # the pool takes that spare for worker 1: none warm
    inj(pool)
    assert pool.killed == [0, 1] and inj.spare_waits == 2
    pool.replaced(1)
    pool.warm += 1  # a spare has warmed
    inj(pool)
    assert pool.killed == [0, 1, 0] and inj.injected == 3


def test_without_spares_or_the_wait_a_kill_fires_at_once():
    for spares, wait in ((0, True), (2, False)):
        pool = ScriptedPool(spares=spares)
        inj = PoolInjector([Fault("actor_kill", 0, 0), Fault("actor_kill", 1, 0), Fault("actor_kill", 0, 0)],
                           wait_for_spare=wait)
        inj(pool)
        inj(pool)
        pool.sees_death(0)
        pool.replaced(0)
        inj(pool)
        assert pool.killed == [0, 1, 0] and inj.spare_waits == 0


def test_mid_decode_waits_for_a_worker_that_has_shown_committed_tokens():
    """A worker slow to start shows nothing while the gap's rounds pass on the other: the fault meant for it
    moves to a worker mid-decode, and waits while none is."""
    pool = ScriptedPool(spares=0)
    pool.committed = {"t0": 0, "t1": 0}
    inj = PoolInjector([Fault("actor_kill", 0, 1)], mid_decode=True)
    inj(pool)  # the gap
    inj(pool)
    assert pool.killed == [] and inj.injected == 0  # nothing committed anywhere yet: it waits
    pool.committed["t1"] = 3
    inj(pool)
    assert pool.killed == [1] and inj.events[0].trajectories == {"t1": 3}
    pool = ScriptedPool(spares=0)
    pool.committed = {"t0": 0, "t1": 0}
    inj = PoolInjector([Fault("actor_kill", 0, 0)])
    inj(pool)
    assert pool.killed == [0]  # without it, the fault fires on the first worker holding requests
