"""Issue 13 diagnostic: replay a sweep's cell order through the real
:class:`~vllm_loopspec.speculative.schedule_choice.ScheduleChooser`, with
each arm's step time and tokens per step taken from that sweep's fixed arms,
to see what ``"auto"`` loses to learning and tries alone, apart from the
machine's noise. No engine: seconds of CPU.

Per cell (setting, width, temperature) and auto engine of depth ``d``, the
arms are modelled from the sweep's medians: ``plain`` by native (one token
per request a step), ``pipelined`` by the fixed pipelined arm of ``d``
(``pipelined d1 K16 s2`` for d1), ``policy`` by the best fixed round of ``d``
(the policy chooses its K). A step's time is its arm's mean times a
log-normal factor (``--noise``); the first plain step after a speculative
one is :data:`SWITCH_PENALTY` slower (``arm_rates_forced.json``). The
drafter's rules are modelled: the first step of an arm at a width is no
sample (a new shape), the policy's first :data:`POLICY_WARMUP` steps in the
engine are its warm-up (no samples), a step is observed when the next
starts, held plain steps are credited and timed. Requests of a cell start
and finish together. The machine: ``--drift`` (the first repeat this much
slower than the last, as in the sweeps), ``--phase`` (a log-normal speed
per trial), ``--spikes`` (a share of steps taking three times as long,
in spells of ``--spike-run`` steps).
Each repeat of each cell is compared with an engine running the best
single arm throughout and one running plain steps (native), on the same
machine model with draws of their own; ``--set NAME=VALUE`` overrides a constant of
:mod:`~vllm_loopspec.speculative.schedule_choice` to compare rules.

    python benchmarks/probes/chooser_sim.py benchmarks/results/SWEEP.json \
        [--seeds 12] [--drift 0.3 --phase 0.15 --spikes 0.03] [--trace "long c16 d2"]
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vllm_loopspec.speculative import schedule_choice as sc  # noqa: E402

SWITCH_PENALTY = 1.17  # the first plain step after a speculative one
POLICY_WARMUP = 12  # policy steps before its cost model exists (engine-wide)
PROMPT_TOKENS = {"short": 36, "long": 395}  # mean prompt lengths of the mixed and long sets


def arms_of(cell: dict, raw: dict, c: int, d: int) -> dict[str, tuple[float, float]] | None:
    """Per arm: (seconds per step, tokens per request per step)."""
    native = cell["native"]["median_tokens_per_s"]
    pip_name = f"pipelined d{d} K16 s2" if f"pipelined d{d} K16 s2" in cell else f"pipelined d{d} K16"
    rounds = {k: v for k, v in cell.items() if k.startswith(f"loopspec d{d} K")}
    if pip_name not in cell or not rounds:
        return None
    out = {sc.PLAIN: (c / native, 1.0)}
    for arm, name in ((sc.PIPELINED, pip_name), (sc.POLICY, max(rounds, key=lambda k: rounds[k]["median_tokens_per_s"]))):
        tokps = cell[name]["median_tokens_per_s"]
        runs = raw[name]
        per_step = statistics.median(r["tokens"] / r["steps"] / c for r in runs)
        out[arm] = (c * per_step / tokps, per_step)
    return out


class Engine:
    """One auto engine's chooser and the drafter's rules around it."""

    held_samples = True
    spikes = 0.0
    spike_run = 1
    spike_left = 0
    wander = 0.0  # stationary sigma of the machine's log speed, a random walk over seconds
    wander_tau = 1.0  # its time constant, seconds
    _log_speed = 0.0
    key_offset = 0  # added to the context the chooser sees (--acceptance-key)

    def __init__(self, rng: random.Random, noise: float):
        self.chooser = sc.ScheduleChooser()
        self.rng, self.noise = rng, noise
        self.shapes: set[tuple[str, int]] = set()
        self.policy_steps = 0
        self.last_arm: str | None = None

    def run(self, c: int, mix: int, prompt: int, new_tokens: int, arms: dict, host: float = 1.0) -> float:
        """Seconds to decode one cell's batch."""
        ch, done, context, seconds = self.chooser, 0.0, prompt, 0.0
        pending = None  # the last chosen step, observed at the next start: (width, arm, committed, s, ctx, after)
        hold, after, held_starts = 0, None, []
        self.trace = []
        while done < new_tokens:
            if hold:
                hold -= 1
                arm, sampled, held = sc.PLAIN, False, True
                held_starts.append(seconds)
            else:
                if held_starts:  # the drafter's credit: steps between the first and last held start
                    ch.credit_held(len(held_starts), (len(held_starts) - 1) * self.held_samples,
                                   held_starts[-1] - held_starts[0])
                    held_starts = []
                in_flight = pending[1] if pending else None
                choice = ch.choose(c, mix, context + self.key_offset, in_flight)
                arm, hold, held = choice.arm, choice.hold, False
                sampled = (arm, c) in self.shapes
                self.shapes.add((arm, c))
                if arm == sc.POLICY:
                    self.policy_steps += 1
                    sampled = sampled and self.policy_steps > POLICY_WARMUP
            if pending is not None:  # observed at this step's start
                w, parm, committed, s, ctx, paft = pending
                ch.observe(w, mix, parm, committed, s, ctx, after=paft)
                pending = None
            self.trace.append(arm[:2] + ("h" if held else "" if hold is None else choice.reason[:1]))
            step_s, per_step = arms[arm]
            step_s *= host * self._machine(step_s)
            if arm == sc.PLAIN and self.last_arm not in (None, sc.PLAIN):
                step_s *= SWITCH_PENALTY
            committed = min(per_step, new_tokens - done)
            step_s *= committed / per_step if arm != sc.PLAIN else 1.0  # a last step drafts what is left
            if sampled and not held:
                pending = (c, arm, committed * c, step_s, context + self.key_offset, after)
            after = arm
            self.last_arm = arm
            done += committed
            context += committed
            seconds += step_s
        if held_starts:
            ch.credit_held(len(held_starts), (len(held_starts) - 1) * self.held_samples,
                           held_starts[-1] - held_starts[0])
        return seconds

    def run_fixed(self, arm: str, new_tokens: int, arms: dict, host: float = 1.0) -> float:
        """Seconds for an engine that runs ``arm`` every step, under the same machine."""
        done, seconds = 0.0, 0.0
        while done < new_tokens:
            step_s, per_step = arms[arm]
            committed = min(per_step, new_tokens - done)
            seconds += step_s * committed / per_step * host * self._machine(step_s)
            done += committed
        return seconds

    def _machine(self, seconds: float = 0.0) -> float:
        factor = self.rng.lognormvariate(0.0, self.noise)
        if self.wander:
            # The machine's speed wanders over seconds (an AR(1) log speed).
            import math
            keep = math.exp(-seconds / self.wander_tau)
            self._log_speed = keep * self._log_speed + self.wander * math.sqrt(1 - keep * keep) * self.rng.gauss(0, 1)
            factor *= math.exp(self._log_speed)
        if self.spike_left or self.rng.random() < self.spikes / self.spike_run:
            # Now and then this shared machine runs three times slower,
            # for spike_run steps in a row.
            self.spike_left = (self.spike_left or self.spike_run) - 1
            factor *= 3.0
        return factor


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("sweep", type=Path)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--noise", type=float, default=0.08)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--drift", type=float, default=0.0, help="first repeat this much slower than the last")
    ap.add_argument("--phase", type=float, default=0.0, help="log-normal sigma of the machine's speed per trial")
    ap.add_argument("--spikes", type=float, default=0.0, help="share of steps that take three times as long")
    ap.add_argument("--spike-run", type=int, default=1, help="steps a slow spell lasts (same share of steps)")
    ap.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE",
                    help="override a constant of schedule_choice, e.g. RETRY_TIME_SHARE=0.03")
    ap.add_argument("--no-held-samples", action="store_true", help="held plain steps are credited, not timed")
    ap.add_argument("--trace", help='one cell\'s steps per repeat (seed 0), e.g. "short c8 d2"')
    ap.add_argument("--wander", type=float, default=0.0,
                    help="sigma of the machine's log speed wandering within trials (time constant --wander-tau)")
    ap.add_argument("--wander-tau", type=float, default=1.0)
    ap.add_argument("--without-policy", action="store_true", help="auto's arms are plain and pipelined only")
    ap.add_argument("--acceptance-key", action="store_true",
                    help="with --text: the chooser's key tells a hard trial from an easy one")
    ap.add_argument("--text", type=float, default=0.0,
                    help="greedy cells: sigma of a trial's log text difficulty at width 1 (over sqrt(c) at width c); "
                         "it scales the policy's tokens per step by exp(h) and the pipeline's by exp(0.4 h)")
    args = ap.parse_args()
    if args.without_policy:
        sc.ARMS = (sc.PLAIN, sc.PIPELINED)
    rec = json.loads(args.sweep.read_text())
    for item in args.set:
        name, value = item.split("=")
        setattr(sc, name, type(getattr(sc, name))(value))
    Engine.held_samples = not args.no_held_samples
    Engine.spikes, Engine.spike_run = args.spikes, args.spike_run
    Engine.wander, Engine.wander_tau = args.wander, args.wander_tau
    settings = rec["settings"]
    cells = [(t, s) for t in rec["temperatures"] for s in settings]
    key = (lambda t, s: s if not t else f"{s} T{t:g}")
    loss = {}  # (cell, c, d) -> [auto/best ratios over seeds x repeats]
    for seed in range(args.seeds):
        rng = random.Random(seed)
        for d in (1, 2, 3):
            engine = Engine(rng, args.noise)
            for rep in range(args.repeats):
                for t, s in cells:
                    for c in rec["concurrency"]:
                        name = key(t, s)
                        arms = arms_of(rec["results"][name][str(c)], rec["raw"][name][str(c)], c, d)
                        if arms is None:
                            continue
                        new_tokens = settings[s]["new_tokens"]
                        mix = 2 if t else 0
                        h = 0.0
                        if args.text and not t:
                            # The trial's text: easy or hard for every arm that
                            # drafts (at width 1, d1, the policy's rounds ran at
                            # 1000 tokens/s per request on easy text and 350 on
                            # hard, the pipeline at 700 and 470: findings,
                            # twenty-ninth session); a wide batch averages its rows.
                            h = rng.gauss(0.0, args.text / math.sqrt(c))
                            weight = {sc.PLAIN: 0.0, sc.POLICY: 1.0, sc.PIPELINED: 0.4}
                            arms = {a: (step_s, max(1.0, per_step * math.exp(h * weight[a])) if a != sc.PLAIN else per_step)
                                    for a, (step_s, per_step) in arms.items()}
                        # The machine's speed in this trial: a trend over the run
                        # (the sweeps' first repeats ran up to 1.6x slower) and
                        # a phase per trial.
                        host = (1 + args.drift * (args.repeats - 1 - rep) / max(args.repeats - 1, 1)) \
                            * rng.lognormvariate(0.0, args.phase)
                        # --acceptance-key: the chooser's key also tells easy text
                        # from hard (a context far from any other, so nothing is
                        # borrowed across it), as a key with an acceptance bucket would.
                        engine.key_offset = (1 << 20) * (args.acceptance_key and not t and h < 0)
                        auto = engine.run(c, mix, PROMPT_TOKENS[s], new_tokens, arms, host)
                        # The best single arm and plain steps, each run by an
                        # engine of its own on the same machine (its own draws).
                        best_arm = min(arms, key=lambda a: arms[a][0] / arms[a][1])
                        fixed = Engine(rng, args.noise)
                        best = fixed.run_fixed(best_arm, new_tokens, arms, host)
                        plain = fixed.run_fixed(sc.PLAIN, new_tokens, arms, host)
                        loss.setdefault((name, c, d), []).append((rep, best / auto, plain / auto))
                        if args.trace and seed == 0 and f"{name} c{c} d{d}" == args.trace:
                            print(rep, f"{best / auto:.2f}", " ".join(engine.trace))
    print(f"{'cell':10s} {'c':>3s} {'d':>2s}  auto/best-arm by repeat (median over seeds)  auto/native  median")
    met = {d: [0, 0, 0] for d in (1, 2, 3)}
    for (name, c, d), rows in loss.items():
        by_rep = [statistics.median(r[1] for r in rows if r[0] == rep) for rep in range(args.repeats)]
        vs_best = statistics.median(r[1] for r in rows)
        vs_native = statistics.median(r[2] for r in rows)
        met[d][0] += 1
        met[d][1] += vs_best >= 0.95
        met[d][2] += vs_native >= 0.97
        print(f"{name:10s} {c:3d} {d:2d}  {' '.join(f'{x:.2f}' for x in by_rep)}   {vs_native:.2f}   {vs_best:.2f}")
    print(f"mean of medians: {statistics.mean(statistics.median(r[1] for r in rows) for rows in loss.values()):.4f} "
          f"of the best arm, {statistics.mean(statistics.median(r[2] for r in rows) for rows in loss.values()):.4f} "
          "of native")
    for d, (n, best, native) in met.items():
        print(f"d{d}: within 5% of its best arm in {best}/{n}, >= 0.97x native in {native}/{n}")


if __name__ == "__main__":
    main()
