"""TRL's GRPOTrainer with an FP8 rollout copy (lumenrl-quant) and token-level TIS. No fork of TRL.

- Rollout: TRL generates with the model itself (no vLLM). ``_generate_single_turn`` is TRL's generation
  step; the subclass runs it on an FP8 blockwise copy of the policy (``quantize_model``), requantized in
  place from the trained weights before every generation (``reload_quantized_weights_``: the weight sync).
  Training stays in the policy's dtype.
- Correction: the rollout log-probs come from the FP8 copy, the trainer's from the policy; token-level TIS
  weights ``min(p_train / p_rollout, C)`` (``tis_token_weights``) enter TRL's loss through its (B, T)
  advantages hook: for every clipped-ratio loss (grpo, bnpo, dr_grpo, dapo, cispo, sapo) the per-token
  loss is linear in the advantage, so ``A * w`` is exactly the IS-weighted loss.
- Logged per step (``trainer.state.log_history``): ``rollout/logprob_abs_diff_mean`` (train/infer gap),
  ``rollout_correction/kl_before_tis`` = KL(train || rollout) and ``kl_after_tis`` = KL(train || q_TIS),
  exact over the vocabulary (``train_rollout_kl``), and TIS weight statistics.

Single process, as written (TRL's own generation path); with vLLM use TRL's
``vllm_importance_sampling_correction`` instead. Run: ``python examples/other_stacks/trl_grpo_fp8_tis.py``.
"""

from __future__ import annotations

import copy
import string
import tempfile

import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders
from tokenizers.models import BPE
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

from lumenrl_quant import (
    quantize_model,
    reload_quantized_weights_,
    rollout_correction_metrics,
    tis_token_weights,
    train_rollout_kl,
)


class Fp8RolloutGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that samples from an FP8 copy of the policy and corrects the loss with token-level TIS."""

    def __init__(self, *args, rollout_scheme: str = "fp8_block", tis_clip: float = 2.0, **kwargs):
        super().__init__(*args, **kwargs)
        if self.use_vllm or self.loss_type == "vespo":
            raise ValueError(f"Fp8RolloutGRPOTrainer: use_vllm={self.use_vllm}, loss_type={self.loss_type!r}; "
                             "it needs TRL's own generation and a loss linear in the advantage (not 'vespo')")
        self.tis_clip = tis_clip
        self.rollout_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.rollout_report = quantize_model(self.rollout_model, rollout_scheme)  # decoder linears -> FP8

    def _generate_single_turn(self, *args, **kwargs):
        reload_quantized_weights_(self.rollout_model, self.model.state_dict())  # weight sync: requantize in place
        policy, self.model_wrapped = self.model_wrapped, self.rollout_model  # TRL generates with model_wrapped
        try:
            return super()._generate_single_turn(*args, **kwargs)
        finally:
            self.model_wrapped = policy

    def _response_log_probs(self, model, out) -> torch.Tensor:
        """(B, T, V) float32 log-softmax of ``model`` at the completion positions, at the sampling temperature."""
        ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
        attention = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
        width = out["completion_ids"].shape[1]
        logits = model(input_ids=ids, attention_mask=attention).logits[:, -width - 1:-1]
        return torch.log_softmax(logits.float() / self.temperature, dim=-1)

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        mask = out["completion_mask"] * out.get("tool_mask", 1)
        with torch.no_grad():
            lp_train, lp_rollout = self._response_log_probs(self.model, out), self._response_log_probs(self.rollout_model, out)
        tokens = out["completion_ids"].unsqueeze(-1)
        old, rollout = lp_train.gather(-1, tokens).squeeze(-1), lp_rollout.gather(-1, tokens).squeeze(-1)  # (B, T)
        weights = tis_token_weights(old, rollout, mask, clip=self.tis_clip)
        out["sampling_per_token_logps"] = rollout
        out["advantages"] = out["advantages"].unsqueeze(1) * weights  # TRL accepts (B, T) advantages
        metrics = rollout_correction_metrics(old, rollout, mask, is_weights=weights, clipped=(old - rollout).exp() > self.tis_clip)
        metrics["rollout/logprob_abs_diff_mean"] = float(((old - rollout).abs() * mask).sum() / mask.sum().clamp(min=1))
        metrics["rollout_correction/kl_before_tis"] = float(train_rollout_kl(lp_train, lp_rollout, mask))
        metrics["rollout_correction/kl_after_tis"] = float(train_rollout_kl(lp_train, lp_rollout, mask, tis_clip=self.tis_clip))
        mode = "train" if self.model.training else "eval"
        for name, value in metrics.items():
            self._metrics[mode][name].append(value)
        return out


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer built in memory (stands in for ``AutoTokenizer.from_pretrained``)."""
    vocab = {tok: i for i, tok in enumerate(["<pad>", "<eos>", "<unk>", *string.ascii_lowercase, *string.digits, " ", ":"])}
    backend = Tokenizer(BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_policy(tokenizer, path: str) -> str:
    """A 2-layer Llama built from a config and saved to ``path`` (stands in for a hub checkpoint)."""
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def reward_letter_a(completions, **kwargs) -> list[float]:
    """Share of 'a' characters in each completion: a reward the policy can move quickly."""
    return [text.count("a") / max(len(text), 1) for text in completions]


def main(steps: int = 4, output_dir: str | None = None) -> Fp8RolloutGRPOTrainer:
    output_dir = output_dir or tempfile.mkdtemp(prefix="trl_fp8_")
    tokenizer = char_tokenizer()
    dataset = Dataset.from_list([{"prompt": f"say {c}{c}:"} for c in "abcdefgh"])  # equal-length prompts
    args = GRPOConfig(output_dir=output_dir, max_steps=steps, learning_rate=1e-3, per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=12, logging_steps=1, report_to=[], use_cpu=True,
                      save_strategy="no", seed=0, disable_tqdm=True)
    trainer = Fp8RolloutGRPOTrainer(model=tiny_policy(tokenizer, f"{output_dir}/policy"), args=args,
                                    reward_funcs=reward_letter_a, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    return trainer


if __name__ == "__main__":
    keys = ("step", "reward", "rollout/logprob_abs_diff_mean", "rollout_correction/kl_before_tis",
            "rollout_correction/kl_after_tis")
    for row in main().state.log_history:
        if "rollout_correction/kl_before_tis" in row:
            print({k: row[k] for k in keys})
