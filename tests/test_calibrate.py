"""Depth calibration (vllm_loopspec.tools.calibrate) and ``"draft_loops": "auto"``.

No engine: the fit and the closed form are pure functions, the tool runs the
oracle on the tests' tiny checkpoint, and "auto" is resolved from vLLM's
engine config (built, not started).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_loopspec.speculative.options import (
    CALIBRATION_FILE,
    LoopSpecConfigError,
    calibrated_draft_loops,
    resolve_options,
)
from vllm_loopspec.tools import calibrate as cal

REPO = Path(__file__).resolve().parents[1]
OURO = ["OuroForCausalLM"]


def _hf(loops=4, path=None):
    return SimpleNamespace(total_ut_steps=loops, early_exit_threshold=1.0, name_or_path=path)


# -- fit ---------------------------------------------------------------------------
def test_fit_recovers_alpha_beta_from_exact_power_law():
    r = np.arange(1, 32)
    fit = cal.fit_power_law(r, 0.175 * r ** -1.03)
    assert fit["alpha"] == pytest.approx(1.03, rel=1e-9)
    assert fit["beta"] == pytest.approx(0.175, rel=1e-9)
    assert fit["r2"] == pytest.approx(1.0)
    assert not fit["raised"] and all(fit["holds"])


def test_fit_with_noise_raises_beta_to_an_upper_bound():
    rng = np.random.default_rng(0)
    r = np.arange(1, 8)
    tv = 0.3 * r ** -1.2 * np.exp(rng.normal(0, 0.1, r.size))
    fit = cal.fit_power_law(r, tv)
    assert fit["alpha"] == pytest.approx(1.2, abs=0.15)
    assert fit["beta"] == pytest.approx(0.3, rel=0.15)
    assert 0.8 < fit["r2"] < 1.0
    # least squares leaves points above the line; the raised beta bounds them all
    assert not all(fit["holds"]) and fit["raised"]
    assert np.all(tv <= fit["beta_bound"] * r ** -fit["alpha"] * (1 + 1e-12))
    assert np.any(np.isclose(tv, fit["beta_bound"] * r ** -fit["alpha"]))  # and touches one


def test_fit_refuses_too_few_positive_points():
    with pytest.raises(ValueError, match="two depths with TV > 0"):
        cal.fit_power_law([1, 2, 3], [0.2, 0.0, 0.0])


# -- depths --------------------------------------------------------------------------
@pytest.mark.parametrize("alpha, beta, R, d1, d2", [
    (1.03, 0.175, 32, 1.26, 8.85),   # LoopSpec, Raven-Llama-3.2 (their Section 5)
    (1.08, 0.207, 32, 1.41, 9.17),   # LoopSpec, Raven-OLMo-2-0425 (their appendix F)
])
def test_closed_form_matches_the_papers_figures(alpha, beta, R, d1, d2):
    cf = cal.closed_form_depths(alpha, beta, R)
    assert cf["d1"] == pytest.approx(d1, abs=0.01)
    assert cf["d2"] == pytest.approx(d2, abs=0.01)
    assert cf["valid"]


def test_closed_form_is_the_stationary_point_of_the_bound():
    alpha, beta, R = 0.8, 0.4, 16
    cf = cal.closed_form_depths(alpha, beta, R)
    f = lambda a, b: cal.envelope_cost(a, b, alpha, beta, R)  # noqa: E731
    h = 1e-5
    assert (f(cf["d1"] + h, cf["d2"]) - f(cf["d1"] - h, cf["d2"])) / (2 * h) == pytest.approx(0, abs=1e-6)
    assert (f(cf["d1"], cf["d2"] + h) - f(cf["d1"], cf["d2"] - h)) / (2 * h) == pytest.approx(0, abs=1e-6)
    for dd1, dd2 in [(0.3, 0), (-0.2, 0), (0, 1), (0, -1), (0.2, 0.5)]:
        assert f(cf["d1"] + dd1, cf["d2"] + dd2) > f(cf["d1"], cf["d2"])


def test_integer_depths_minimise_the_bound_near_the_closed_form():
    alpha, beta, R = 1.03, 0.175, 32
    d1, d2 = cal.integer_depths(alpha, beta, R)
    best = min(cal.envelope_cost(a, b, alpha, beta, R) for a in range(1, R - 1) for b in range(a + 1, R))
    assert cal.envelope_cost(d1, d2, alpha, beta, R) == best
    assert abs(d1 - 1.26) < 1 and abs(d2 - 8.85) < 1.5
    assert cal.integer_depths(alpha, beta, 2) == (1, None)
    # a weak early loop (TV 0.9 at r=1) pushes the draft deeper
    assert cal.integer_depths(0.3, 0.9, 8)[0] >= cal.integer_depths(2.0, 0.2, 8)[0]


def test_expected_ticks():
    assert cal.expected_ticks(1.0, 0.0, 1, 2, 4) == 1
    assert cal.expected_ticks(0.0, 1.0, 1, 2, 4) == 2
    assert cal.expected_ticks(0.0, 0.0, 1, 2, 4) == 4
    assert cal.expected_ticks(0.5, 0.0, 1, None, 4) == 2.5


def test_sampled_cascade_probabilities_match_enumeration():
    """The vectorised restart probability (first draft rejected, gate, second
    residual draft rejected) equals a direct enumeration of the cascade."""
    torch.manual_seed(0)
    V = 6
    logits = [torch.randn(1, V) * s for s in (2.0, 1.5, 1.0, 1.0)]   # loops 1..4; R = 4
    acc = cal.Accumulator(4)
    acc.add(logits, temperature=1.0)
    probs = [torch.softmax(lg[0].double(), -1) for lg in logits]
    p = probs[-1]
    for i, (d1, d2) in enumerate(acc.pairs):
        q1, q2t = probs[d1 - 1], probs[d2 - 1]
        res = (q2t - q1).clamp_min(0)
        q2 = res / res.sum()
        rho1 = (p - q1).clamp_min(0)
        rho1 = rho1 / rho1.sum()
        accept1 = accept2 = 0.0
        for x in range(V):
            a = min(1.0, float(p[x] / q1[x]))
            accept1 += float(q1[x]) * a
            if q2t[x] < q1[x]:   # gate open: a second, residual proposal
                for y in range(V):
                    if q2[y] > 0:
                        accept2 += float(q1[x]) * (1 - a) * float(q2[y]) * min(1.0, float(rho1[y] / q2[y]))
        assert acc.s_acc2[i] == pytest.approx(accept2, abs=1e-9)
        assert 1 - acc.tv[d1 - 1] == pytest.approx(accept1, abs=1e-9)


# -- "auto" --------------------------------------------------------------------------
def _write(dirpath: Path, text: str) -> Path:
    dirpath.mkdir(parents=True, exist_ok=True)
    (dirpath / CALIBRATION_FILE).write_text(text)
    return dirpath


def test_auto_reads_the_calibration_and_unset_keeps_half(tmp_path):
    ckpt = _write(tmp_path / "m", json.dumps({"loops": 4, "draft_loops": 1}))
    auto = {"method": "loopspec", "draft_loops": "auto"}
    assert resolve_options(auto, _hf(), OURO, model_path=ckpt).draft_loops == 1
    assert resolve_options(auto, _hf(path=str(ckpt)), OURO).draft_loops == 1   # path from the config
    # unset is R // 2 whatever the file says; an explicit integer wins
    assert resolve_options({"method": "loopspec"}, _hf(), OURO, model_path=ckpt).draft_loops == 2
    assert resolve_options("loopspec", _hf(), OURO, model_path=ckpt).draft_loops == 2
    assert resolve_options({"method": "loopspec", "draft_loops": 3}, _hf(), OURO, model_path=ckpt).draft_loops == 3


def test_auto_without_a_file_falls_back_to_half(tmp_path):
    auto = {"method": "loopspec", "draft_loops": "auto"}
    assert resolve_options(auto, _hf(), OURO, model_path=tmp_path).draft_loops == 2
    assert resolve_options(auto, _hf(loops=6), OURO, model_path="some-org/some-hub-model").draft_loops == 3
    assert resolve_options(auto, _hf(), OURO).draft_loops == 2
    assert calibrated_draft_loops(None, 4) is None


@pytest.mark.parametrize("text, words", [
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "is not a JSON object"),
    (json.dumps({"loops": 8, "draft_loops": 1}), "calibrated for loops=8, but the model has total_ut_steps=4"),
    (json.dumps({"loops": 4}), "has draft_loops=None"),
    (json.dumps({"loops": 4, "draft_loops": 4}), "has draft_loops=4, not an integer with 1 <= draft_loops < total_ut_steps (4)"),
    (json.dumps({"loops": 4, "draft_loops": "1"}), "has draft_loops='1'"),
])
def test_malformed_calibration_is_refused_naming_the_file(tmp_path, text, words):
    ckpt = _write(tmp_path / "m", text)
    with pytest.raises(LoopSpecConfigError) as err:
        resolve_options({"method": "loopspec", "draft_loops": "auto"}, _hf(), OURO, model_path=ckpt)
    msg = str(err.value)
    assert str(ckpt / CALIBRATION_FILE) in msg and words in msg
    assert "vllm_loopspec.tools.calibrate" in msg
    # without "auto" the file is not read at all
    assert resolve_options({"method": "loopspec"}, _hf(), OURO, model_path=ckpt).draft_loops == 2


def test_auto_through_vllms_engine_config(tiny_checkpoint, tmp_path):
    """The model path reaches resolve_options from vLLM's config (no engine starts)."""
    from vllm.engine.arg_utils import EngineArgs

    ckpt = tmp_path / "tiny-calibrated"
    shutil.copytree(tiny_checkpoint, ckpt)
    _write(ckpt, json.dumps({"loops": 4, "draft_loops": 3}))

    def d(spec):
        cfg = EngineArgs(model=str(ckpt), dtype="float32", max_model_len=256,
                         speculative_config=spec).create_engine_config()
        return cfg.additional_config["loopspec"]["draft_loops"]

    assert d({"method": "loopspec", "draft_loops": "auto"}) == 3
    assert d({"method": "loopspec"}) == 2


# -- the tool ------------------------------------------------------------------------
def test_tool_runs_on_the_tiny_checkpoint_and_writes_a_valid_file(tiny_checkpoint, tmp_path, capsys):
    ckpt = tmp_path / "tiny"
    shutil.copytree(tiny_checkpoint, ckpt)
    prompts = REPO / "benchmarks" / "prompts" / "code.jsonl"
    res = cal.main([str(ckpt), "--prompts", str(prompts), "--context", "48"])
    out = capsys.readouterr().out
    assert "mean TV" in out and "d1* =" in out and "predicted speedup" in out
    data = json.loads((ckpt / CALIBRATION_FILE).read_text())
    assert data == json.loads(json.dumps(res))
    assert data["schema"] == cal.SCHEMA and data["loops"] == 4
    assert data["prompt_set"]["files"] == [str(prompts)] and data["prompt_set"]["prompts"] == 32
    assert data["positions"] > 32 * 10
    assert [row["r"] for row in data["per_loop"]] == [1, 2, 3]
    for row in data["per_loop"]:
        assert 0 <= row["mean_tv"] <= 1 and 0 <= row["agreement"] <= 1
    assert 1 <= data["draft_loops"] == data["depths"]["d1"] < data["depths"]["d2"] < 4
    assert data["command"].startswith("python -m vllm_loopspec.tools.calibrate ") and data["date"]
    for pair in data["candidates"]:
        assert 1 <= pair["greedy_ticks"] <= 4 and 1 <= pair["sampled_ticks"] <= 4
    # "auto" takes it
    assert calibrated_draft_loops(ckpt, 4) == data["draft_loops"]
    # --out writes elsewhere
    other = tmp_path / "elsewhere.json"
    cal.main([str(ckpt), "--prompts", str(prompts), "--context", "16", "--out", str(other)])
    assert json.loads(other.read_text())["loops"] == 4


def test_tool_per_loop_figures_match_the_oracle(tiny_checkpoint):
    """TV and agreement recomputed by hand from loop_logits for one sequence."""
    from vllm_loopspec.reference import OuroReference

    model = OuroReference.from_pretrained(tiny_checkpoint)
    ids = torch.arange(1, 40) % model.config.vocab_size
    acc = cal.measure(model, [ids])
    with torch.no_grad():
        logits = [lg[0] for lg in model.loop_logits(ids[None])]
    pR = torch.softmax(logits[-1].double(), -1)
    for r in range(3):
        pr = torch.softmax(logits[r].double(), -1)
        assert acc.tv[r] / acc.n == pytest.approx(float(0.5 * (pr - pR).abs().sum(-1).mean()), rel=1e-9)
        agree = float((logits[r].argmax(-1) == logits[-1].argmax(-1)).double().mean())
        assert acc.agree[r] / acc.n == pytest.approx(agree)


def test_bundled_checkpoint_ships_its_calibration():
    """checkpoints/ouro-stdlib carries a calibration "auto" accepts, whose
    greedy agreement agrees with eval.json's teacher-forced agreement (other
    windows of the same held-out split), and its card shows the figures."""
    ckpt = REPO / "checkpoints" / "ouro-stdlib"
    if not (ckpt / CALIBRATION_FILE).exists():
        pytest.skip("no bundled calibration")
    data = json.loads((ckpt / CALIBRATION_FILE).read_text())
    assert data["schema"] == cal.SCHEMA and data["prompt_set"]["kind"] == cal.HELD_OUT
    assert calibrated_draft_loops(ckpt, data["loops"]) == data["draft_loops"]
    tf = json.loads((ckpt / "eval.json").read_text())["teacher_forced"]["argmax_agreement_with_loop_R"]
    for row in data["per_loop"]:
        assert row["agreement"] == pytest.approx(tf[str(row["r"])], abs=0.03)
    card = (ckpt / "README.md").read_text()
    assert "## Depth calibration" in card and f"d1* = {data['draft_loops']}" in card
