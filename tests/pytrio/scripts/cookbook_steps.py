"""One step of each pytrio-cookbook trainer (GRPO, SFT, DPO, OPD), unmodified, as a cookbook user runs them:
the trainers open their own ServiceClients from PYTRIO_BASE_URL / PYTRIO_API_KEY."""

import asyncio
import json
import math
import sys
from pathlib import Path

from trio_cookbook import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, OPDConfig, OPDTrainer
from trio_cookbook.trainer import SFTConfig, SFTTrainer

plan = json.loads(Path(sys.argv[1]).read_text())
model = plan["model"]
report = {}


def finite(metrics) -> dict:
    return {k: float(v) for k, v in dict(metrics).items() if isinstance(v, (int, float)) and math.isfinite(v)}


def prompt(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}]}


def even_tokens(completion_ids, **_):
    return [float(sum(t % 2 == 0 for t in ids)) for ids in completion_ids]


grpo = GRPOTrainer(model, reward_funcs=even_tokens, lora_rank=8,
                   args=GRPOConfig(num_generations=4, max_completion_length=8, batch_size=2, seed=3, save_every=1,
                                   learning_rate=1e-3))
result = grpo.step([prompt("what is 2 + 3?"), prompt("name a colour")])
report["grpo"] = {"metrics": finite(result.metrics), "state": getattr(result, "checkpoint", None) or ""}

sft = SFTTrainer(model, lora_rank=8, args=SFTConfig(batch_size=2, seed=3, learning_rate=1e-3))
report["sft"] = {"metrics": finite(asyncio.run(sft.step([{"prompt": "2 + 3 =", "completion": " 5"},
                                                          {"prompt": "the sky is", "completion": " blue"}])))}

dpo = DPOTrainer(model, lora_rank=8, args=DPOConfig(batch_size=1, seed=3, learning_rate=1e-3, prompt_key="prompt"))
result = dpo.step([{"prompt": "2 + 3 =", "chosen": " 5", "rejected": " 7"}])
report["dpo"] = {"metrics": finite(result.metrics)}

opd = OPDTrainer(model, plan["teacher"], lora_rank=8,
                 args=OPDConfig(batch_size=2, num_generations=1, max_completion_length=6, seed=3,
                                learning_rate=1e-3))
result = opd.step([prompt("what is 2 + 3?"), prompt("name a colour")])
report["opd"] = {"metrics": finite(result.metrics)}
Path(sys.argv[2]).write_text(json.dumps(report))
