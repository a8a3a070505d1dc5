"""Log-probabilities computed outside the decode loop: teacher-forced (a whole sequence at once) and a prompt's.

Both are float32 ``log_softmax`` of the raw logits, the numbers the trainer computes.
"""

from __future__ import annotations

import torch

__all__ = ["EvalMode", "prompt_logprobs", "teacher_forced_logprobs"]

# Rows of (sequence length x vocab) float32 log-softmax computed at once for prompt logprobs.
_PROMPT_LOGPROB_CHUNK = 256


class EvalMode:
    """Put every submodule in eval mode (no dropout, e.g. LoRA's); restore each one's mode afterwards."""

    def __init__(self, model):
        self.model = model
        self.states: list[tuple[torch.nn.Module, bool]] = []

    def __enter__(self):
        self.states = [(m, m.training) for m in self.model.modules()]
        self.model.eval()
        return self

    def __exit__(self, *exc):
        for m, training in self.states:
            m.training = training
        return False


def teacher_forced_logprobs(model, tokens: list[int]) -> list[float]:
    """Logprob of ``tokens[i]`` given ``tokens[:i]`` for i >= 1 (length ``len(tokens) - 1``), float32."""
    if len(tokens) < 2:
        return []
    device = next(model.parameters()).device
    ids = torch.tensor([tokens], dtype=torch.long, device=device)
    with torch.no_grad(), EvalMode(model):
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
        lp = torch.log_softmax(logits.float(), dim=-1)
        out = lp.gather(-1, ids[0, 1:, None])[:, 0]
    return out.cpu().tolist()


def prompt_logprobs(
    logits: torch.Tensor, prompt: torch.Tensor, want_lp: bool, topk: int
) -> tuple[list[float | None] | None, list[list[tuple[int, float]] | None] | None]:
    """Prompt logprobs from prefill logits ``(P, V)`` (row i predicts token i+1)."""
    n = prompt.shape[0]
    lps: list[float | None] | None = [None] if want_lp else None
    tops: list[list[tuple[int, float]] | None] | None = [None] if topk > 0 else None
    for start in range(0, n - 1, _PROMPT_LOGPROB_CHUNK):
        end = min(start + _PROMPT_LOGPROB_CHUNK, n - 1)
        lp = torch.log_softmax(logits[start:end].float(), dim=-1)
        if lps is not None:
            lps.extend(lp.gather(-1, prompt[start + 1 : end + 1, None])[:, 0].cpu().tolist())
        if tops is not None:
            vals, idx = lp.topk(min(topk, lp.shape[-1]), dim=-1)
            for v_row, i_row in zip(vals.cpu().tolist(), idx.cpu().tolist()):
                tops.append(list(zip(i_row, v_row)))
    return lps, tops
