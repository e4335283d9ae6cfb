"""Issue 13 tool: the acceptance every greedy request of the sweep's prompts
would see, for the policy replay (``policy_sim.py``). Writes
``benchmarks/results/greedy_acceptance_traces.json``.

Per prompt (the ``mixed`` set, 128 new tokens, and the ``long`` set, 192;
the sweep's settings) and draft depth ``d``: ``runs[t]``, how many drafts a
round started after ``t`` committed tokens would have accepted (up to
:data:`MAX_RUN`). A greedy draft chain follows the committed text while it
is accepted, so draft ``j`` of a round at ``t`` is the depth-``d`` argmax
at committed position ``t + j - 1``: one pass of the reference model over
prompt and output gives every round's outcome. The output is vLLM's
native greedy decode (float32)."""
import json
import sys

import torch

from _probe import CHECKPOINT, ENGINE_ARGS, ROOT, load_prompts

MAX_RUN = 32
SETTINGS = {"short": ("mixed", 128), "long": ("long", 192)}


def runs_of(match: list[bool]) -> list[int]:
    """``runs[t]``: consecutive True from ``t`` on (capped)."""
    out, run = [0] * len(match), 0
    for t in range(len(match) - 1, -1, -1):
        run = run + 1 if match[t] else 0
        out[t] = min(run, MAX_RUN)
    return out


def main():
    from vllm import LLM, SamplingParams
    from vllm_loopspec.reference import OuroReference

    llm = LLM(CHECKPOINT, **ENGINE_ARGS)
    model = OuroReference.from_pretrained(CHECKPOINT)
    loops = model.config.total_ut_steps
    record = {"checkpoint": "checkpoints/ouro-stdlib", "max_run": MAX_RUN, "loops": loops, "settings": {}}
    for setting, (prompt_set, new_tokens) in SETTINGS.items():
        prompts = load_prompts(prompt_set)
        outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
        rows = []
        for out in outs:
            prompt_ids, ids = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
            seq = torch.tensor(prompt_ids + ids)
            with torch.no_grad():
                logits = model.loop_logits(seq, loops)
            start = len(prompt_ids) - 1  # position whose next token is ids[0]
            row = {"prompt_tokens": len(prompt_ids), "runs": {}}
            full = logits[loops - 1][0, start:start + len(ids)].argmax(-1).tolist()
            row["full_depth_agrees"] = sum(a == b for a, b in zip(full, ids)) / len(ids)
            for d in range(1, loops):
                shallow = logits[d - 1][0, start:start + len(ids)].argmax(-1).tolist()
                row["runs"][str(d)] = runs_of([a == b for a, b in zip(shallow, ids)])
            rows.append(row)
        record["settings"][setting] = {"prompts": prompt_set, "new_tokens": new_tokens, "requests": rows}
        print(setting, "full-depth agreement", min(r["full_depth_agrees"] for r in rows), flush=True)
    out = ROOT / "benchmarks" / "results" / "greedy_acceptance_traces.json"
    out.write_text(json.dumps(record) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
