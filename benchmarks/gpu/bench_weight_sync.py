"""Weight-sync seconds, trainer (FSDP2, fp32 master weights) -> native engine, on one GPU.

For random-initialized Qwen3-1.7B and Qwen3-8B shapes (full size, real vocabulary):

* ``in-process bf16``: ``lumenrl_backends.sync.sync_to_engine`` streams every trainer parameter
  (the 1-rank DTensor's local shard, no gather, no copy) into the bf16 engine's existing storage
  (``copy_`` with the fp32 -> bf16 cast in the same kernel). Bytes moved: 4 read + 2 written per
  parameter; the floor is that over the measured copy bandwidth.
* ``in-process fp8``: the same into an engine whose decoder linears are lumenrl-quant FP8
  (``fp8_block``) ``QuantizedLinear``s, requantized in place.
* ``filesystem`` (1.7B by default): ``publish_snapshot`` (bf16 safetensors + manifest through
  ``lumenrl_async.FilesystemWeightSync``, on local disk) then ``apply_latest_snapshot`` on the
  engine (checksum verified, copied in place): the cross-process path.

    python -m benchmarks.gpu.bench_weight_sync [--shapes 1.7b,8b] [--fs-shapes 1.7b] [--repeats 3]
    python -m benchmarks run gpu --only weight_sync

Writes ``weight_sync.json`` and prints a table last.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu._common import (  # noqa: E402
    StubTokenizer,
    command_line,
    copy_bandwidth_gbs,
    environment,
    print_table,
    write_json,
)
from lumenrl_async import FilesystemWeightSync  # noqa: E402
from lumenrl_backends.engines import NativeEngine  # noqa: E402
from lumenrl_backends.sync import apply_latest_snapshot, publish_snapshot, sync_to_engine  # noqa: E402
from lumenrl_backends.training.fsdp2 import FSDP2Backend  # noqa: E402
from lumenrl_core.config.schema import PolicyTrainConfig  # noqa: E402

SHAPES = {  # hidden, intermediate, layers, heads, kv heads, vocab, tied
    "1.7b": (2048, 6144, 28, 16, 8, 151936, True),
    "8b": (4096, 12288, 36, 32, 8, 151936, False),
    "smoke": (128, 256, 2, 4, 2, 512, True),
}


def build_model(shape: str, device: torch.device, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    hidden, inter, layers, heads, kv, vocab, tied = SHAPES[shape]
    cfg = AutoConfig.for_model(
        "qwen3", hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=128 if shape != "smoke" else 32,
        vocab_size=vocab, tie_word_embeddings=tied, max_position_embeddings=40960, attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    with device:
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def sync_dev(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_in_process(trainer: FSDP2Backend, engine: NativeEngine, repeats: int, version: int) -> dict[str, Any]:
    sync_to_engine(trainer, engine, version)  # warm-up (allocator, first-call overheads)
    stats = [sync_to_engine(trainer, engine, version + 1 + i) for i in range(repeats)]
    secs = [s.seconds for s in stats]
    return {"seconds": statistics.median(secs), "seconds_min": min(secs), "tensors": stats[0].tensors,
            "bytes_read": stats[0].bytes_read}


def _local(param: torch.Tensor) -> torch.Tensor:
    """The rank's shard of an FSDP2 DTensor parameter; the one-rank fast path holds plain Parameters."""
    return param.to_local() if hasattr(param, "to_local") else param


@torch.no_grad()
def check_copied(trainer: FSDP2Backend, engine: NativeEngine) -> float:
    """Max |engine - bf16(trainer)| over the embedding and the final norm (0 when the copy is exact)."""
    err = 0.0
    for name in ("model.embed_tokens.weight", "model.norm.weight"):
        src = _local(trainer.model.get_parameter(name)).to(torch.bfloat16)
        err = max(err, float((engine.model.get_parameter(name) - src).abs().max()))
    return err


@torch.no_grad()
def fp8_error(trainer: FSDP2Backend, engine: NativeEngine) -> float:
    name = "model.layers.0.mlp.down_proj"
    target = _local(trainer.model.get_parameter(f"{name}.weight")).float()
    got = engine.model.get_submodule(name).dequantized_weight(torch.float32)
    return float((got - target).norm() / target.norm())


def run_shape(shape: str, device: torch.device, repeats: int, fs: bool, bandwidth: float | None) -> list[dict]:
    rows: list[dict[str, Any]] = []
    trainer = FSDP2Backend(
        build_model(shape, device, torch.float32, seed=0), role="ref", optim=None,
        train=PolicyTrainConfig(), num_training_steps=1, device=device,
    )
    params = sum(p.numel() for p in trainer.model.parameters())
    kv = {"max_batch_size": 8, "max_seq_len": 128, "device": device}
    for mode in ("bf16", "fp8"):
        engine = NativeEngine(
            build_model(shape, device, torch.bfloat16, seed=1).eval(), StubTokenizer(),
            quant_scheme="fp8_block" if mode == "fp8" else None, **kv,
        )
        r = {"shape": shape, "path": f"in-process {mode}", "params": params, **time_in_process(trainer, engine, repeats, 1)}
        r["check"] = check_copied(trainer, engine) if mode == "bf16" else fp8_error(trainer, engine)
        if mode == "bf16" and bandwidth:
            moved = params * (4 + 2)
            r["floor_s"] = moved / (bandwidth * 1e9)
            r["achieved_gbs"] = moved / r["seconds"] / 1e9
        rows.append(r)
        if mode == "bf16" and fs:
            rows.append(run_filesystem(shape, trainer, engine, device, params))
        del engine
        free(device)
    del trainer
    free(device)
    return rows


def run_filesystem(shape: str, trainer: FSDP2Backend, engine: NativeEngine, device: torch.device, params: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix="lumenrl_ws_"))
    try:
        sync = FilesystemWeightSync(root, keep_last=1)
        sync_dev(device)
        t0 = time.perf_counter()
        publish_snapshot(trainer, sync, 100)
        t1 = time.perf_counter()
        applied = apply_latest_snapshot(sync, engine)
        sync_dev(device)
        t2 = time.perf_counter()
        manifest = sync.manifest()
        return {"shape": shape, "path": "filesystem bf16", "params": params, "seconds": t2 - t0,
                "publish_s": t1 - t0, "apply_s": t2 - t1, "bytes_read": manifest["bytes"],
                "tensors": manifest["num_tensors"], "check": check_copied(trainer, engine) if applied == 100 else -1.0}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def measure(shapes: list[str], fs_shapes: set[str], repeats: int, device: torch.device) -> dict[str, Any]:
    env = environment()
    bandwidth = None
    if device.type == "cuda":
        bandwidth = copy_bandwidth_gbs()
        env["copy_bandwidth_gbs"] = round(bandwidth, 1)
    rows: list[dict[str, Any]] = []
    for shape in shapes:
        rows += run_shape(shape, device, repeats, shape in fs_shapes, bandwidth)
    print_table(rows, ["shape", "path", "seconds", "floor_s", "achieved_gbs", "publish_s", "apply_s", "tensors", "check"])
    return {"environment": env, "command": command_line(), "results": rows}


def run(smoke: bool) -> dict[str, Any]:
    """Suite entry: seconds of one in-process sync of the largest shape (8B; smoke: a tiny model on CPU)."""
    device = torch.device("cuda:0" if torch.cuda.is_available() and not smoke else "cpu")
    shape = "smoke" if smoke else "8b"
    payload = measure(["smoke"] if smoke else ["1.7b", "8b"], {"smoke" if smoke else "1.7b"}, 3, device)
    write_json("weight_sync_smoke.json" if smoke else "weight_sync.json", payload)
    by_path = {r["path"]: r for r in payload["results"] if r["shape"] == shape}
    fs = [r for r in payload["results"] if r["path"] == "filesystem bf16"]
    return {"shape": shape, "bf16_s": by_path["in-process bf16"]["seconds"], "fp8_s": by_path["in-process fp8"]["seconds"],
            "bf16_max_abs_err": by_path["in-process bf16"]["check"], "fp8_rel_err": by_path["in-process fp8"]["check"],
            "filesystem_s": fs[0]["seconds"] if fs else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="1.7b,8b")
    ap.add_argument("--fs-shapes", default="1.7b")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    print(write_json("weight_sync.json", measure(args.shapes.split(","), set(args.fs_shapes.split(",")), args.repeats, device)))


if __name__ == "__main__":
    main()
