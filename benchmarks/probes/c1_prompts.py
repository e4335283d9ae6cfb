"""Issue 13 check: is auto's deficit at short greedy c1 in the sweep (0.82x
of pipelined d1 K16 on `ee8af3b`) a loss at c1, or a property of the five
prompts that cell decodes (the sweep's repeat r takes ``mixed`` prompt r)?
Native, a round of d1 K16 (pinned), pipelined d1 K16 and auto d1, one
prompt per repeat, REPEATS prompts in turn, 128 greedy tokens, interleaved;
per arm the median tok/s and the median per-prompt ratio to pipelined.

    python benchmarks/probes/c1_prompts.py REPEATS OUT"""
import json, statistics, sys

from _probe import CHECKPOINT, ENGINE_ARGS, ROOT, load_prompts

sys.path.insert(0, str(ROOT / "benchmarks"))


def main():
    from vllm import LLM
    from loopspec_decode import decode_trial
    repeats, out = int(sys.argv[1]), sys.argv[2]
    arms = {"native": None,
            "round d1 K16": {"method": "loopspec", "num_speculative_tokens": 16, "draft_loops": 1, "adaptive": False},
            "pipelined d1 K16": {"method": "loopspec", "num_speculative_tokens": 16, "draft_loops": 1,
                                 "schedule": "pipelined"},
            "auto d1": {"method": "loopspec", "draft_loops": 1, "schedule": "auto"}}
    llms = {name: LLM(CHECKPOINT, speculative_config=spec, **ENGINE_ARGS | {"max_num_seqs": 4})
            for name, spec in arms.items()}
    prompts = load_prompts("mixed")
    for llm in llms.values():
        decode_trial(llm, prompts[:1], 16)  # warm-up
    rates = {name: [] for name in arms}
    for rep in range(repeats):
        for name, llm in llms.items():
            rates[name].append(decode_trial(llm, [prompts[rep % len(prompts)]], 128)["tokens_per_s"])
        print(rep, {name: round(r[-1]) for name, r in rates.items()}, flush=True)
    summary = {name: {"median": statistics.median(r),
                      "vs_pipelined_paired": statistics.median(a / b for a, b in zip(r, rates["pipelined d1 K16"]))}
               for name, r in rates.items()}
    print(json.dumps(summary, indent=1))
    with open(out, "w") as f:
        json.dump({"probe": "c1_prompts", "command": " ".join(["python", *sys.argv]), "summary": summary,
                   "tokens_per_s": rates}, f, indent=1)


if __name__ == "__main__":
    main()
