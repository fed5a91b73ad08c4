"""R3 route recording under ``torch.compile`` (the native engine's ``compile="full"``): inductor fuses the
route writes of every MoE layer into one kernel per forward (each layer's write is one ``index_put_`` into the
record buffer itself, :class:`lumenrl_moe.RecordTarget`), and the routes equal those of an eager forward.
CPU inductor (C++ kernels); the GPU's Triton code comes from the same scheduler."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lumenrl_moe import RecordTarget, install_routing, uninstall_routing

SHAPE = dict(hidden_size=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=64,
             num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64,
             norm_topk_prob=True, max_position_embeddings=64)


def test_compiled_recording_writes_every_layer_in_one_kernel(inductor_kernel_calls):
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **SHAPE)).eval()
    blocks = [layer.mlp for layer in model.model.layers]  # the MoE blocks chained: what differs with recording

    def forward(h: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            h = h + block(h)
        return h

    x = torch.randn(5, 1, SHAPE["hidden_size"])
    rows, cols = torch.arange(5), torch.tensor([0, 3, 7, 2, 5])  # decode: one token per slot, at its column
    with torch.no_grad():
        torch._dynamo.reset()
        plain_out, (plain_code,) = run_and_get_code(torch.compile(forward), x)
        ctl = install_routing(model)
        try:
            eager = torch.zeros(5, 8, 3, 2, dtype=torch.int16)
            ctl.record(RecordTarget(routes=eager, index=(rows, cols)))
            eager_out = forward(x)
            compiled = torch.zeros_like(eager)
            ctl.record(RecordTarget(routes=compiled, index=(rows, cols)))
            torch._dynamo.reset()
            out, (code,) = run_and_get_code(torch.compile(forward), x)
            ctl.record(None)
        finally:
            uninstall_routing(model)
            torch._dynamo.reset()
    assert torch.equal(compiled, eager) and (compiled[rows, cols] != 0).any()  # routes were recorded, as eager records them
    assert torch.allclose(out, eager_out, atol=1e-5) and torch.allclose(out, plain_out, atol=1e-5)
    assert inductor_kernel_calls(code) - inductor_kernel_calls(plain_code) == 1  # three layers' writes: one kernel
