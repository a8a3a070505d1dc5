"""Helpers for the OpenAI-compatible API tests: a worker with two API keys, and independent references."""

from __future__ import annotations

from pathlib import Path

import numpy as np

KEY_A, KEY_B = "key-tenant-a", "key-tenant-b"
CHATML_USER_TURN = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"  # tiny_model's ChatML template


def start_worker(model_dir: Path, root: Path, *extra: str):
    """A worker of its own, in this process, for the two tenants."""
    from support import InProcessWorker

    return InProcessWorker(model_dir, root / "storage", *extra, api_keys=[KEY_A, KEY_B]).start()


def openai_url(worker) -> str:
    return worker.base_url + "/api/openai/v1"


def chat_prompt_ids(tokenizer, user_text: str) -> list[int]:
    """The prompt of a one-message chat, from the literal ChatML text (not through apply_chat_template)."""
    return tokenizer.encode(CHATML_USER_TURN.format(user_text), add_special_tokens=False)


def reference_logprobs(model, tokens: list[int], start: int, k: int) -> tuple[np.ndarray, list[list[int]], np.ndarray]:
    """With transformers directly: for positions start.., the log-probability of each token given the ones
    before it, the ids of the k most likely tokens there, and their log-probabilities."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    rows = logp[start - 1:len(tokens) - 1]
    chosen = rows.gather(1, torch.tensor(tokens[start:]).unsqueeze(1)).squeeze(1)
    top = torch.topk(rows, k, dim=-1)
    return chosen.numpy(), top.indices.tolist(), top.values.numpy()
