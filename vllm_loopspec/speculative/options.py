"""User-facing loopspec options and their validation.

``--speculative-config loopspec`` or JSON such as
``{"method": "loopspec", "num_speculative_tokens": 4, "draft_loops": 2}``.
Every error says what to change, and is raised while vLLM builds its config,
before the engine starts or a port is bound.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

METHOD = "loopspec"
# Key of loopspec's resolved options in vLLM's ``additional_config``.
ADDITIONAL_CONFIG_KEY = "loopspec"
# vLLM's rejection sampler handles at most this many drafts per request.
MAX_SPECULATIVE_TOKENS = 128
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
DEFAULT_MAX_SPECULATIVE_TOKENS = 8
# Written by ``python -m vllm_loopspec.tools.calibrate CKPT`` into the
# checkpoint directory; ``"draft_loops": "auto"`` reads its ``draft_loops``.
CALIBRATION_FILE = "loopspec_calibration.json"
ALLOWED_KEYS = {"method", "num_speculative_tokens", "max_speculative_tokens", "adaptive", "draft_loops",
                "skip_logprobs_requests", "schedule", "second_proposal_loop"}
SCHEDULES = ("round", "pipelined", "auto")
# With "auto", pipelined steps run up to this many slots per request (the
# pipeline's fill and drain are paid once per step; longer steps amortise
# them), and rounds choose K up to it.
DEFAULT_AUTO_MAX_SPECULATIVE_TOKENS = 16
# The default where the policy adapts (benchmarks/results/adaptive_sweep_auto.json);
# "adaptive": false pins a round of K instead.
DEFAULT_SCHEDULE = "auto"


class LoopSpecConfigError(ValueError):
    """A loopspec setup that cannot run; the message says what to change."""


@dataclass(frozen=True)
class LoopSpecOptions:
    num_speculative_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    """K: tokens drafted per round when ``adaptive`` is off; with it on, the
    K a barely measured greedy request is re-probed with, and of the
    warm-up steps of a policy that has no startup seed
    (:meth:`~vllm_loopspec.speculative.adaptive.AdaptiveController.seed`)."""
    max_speculative_tokens: int = DEFAULT_MAX_SPECULATIVE_TOKENS
    """Largest K the adaptive policy may choose (vLLM reserves this many
    draft slots per request)."""
    adaptive: bool = True
    """Choose K per request and step from measured costs and acceptance
    (:mod:`vllm_loopspec.speculative.policy`); off: always K."""
    draft_loops: int | None = None
    """d: loops that draft (1 <= d < R). Unset: R // 2. ``"auto"``: the
    calibrated ``d1*`` of the checkpoint's ``loopspec_calibration.json``, or
    R // 2 when the checkpoint has none. A list of depths (``"schedule":
    "auto"`` only): each step drafts at the depth whose arms have delivered
    the most (:attr:`draft_depths`); this field is then the smallest."""
    draft_depths: tuple[int, ...] | None = None
    """Depths the ``"auto"`` chooser picks from per step (``draft_loops``
    given as a list); None: every step drafts at ``draft_loops``."""
    depth_second_proposal_loops: tuple[int | None, ...] | None = None
    """With :attr:`draft_depths`: each depth's ``d2`` for its pipelined
    steps (``2 * d`` where that is below R)."""
    skip_logprobs_requests: bool = True
    """Requests asking for logprobs decode one token per step (counted as
    skipped) so their logprobs are exactly those of native decoding."""
    schedule: str = DEFAULT_SCHEDULE
    """``"round"``: draft K with loops ``[0, d)``, then verify them at once
    (:mod:`.round`). ``"pipelined"``: every token proposes its successor at
    depth ``d`` and is verified at depth R while later tokens are in flight
    (:mod:`.pipeline`, RFC §7); K fixed (no adaptive policy). ``"auto"``:
    every step is the adaptive policy's (a round or a plain step) or a
    pipelined step of ``max_speculative_tokens`` slots, whichever has
    delivered more tokens per second at the batch's width and sampling mix
    (:mod:`.schedule_choice`)."""
    second_proposal_loop: int | None = None
    """Pipelined steps only: ``d2``, the depth at which a token refines its
    successor's proposal (a multiple of ``draft_loops`` below R); unset:
    no second proposals with ``"pipelined"``, ``2 * draft_loops`` (where
    that is below R) with ``"auto"``."""

    @property
    def depths(self) -> tuple[int, ...]:
        """Every draft depth a step of this engine may run at."""
        return tuple(self.draft_depths) if self.draft_depths else (self.draft_loops,)

    def second_proposal_loop_at(self, d: int) -> int | None:
        """``d2`` of a pipelined step drafting at depth ``d``."""
        if self.draft_depths:
            return self.depth_second_proposal_loops[list(self.draft_depths).index(d)]
        return self.second_proposal_loop

    @property
    def draft_slots(self) -> int:
        """Draft slots per request vLLM must provide: the most K can be."""
        return self.max_speculative_tokens if self.adaptive else self.num_speculative_tokens

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "LoopSpecOptions":
        return cls(**{k: v for k, v in raw.items() if k != "method"})


def is_loopspec(spec: Any) -> bool:
    if isinstance(spec, str):
        return spec.strip() == METHOD
    return isinstance(spec, dict) and spec.get("method") == METHOD


def parse_user_spec(spec: str | dict[str, Any]) -> dict[str, Any]:
    """The bare word or a dict, as a dict with ``method`` set."""
    if isinstance(spec, str):
        return {"method": METHOD}
    unknown = set(spec) - ALLOWED_KEYS
    if unknown:
        raise LoopSpecConfigError(
            f"unknown loopspec option(s) {sorted(unknown)}; loopspec accepts "
            f"{sorted(ALLOWED_KEYS)} (e.g. "
            '{"method":"loopspec","num_speculative_tokens":4,"draft_loops":2}).'
        )
    return dict(spec)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def calibrated_draft_loops(model_path: str | Path | None, loops: int) -> int | None:
    """``d1*`` from ``<model_path>/loopspec_calibration.json``; ``None`` when
    the model is not a local directory or has no such file. A file that is
    not a calibration of this model is refused, naming the file."""
    if model_path is None or not Path(model_path).is_dir():
        return None
    path = Path(model_path) / CALIBRATION_FILE
    if not path.is_file():
        return None
    fix = (f"rerun `python -m vllm_loopspec.tools.calibrate {model_path}` or remove the file "
           "(\"auto\" then drafts with R // 2 loops), or set draft_loops to an integer.")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoopSpecConfigError(f"loopspec draft_loops \"auto\": {path} is not valid JSON ({e}); {fix}") from None
    if not isinstance(data, dict):
        raise LoopSpecConfigError(f"loopspec draft_loops \"auto\": {path} is not a JSON object; {fix}")
    if data.get("loops") != loops:
        raise LoopSpecConfigError(
            f"loopspec draft_loops \"auto\": {path} was calibrated for loops={data.get('loops')!r}, "
            f"but the model has total_ut_steps={loops}; {fix}")
    d = data.get("draft_loops")
    if not _positive_int(d) or not 1 <= d < loops:
        raise LoopSpecConfigError(
            f"loopspec draft_loops \"auto\": {path} has draft_loops={d!r}, not an integer with "
            f"1 <= draft_loops < total_ut_steps ({loops}); {fix}")
    return d


def resolve_options(spec: str | dict[str, Any], hf_config: Any, architectures: list[str] | None,
                    model_path: str | Path | None = None) -> LoopSpecOptions:
    """Validate the user's loopspec request against the model; fill defaults.
    ``model_path`` (default: the config's ``name_or_path``) is where
    ``"draft_loops": "auto"`` looks for the calibration file."""
    raw = parse_user_spec(spec)
    archs = architectures or []
    if "OuroForCausalLM" not in archs or getattr(hf_config, "total_ut_steps", None) is None:
        raise LoopSpecConfigError(
            f"loopspec needs an Ouro looped model (architecture OuroForCausalLM with "
            f"'total_ut_steps'); this model is {archs or 'unknown'}. Serve an Ouro "
            "checkpoint or choose another speculative method."
        )
    loops = hf_config.total_ut_steps
    schedule = raw.get("schedule", "round" if raw.get("adaptive") is False else DEFAULT_SCHEDULE)
    if schedule not in SCHEDULES:
        raise LoopSpecConfigError(
            f"loopspec schedule must be one of {list(SCHEDULES)}, got {schedule!r}; "
            '"round" drafts K then verifies them at once, "pipelined" overlaps drafting and verification, '
            '"auto" picks one of the two per step by measured throughput.')
    # The adaptive policy prices rounds; a pipelined step runs a fixed K.
    adaptive = raw.get("adaptive", schedule != "pipelined")
    if not isinstance(adaptive, bool):
        raise LoopSpecConfigError(f"loopspec adaptive must be true or false, got {adaptive!r}.")
    if adaptive and schedule == "pipelined":
        raise LoopSpecConfigError(
            'loopspec "schedule": "pipelined" runs a fixed K per step and the adaptive policy prices only '
            'rounds; drop "adaptive" (or set it to false) with "pipelined", or use "schedule": "auto" (the '
            'adaptive policy\'s steps and pipelined steps, chosen per step by measured throughput).')
    if not adaptive and schedule == "auto":
        raise LoopSpecConfigError(
            'loopspec "schedule": "auto" chooses between the adaptive policy\'s steps and pipelined steps by '
            'measurement; drop "adaptive": false, or pin a schedule ("round" or "pipelined") with a fixed K.')
    k = raw.get("num_speculative_tokens", DEFAULT_NUM_SPECULATIVE_TOKENS)
    if not _positive_int(k) or k < 1:
        raise LoopSpecConfigError(
            f"loopspec num_speculative_tokens must be an integer >= 1, got {k!r}; "
            f"set e.g. \"num_speculative_tokens\": {DEFAULT_NUM_SPECULATIVE_TOKENS}."
        )
    if k > MAX_SPECULATIVE_TOKENS:
        raise LoopSpecConfigError(
            f"loopspec num_speculative_tokens={k} exceeds vLLM's rejection sampler "
            f"limit of {MAX_SPECULATIVE_TOKENS}; use a smaller K."
        )
    default_max = DEFAULT_AUTO_MAX_SPECULATIVE_TOKENS if schedule == "auto" else DEFAULT_MAX_SPECULATIVE_TOKENS
    k_max = raw.get("max_speculative_tokens", max(k, default_max))
    if not _positive_int(k_max) or not k <= k_max <= MAX_SPECULATIVE_TOKENS:
        raise LoopSpecConfigError(
            f"loopspec max_speculative_tokens must be an integer with num_speculative_tokens ({k}) <= "
            f"max_speculative_tokens <= {MAX_SPECULATIVE_TOKENS}, got {k_max!r}; raise it or lower "
            "num_speculative_tokens."
        )
    if "max_speculative_tokens" in raw and not adaptive:
        raise LoopSpecConfigError(
            "loopspec max_speculative_tokens bounds the adaptive policy, but \"adaptive\" is false; "
            "drop max_speculative_tokens or set \"adaptive\": true."
        )
    # Unset means R // 2, always (tests and benchmarks rely on it); only the
    # explicit "auto" reads the checkpoint's calibration.
    d = raw.get("draft_loops", loops // 2)
    depths = None
    if isinstance(d, list):
        depths = _draft_depths(d, loops, schedule, raw)
        d = depths[0]
    if d == "auto":
        if model_path is None:
            model_path = getattr(hf_config, "name_or_path", None) or None
        calibrated = calibrated_draft_loops(model_path, loops)
        d = loops // 2 if calibrated is None else calibrated
    if not _positive_int(d) or not 1 <= d < loops:
        raise LoopSpecConfigError(
            f"loopspec draft_loops must be \"auto\" or an integer with 1 <= draft_loops < "
            f"total_ut_steps ({loops}) (or, with \"schedule\": \"auto\", a list of such integers), "
            f"got {d!r}; the remaining loops verify."
        )
    threshold = getattr(hf_config, "early_exit_threshold", 1.0)
    if threshold is not None and threshold < 1.0:
        raise LoopSpecConfigError(
            f"loopspec needs fixed-depth decoding, but the checkpoint sets "
            f"early_exit_threshold={threshold}; override it with "
            "--hf-overrides '{\"early_exit_threshold\": 1.0}'."
        )
    d2 = raw.get("second_proposal_loop")
    if d2 is None and schedule == "auto" and 2 * d < loops and depths is None:
        d2 = 2 * d
    if d2 is not None:
        if schedule == "round":
            raise LoopSpecConfigError(
                'loopspec second_proposal_loop refines drafts of the pipelined schedule; add "schedule": '
                '"pipelined" (or "auto") or drop second_proposal_loop.')
        if not _positive_int(d2) or not d < d2 < loops or d2 % d:
            raise LoopSpecConfigError(
                f"loopspec second_proposal_loop must be a multiple of draft_loops ({d}) with draft_loops < "
                f"second_proposal_loop < total_ut_steps ({loops}), got {d2!r} (a tick advances every token "
                f"by draft_loops loops); e.g. draft_loops 1 with second_proposal_loop 2 or 3.")
    skip = raw.get("skip_logprobs_requests", True)
    if not isinstance(skip, bool):
        raise LoopSpecConfigError(f"loopspec skip_logprobs_requests must be true or false, got {skip!r}.")
    return LoopSpecOptions(num_speculative_tokens=k, max_speculative_tokens=k_max, adaptive=adaptive,
                           draft_loops=d, skip_logprobs_requests=skip, schedule=schedule,
                           second_proposal_loop=d2, draft_depths=depths,
                           depth_second_proposal_loops=None if depths is None else tuple(
                               2 * u if 2 * u < loops else None for u in depths))


def _draft_depths(values: list, loops: int, schedule: str, raw: dict[str, Any]) -> tuple[int, ...]:
    """``draft_loops`` given as a list: the depths each step chooses from."""
    example = f'e.g. "draft_loops": [1, {max(loops // 2, 1)}]' if loops > 2 else '"draft_loops": 1'
    if schedule != "auto":
        raise LoopSpecConfigError(
            f'loopspec draft_loops as a list lets "schedule": "auto" choose each step\'s draft depth; with '
            f'"schedule": {schedule!r} give one integer, or use "schedule": "auto" ({example}).')
    if (not values or not all(_positive_int(u) and 1 <= u < loops for u in values)
            or len(set(values)) != len(values)):
        raise LoopSpecConfigError(
            f"loopspec draft_loops as a list must hold distinct integers with 1 <= d < total_ut_steps "
            f"({loops}), got {values!r}; {example}.")
    if raw.get("second_proposal_loop") is not None and len(values) > 1:
        raise LoopSpecConfigError(
            "loopspec second_proposal_loop is one depth's; with several draft_loops each pipelined step "
            "refines at twice its draft depth (where that is below R): drop second_proposal_loop, or give "
            "draft_loops as one integer.")
    return tuple(sorted(values))
