"""``build_rollout_batch``: the requests' responses and log-probs laid out as the rollout columns, checked
row by row on fresh random requests (ragged lengths in random order, empty and full-width responses,
interrupted rows)."""

from __future__ import annotations

import pytest
import torch

from lumenrl_backends.engines.requests import INTERRUPTED, LENGTH, Request, build_rollout_batch


class _Tok:
    def batch_decode(self, rows, **_):
        return [" ".join(map(str, row)) for row in rows]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_columns_match_each_request(seed):
    g = torch.Generator().manual_seed(seed)
    rows, width, pad = 9, 7, 5
    lengths = torch.randint(0, width + 1, (rows,), generator=g).tolist()
    lengths[int(torch.randint(0, rows, (1,), generator=g))] = 0
    lengths[int(torch.randint(0, rows, (1,), generator=g))] = width
    requests = []
    for i, n in enumerate(lengths):  # the engine's requests: row i of the caller's batch at position i
        requests.append(Request(index=i, prompt=[1, 2, 3], seed=i, response=torch.randint(0, 100, (n,), generator=g).tolist(),
                                log_probs=(-torch.rand(n, generator=g)).tolist(), finish_reason=LENGTH if n % 2 else None))
    prompts = torch.ones(rows, 3, dtype=torch.int64)
    out = build_rollout_batch(requests, prompts, torch.ones_like(prompts), width=width, pad_id=pad, tokenizer=_Tok(),
                              meta_info={})
    responses, mask, log_probs = (out.batch[k] for k in ("responses", "response_mask", "rollout_log_probs"))
    assert responses.shape == mask.shape == log_probs.shape == (rows, width)
    for r in requests:
        n = len(r.response)
        assert responses[r.index, :n].tolist() == r.response and (responses[r.index, n:] == pad).all()
        assert mask[r.index, :n].all() and not mask[r.index, n:].any()
        assert torch.equal(log_probs[r.index, :n], torch.tensor(r.log_probs)) and not log_probs[r.index, n:].any()
        assert out.non_tensor_batch["response_text"][r.index] == " ".join(map(str, r.response))
        assert out.non_tensor_batch["finish_reason"][r.index] == (r.finish_reason or INTERRUPTED)
    assert torch.equal(out.batch["input_ids"], torch.cat([prompts, responses], dim=1))
