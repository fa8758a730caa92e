# SPDX-License-Identifier: Apache-2.0
"""Route a Hugging Face transformers model's attention through kvsieve: helpers over the package
module ``kvsieve.transformers`` (which is what to use; see docs/bindings.md).

``kvsieve.transformers.KvsieveCache`` is a ``transformers.Cache`` (one kvsieve ``Session`` per batch
row) and the ``"kvsieve"`` attention function stores the new tokens' post-RoPE K/V in it and attends
there: the prompt through ``Session.prefill`` + ``build_index`` (exact), every later single token
through a decode step (the method's sparse attention), several later tokens through
``Session.append`` (exact). With it, ``model.generate(...)`` works as is::

    import kvsieve.transformers as kt
    model.set_attn_implementation(kt.NAME)
    cache = kt.KvsieveCache(model.config, method="quest", budget=0.05)
    out = model.generate(input_ids, attention_mask=mask, past_key_values=cache, max_new_tokens=64)

This file keeps the step-by-step helpers of the earlier example (same names, same behaviour)::

    import kvsieve_hf
    kvsieve_hf.register()                       # done by importing kvsieve.transformers already
    model.set_attn_implementation("kvsieve")
    cache = kvsieve_hf.KvsieveCache(model.config, method="quest", budget=0.05)
    logits = kvsieve_hf.forward(model, input_ids, cache)       # prompt
    logits = kvsieve_hf.forward(model, next_ids, cache)        # one decode step
    ids = kvsieve_hf.greedy_generate(model, input_ids, cache, max_new_tokens=64)

Batches without padding work with these helpers too (input_ids [B, n], one session per row); for
padded batches use generate() with the attention mask.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvsieve.transformers import NAME, KvsieveCache, kvsieve_attention, kvsieve_mask, register  # noqa: F401

__all__ = ["NAME", "KvsieveCache", "kvsieve_attention", "register", "forward", "greedy_generate"]


def forward(model, input_ids: torch.Tensor, cache: KvsieveCache, **kwargs):
    """Runs the model on the next tokens of the sequences held by ``cache`` (input_ids [B, n], no
    padding) and returns the logits [B, n, vocab]. Positions continue from the cache's length."""
    n = input_ids.shape[-1]
    start = cache.get_seq_length()
    pos = torch.arange(start, start + n, device=input_ids.device).unsqueeze(0).expand(input_ids.shape[0], -1)
    out = model(input_ids=input_ids, position_ids=pos, past_key_values=cache, use_cache=True, **kwargs)
    if cache.backend == "cuda":
        torch.cuda.current_stream(input_ids.device).synchronize()
    return out.logits


@torch.no_grad()
def greedy_generate(model, input_ids: torch.Tensor, cache: KvsieveCache, max_new_tokens: int,
                    eos_token_id: Optional[int] = None) -> torch.Tensor:
    """Greedy decoding of one sequence: the prompt through prefill, then one kvsieve decode per token
    and layer. Returns the new token ids [1, m] (model.generate with past_key_values=cache does the
    same and more)."""
    logits = forward(model, input_ids, cache, logits_to_keep=1)   # not [n, vocab] for a long prompt
    new = []
    for _ in range(max_new_tokens):
        tok = logits[:, -1].argmax(-1, keepdim=True)
        new.append(tok)
        if eos_token_id is not None and int(tok) == eos_token_id:
            break
        logits = forward(model, tok, cache)
    return torch.cat(new, dim=1) if new else input_ids[:, :0]
