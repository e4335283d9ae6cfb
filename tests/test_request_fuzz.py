"""Issue 10: every sampling parameter a user can send is served or refused per
request, never fatal.

Hypothesis draws batches of 1-6 requests over the fields of vLLM's
``SamplingParams`` (greedy and sampled rows, token-id prompts, some running
into ``max_model_len``) and runs each batch on a loopspec engine and on the
native engine. Per batch:

(a) greedy rows give native's tokens, text, finish reason and logprobs, and
    every row native's prompt logprobs;
(b) seeded sampled rows replay exactly when the batch runs again on the
    loopspec engine (same order, prefix cache reset as for the first run: a
    seeded request's stream under speculation depends on how its steps are
    scheduled; see ``test_seeded_row_does_not_depend_on_its_neighbours``),
    on the engines whose schedule does not follow measured timings;
(c) a request is refused only when it is built (``SamplingParams``) or added
    (``add_request``), with a clear per-request error, and only where native
    refuses it too (``min_p`` and ``logit_bias``, which vLLM refuses with
    any other speculative method, are served: those rows decode plainly);
    ``LLM.generate`` of the whole batch then raises that error and leaves
    the engine clean;
(d) afterwards both engines are idle (no request left, every KV block free)
    and a greedy probe still gets native's answer.

Every batch starts with empty prefix caches, so an example does not depend
on the ones before it (Hypothesis replays and shrinks examples) and long
prompts are prefilled in chunks.

Served outputs also keep the request's own contract (lengths, stop tokens,
allowed tokens, bad words, structured output, logprobs shapes). The one
per-request failure vLLM has after admission, ``finish_reason="error"`` when
a grammar rejects a token its other constraints forced, is allowed for
structured rows. Any exception from an engine step fails the test: in-process
engines re-raise there what kills a served engine. The batch's requests are
then aborted, which leaves the engine usable while Hypothesis shrinks.

Budget: ``LOOPSPEC_FUZZ_EXAMPLES`` examples (default 25, about a minute;
``make fuzz`` runs 500), derandomized so every run of ``make test`` draws the
same batches. Counterexamples found so far are explicit cases at the end.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import time
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from vllm import SamplingParams
from vllm.exceptions import VLLMClientError
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm.v1.request import RequestStatus

from conftest import MAX_BATCHED_TOKENS, MAX_MODEL_LEN
from engine_access import engine_core, free_blocks
from prompts import SHORT, long_prompt

FUZZ_EXAMPLES = int(os.environ.get("LOOPSPEC_FUZZ_EXAMPLES", "25"))
VOCAB = 512  # the tiny checkpoint's
EOS = 0
# loopspec engines the batches run on: (num_speculative_tokens, draft_loops[,
# adaptive, schedule, second_proposal_loop]): two rounds, and the pipelined
# schedule with second proposals (issue 12).
ENGINES = [(4, 2), (2, 1), (4, 1, False, "pipelined", 2), (4, 1, True, "auto")]
# Engines whose step schedule does not depend on measured timings: on them a
# seeded row's stream replays (with "auto" a step may pipeline one run and
# not the next, and a seeded stream follows the steps).
DETERMINISTIC_SCHEDULES = [e for e in ENGINES if not (len(e) > 2 and e[2])]

# EOS and tokens the tiny checkpoint emits often, so that stop tokens, allowed
# tokens and logit biases actually bite.
COMMON_TOKENS = [EOS, 146, 281, 183, 218, 481, 317, 370]
STOP_STRINGS = ["a", "e", " ", "\n", "de", "ack", "zzzz"]
BAD_WORDS = ["ack", " de", "W", "__", "at", "zz"]
STRUCTURED = [
    {"choice": ["yes", "no"]},
    {"choice": ["ack", "de", "W"]},
    {"regex": "[a-z]{1,4}"},
    {"regex": "(["},  # invalid: both engines must refuse it
    {"json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
    {"json_object": True},
    {"grammar": 'root ::= "a" | "b" "c"'},
]
# Prompts of these lengths run into (or past) max_model_len = 1024.
LONG_PROMPT_LENGTHS = [990, 1010, 1020, 1023, 1024]


# -- what a batch is ------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """One request: ``prompt`` is ("text", index into SHORT), ("ids", token
    ids) or ("long", length of a code prompt's prefix); ``params`` are
    SamplingParams keyword arguments, ``structured_outputs`` as a dict."""

    prompt: tuple
    params: dict

    @property
    def greedy(self) -> bool:
        return self.params.get("temperature", 1.0) == 0

    @property
    def seeded(self) -> bool:
        return not self.greedy and self.params.get("seed") is not None


@dataclass(frozen=True)
class Batch:
    engine: tuple  # one of ENGINES
    rows: list[Row]


@dataclass
class Served:
    output: object  # vllm.RequestOutput

    @property
    def completions(self) -> list[tuple[list[int], str, str]]:
        return [(list(c.token_ids), c.text, c.finish_reason) for c in self.output.outputs]


@dataclass
class Refused:
    error: BaseException
    at: str  # "construction" (SamplingParams) or "add_request"

    @property
    def clear(self) -> bool:
        """A per-request validation error with a message, as a client sees it."""
        return isinstance(self.error, (ValueError, TypeError, VLLMClientError)) and bool(str(self.error).strip())


Outcome = Served | Refused


# -- strategies -------------------------------------------------------------------
token_ids = st.integers(0, VOCAB - 1) | st.sampled_from(COMMON_TOKENS)


@st.composite
def rows(draw) -> Row:
    """A request; each optional field is present one time in four, values
    that get the row refused one time in eight; shrinking removes them."""

    def present() -> bool:
        return draw(st.integers(0, 3)) == 3

    def rarely() -> bool:  # for values that get the whole row refused
        return draw(st.integers(0, 7)) == 7

    prompt = draw(st.one_of(
        st.tuples(st.just("text"), st.integers(0, len(SHORT) - 1)),
        st.tuples(st.just("ids"), st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=24).map(tuple)),
        st.tuples(st.just("long"), st.sampled_from(LONG_PROMPT_LENGTHS)),
    ))
    lengths = [1, 6, 17, 40] if prompt[0] == "long" else [1, 3, 6, 17]
    p: dict = {"max_tokens": draw(st.sampled_from(lengths))}
    if draw(st.booleans()):  # sampled; 5.0 is beyond vLLM's range [0, 2]
        p["temperature"] = 5.0 if rarely() else draw(st.sampled_from([1e-3, 0.7, 1.0, 2.0]))
        p["n"] = draw(st.integers(1, 3))
        if draw(st.booleans()):
            p["seed"] = draw(st.integers(0, 2**31 - 1))
    else:
        p["temperature"] = 0.0
    if present():
        p["top_k"] = draw(st.sampled_from([-1, 0, 1, 5, 20, VOCAB + 88]))
    if present():
        p["top_p"] = draw(st.sampled_from([1e-3, 0.5, 0.9, 1.0]))
    if present():
        p["min_p"] = draw(st.sampled_from([0.0, 0.05, 0.3]))
    if present():
        p["repetition_penalty"] = draw(st.sampled_from([0.5, 1.3, 2.0]))
    if present():
        p["presence_penalty"] = draw(st.sampled_from([-2.0, -0.5, 1.0, 2.0]))
    if present():
        p["frequency_penalty"] = draw(st.sampled_from([-2.0, 0.5, 2.0]))
    if present():
        p["min_tokens"] = min(draw(st.sampled_from([1, 3, 8])), p["max_tokens"])
    if present():
        p["stop"] = draw(st.lists(st.sampled_from(STOP_STRINGS), min_size=1, max_size=2, unique=True))
        p["include_stop_str_in_output"] = draw(st.booleans())
    if present():
        p["stop_token_ids"] = draw(st.lists(token_ids, min_size=1, max_size=3, unique=True))
    if present():
        p["bad_words"] = draw(st.lists(st.sampled_from(BAD_WORDS), min_size=1, max_size=3, unique=True))
    if present():
        p["logit_bias"] = draw(st.dictionaries(token_ids, st.sampled_from([-100.0, -5.0, 5.0, 100.0]),
                                               min_size=1, max_size=2))
    if present():
        p["logprobs"] = draw(st.sampled_from([0, 1, 5, 20, 21]))
    if present():
        p["prompt_logprobs"] = draw(st.sampled_from([0, 2, 20]))
    if present():
        p["ignore_eos"] = True
    if present():
        p["allowed_token_ids"] = draw(st.lists(token_ids, min_size=1, max_size=8, unique=True))
    if present():
        p["structured_outputs"] = draw(st.sampled_from(STRUCTURED))
    return Row(prompt, p)


@st.composite
def batches(draw) -> Batch:
    engine = draw(st.sampled_from(ENGINES))
    return Batch(engine, draw(st.lists(rows(), min_size=1, max_size=6)))


# -- running a batch --------------------------------------------------------------
_request_numbers = itertools.count()


def make_params(kwargs: dict) -> SamplingParams:
    """Fresh SamplingParams (vLLM writes into them while adding a request)."""
    kwargs = dict(kwargs)
    if "structured_outputs" in kwargs:
        kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
    params = SamplingParams(**kwargs)
    params.output_kind = RequestOutputKind.FINAL_ONLY  # as LLM.generate sets it
    return params


class Prompts:
    """Token ids of the rows' prompts."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.long_ids = tokenizer(long_prompt(max(LONG_PROMPT_LENGTHS) + 16, tokenizer))["input_ids"]

    def __call__(self, prompt: tuple) -> list[int]:
        kind, value = prompt
        if kind == "text":
            return self.tokenizer(SHORT[value])["input_ids"]
        if kind == "ids":
            return list(value)
        return self.long_ids[:value]


def run_batch(llm, batch_rows: list[Row], prompts: Prompts) -> list[Outcome]:
    """Add the rows one by one as ``LLM.generate`` does, step the engine until
    they finish, and return one outcome per row. A refusal is the exception
    that construction or ``add_request`` raised; an exception from a step
    propagates after the batch's requests are aborted."""
    engine = llm.llm_engine
    outcomes: list[Outcome | None] = [None] * len(batch_rows)
    row_of: dict[str, int] = {}
    max_steps = 20
    try:
        for i, row in enumerate(batch_rows):
            try:
                params = make_params(row.params)
            except Exception as e:  # noqa: BLE001 - judged by Refused.clear
                outcomes[i] = Refused(e, "construction")
                continue
            request_id = f"fuzz-{next(_request_numbers)}"
            ids = prompts(row.prompt)
            try:
                engine.add_request(request_id, {"prompt_token_ids": ids}, params)
            except Exception as e:  # noqa: BLE001
                outcomes[i] = Refused(e, "add_request")
                continue
            row_of[request_id] = i
            max_steps += params.n * (math.ceil(len(ids) / MAX_BATCHED_TOKENS) + params.max_tokens + 2)
        steps = grammar_waits = 0
        while engine.has_unfinished_requests():
            # Grammars compile in the background; steps meanwhile do nothing
            # for those requests and are not counted. The poll count is only
            # a hang guard (5 minutes for a grammar of a few rules).
            if waiting_for_grammar(llm):
                grammar_waits += 1
                assert grammar_waits < 6000, "a structured-output grammar never finished compiling"
                time.sleep(0.05)
            else:
                steps += 1
                assert steps <= max_steps, f"requests unfinished after {max_steps} engine steps"
            for out in engine.step():
                if out.finished:
                    outcomes[row_of[out.request_id]] = Served(out)
    except BaseException:
        engine.abort_request(list(row_of))
        raise
    missing = [i for i, o in enumerate(outcomes) if o is None]
    assert not missing, f"rows {missing} were added but never finished"
    return outcomes  # type: ignore[return-value]


def waiting_for_grammar(llm) -> bool:
    return any(r.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
               for r in engine_core(llm).scheduler.requests.values())


def assert_idle(llm, name: str) -> None:
    """No request left anywhere and every KV block free. vLLM's pool keeps
    one null block out of use; blocks that prefix caching keeps for finished
    requests have no reference and count as free (evictable)."""
    core = engine_core(llm)
    assert not llm.llm_engine.has_unfinished_requests(), f"{name}: front end still has requests"
    assert not core.scheduler.requests, f"{name}: scheduler still holds {list(core.scheduler.requests)}"
    total = core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks
    assert free_blocks(llm) == total - 1, f"{name}: {free_blocks(llm)} of {total - 1} KV blocks free"


PROBE = Row(("ids", (5, 6, 7)), {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True})


def probe(llm, prompts: Prompts) -> list:
    (outcome,) = run_batch(llm, [PROBE], prompts)
    assert isinstance(outcome, Served), f"probe refused: {outcome}"
    return outcome.completions


# -- checks -----------------------------------------------------------------------
def bad_word_sequences(row: Row, tokenizer) -> list[list[int]]:
    """The token sequences vLLM bans for the row's bad words (``tokenizer``:
    an engine's, as ``LLM.get_tokenizer`` returns it)."""
    params = make_params(row.params)
    params.update_from_tokenizer(tokenizer)
    return params.bad_words_token_ids or []


def check_contract(row: Row, prompt_len: int, served: Served, tokenizer, name: str) -> None:
    """What every served request promises, whatever the engine
    (``tokenizer``: the engine's)."""
    p = row.params
    completions = served.output.outputs
    assert len(completions) == p.get("n", 1), f"{name}: {len(completions)} completions for n={p.get('n', 1)}"
    stop_ids = set(p.get("stop_token_ids") or ()) | (set() if p.get("ignore_eos") else {EOS})
    bad = bad_word_sequences(row, tokenizer) if p.get("bad_words") else []
    for c in completions:
        tokens, where = list(c.token_ids), f"{name}: {list(c.token_ids)} {c.text!r} ({c.finish_reason})"
        assert 1 <= len(tokens) <= p["max_tokens"], where
        assert prompt_len + len(tokens) <= MAX_MODEL_LEN, where
        if c.finish_reason == "error":
            # vLLM ends (only) a request whose grammar rejects the sampled
            # token, e.g. when allowed_token_ids or bad_words contradict it.
            assert p.get("structured_outputs"), f"request failed without a grammar: {where}"
            continue
        assert c.finish_reason in ("stop", "length"), where
        if c.finish_reason == "length":
            assert len(tokens) == p["max_tokens"] or prompt_len + len(tokens) == MAX_MODEL_LEN, where
        elif not (p.get("structured_outputs") or p.get("allowed_token_ids")):
            # (A grammar or allowed_token_ids may leave only EOS to sample:
            # vLLM then stops before min_tokens.)
            assert len(tokens) >= p.get("min_tokens", 0), where
        assert not stop_ids & set(tokens[:-1]), f"stop token inside the output: {where}"
        if p.get("allowed_token_ids") and allowed_tokens_can_be_sampled(p, bad):
            assert set(tokens) <= set(p["allowed_token_ids"]), where
        for seq in bad:
            assert not any(tokens[i : i + len(seq)] == seq for i in range(len(tokens))), f"bad word {seq}: {where}"
        if p.get("stop") and not p.get("min_tokens") and not p.get("include_stop_str_in_output"):
            assert not any(s in c.text for s in p["stop"]), where
        if p.get("logprobs") is not None:
            assert c.logprobs is not None and len(c.logprobs) == len(tokens), where
            assert all(t in entry for t, entry in zip(tokens, c.logprobs)), where
        structured = p.get("structured_outputs")
        plain_stop = not (p.get("stop") or p.get("stop_token_ids") or p.get("ignore_eos"))
        if structured and c.finish_reason == "stop" and plain_stop and tokens[-1] == EOS:
            # Decoded here: vLLM's incremental detokenizer can prepend the
            # tail of a random prompt that ends inside a UTF-8 character.
            check_structured_text(structured, tokenizer.decode(tokens[:-1]), where)
    if p.get("prompt_logprobs") is not None:
        assert served.output.prompt_logprobs is not None, name
        assert len(served.output.prompt_logprobs) == prompt_len, name


def allowed_tokens_can_be_sampled(p: dict, bad: list[list[int]]) -> bool:
    """Whether some allowed token survives the request's other masks. When
    none does (min_tokens masking stop tokens, single-token bad words, a
    grammar), every logit is -inf and vLLM emits token 0 on both engines."""
    if p.get("structured_outputs"):
        return False
    allowed = set(p["allowed_token_ids"]) - {seq[0] for seq in bad if len(seq) == 1}
    if p.get("min_tokens"):
        allowed -= set(p.get("stop_token_ids") or ()) | {EOS}
    return bool(allowed)


def check_structured_text(structured: dict, text: str, where: str) -> None:
    """A request its grammar ended (EOS) produced a complete match."""
    if "choice" in structured:
        assert text in structured["choice"], where
    elif "regex" in structured:
        assert re.fullmatch(structured["regex"], text), where
    elif "json" in structured or "json_object" in structured:
        json.loads(text)


def check_verdicts(row: Row, spec: Outcome, native: Outcome) -> None:
    """(c): refusals are clear, and loopspec refuses exactly what native
    refuses."""
    for name, outcome in (("loopspec", spec), ("native", native)):
        if isinstance(outcome, Refused):
            assert outcome.clear, f"{name} refused {row} without a clear error: {outcome.error!r}"
    assert not (isinstance(spec, Refused) and isinstance(native, Served)), \
        f"loopspec refused what native serves: {row}: {spec.error}"
    assert not (isinstance(native, Refused) and isinstance(spec, Served)), \
        f"loopspec served what native refuses: {row}: {native.error}"


def check_greedy_equal(row: Row, spec: Served, native: Served) -> None:
    """(a): exact greedy output, and the same logprobs where asked for."""
    assert spec.completions == native.completions, f"greedy row differs from native: {row}"
    for s, n in zip(spec.output.outputs, native.output.outputs):
        if row.params.get("logprobs") is not None:
            for t, ls, ln in zip(s.token_ids, s.logprobs, n.logprobs):
                assert ls[t].logprob == pytest.approx(ln[t].logprob, abs=1e-4), row


def check_prompt_logprobs_equal(row: Row, spec: Served, native: Served) -> None:
    """The prompt's logprobs come from the full-depth prefill on both engines."""
    pairs = zip(spec.output.prompt_token_ids[1:], spec.output.prompt_logprobs[1:], native.output.prompt_logprobs[1:])
    for t, ls, ln in pairs:
        assert ls[t].logprob == pytest.approx(ln[t].logprob, abs=1e-4), f"prompt logprobs differ: {row}"


def note_coverage(row: Row, spec: Outcome, native: Outcome) -> None:
    """Hypothesis events (``--hypothesis-show-statistics``): what the drawn
    rows exercised."""
    if not currently_in_test_context():
        return
    kinds = {Served: "served", Refused: "refused"}
    event(f"loopspec {kinds[type(spec)]}, native {kinds[type(native)]}")
    if isinstance(spec, Served):
        p = row.params
        event("greedy row compared" if row.greedy else ("seeded sampled row" if row.seeded else "sampled row"))
        if not row.greedy and p.get("top_k", 0) > 0 and p.get("top_p", 1.0) >= 1.0:
            event("sampled row with top_k and no top_p")
        if any(c.finish_reason == "error" for c in spec.output.outputs):
            event("grammar ended a request with an error")
        if any(len(spec.output.prompt_token_ids) + len(c.token_ids) == MAX_MODEL_LEN for c in spec.output.outputs):
            event("ran into max_model_len")


# -- the property -----------------------------------------------------------------
class Engines:
    """The session's engines and tokenizers, and native's answer to the probe
    (one fixture with a short repr, so counterexamples print only the batch)."""

    def __init__(self, loopspec_llms, native_llm, tokenizer) -> None:
        self.loopspec = loopspec_llms  # loopspec_llms(*ENGINES[i])
        self.native = native_llm
        self.prompts = Prompts(tokenizer)
        self.engine_tokenizer = native_llm.get_tokenizer()
        self.native_probe = probe(native_llm, self.prompts)

    def __repr__(self) -> str:
        return "Engines()"


@pytest.fixture(scope="module")
def engines(loopspec_llms, native_llm, tokenizer) -> Engines:
    return Engines(loopspec_llms, native_llm, tokenizer)


@settings(max_examples=FUZZ_EXAMPLES, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batch=batches())
def test_request_batches_are_served_or_refused_never_fatal(engines, batch):
    check_batch(engines, batch)


def check_batch(engines: Engines, batch: Batch) -> None:
    """Properties (a)-(d) of the module docstring for one batch."""
    llm, native_llm, prompts = engines.loopspec(*batch.engine), engines.native, engines.prompts
    if currently_in_test_context():
        event(f"loopspec engine {batch.engine}")
    rows_ = batch.rows
    assert llm.reset_prefix_cache() and native_llm.reset_prefix_cache()
    spec = run_batch(llm, rows_, prompts)
    native = run_batch(native_llm, rows_, prompts)
    for row, s, n in zip(rows_, spec, native):
        check_verdicts(row, s, n)
        for name, outcome in (("loopspec", s), ("native", n)):
            if isinstance(outcome, Served):
                check_contract(row, len(prompts(row.prompt)), outcome, engines.engine_tokenizer, name)
        if isinstance(s, Served) and isinstance(n, Served):
            if row.greedy:
                check_greedy_equal(row, s, n)
            if row.params.get("prompt_logprobs") is not None:
                check_prompt_logprobs_equal(row, s, n)
        note_coverage(row, s, n)

    # (c) The whole batch through LLM.generate: a refused row fails the call
    # with its own error before anything runs.
    refused_at_add = [o for o in spec if isinstance(o, Refused) and o.at == "add_request"]
    constructed = [(prompts(r.prompt), make_params(r.params)) for r, o in zip(rows_, spec)
                   if not (isinstance(o, Refused) and o.at == "construction")]
    if refused_at_add:
        with pytest.raises(type(refused_at_add[0].error)) as raised:
            llm.generate([{"prompt_token_ids": ids} for ids, _ in constructed], [p for _, p in constructed],
                         use_tqdm=False)
        assert str(raised.value) == str(refused_at_add[0].error)
        assert_idle(llm, "loopspec after a refused generate")

    # (b) Seeded sampled rows replay exactly.
    assert llm.reset_prefix_cache()
    replay = run_batch(llm, rows_, prompts)
    for row, first, again in zip(rows_, spec, replay):
        assert type(again) is type(first), f"served once, refused once: {row}"
        if row.seeded and isinstance(first, Served) and batch.engine in DETERMINISTIC_SCHEDULES:
            assert again.completions == first.completions, f"seeded row did not replay: {row}"

    # (d) Both engines idle, KV free, and still answering.
    assert_idle(llm, "loopspec")
    assert_idle(native_llm, "native")
    assert probe(llm, prompts) == engines.native_probe
    assert_idle(llm, "loopspec after the probe")


# -- counterexamples the fuzzer found, kept as explicit cases ---------------------
COUNTEREXAMPLES = {
    # With patch 5 disabled: the engine step raised in vLLM's top-k-only mask
    # (a sampled row with top_k and no top_p; the fuzzer's shrunk example).
    "top_k_only_sampled_row": Batch((4, 2), [
        Row(("text", 0), {"max_tokens": 1, "temperature": 1e-3, "n": 1, "top_k": 1}),
    ]),
    # With patch 6 disabled: a seeded request whose prompt is prefilled in
    # chunks made vLLM rewind its CPU generator, which raised in the step.
    "seeded_row_in_a_chunked_prefill": Batch((4, 2), [
        Row(("long", 990), {"max_tokens": 1, "temperature": 1e-3, "n": 1, "seed": 0}),
        Row(("text", 0), {"max_tokens": 6, "temperature": 1.0, "n": 2, "seed": 5}),
    ]),
    # Rows waiting for their grammar to compile while the engine steps: a
    # step budget alone would call this a hang.
    "grammar_compiling_while_stepping": Batch((4, 2), [
        Row(("text", 1), {"max_tokens": 6, "temperature": 0.0, "repetition_penalty": 2.0, "logprobs": 20,
                          "prompt_logprobs": 2, "ignore_eos": True, "structured_outputs": {"choice": ["yes", "no"]}}),
    ]),
    # allowed_token_ids contradict the grammar: vLLM ends that request with
    # finish_reason "error" and serves the rest.
    "grammar_contradicts_allowed_tokens": Batch((4, 2), [
        Row(("text", 0), {"max_tokens": 1, "temperature": 0.0, "allowed_token_ids": [0],
                          "structured_outputs": {"choice": ["yes", "no"]}}),
        Row(("text", 2), {"max_tokens": 6, "temperature": 0.0}),
    ]),
    # The grammar ends at EOS before min_tokens.
    "grammar_ends_before_min_tokens": Batch((4, 2), [
        Row(("text", 0), {"max_tokens": 6, "temperature": 0.0, "min_tokens": 6,
                          "structured_outputs": {"choice": ["yes", "no"]}}),
    ]),
    # min_tokens masks the only allowed token (a stop token): every logit is
    # -inf and both engines emit token 0 until min_tokens is reached.
    "min_tokens_masks_every_allowed_token": Batch((4, 2), [
        Row(("text", 6), {"max_tokens": 17, "temperature": 2.0, "n": 1, "seed": 3068, "top_k": -1, "min_tokens": 8,
                          "stop_token_ids": [113], "ignore_eos": True, "allowed_token_ids": [113]}),
        Row(("text", 6), {"max_tokens": 17, "temperature": 0.0, "min_tokens": 8, "stop_token_ids": [113],
                          "ignore_eos": True, "allowed_token_ids": [113]}),
    ]),
    # A random prompt ending inside a UTF-8 character: vLLM's text of the
    # completion starts with the prompt's tail (both engines); the grammar
    # holds on the tokens.
    "structured_row_after_a_random_prompt": Batch((4, 2), [
        Row(("text", 3), {"max_tokens": 6, "temperature": 1.0, "n": 3, "top_p": 0.9, "presence_penalty": 1.0,
                          "logprobs": 1}),
        Row(("ids", (34, 234, 13, 278, 346, 442, 6, 163)),
            {"max_tokens": 6, "temperature": 1.0, "n": 1, "frequency_penalty": 0.5,
             "structured_outputs": {"choice": ["yes", "no"]}}),
        Row(("long", 990), {"max_tokens": 6, "temperature": 0.7, "n": 1, "stop_token_ids": [510, 291, 481],
                            "bad_words": [" de", "W", "at"]}),
    ]),
}


@pytest.mark.parametrize("name", list(COUNTEREXAMPLES))
def test_counterexample(engines, name):
    check_batch(engines, COUNTEREXAMPLES[name])


# -- a limit the fuzzer found: seeded streams follow the step schedule ------------
SEEDED_ONE_TOKEN = Row(("ids", (176,)), {"max_tokens": 6, "temperature": 1.0, "seed": 164471, "top_k": 5})


def seeded_after_a_decoding_neighbour(llm, prompts: Prompts) -> list:
    """SEEDED_ONE_TOKEN's completion when it arrives while another request is
    decoding: vLLM 0.32's scheduler then pads its one-token prefill to 1+K
    slots (``Scheduler.schedule``: "Pad new decode requests to uniform spec
    decoding size"), so its first token comes from a round, not a plain
    sample."""
    assert llm.reset_prefix_cache()
    engine = llm.llm_engine
    neighbour = f"fuzz-{next(_request_numbers)}"
    engine.add_request(neighbour, {"prompt_token_ids": prompts(("text", 0))},
                       make_params({"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}))
    engine.step()  # the neighbour's prefill: it decodes from now on
    seeded = f"fuzz-{next(_request_numbers)}"
    engine.add_request(seeded, {"prompt_token_ids": prompts(SEEDED_ONE_TOKEN.prompt)},
                       make_params(SEEDED_ONE_TOKEN.params))
    result = None
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.request_id == seeded and out.finished:
                result = Served(out).completions
    assert result is not None, "the seeded request did not finish"
    assert_idle(llm, "after the seeded request")
    return result


def alone(llm, prompts: Prompts) -> list:
    assert llm.reset_prefix_cache()
    (outcome,) = run_batch(llm, [SEEDED_ONE_TOKEN], prompts)
    return outcome.completions


def test_native_seeded_row_does_not_depend_on_its_neighbours(engines):
    assert seeded_after_a_decoding_neighbour(engines.native, engines.prompts) == alone(engines.native, engines.prompts)


@pytest.mark.xfail(strict=True, reason=(
    "loopspec (like any speculative method) draws a seeded request's random numbers per draft: its stream "
    "depends on how many drafts each of its steps gets, which vLLM's scheduler decides from the whole batch "
    "(padding of one-token prefills, token budget). Replays hold for the same batch and schedule only."))
def test_seeded_row_does_not_depend_on_its_neighbours(engines):
    llm = engines.loopspec(4, 2)
    assert seeded_after_a_decoding_neighbour(llm, engines.prompts) == alone(llm, engines.prompts)
