"""Sampled loopspec keeps the target distribution, and seeds replay.

Statistical test: a 16-token model, draft with 1 of 4 loops (so the draft
distribution q is far from the target p and rejections with residual
resampling are frequent), 4000 independent sampled continuations of 3 tokens.
Tokens 2 and 3 come from speculative rounds. Their empirical marginals are
compared with the exact marginals enumerated with the oracle (chi-square
goodness of fit, cells with expected count < 5 merged, rejected at
p < 0.001). The same test must reject the draft-only (q) marginal, which
shows it has the power to catch a verifier that leaks q."""

from collections import Counter

import pytest
import torch
from vllm import SamplingParams

from conftest import make_llm
from engine_access import model_runner

PROMPT = [3, 1, 4, 1, 5]
DRAWS = 4000
# chi-square 0.999 quantiles by degrees of freedom
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88,
            10: 29.59, 11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70}

SETTINGS = {
    "temperature": dict(temperature=1.0),
    "top_k_top_p": dict(temperature=0.8, top_k=6, top_p=0.9),
}


@pytest.fixture(scope="module")
def v16(tmp_path_factory):
    return build_v16(tmp_path_factory.mktemp("v16"))


def build_v16(directory):
    """A 16-token checkpoint with softened logits, and its oracle."""
    from vllm_loopspec.reference import OuroReference
    from vllm_loopspec.tools.make_checkpoint import make_checkpoint

    path = make_checkpoint(directory / "tiny-v16", preset="tiny-v16", seed=3)
    # Soften the random logits so that many tokens have real probability.
    oracle = OuroReference.from_pretrained(path)
    with torch.no_grad():
        oracle.lm_head.weight.mul_(0.35)
    oracle.save_pretrained(path)
    return path, OuroReference.from_pretrained(path)


@pytest.fixture(scope="module")
def v16_llm(v16):
    llm = make_llm(v16[0], {"method": "loopspec", "num_speculative_tokens": 2, "draft_loops": 1, "adaptive": False},
                   skip_tokenizer_init=True, max_num_seqs=256, max_num_batched_tokens=2048)
    return llm


def processed(logits: torch.Tensor, temperature: float, top_k=None, top_p=None) -> torch.Tensor:
    """Target processing as vLLM applies it: temperature, then top-k, then top-p."""
    logits = logits.double() / temperature
    if top_k is not None:
        kth = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if top_p is not None:
        sorted_p, order = probs.sort()  # ascending, as vLLM's top-p masks the low tail
        tail = sorted_p.cumsum(-1) <= 1 - top_p
        tail[-1] = False
        mask = torch.zeros_like(tail)
        mask[order] = tail
        probs = probs.masked_fill(mask, 0)
        probs = probs / probs.sum()
    return probs


@torch.no_grad()
def exact_marginals(oracle, loop: int, **proc) -> tuple[torch.Tensor, torch.Tensor]:
    """Marginal distributions of output tokens 2 and 3 when every token is
    drawn from loop ``loop``'s processed distribution."""
    def dist(seq):
        return processed(oracle.loop_logits(torch.tensor(seq))[loop - 1][0, -1], **proc)

    v = oracle.config.vocab_size
    p1 = dist(PROMPT)
    m2, m3 = torch.zeros(v, dtype=torch.float64), torch.zeros(v, dtype=torch.float64)
    for t1 in range(v):
        if p1[t1] == 0:
            continue
        p2 = dist(PROMPT + [t1])
        m2 += p1[t1] * p2
        for t2 in range(v):
            if p2[t2] == 0:
                continue
            m3 += p1[t1] * p2[t2] * dist(PROMPT + [t1, t2])
    return m2, m3


def chi_square(counts: Counter, probs: torch.Tensor, n: int) -> tuple[float, int]:
    expected = (probs * n).tolist()
    cells, pooled_obs, pooled_exp = [], 0.0, 0.0
    for tok, e in enumerate(expected):
        if e >= 5:
            cells.append((counts.get(tok, 0), e))
        else:
            pooled_obs += counts.get(tok, 0)
            pooled_exp += e
    if pooled_exp > 0:
        cells.append((pooled_obs, max(pooled_exp, 1e-9)))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return stat, len(cells) - 1


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_sampled_loopspec_recovers_target_distribution(v16, v16_llm, setting):
    check_target_marginals(v16_llm, v16[1], SETTINGS[setting], power_check=True)


def check_target_marginals(llm, oracle, proc: dict, power_check: bool = False) -> None:
    """Tokens 2 and 3 of DRAWS sampled continuations follow the target's
    exact marginals (chi-square); with ``power_check`` the same test must
    reject the draft distribution's."""
    params = SamplingParams(max_tokens=3, ignore_eos=True, detokenize=False, **proc)
    stats = model_runner(llm).drafter.stats
    drafted_before = stats.drafted_tokens
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * DRAWS, params, use_tqdm=False)
    seqs = [list(o.outputs[0].token_ids) for o in outs]
    assert all(len(s) == 3 for s in seqs)
    drafted = stats.drafted_tokens - drafted_before
    assert drafted >= DRAWS, "the continuations were not speculated"
    target2, target3 = exact_marginals(oracle, loop=4, **proc)
    for position, target in ((1, target2), (2, target3)):
        counts = Counter(s[position] for s in seqs)
        stat, dof = chi_square(counts, target, DRAWS)
        assert stat < CHI2_999[dof], f"token {position + 1}: chi2={stat:.1f} dof={dof}"
    if power_check:  # the draft distribution is clearly distinguishable
        draft2, _ = exact_marginals(oracle, loop=1, **proc)
        stat_q, dof_q = chi_square(Counter(s[1] for s in seqs), draft2, DRAWS)
        assert stat_q > 3 * CHI2_999[dof_q], "test cannot tell q from p; make them differ more"


def test_seeded_requests_replay_exactly(v16_llm):
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=s, ignore_eos=True, detokenize=False)
              for s in (11, 12, 13)]
    prompt = {"prompt_token_ids": PROMPT}

    def run(order, filler):
        reqs = [prompt] * (len(order) + filler)
        ps = [params[i] for i in order] + [SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True,
                                                          detokenize=False)] * filler
        outs = v16_llm.generate(reqs, ps, use_tqdm=False)
        return {order[i]: list(outs[i].outputs[0].token_ids) for i in range(len(order))}

    first = run([0, 1, 2], filler=0)
    again = run([2, 0, 1], filler=5)  # other order, other batch neighbours
    assert first == again
    assert len({tuple(v) for v in first.values()}) == 3  # different seeds differ
    assert model_runner(v16_llm).drafter.stats.rounds > 0
