import torch

from rollout.sampling import SamplingParams, sample, uniform


def test_uniform_is_a_pure_function_of_its_keys():
    a = [uniform(7, 11, t) for t in range(1000)]
    assert a == [uniform(7, 11, t) for t in range(1000)]
    assert all(0.0 <= x < 1.0 for x in a)
    assert a != [uniform(8, 11, t) for t in range(1000)]
    assert abs(sum(a) / len(a) - 0.5) < 0.05


def test_draws_follow_the_distribution():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))[None].repeat(4000, 1)
    u = [uniform(1, 2, t) for t in range(4000)]
    tok, lp = sample(logits, [SamplingParams()] * 4000, u)
    freq = torch.bincount(tok, minlength=3).double() / 4000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64), atol=0.03)
    assert torch.allclose(lp, torch.log(torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64))[tok], atol=1e-6)


def test_top_k_top_p_and_greedy():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]]).repeat(500, 1)
    u = [uniform(3, 4, t) for t in range(500)]
    tok, lp = sample(logits, [SamplingParams(top_k=2)] * 500, u)
    assert set(tok.tolist()) == {1, 2}
    p = torch.softmax(torch.tensor([3.0, 2.0], dtype=torch.float64), 0)
    assert torch.allclose(lp.exp(), p[(tok == 2).long()], atol=1e-6)
    tok, _ = sample(logits, [SamplingParams(top_p=0.5)] * 500, u)
    assert set(tok.tolist()) == {1}  # the top token alone holds > 0.5 of the mass
    tok, lp = sample(logits[:1], [SamplingParams(temperature=0.0)], [0.99])
    assert tok.item() == 1 and abs(lp.item() - torch.log_softmax(logits[0], 0)[1].item()) < 1e-6


def test_a_row_does_not_depend_on_its_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 97, generator=g)
    params = [SamplingParams(temperature=0.7, top_p=0.9, top_k=20)] * 16
    u = [uniform(5, i, 9) for i in range(16)]
    tok, lp = sample(logits, params, u)
    for i in range(16):
        t1, l1 = sample(logits[i:i + 1], params[:1], u[i:i + 1])
        assert t1.item() == tok[i].item() and l1.item() == lp[i].item()


def test_mixed_filtered_and_plain_rows_are_independent():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 50, generator=g)
    params = [SamplingParams(top_k=5) if i % 2 else SamplingParams() for i in range(8)]
    u = [uniform(2, i, 3) for i in range(8)]
    tok, lp = sample(logits, params, u)
    for i in range(8):
        t1, l1 = sample(logits[i:i + 1], params[i:i + 1], u[i:i + 1])
        assert t1.item() == tok[i].item() and l1.item() == lp[i].item()
    top5 = torch.topk(logits, 5, dim=-1).indices
    assert all(tok[i].item() in top5[i].tolist() for i in range(1, 8, 2))


def test_device_uniforms_equal_the_host_function():
    """`uniform_t` (int64 splitmix64 on tensors) draws exactly `uniform`'s floats, keys with the top bit
    set and large positions included."""
    import random

    from rollout.sampling import row_hash, traj_key, uniform_t

    rng = random.Random(0)
    seeds = [0, 1, 7, (1 << 63) + 5, rng.getrandbits(64)]
    keys = [traj_key(f"t{i}") for i in range(40)] + [0, (1 << 64) - 1, 1 << 63]
    for seed in seeds:
        pos = [rng.randrange(0, 1 << 20) for _ in keys]
        got = uniform_t(torch.tensor([row_hash(seed, k) for k in keys]), torch.tensor(pos)).tolist()
        assert got == [uniform(seed, k, p) for k, p in zip(keys, pos)]


def test_dense_draw_equals_sample_on_unfiltered_rows():
    """The on-device draw (tensor params) is `sample`'s draw, greedy rows mixed in."""
    from rollout.sampling import sample_dense

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(12, 61, generator=g)
    params = [SamplingParams(temperature=[0.0, 0.7, 1.3][i % 3]) for i in range(12)]
    u = [uniform(9, i, 4) for i in range(12)]
    want_tok, want_lp = sample(logits, params, u)
    temp = torch.tensor([p.temperature for p in params], dtype=torch.float64)
    tok, lp = sample_dense(logits, temp, torch.tensor(u, dtype=torch.float64), True)
    assert torch.equal(tok, want_tok) and torch.equal(lp, want_lp)
    tok2, lp2 = sample_dense(logits[1:3], temp[1:3], torch.tensor(u[1:3], dtype=torch.float64), False)
    assert torch.equal(tok2, want_tok[1:3]) and torch.equal(lp2, want_lp[1:3])
