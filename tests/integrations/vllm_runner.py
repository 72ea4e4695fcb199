"""Serves a multi-turn workload through stock ``vllm.LLM`` in this process, one engine after
another, with or without kvtier's offloading spec, and prints one line ``VLLM_RUNNER <json>``:
per engine, the greedy outputs and cached tokens per turn, and vLLM's metrics (its cached
tokens by source, kvtier's ``vllm:kv_offload_kvtier_*``).

``python vllm_runner.py MODEL_DIR RUNS_JSON``: a list of runs, each with ``extra`` (the spec's
extra config, or null for no offloading), ``clients``, ``turns``, ``reset`` (reset vLLM's own
prefix cache after every turn) and ``gpu_blocks`` (vLLM's KV cache in blocks). The tests run it
in a child process, so vLLM's thread settings never reach the test process; each engine is shut
down before the next starts (the spec's worker then hands storage what the host holds).
"""

from __future__ import annotations

import gc
import json
import os
import random
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

BLOCK = 32


def kv_transfer_config(extra: dict | None) -> dict | None:
    if extra is None:
        return None
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"spec_name": "KvtierOffloadingSpec",
                                          "spec_module_path": "kvtier.integrations.vllm", **extra}}


def metrics(llm) -> dict:
    """vLLM's counters and gauges this test reads: ``name`` or ``name.label`` -> value."""
    out = {}
    for m in llm.get_metrics():
        if m.name.startswith(("vllm:kv_offload_kvtier_", "vllm:prompt_tokens_cached")):
            extra = [v for k, v in m.labels.items() if k not in ("model_name", "engine")]
            out[".".join([m.name, *extra])] = getattr(m, "value", None)
    return out


def main(model: str, opts: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, block_size=BLOCK, dtype="float32",
              max_model_len=512, seed=0, kv_transfer_config=kv_transfer_config(opts.get("extra")),
              disable_log_stats=False, num_gpu_blocks_override=opts.get("gpu_blocks", 200))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, detokenize=False)
    rng = random.Random(0)
    history = [[rng.randrange(1024) for _ in range(200)] for _ in range(opts.get("clients", 3))]
    turns = []
    for _ in range(opts.get("turns", 3)):
        prompts = [h + [rng.randrange(1024) for _ in range(50)] for h in history]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        turns.append({"outputs": [list(o.outputs[0].token_ids) for o in outs],
                      "cached": [o.num_cached_tokens for o in outs]})
        history = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
        if opts.get("reset"):
            assert llm.reset_prefix_cache()
    result = {"turns": turns, "metrics": metrics(llm)}
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return result


if __name__ == "__main__":
    results = [main(sys.argv[1], opts) for opts in json.loads(sys.argv[2])]
    print("VLLM_RUNNER " + json.dumps(results), flush=True)
