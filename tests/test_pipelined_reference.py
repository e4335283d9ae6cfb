"""The pipelined schedule (issue 12) on the serial oracle: greedy output equal
to plain decoding, every in-flight state equal to a full-sequence pass,
forced rejections at every stage, and lossless sampled verification with
second proposals."""

import numpy as np
import pytest
import torch

from vllm_loopspec.pipelined_reference import (Sampling, cascade, decode_pipelined, decode_plain,
                                               second_proposal_distribution)

from pathlib import Path

# The bundled, trained checkpoint: its loops really agree and disagree, so
# the schedule accepts, rejects and rescues (a random model only rejects).
BUNDLED = Path(__file__).resolve().parents[1] / "checkpoints" / "ouro-stdlib"
PROMPTS = ["def parse(line):\n    ", "import os\nimport sys\n\n", "The report says that"]


@pytest.fixture(scope="module")
def oracle():
    from vllm_loopspec.reference import OuroReference

    return OuroReference.from_pretrained(BUNDLED)


@pytest.fixture(scope="module")
def prompt_ids():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(BUNDLED)
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def plain_greedy(oracle, prompt_ids):
    return [decode_plain(oracle, ids, 24) for ids in prompt_ids]


def test_plain_one_token_decode_equals_the_full_sequence_oracle(oracle, prompt_ids, plain_greedy):
    assert plain_greedy[0][:12] == oracle.greedy_generate(prompt_ids[0], 12)


@pytest.mark.parametrize("d1,d2", [(1, None), (1, 2), (1, 3), (2, None), (2, 3), (3, None)])
@pytest.mark.parametrize("budget", [1, 2, 5, 24])
def test_greedy_pipelined_equals_plain_decoding(oracle, prompt_ids, plain_greedy, d1, d2, budget):
    accepted = rejected = 0
    for ids, plain in zip(prompt_ids, plain_greedy):
        out, stats = decode_pipelined(oracle, ids, budget, d1, d2)
        assert out == plain[:budget]
        assert stats.committed == budget - 1
        accepted += stats.first_accepted
        rejected += stats.committed - stats.first_accepted
    if budget == 24:
        assert accepted > 0 and rejected > 0  # both paths of the schedule ran


def test_in_flight_states_equal_a_full_sequence_pass_including_pruned_ones(oracle, prompt_ids):
    """Every state any in-flight token had, at every loop (tokens later
    pruned included), equals the oracle's full-sequence pass over the
    committed prefix and that token's chain of in-flight ancestors."""
    ids = prompt_ids[0]
    seen = {}

    def record(nodes):
        for n in nodes:
            seen[id(n)] = n

    def wrong(pos, token):  # every third first proposal is wrong: pruning happens
        return (token + 1) % oracle.config.vocab_size if pos % 3 == 0 else token

    out, stats = decode_pipelined(oracle, ids, 14, d1=1, d2=2, force_first=wrong, on_tick=record)
    assert stats.pruned_loop_passes > 0
    committed = ids + out
    checked = 0
    for node in seen.values():
        chain = []
        n = node
        while n is not None:
            chain.append(n.token)
            n = n.parent
        chain.reverse()
        # The chain starts at a token whose position is committed or the root's.
        root_pos = node.pos - len(chain) + 1
        sequence = committed[:root_pos] + chain
        trace = oracle.trace(torch.tensor(sequence))
        for loop, state in node.states.items():
            torch.testing.assert_close(state, trace.hidden[loop][0, -1], rtol=1e-4, atol=1e-4)
            checked += 1
    assert checked > 50


@pytest.mark.parametrize("stage", range(1, 6))
@pytest.mark.parametrize("d1,d2", [(1, None), (1, 2), (2, 3)])
def test_forced_rejection_at_every_stage_commits_the_right_tokens(oracle, prompt_ids, plain_greedy, stage, d1, d2):
    ids, plain = prompt_ids[1], plain_greedy[1]
    target = len(ids) + stage

    def wrong(pos, token):
        return (token + 7) % oracle.config.vocab_size if pos == target else token

    out, stats = decode_pipelined(oracle, ids, 16, d1, d2, force_first=wrong)
    assert out == plain[:16]
    assert stats.second_accepted + stats.corrections >= 1


def _chi_square_ok(counts: np.ndarray, probs: torch.Tensor) -> bool:
    from collections import Counter

    from test_loopspec_sampling import CHI2_999, chi_square

    n = int(counts.sum())
    stat, dof = chi_square(Counter({t: int(c) for t, c in enumerate(counts) if c}), probs.double(), n)
    return stat < CHI2_999[dof]


def test_cascade_verification_keeps_the_target_distribution():
    """The cascade, on synthetic distributions where both candidates are
    often rejected: the committed token follows p."""
    gen = torch.Generator().manual_seed(0)
    vocab = 6
    p = torch.tensor([0.30, 0.05, 0.25, 0.10, 0.20, 0.10])
    q1 = torch.tensor([0.05, 0.40, 0.05, 0.30, 0.10, 0.10])
    q2 = torch.tensor([0.30, 0.10, 0.30, 0.05, 0.20, 0.05])
    counts = np.zeros(vocab)
    which = np.zeros(3)
    for _ in range(20000):
        first = int(torch.multinomial(q1, 1, generator=gen))
        q2p = second_proposal_distribution(q1, q2, first)
        second = None if q2p is None else int(torch.multinomial(q2p, 1, generator=gen))
        token, w = cascade(p, first, q1, second, q2p, gen)
        counts[token] += 1
        which[w] += 1
    assert which[2] > 1000 and which[0] > 300  # both later stages really run
    assert _chi_square_ok(counts, p)
    # Power: the first candidates alone are far from p.
    assert not _chi_square_ok(np.bincount(np.random.default_rng(0).choice(vocab, 20000, p=q1.numpy()),
                                          minlength=vocab), p)


@pytest.fixture(scope="module")
def v16_oracle(tmp_path_factory):
    from test_loopspec_sampling import build_v16

    return build_v16(tmp_path_factory.mktemp("v16-pipeline"))[1]


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [Sampling(1.0), Sampling(0.8, top_k=6, top_p=0.9)],
                         ids=["T1", "T0.8-topk-topp"])
def test_sampled_pipelined_tokens_follow_the_target(v16_oracle, sampling):
    """With second proposals on (16-token model, so that the chi-square has
    power), the second and third new tokens (the first verification, and
    one made by a candidate that kept its progress) follow the target
    distribution of plain decoding."""
    oracle = v16_oracle
    ids, first = [3, 1, 4, 1, 5], 9
    gen = torch.Generator().manual_seed(1)
    seconds, thirds, second_wins = [], [], 0
    for _ in range(2000):
        out, stats = decode_pipelined(oracle, ids, 3, d1=1, d2=2, sampling=sampling, generator=gen,
                                      first_token=first)
        seconds.append(out[1])
        thirds.append(out[2])
        second_wins += stats.second_accepted
    assert second_wins > 50  # the second proposal really decides tokens
    with torch.no_grad():
        p1 = sampling.probs(oracle.lm_head(oracle.trace(torch.tensor(ids + [first])).hidden[-1][0, -1]))
        common = max(set(seconds), key=seconds.count)
        p2 = sampling.probs(oracle.lm_head(oracle.trace(torch.tensor(ids + [first, common])).hidden[-1][0, -1]))
    assert _chi_square_ok(np.bincount(seconds, minlength=p1.numel()), p1)
    given = [t for s, t in zip(seconds, thirds) if s == common]
    assert len(given) > 200
    assert _chi_square_ok(np.bincount(given, minlength=p2.numel()), p2)
