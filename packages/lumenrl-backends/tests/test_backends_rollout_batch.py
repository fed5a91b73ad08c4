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
    prompts = torch.randint(1, 100, (rows, 3), generator=g)
    prompt_mask = (torch.arange(3) >= torch.randint(0, 3, (rows, 1), generator=g)).long()  # left padding
    out = build_rollout_batch(requests, prompts, prompt_mask, width=width, pad_id=pad, tokenizer=_Tok(), meta_info={})
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
    attention = torch.cat([prompt_mask, mask], dim=1)
    assert torch.equal(out.batch["attention_mask"], attention)
    assert torch.equal(out.batch["position_ids"], (attention.cumsum(dim=1) - 1).clamp(min=0))
    assert {k: out.batch[k].dtype for k in ("input_ids", "attention_mask", "position_ids", "rollout_log_probs")} == {
        "input_ids": torch.int64, "attention_mask": torch.int64, "position_ids": torch.int64,
        "rollout_log_probs": torch.float32}


@pytest.mark.parametrize("clean_up", [False, True])
def test_decode_texts_is_batch_decode(clean_up):
    """The direct backend decode (no clean-up) and the fallback both give ``batch_decode``'s strings, special
    tokens dropped, on random ids of a locally built tokenizer."""
    from transformers import AutoTokenizer

    from lumenrl_backends.engines.requests import decode_texts
    from lumenrl_backends.models.builtin import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("lumenrl:tiny-qwen3-arith"))
    tok.clean_up_tokenization_spaces = clean_up
    g = torch.Generator().manual_seed(int(clean_up))
    rows = [torch.randint(0, len(tok), (int(n),), generator=g).tolist() for n in torch.randint(0, 40, (12,), generator=g)]
    rows[0] = list(tok.all_special_ids) + rows[0]
    assert decode_texts(tok, rows) == tok.batch_decode(rows, skip_special_tokens=True)


@pytest.mark.parametrize("seed", [0, 1])
def test_left_pad_and_unpad_round_trip(seed):
    """``left_pad`` against the per-row loop it replaced (ragged rows, an empty one, a width wider than the
    longest); ``_unpad`` gives the rows back."""
    from lumenrl_backends.engines.requests import _unpad, left_pad

    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, 1000, (int(n),), generator=g).tolist() for n in torch.randint(0, 30, (11,), generator=g)]
    seqs[3] = []
    for width in (0, 40):
        ids, mask = left_pad(seqs, 7, torch.device("cpu"), width=width)
        w = max(width, max(map(len, seqs)))
        want_ids, want_mask = torch.full((len(seqs), w), 7), torch.zeros(len(seqs), w, dtype=torch.int64)
        for i, s in enumerate(seqs):
            if s:
                want_ids[i, w - len(s):], want_mask[i, w - len(s):] = torch.tensor(s), 1
        assert torch.equal(ids, want_ids) and torch.equal(mask, want_mask) and ids.dtype == torch.int64
        assert _unpad(ids, mask) == seqs
