"""Issue 13 check: is the second of two back-to-back trials of the same
prompts slower, whichever engine runs it (``auto_cost_split.py`` with and
without ``--native-after``: 3-4% in the sampled cells), and does a garbage
collection before each trial change that? Two native engines, WIDTH
``long`` prompts at TEMPERATURE; each repeat a pair of trials, the engines'
order alternating; REPEATS pairs without, then REPEATS with ``gc.collect()``
before each trial. Per mode: the median of second over first (tokens/s).
With ``auto`` as the last argument the second engine is a d1 ``"schedule":
"auto"`` one, and each mode also reports it over native by which ran first.

    python benchmarks/probes/pair_order.py WIDTH TEMPERATURE REPEATS OUT [auto]"""
import gc, json, statistics, sys

from _probe import CHECKPOINT, ENGINE_ARGS, ROOT, load_prompts

sys.path.insert(0, str(ROOT / "benchmarks"))


def main():
    from vllm import LLM
    from loopspec_decode import decode_trial
    width, temperature, repeats, out = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    second = sys.argv[5] if len(sys.argv) > 5 else "native"
    spec = {"method": "loopspec", "draft_loops": 1, "schedule": "auto"} if second == "auto" else None
    engine_args = ENGINE_ARGS | {"max_num_seqs": max(width, 4)}
    engines = [LLM(CHECKPOINT, **engine_args), LLM(CHECKPOINT, speculative_config=spec, **engine_args)]
    prompts = load_prompts("long")
    for llm in engines:
        decode_trial(llm, prompts[:width], 16)  # warm-up
    record = {"probe": "pair_order", "command": " ".join(["python", *sys.argv]), "modes": {}}
    for mode in ("plain", "gc.collect before each trial"):
        ratios, pairs = [], []
        for rep in range(repeats):
            batch = [prompts[(rep * width + i) % len(prompts)] for i in range(width)]
            order = engines if rep % 2 == 0 else engines[::-1]
            rates = []
            for llm in order:
                if mode != "plain":
                    gc.collect()
                rates.append(decode_trial(llm, batch, 192, temperature=temperature)["tokens_per_s"])
            ratios.append(rates[1] / rates[0])
            pairs.append(rates)
        # The second engine over the first (native), by which of them ran first.
        b_over_a = [(p[1] / p[0]) if rep % 2 == 0 else (p[0] / p[1]) for rep, p in enumerate(pairs)]
        by_order = {"first engine first": statistics.median(b_over_a[0::2]),
                    "second engine first": statistics.median(b_over_a[1::2])}
        record["modes"][mode] = {"second_over_first_median": statistics.median(ratios), "ratios": ratios,
                                 "pairs": pairs, f"{second} over native by order": by_order}
        print(mode, round(statistics.median(ratios), 3), [round(r, 3) for r in ratios],
              {k: round(v, 3) for k, v in by_order.items()}, flush=True)
    with open(out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
