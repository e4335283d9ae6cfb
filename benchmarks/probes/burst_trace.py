"""Issue 13 diagnostic: ``benchmarks/adaptive_burst.py`` with the
``"auto"`` chooser's every choice logged (width, sampling mix, mean
context, arm, reason, hold; from :data:`RATES_FROM_WIDTH` rows on, also
the key's rate per arm as ``[tokens/s per request, samples, own samples,
borrowed, median step ms]``), so a burst's speculative steps can be told
apart: measuring steps, tries of a losing arm, or verdicts, and what they
were decided on. Arguments are
``adaptive_burst.py``'s; the log is added to its ``--out`` JSON as
``chooser_log`` (``["START", tag]`` entries begin each timeline).

    python benchmarks/probes/burst_trace.py --compiled --schedule auto --repeats 9 --out OUT.json
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import adaptive_burst  # noqa: E402
from vllm_loopspec.speculative import schedule_choice  # noqa: E402

LOG: list = []
RATES_FROM_WIDTH = 9  # the burst's steps (17 rows) and the batch narrowing after it


def main() -> None:
    choose = schedule_choice.ScheduleChooser.choose

    def logged_choose(self, width, mix, context=0, in_flight=None):
        out = choose(self, width, mix, context, in_flight)
        entry = [width, mix, context, out.arm, out.reason, out.hold]
        if width >= RATES_FROM_WIDTH:
            entry.append({arm: [round(r.rate), r.samples, r.own, r.borrowed, round(1000 * r.step_seconds, 1)]
                          for arm, r in self._last_key.arms.items()})
        LOG.append(entry)
        return out

    run_timeline = adaptive_burst.run_timeline

    def logged_run_timeline(llm, args, greedy_prompt, burst_prompts, tag):
        LOG.append(["START", tag])
        return run_timeline(llm, args, greedy_prompt, burst_prompts, tag)

    schedule_choice.ScheduleChooser.choose = logged_choose
    adaptive_burst.run_timeline = logged_run_timeline
    adaptive_burst.main()
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    record = json.loads(out.read_text())
    record["chooser_log"] = LOG
    out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
