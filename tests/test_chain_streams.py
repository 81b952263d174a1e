"""The chains of one seed are one MRP under every feature kind, and the default kind's draws are those recorded before the
change that made them so (issue 18): P, r, d_pi and v_pi never depend on `features`; features come from a block every kind reads."""
import hashlib
from types import SimpleNamespace
import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st
from ictd.boyan import FEATURES, random_boyan_chain, sample_trajectory, chain_from_uniforms, transitions_from_uniforms
from ictd.tasks import random_tasks, sample_trajectories, task_pool

pytestmark = pytest.mark.unit

def h(x):
    "The first 12 hex digits of the sha256 of an array's float64/int64 bytes."
    x = x.cpu().numpy() if torch.is_tensor(x) else np.asarray(x)
    return hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()[:12]

# sha256 prefixes of (P, r, phi) -- (states, rewards) for trajectories -- recorded at commit 99c6c77, before the change:
# chain/<features>/<rewards>/<n_states>/<d>/<seed>, pool/<features>/<d>/<seed> (32 tasks of PretrainConfig(features, d)),
# traj/<seed>/<start> (50 steps of random_boyan_chain(seed=3)), trajs/<seed> (50 steps of random_tasks(8, seed=3)).
# pool/* and trajs/* were re-recorded when batches moved from consecutive seeds to child streams (`task_rng`, issue 22):
# they now guard that convention; chain/* and traj/* are unchanged since 99c6c77.
RECORDED = {
    'chain/random/random/10/4/0': 'a043ebf1db46a9b3c72b054c833baffafa45',
    'chain/random/random/10/4/1': '5b804868d098cf7bf78f56b46579cf1437e3',
    'chain/random/random/10/4/123': 'd0585768b45ada8c59bf8806fd927cbe0c32',
    'chain/random/random/10/4/7': '74d7655c58f08465b91766a971fb1e784829',
    'chain/random/random/2/1/0': 'c035de922752fe35216daf6097bdee052c2f',
    'chain/random/random/2/1/1': '94c6c6c29f52915b26bd8ed7a853c2480da2',
    'chain/random/random/2/1/123': 'ca6e0aeefc0a57c9775f41e033d60ffdcfd3',
    'chain/random/random/2/1/7': 'f3fb946567eff647988e6152abc5aa896af7',
    'chain/random/random/20/8/0': '9b85314b56e67b521c95a731caf3224e4e7d',
    'chain/random/random/20/8/1': 'b7ad73cc8eefb936401a0ecdb508a4b44f01',
    'chain/random/random/20/8/123': '7f6ac3305d1166440630c99d99cb2137c0ed',
    'chain/random/random/20/8/7': 'fe06e6944c90ea3abee056a6da6132389bb4',
    'chain/random/random/5/3/0': 'd9cae02afbae1b4e8bed9be73a9e9ee819af',
    'chain/random/random/5/3/1': 'd2a66a7d0482ea3831c2a8baf55e2f87ae61',
    'chain/random/random/5/3/123': '7053f358997274be66c6be73cd0d7332e6ee',
    'chain/random/random/5/3/7': '04597a8ada86927b68ceab080340ebe50468',
    'chain/random/representable/10/4/0': 'a043ebf1db46e2ad6bd45cd8833baffafa45',
    'chain/random/representable/10/4/1': '5b804868d098c18ceb228b5f6579cf1437e3',
    'chain/random/representable/10/4/123': 'd0585768b45a46cd596e5e4efd927cbe0c32',
    'chain/random/representable/10/4/7': '74d7655c58f043ab8a1f4f9871fb1e784829',
    'chain/random/representable/2/1/0': 'c035de922752d25565210cc297bdee052c2f',
    'chain/random/representable/2/1/1': '94c6c6c29f52e9686160b5e3a853c2480da2',
    'chain/random/representable/2/1/123': 'ca6e0aeefc0ae5c5606bdf3633d60ffdcfd3',
    'chain/random/representable/2/1/7': 'f3fb946567ef77a54611ab04abc5aa896af7',
    'chain/random/representable/20/8/0': '9b85314b56e6bb31475076accaf3224e4e7d',
    'chain/random/representable/20/8/1': 'b7ad73cc8eef9b1d871ff9a0b508a4b44f01',
    'chain/random/representable/20/8/123': '7f6ac3305d1182a12f0ae0f499cb2137c0ed',
    'chain/random/representable/20/8/7': 'fe06e6944c906a7ab6caaeb0da6132389bb4',
    'chain/random/representable/5/3/0': 'd9cae02afbae1233552c57543a9e9ee819af',
    'chain/random/representable/5/3/1': 'd2a66a7d0482c3f0658a1a53f55e2f87ae61',
    'chain/random/representable/5/3/123': '7053f3589972ee8858a57f4acd0d7332e6ee',
    'chain/random/representable/5/3/7': '04597a8ada86e46ae7cdbc9e0340ebe50468',
    'chain/unit/random/10/4/0': 'a043ebf1db46a9b3c72b054c166aa1906877',
    'chain/unit/random/10/4/1': '5b804868d098cf7bf78f56b441e998ac72a9',
    'chain/unit/random/10/4/123': 'd0585768b45ada8c59bf880637dd99a32308',
    'chain/unit/random/10/4/7': '74d7655c58f08465b91766a912c5c234de04',
    'chain/unit/random/2/1/0': 'c035de922752fe35216daf60e077172409ed',
    'chain/unit/random/2/1/1': '94c6c6c29f52915b26bd8ed7723f1c3eac1d',
    'chain/unit/random/2/1/123': 'ca6e0aeefc0a57c9775f41e0e077172409ed',
    'chain/unit/random/2/1/7': 'f3fb946567eff647988e6152b74fce6cd8bc',
    'chain/unit/random/20/8/0': '9b85314b56e67b521c95a7315e6c39dc5f6a',
    'chain/unit/random/20/8/1': 'b7ad73cc8eefb936401a0ecd108d545fdad6',
    'chain/unit/random/20/8/123': '7f6ac3305d1166440630c99da5b65d304cdf',
    'chain/unit/random/20/8/7': 'fe06e6944c90ea3abee056a671bc07d20d3f',
    'chain/unit/random/5/3/0': 'd9cae02afbae1b4e8bed9be75da6dd26b600',
    'chain/unit/random/5/3/1': 'd2a66a7d0482ea3831c2a8badc1c8a4959bf',
    'chain/unit/random/5/3/123': '7053f358997274be66c6be73074d09a45336',
    'chain/unit/random/5/3/7': '04597a8ada86927b68ceab08f3f7cd8fd8de',
    'chain/unit/representable/10/4/0': 'a043ebf1db46845fc839cfc9166aa1906877',
    'chain/unit/representable/10/4/1': '5b804868d09875e4942293ae41e998ac72a9',
    'chain/unit/representable/10/4/123': 'd0585768b45afb58c9ec331a37dd99a32308',
    'chain/unit/representable/10/4/7': '74d7655c58f014b5a6d6115012c5c234de04',
    'chain/unit/representable/2/1/0': 'c035de922752f584464cc47be077172409ed',
    'chain/unit/representable/2/1/1': '94c6c6c29f524ccf10591c68723f1c3eac1d',
    'chain/unit/representable/2/1/123': 'ca6e0aeefc0ab23af63a169ae077172409ed',
    'chain/unit/representable/2/1/7': 'f3fb946567efd3fdda1830e3b74fce6cd8bc',
    'chain/unit/representable/20/8/0': '9b85314b56e6b237b62040bf5e6c39dc5f6a',
    'chain/unit/representable/20/8/1': 'b7ad73cc8eef2c90b1f26777108d545fdad6',
    'chain/unit/representable/20/8/123': '7f6ac3305d11e22748affb33a5b65d304cdf',
    'chain/unit/representable/20/8/7': 'fe06e6944c9073692803deb871bc07d20d3f',
    'chain/unit/representable/5/3/0': 'd9cae02afbaecb93198a15da5da6dd26b600',
    'chain/unit/representable/5/3/1': 'd2a66a7d0482e7aa69bcc4acdc1c8a4959bf',
    'chain/unit/representable/5/3/123': '7053f35899725424d17d9380074d09a45336',
    'chain/unit/representable/5/3/7': '04597a8ada86a9cf6dc1f75df3f7cd8fd8de',
    'pool/random/10/0': '510c235e67d17e45f83494144d12e51882b5',
    'pool/random/10/1000003': 'bc29653960972919061944eed62281242591',
    'pool/random/10/7': '34e858fe01902c476fa545184d2acf64f1c5',
    'pool/random/4/0': '510c235e67d1247e511338bd746567b1ab50',
    'pool/random/4/1000003': 'bc2965396097cb711f24d27798e584fe3a8a',
    'pool/random/4/7': '34e858fe019068b920d6ac8365eee07e45fc',
    'pool/unit/10/0': '510c235e67d17e45f83494149696bb7bb6c1',
    'pool/unit/10/1000003': 'bc29653960972919061944eed92ecf66530c',
    'pool/unit/10/7': '34e858fe01902c476fa545188cd567277086',
    'pool/unit/4/0': '510c235e67d1247e511338bdd1322bfa34e8',
    'pool/unit/4/1000003': 'bc2965396097cb711f24d27757e2c8cbb4dd',
    'pool/unit/4/7': '34e858fe019068b920d6ac838446fb5b7f78',
    'traj/0/2': 'd81a7df26d364087a71b9d29',
    'traj/0/stationary': '5f2a911e2f28ad4bf56055b8',
    'traj/0/uniform': '5f2a911e2f28ad4bf56055b8',
    'traj/5/2': 'f9a8636bf7d5a51718badbaf',
    'traj/5/stationary': '9f42e6cec3bcb5a4f48d06c1',
    'traj/5/uniform': '2f3289783508840ef2320849',
    'trajs/0': 'a5a058ccdb2c',
    'trajs/5': 'a7540fc308b9',
}



@pytest.mark.parametrize("key", [k for k in RECORDED if k.startswith("chain/")])
def test_chain_draws_unchanged(key):
    "Random- and unit-feature chains (both reward kinds) are bit-identical to the draws recorded before the change."
    _, features, rewards, s, d, seed = key.split("/")
    m = random_boyan_chain(int(s), int(d), gamma=0.9, features=features, rewards=rewards, seed=int(seed))
    assert h(m.P) + h(m.r) + h(m.phi) == RECORDED[key]

@pytest.mark.parametrize("key", [k for k in RECORDED if k.startswith("pool/")])
def test_pool_draws_unchanged(key):
    "The training pools of random and unit features (default PretrainConfig task settings) are bit-identical to the recorded ones."
    _, features, d, seed = key.split("/")
    b = task_pool(SimpleNamespace(n_states=10, d=int(d), gamma=0.9, features=features), 32, int(seed))
    assert h(b.P) + h(b.r) + h(b.phi) == RECORDED[key]

def test_trajectory_draws_unchanged():
    "Both trajectory samplers still draw the recorded streams."
    m, tb = random_boyan_chain(seed=3), random_tasks(8, seed=3)
    for seed in (0, 5):
        for start in ("stationary", "uniform", 2):
            S, R = sample_trajectory(m, n=50, seed=seed, start=start)
            assert h(S) + h(R) == RECORDED[f"traj/{seed}/{start}"]
        assert h(sample_trajectories(tb.P, tb.d_pi, n=50, seed=seed)) == RECORDED[f"trajs/{seed}"]

def test_default_chain_literal_values():
    "A few entries of the default chain of seed 0, exactly (the predecessor's generator's values, recorded before the change)."
    m = random_boyan_chain(seed=0)
    assert m.P[0, 1].item() == float.fromhex("0x1.44b8ce30fcbabp-1")
    assert m.phi[0, 0].item() == float.fromhex("-0x1.9a30a6ff5b578p-2")
    assert m.r[:3].tolist() == [float.fromhex(x) for x in ("-0x1.13d2875d2dbacp-1", "-0x1.cabaed94ee952p-1", "-0x1.86f4a666e0e50p-3")]

def assert_same_mrp_but_phi(chains):
    "P, r, d_pi and v_pi equal bit for bit across the chains; unit features are the random ones normalised; one-hot are I."
    ref = chains["random"]
    for kind, m in chains.items():
        for k in ("P", "r", "d_pi", "v_pi"): assert torch.equal(getattr(m, k), getattr(ref, k)), (kind, k)
    phi = ref.phi.numpy()
    assert np.array_equal(chains["unit"].phi.numpy(), phi / np.linalg.norm(phi, axis=-1, keepdims=True))
    assert torch.equal(chains["onehot"].phi, torch.eye(ref.P.shape[-1], dtype=torch.float64).expand_as(chains["onehot"].phi))

@pytest.mark.parametrize("s,d", [(10, 4), (5, 3), (20, 8), (2, 1), (10, 10)])
def test_kinds_share_the_mrp(s, d):
    "For several seeds and sizes, every feature kind of one seed is the same MRP; only phi differs."
    for seed in range(12):
        assert_same_mrp_but_phi({f: random_boyan_chain(s, d, gamma=0.9, features=f, rewards="random", seed=seed) for f in FEATURES})

def test_pools_share_the_mrp_and_match_random_tasks():
    "The batched pool of each kind shares P, r, d_pi, v_pi with the other kinds, and equals `random_tasks` task by task."
    for s, d in ((10, 4), (6, 2)):
        pools = {f: task_pool(SimpleNamespace(n_states=s, d=d, gamma=0.9, features=f), 16, 1_000_003) for f in FEATURES}
        assert_same_mrp_but_phi(pools)
        for f, pool in pools.items():
            slow = random_tasks(16, seed=1_000_003, n_states=s, d=d, features=f)
            for k in ("P", "r", "phi", "v_pi"): assert torch.equal(getattr(pool, k), getattr(slow, k)), (f, k)
            torch.testing.assert_close(pool.d_pi, slow.d_pi, rtol=0, atol=1e-14)

def test_representable_rewards_share_P():
    "Representable rewards depend on phi by construction (v = phi w), but P and d_pi are still shared across kinds."
    chains = [random_boyan_chain(8, 3, gamma=0.9, features=f, rewards="representable", seed=4) for f in FEATURES]
    for m in chains[1:]: assert torch.equal(m.P, chains[0].P) and torch.equal(m.d_pi, chains[0].d_pi)

@given(seed=st.integers(0, 2**32 - 1), s=st.integers(2, 25), d=st.integers(1, 12))
def test_kinds_share_the_mrp_property(seed, s, d):
    "Property: for any seed, number of states and feature dimension, the kinds of one seed are one MRP."
    assert_same_mrp_but_phi({f: random_boyan_chain(s, d, gamma=0.5, features=f, rewards="random", seed=seed) for f in FEATURES})

@given(seed=st.integers(0, 2**32 - 1), s=st.integers(2, 12), d=st.integers(1, 5), T=st.integers(1, 4))
def test_batched_uniforms_equal_single(seed, s, d, T):
    "Property: `chain_from_uniforms` on a batch equals it on each row (one implementation serves chains and pools)."
    u = np.random.default_rng(seed).random((T, 2 * s - 2 + s * d))
    for f in FEATURES:
        P, phi = chain_from_uniforms(u, s, d, f)
        for b in range(T):
            Pb, phib = chain_from_uniforms(u[b], s, d, f)
            assert np.array_equal(P[b], Pb) and np.array_equal(phi[b], phib)

def test_bad_uniforms():
    "Wrongly sized uniforms and unknown kinds are refused with a ValueError naming the argument."
    with pytest.raises(ValueError, match="`u` must have last dimension"): chain_from_uniforms(np.zeros(5), 3, 2, "random")
    with pytest.raises(ValueError, match="`features` must be one of"): chain_from_uniforms(np.zeros(10), 3, 2, "cubic")
    with pytest.raises(ValueError, match="`u` must have last dimension"): transitions_from_uniforms(np.zeros(3), 3)

def test_side_by_side_draws_identical_contexts():
    "Chapter 7's side-by-sides draw one-hot and random-feature tasks and contexts with the same seeds: they get the same chains and the same trajectories."
    for b in range(10):
        a, o = (random_boyan_chain(features=f, seed=b) for f in ("random", "onehot"))
        for x, y in zip(sample_trajectory(a, n=200, seed=b), sample_trajectory(o, n=200, seed=b)): assert torch.equal(x, y)
    ta, to = (random_tasks(20, seed=100_000, features=f) for f in ("random", "onehot"))
    assert torch.equal(sample_trajectories(ta.P, ta.d_pi, n=100, seed=100_000), sample_trajectories(to.P, to.d_pi, n=100, seed=100_000))
