"""Issue 13 diagnostic: cProfile of engine steps: native vs an auto d2 engine whose chooser always
answers plain with a hold (held plain steps), c16, T=0.8, short prompts.
Prints per-step time by function (tottime), and the functions where the
held engine spends more. Thirty-seventh session: benchmarks/results/held_plain_profile_thirty_seventh.txt.

    python benchmarks/probes/held_plain_profile.py
"""
import cProfile, pstats, sys, time, types
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent)); sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _probe  # noqa
from _probe import CHECKPOINT, ENGINE_ARGS, load_prompts
from vllm import LLM, SamplingParams
from vllm_loopspec.engine_internals import model_runner
from chooser_ab import choose_plain

prompts = load_prompts("mixed")[:16]
native = LLM(CHECKPOINT, **ENGINE_ARGS)
auto = LLM(CHECKPOINT, speculative_config={"method": "loopspec", "draft_loops": 2, "schedule": "auto"}, **ENGINE_ARGS)
ch = model_runner(auto).drafter.chooser
ch.choose = types.MethodType(choose_plain, ch)

def run(llm, prof=None):
    eng = llm.llm_engine
    sp = SamplingParams(max_tokens=128, temperature=0.8, ignore_eos=True, seed=None)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{time.monotonic_ns()}-{i}", p, sp)
    eng.step()
    steps = 0
    t = time.perf_counter()
    if prof: prof.enable()
    while eng.has_unfinished_requests():
        eng.step(); steps += 1
    if prof: prof.disable()
    return steps, time.perf_counter() - t

for llm in (native, auto, native, auto):
    run(llm)
profs = {}
tot = {}
for name, llm in (("native", native), ("auto", auto)):
    profs[name] = cProfile.Profile(); tot[name] = [0, 0.0]
for rep in range(3):
    for name, llm in (("native", native), ("auto", auto)):
        s, t = run(llm, profs[name]); tot[name][0] += s; tot[name][1] += t
for name in tot:
    print(name, "steps", tot[name][0], "us/step (profiled)", round(1e6 * tot[name][1] / tot[name][0], 1))
def table(p, steps):
    st = pstats.Stats(p); out = {}
    for (f, l, fn), (cc, nc, tt, ct, callers) in st.stats.items():
        key = f"{f.split('site-packages/')[-1].split('/work/main/')[-1]}:{fn}"
        out[key] = out.get(key, 0) + tt
    return {k: 1e6 * v / steps for k, v in out.items()}
n = table(profs["native"], tot["native"][0]); a = table(profs["auto"], tot["auto"][0])
keys = set(n) | set(a)
diff = sorted(keys, key=lambda k: a.get(k, 0) - n.get(k, 0), reverse=True)
print("\nfunctions where the held engine spends more (us/step tottime: auto, native, diff)")
for k in diff[:30]:
    print(f"{a.get(k,0):8.1f} {n.get(k,0):8.1f} {a.get(k,0)-n.get(k,0):+8.1f}  {k}")
print("\nwhere it spends less")
for k in diff[-10:]:
    print(f"{a.get(k,0):8.1f} {n.get(k,0):8.1f} {a.get(k,0)-n.get(k,0):+8.1f}  {k}")
